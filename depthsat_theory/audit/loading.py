"""Resolve the text of a residual family: a built-in spec, a user module or a sympy expression.

:func:`load_family` tries, in order, the built-in spec registry
(:data:`depthsat_theory.families.FAMILY_SPECS`), ``sympy:EXPR``, ``package.module:attr`` and a
bare sympy expression in units ``u1..ud`` and parameters ``t1..tp`` (the symbolic engine
:mod:`depthsat_theory.engines.symbolic`, imported on first use by :func:`symbolic_engine`).
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

from depthsat_theory.families import FamilyError, ResidualFamily, is_family_name, parse_family

__all__ = ["AuditError", "LoadedFamily", "load_family", "symbolic_engine"]

_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
_SYMBOL_RE = re.compile(r"(?<![A-Za-z0-9_])[ut][0-9]+(?![A-Za-z0-9_])")


class AuditError(ValueError):
    """Bad input to an audit (a family that cannot be loaded, a wrong site, …)."""


@dataclass
class LoadedFamily:
    """A residual family resolved from text by :func:`load_family`.

    Attributes:
        family: the numeric family (a :class:`~depthsat_theory.families.ResidualFamily`).
        source: ``"builtin"``, ``"module"`` or ``"sympy"``.
        text: the text it was loaded from.
        symbolic: the symbolic family (``source == "sympy"``), else ``None``.
        d: the unit dimension the family fixes (sympy expressions), else ``None``.
    """

    family: ResidualFamily
    source: str
    text: str
    symbolic: Any = None
    d: int | None = None


def load_family(text: str, *, d: int | None = None) -> LoadedFamily:
    """Resolve a family given as a built-in spec, a ``module:attr`` path or a sympy expression.

    Rules, in this order:

    1. a built-in spec accepted by :func:`~depthsat_theory.families.parse_family`
       (``linear``, ``poly:2``, ``relu:64:1``, ``product:2``, …);
    2. ``sympy:EXPR``: a sympy expression (explicit);
    3. ``package.module:attr`` (dotted identifiers, one colon): a user family, imported
       with :func:`importlib.import_module` from ``sys.path`` (nothing else is
       imported); ``attr`` must be a
       :class:`~depthsat_theory.families.ResidualFamily` instance, or a zero-argument
       callable (a factory or a class) returning one;
    4. text containing symbols ``u1, u2, …`` or ``t1, t2, …``: a sympy expression in
       units ``u1..ud`` and parameters ``t1..tp``, e.g. ``"t1*u1 + t2*u1**3"`` or
       ``"[t1*u1 + t2, t3*u2]"`` (one component per unit coordinate).

    A text whose head is a built-in family name (``relu:abc``) is reported as a bad
    built-in spec, never imported.

    Args:
        text: the family text.
        d: unit dimension for sympy expressions (default: inferred from the largest
            ``u`` index).

    Returns:
        A :class:`LoadedFamily`.

    Raises:
        AuditError: on text that fits none of the rules, a module that does not exist or
            fails to import, a missing attribute, or an attribute of the wrong type.
        FamilyError: on a malformed built-in spec or an unparsable sympy expression.
    """
    raw = text.strip()
    if not raw:
        raise AuditError("empty family text; " + _FORMS)
    try:
        return LoadedFamily(parse_family(raw), "builtin", raw)
    except FamilyError as exc:
        builtin_error = exc
    if raw.lower().startswith("sympy:"):
        return _load_sympy(raw[len("sympy:") :].strip(), raw, d)
    if ":" in raw and is_family_name(raw.split(":", 1)[0]):
        raise builtin_error
    if _MODULE_RE.fullmatch(raw):
        return _load_module(raw)
    if _SYMBOL_RE.search(raw):
        return _load_sympy(raw, raw, d)
    hint = ""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+", raw):
        mod, _, attr = raw.rpartition(".")
        hint = f" (to load a user family write 'module:attr' with a colon, e.g. {mod}:{attr})"
    raise AuditError(f"cannot interpret {text!r} as a residual family{hint}; {_FORMS}")


_FORMS = (
    "give a built-in spec (linear, poly:D, powers:D, relu:K[:SEED], … product:R), a user family "
    "'module:attr', or a sympy expression in units u1..ud and parameters t1..tp "
    "(optionally prefixed 'sympy:')"
)


def _load_module(text: str) -> LoadedFamily:
    modname, attr = text.split(":")
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        if exc.name and (modname == exc.name or modname.startswith(exc.name + ".")):
            raise AuditError(
                f"user family {text!r}: no module named {exc.name!r} on the Python "
                f"path (run from its folder or add it to PYTHONPATH)"
            ) from None
        raise AuditError(
            f"user family {text!r}: importing module {modname!r} failed (ModuleNotFoundError: {exc})"
        ) from None
    except Exception as exc:
        raise AuditError(
            f"user family {text!r}: importing module {modname!r} raised {type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:10]
        raise AuditError(
            f"user family {text!r}: module {modname!r} has no attribute {attr!r} "
            f"(public names: {', '.join(public) or 'none'})"
        )
    obj = getattr(module, attr)
    if isinstance(obj, ResidualFamily):
        return LoadedFamily(obj, "module", text)
    if not callable(obj):
        raise AuditError(
            f"user family {text!r}: {attr!r} is a {type(obj).__name__}, expected a "
            f"depthsat_theory ResidualFamily instance or a zero-argument factory "
            f"returning one"
        )
    if inspect.isclass(obj) and inspect.isabstract(obj):
        raise AuditError(f"user family {text!r}: {attr!r} is an abstract class; give an instance or a factory")
    try:
        made = obj()
    except Exception as exc:
        raise AuditError(
            f"user family {text!r}: calling {attr}() with no arguments raised {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(made, ResidualFamily):
        raise AuditError(
            f"user family {text!r}: {attr}() returned a {type(made).__name__}, expected "
            f"a depthsat_theory ResidualFamily (e.g. GeneralFamily(fn, p))"
        )
    return LoadedFamily(made, "module", text)


_SYMBOLIC_NAMES = ("SymbolicFamily", "to_general_family", "is_function_preserving", "tangent_rank", "is_degenerate")


def symbolic_engine() -> Any:
    """The symbolic engine :mod:`depthsat_theory.engines.symbolic` (parser, bridge, exact verdicts).

    Imported on first use (sympy is slow to import).

    Returns:
        The imported module.

    Raises:
        AuditError: if the engine cannot be imported or lacks a name the audit uses.
    """
    try:
        sym = importlib.import_module("depthsat_theory.engines.symbolic")
    except ImportError as exc:
        raise AuditError(
            f"sympy families need the symbolic engine depthsat_theory.engines.symbolic, which is not available ({exc})"
        ) from None
    missing = [a for a in _SYMBOLIC_NAMES if not hasattr(sym, a)]
    if missing:
        raise AuditError(f"the symbolic engine lacks {', '.join(missing)}; sympy families cannot be audited")
    return sym


def _load_sympy(expr: str, text: str, d: int | None) -> LoadedFamily:
    sym = symbolic_engine()
    if not expr:
        raise FamilyError(f"empty sympy expression in {text!r}")
    fam = sym.SymbolicFamily.parse(expr, d=d)
    return LoadedFamily(sym.to_general_family(fam), "sympy", text, symbolic=fam, d=int(fam.d))
