"""Symbolic residual families ``h(θ, u)`` as sympy expressions (theory/definitions.md).

A :class:`SymbolicFamily` is the exact counterpart of a row-wise
:class:`~depthsat_theory.families.base.ResidualFamily`: an output column of ``d`` sympy
expressions in the unit variables ``u = (u1, …, ud)`` and the tangent coordinates
``θ = (t1, …, tp)``.  Function preservation ``h(0, u) ≡ 0`` is *not* assumed at
construction (it is what :func:`~depthsat_theory.engines.symbolic.engine.is_function_preserving`
decides).

The built-in factories mirror the numeric families and use the **same coordinate
order**, so gradients ``b`` can be compared entry by entry:

* :func:`linear`, :func:`polynomial`, :func:`powers`, :func:`random_features`: zero-output feature
  families ``h(u) = W φ(u) (+ c)`` with ``θ = (vec_row(W), c)`` (``W ∈ R^{d×k}``
  row-major, ``c`` last), exactly as
  :meth:`depthsat_theory.families.base.FeatureFamily.split_theta`;
* :func:`product`: ``h(u) = U V u`` with ``θ = (vec_row(U), vec_row(V))`` as
  :func:`depthsat_theory.families.product` (degenerate, T4);
* :func:`elementwise_square_param`: the linear family reparameterized by
  ``θ = ξ ⊙ ξ`` (degenerate, T4).

Unit symbols are real ``sympy.Symbol`` objects named ``u1..ud`` (``u`` is accepted
for ``d = 1`` by :meth:`SymbolicFamily.parse`); parameter symbols are real and named
``t1..tp``.
"""

from __future__ import annotations

import io
import keyword
import re
import tokenize
from collections.abc import Sequence

import sympy as sp
from sympy.core.function import AppliedUndef
from sympy.parsing.sympy_parser import auto_number, parse_expr, rationalize

from depthsat_theory.families import FamilyError

__all__ = [
    "ALLOWED_FUNCTIONS",
    "SymbolicFamily",
    "elementwise_square_param",
    "exact",
    "linear",
    "param_symbols",
    "polynomial",
    "powers",
    "product",
    "random_features",
    "to_matrix",
    "unit_symbols",
]


def unit_symbols(d: int) -> tuple[sp.Symbol, ...]:
    """The canonical real unit symbols ``(u1, …, ud)``.

    Args:
        d: unit dimension.

    Returns:
        ``d`` real sympy symbols ``u1 … ud``.

    Raises:
        FamilyError: if ``d < 1``.
    """
    if int(d) < 1:
        raise FamilyError(f"unit dimension d must be >= 1, got {d}")
    return tuple(sp.Symbol(f"u{i}", real=True) for i in range(1, int(d) + 1))


def param_symbols(p: int, prefix: str = "t") -> tuple[sp.Symbol, ...]:
    """The canonical real parameter symbols ``(t1, …, tp)`` (or another ``prefix``).

    Args:
        p: number of parameters.
        prefix: the symbol names' prefix.

    Returns:
        ``p`` real sympy symbols ``prefix1 … prefixp``.

    Raises:
        FamilyError: if ``p < 0``.
    """
    if int(p) < 0:
        raise FamilyError(f"parameter dimension p must be >= 0, got {p}")
    return tuple(sp.Symbol(f"{prefix}{i}", real=True) for i in range(1, int(p) + 1))


def exact(x) -> sp.Expr:
    """Convert a number to an exact sympy value.

    Python floats become the *exact* rational value of their binary representation
    (``Rational(0.1) = 3602879701896397/36028797018963968``), so a symbolic result
    on float inputs is the exact value of the mathematics on the numbers the numeric
    engine sees.  Strings are sympified (``"1/3"`` → ``1/3``); sympy values pass.

    Args:
        x: a bool, float, numpy/torch scalar, string or sympy value (anything ``sympify`` takes).

    Returns:
        The exact sympy value.
    """
    if isinstance(x, bool):
        return sp.Integer(int(x))
    if isinstance(x, float):
        return sp.Rational(x)
    if hasattr(x, "item") and not isinstance(x, sp.Basic):  # numpy / torch scalars
        return exact(x.item())
    if isinstance(x, str):
        return sp.sympify(x, rational=True)
    return sp.sympify(x)


def to_matrix(expr) -> sp.Matrix:
    """A column ``Matrix`` from a sympy expression, a list/tuple, or a Matrix.

    A row vector or a column is flattened to a column; a scalar becomes ``1 × 1``.

    Args:
        expr: a sympy expression or number, a list/tuple of them, or a vector Matrix.

    Returns:
        A column Matrix (numbers converted with :func:`exact`).

    Raises:
        FamilyError: on a 2-D (non-vector) matrix.
    """
    if isinstance(expr, sp.MatrixBase):
        mat = sp.Matrix(expr)
        if mat.rows != 1 and mat.cols != 1:
            raise FamilyError(f"expected a vector of output components, got a {mat.shape} matrix")
        return mat.reshape(len(mat), 1)
    if isinstance(expr, (list, tuple)):
        return sp.Matrix([exact(e) if not isinstance(e, sp.Basic) else e for e in expr])
    return sp.Matrix([exact(expr) if not isinstance(expr, sp.Basic) else expr])


class SymbolicFamily:
    """A residual family given by sympy expressions (theory/definitions.md, def-setting, ``def-family``).

    Args:
        expr: the output, a sympy expression (scalar, ``d = 1``), a list of
            expressions or a vector ``Matrix`` (one entry per output component).
        units: the unit symbols ``(u1, …, ud)`` (``d = len(units)``).
        params: the parameter symbols ``(θ1, …, θp)`` in tangent-coordinate order.
        name: a label used in reports (default ``"symbolic"``).

    Attributes:
        expr: the output as a ``d × 1`` ``sympy.Matrix``.
        units: tuple of ``d`` unit symbols.
        params: tuple of ``p`` parameter symbols.
        name: label.

    Raises:
        FamilyError: if the output dimension is not ``d``, a symbol is both a unit
            and a parameter, symbols repeat, the expression uses an undefined function,
            or it has free symbols that are neither units nor parameters.
    """

    def __init__(self, expr, units: Sequence[sp.Symbol], params: Sequence[sp.Symbol], name: str | None = None):
        self.units = tuple(units)
        self.params = tuple(params)
        self.name = name or "symbolic"
        if not self.units:
            raise FamilyError("a family needs at least one unit variable")
        for kind, syms in (("unit", self.units), ("parameter", self.params)):
            for s in syms:
                if not isinstance(s, sp.Symbol):
                    raise FamilyError(f"{kind} variables must be sympy Symbols, got {s!r}")
            if len(set(syms)) != len(syms):
                raise FamilyError(f"{kind} symbols repeat: {syms}")
        both = set(self.units) & set(self.params)
        if both:
            raise FamilyError(f"symbols {sorted(map(str, both))} are both units and parameters")
        self.expr = to_matrix(expr)
        if self.expr.rows != len(self.units):
            raise FamilyError(
                f"family {self.name!r} has {self.expr.rows} output components but d = "
                f"{len(self.units)} unit variables; a residual block must map R^d to R^d"
            )
        undef = self.expr.atoms(AppliedUndef)
        if undef:
            raise FamilyError(
                f"family {self.name!r} uses undefined functions {sorted(map(str, undef))}; use sympy functions"
            )
        extra = self.expr.free_symbols - set(self.units) - set(self.params)
        if extra:
            raise FamilyError(
                f"family {self.name!r} has free symbols {sorted(map(str, extra))} that are "
                f"neither units {tuple(map(str, self.units))} nor parameters "
                f"{tuple(map(str, self.params))}"
            )

    # -- shapes
    @property
    def d(self) -> int:
        """Unit (and output) dimension ``d``."""
        return len(self.units)

    @property
    def p(self) -> int:
        """Number ``p`` of tangent coordinates."""
        return len(self.params)

    @property
    def out_dim(self) -> int:
        """Number of output components (always ``d``)."""
        return self.expr.rows

    # -- evaluation
    def at(self, theta=None, u=None) -> sp.Matrix:
        """Substitute values for ``θ`` and/or ``u`` (exactly; floats become exact rationals).

        Args:
            theta: ``p`` values (or ``None`` to keep ``θ`` symbolic).
            u: ``d`` values (or ``None`` to keep ``u`` symbolic).

        Returns:
            The ``d × 1`` output ``Matrix``.

        Raises:
            FamilyError: on a wrong number of values.
        """
        rep = {}
        if theta is not None:
            theta = list(theta)
            if len(theta) != self.p:
                raise FamilyError(f"theta has {len(theta)} entries, family needs {self.p}")
            rep.update({s: exact(v) for s, v in zip(self.params, theta, strict=False)})
        if u is not None:
            u = list(u)
            if len(u) != self.d:
                raise FamilyError(f"u has {len(u)} entries, family needs d = {self.d}")
            rep.update({s: exact(v) for s, v in zip(self.units, u, strict=False)})
        return self.expr.xreplace(rep)

    def coerce(self, m, *, what: str = "m") -> sp.Matrix:
        """A function of the unit as a ``d × 1`` Matrix in *this family's* unit symbols.

        Accepts a string (parsed with the same grammar as :meth:`parse`, units only), a
        sympy expression (``d = 1``), a list or a Matrix.  Free symbols are matched to
        the units **by name** (so ``Symbol("u1")`` without assumptions is this family's
        real ``u1``; for ``d = 1`` both ``u`` and ``u1`` name the unit).

        Args:
            m: a string, a sympy expression (``d = 1``), a list or a Matrix.
            what: the name of ``m`` in error messages.

        Returns:
            A ``d × 1`` Matrix in this family's unit symbols.

        Raises:
            FamilyError: on a wrong number of components, or if ``m`` contains the
                family's parameters.
        """
        if isinstance(m, str):
            names = {s.name: s for s in self.units}
            if self.d == 1:
                names.setdefault("u", self.units[0])
                names.setdefault("u1", self.units[0])
            mat = to_matrix(_parse_text(m, names, {}, what=what))
        else:
            mat = to_matrix(m)
        byname = {s.name: s for s in self.units}
        if self.d == 1:
            byname.setdefault("u", self.units[0])
            byname.setdefault("u1", self.units[0])
        rep = {}
        for s in mat.free_symbols:
            if s in self.params or s.name in {q.name for q in self.params}:
                raise FamilyError(f"{what} must be a function of the unit only; it contains the parameter {s}")
            if s.name in byname and s != byname[s.name]:
                rep[s] = byname[s.name]
        mat = mat.xreplace(rep)
        if mat.rows != self.d:
            raise FamilyError(f"{what} has {mat.rows} components; the unit dimension is d = {self.d}")
        return mat

    # -- constructors
    @classmethod
    def parse(cls, text: str, d: int | None = None, name: str | None = None) -> SymbolicFamily:
        """Parse a family from text, e.g. ``"t1*u1 + t2*u1**2"`` or ``"[t1*u1 + t2, t3*u2]"``.

        Grammar: numbers (decimals are read as exact rationals, ``0.5 = 1/2``), ``+ - * /
        **``, parentheses, a bracketed comma list for vector outputs, unit symbols
        ``u`` (only when ``d = 1``) or ``u1..ud``, parameter symbols ``t1..tp`` or
        ``theta1..thetap`` (aliases: ``theta3`` is ``t3``; a bare ``t``/``theta``
        means the single parameter ``t1``), the constants ``pi`` and ``E``, and the
        functions in :data:`ALLOWED_FUNCTIONS`.  ``p`` is the largest parameter index
        used (unused lower indices are parameters with a zero tangent column).
        Nothing is evaluated beyond sympy constructors: the text is tokenized and
        every name is checked against this whitelist before ``parse_expr`` sees it.

        Args:
            text: the expression.
            d: unit dimension (default: the largest unit index used, 1 for ``u``).
            name: label (default: the text).

        Returns:
            The family, with units ``u1..ud`` (``(u,)`` if the text uses bare ``u``)
            and parameters ``t1..tp``.

        Raises:
            FamilyError: one-line message on a syntax error, an unknown name (the
                message names it), a unit index above ``d``, a scalar output for
                ``d > 1``, an output of the wrong length, or no parameters.
        """
        if not isinstance(text, str):
            raise FamilyError(f"family text must be a string, got {type(text).__name__}")
        _check_tokens(text, "family text", _grammar_name, "u (d = 1) or u1..ud, t1..tp or theta1..thetap")
        unit_idx, bare_u, param_idx = _symbol_indices(_scan_names(text))
        units = _parsed_units(text, d, unit_idx, bare_u)
        if not param_idx:
            raise FamilyError(f"family text {text!r} has no parameters (use t1..tp)")
        params = param_symbols(max(param_idx))
        local = {s.name: s for s in units}
        for i, s in enumerate(params, start=1):
            local[f"t{i}"] = s
            local[f"theta{i}"] = s
        local["t"] = local["theta"] = params[0]
        out = _parse_text(text, local, {}, what="family text")
        mat = to_matrix(out)
        if mat.rows != len(units):
            kind = "a scalar" if not isinstance(out, (list, tuple)) else f"{mat.rows} components"
            raise FamilyError(
                f"family text {text!r} gives {kind} but d = {len(units)}; "
                f"the output must have d components (a scalar only when d = 1)"
            )
        return cls(mat, units, params, name=name or text.strip())

    # -- transformations
    def subs_params(self, mapping: dict, new_params: Sequence[sp.Symbol], name: str | None = None) -> SymbolicFamily:
        """The family with ``θ`` replaced by expressions in ``new_params``.

        Args:
            mapping: ``{θ_j: expression}``, applied with ``xreplace``.
            new_params: the parameter symbols of the new family.
            name: the new family's name (default: this family's).

        Returns:
            A new :class:`SymbolicFamily` with the same units.
        """
        return SymbolicFamily(self.expr.xreplace(mapping), self.units, new_params, name=name or self.name)

    def __repr__(self) -> str:
        comps = ", ".join(str(e) for e in self.expr)
        return f"SymbolicFamily({self.name!r}, d={self.d}, p={self.p}, h=[{comps}])"


# ----------------------------------------------------------------------------- parsing
def _relu(x):
    return sp.Max(0, x)


def _sigmoid(x):
    return 1 / (1 + sp.exp(-x))


def _gelu(x):
    return x / 2 * (1 + sp.erf(x / sp.sqrt(2)))


#: Function names accepted by :meth:`SymbolicFamily.parse` (→ sympy callables).
ALLOWED_FUNCTIONS = {
    "exp": sp.exp,
    "log": sp.log,
    "sqrt": sp.sqrt,
    "sin": sp.sin,
    "cos": sp.cos,
    "tanh": sp.tanh,
    "erf": sp.erf,
    "Abs": sp.Abs,
    "abs": sp.Abs,
    "sign": sp.sign,
    "Max": sp.Max,
    "Min": sp.Min,
    "max": sp.Max,
    "min": sp.Min,
    "Heaviside": sp.Heaviside,
    "relu": _relu,
    "sigmoid": _sigmoid,
    "gelu": _gelu,
}
_CONSTANTS = {"pi": sp.pi, "E": sp.E}
_OPS = {"+", "-", "*", "/", "**", "(", ")", "[", "]", ","}
_PARSER_GLOBALS = {"Integer": sp.Integer, "Float": sp.Float, "Rational": sp.Rational, "__builtins__": {}}


def _grammar_name(nm: str) -> bool:
    return (
        nm in ALLOWED_FUNCTIONS
        or nm in _CONSTANTS
        or re.fullmatch(r"u|u[1-9]\d*|t|theta|(t|theta)[1-9]\d*", nm) is not None
    )


def _tokens(text: str, what: str):
    try:
        return [
            t
            for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT)
        ]
    except (tokenize.TokenError, IndentationError, SyntaxError) as exc:
        why = exc.args[0] if isinstance(exc, tokenize.TokenError) and exc.args else _first_line(exc)
        raise FamilyError(f"cannot parse {what} {text!r}: {why} (unbalanced brackets?)") from None


def _scan_names(text: str, what: str = "family text") -> list[str]:
    return [t.string for t in _tokens(text, what) if t.type == tokenize.NAME]


def _symbol_indices(names: Sequence[str]) -> tuple[set[int], bool, set[int]]:
    """Unit indices, whether bare ``u`` occurs, and parameter indices among ``names``."""
    unit_idx: set[int] = set()
    param_idx: set[int] = set()
    bare_u = False
    for nm in names:
        if nm == "u":
            bare_u = True
        elif re.fullmatch(r"u[1-9]\d*", nm):
            unit_idx.add(int(nm[1:]))
        elif nm in ("t", "theta"):
            param_idx.add(1)
        elif re.fullmatch(r"(t|theta)[1-9]\d*", nm):
            param_idx.add(int(re.sub(r"^(theta|t)", "", nm)))
    return unit_idx, bare_u, param_idx


def _parsed_units(text: str, d: int | None, unit_idx: set[int], bare_u: bool) -> tuple[sp.Symbol, ...]:
    """The unit symbols of a parsed family text (``(u,)`` for bare ``u``, else ``u1..ud``)."""
    if bare_u and unit_idx:
        raise FamilyError(f"family text {text!r} mixes the unit names 'u' and u1..ud; use u1..ud")
    if bare_u:
        if d not in (None, 1):
            raise FamilyError(f"bare 'u' names the unit only when d = 1 (got d = {d}); use u1..u{d}")
        return (sp.Symbol("u", real=True),)
    dd = max(unit_idx, default=1) if d is None else int(d)
    if dd < 1:
        raise FamilyError(f"unit dimension d must be >= 1, got {d}")
    if unit_idx and max(unit_idx) > dd:
        raise FamilyError(f"family text {text!r} uses u{max(unit_idx)} but d = {dd}")
    return unit_symbols(dd)


def _first_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return msg[0] if msg else type(exc).__name__


def _parse_text(text: str, local: dict, extra: dict, *, what: str):
    """Whitelist-check the tokens of ``text`` and parse it with sympy constructors only."""
    allowed_names = set(local) | set(ALLOWED_FUNCTIONS) | set(_CONSTANTS) | set(extra)
    _check_tokens(text, what, lambda nm: nm in allowed_names, ", ".join(sorted(local)))
    namespace = dict(_CONSTANTS)
    namespace.update(ALLOWED_FUNCTIONS)
    namespace.update(extra)
    namespace.update(local)
    try:
        out = parse_expr(
            text,
            local_dict=namespace,
            global_dict=dict(_PARSER_GLOBALS),
            transformations=(auto_number, rationalize),
            evaluate=True,
        )
    except FamilyError:
        raise
    except Exception as exc:  # SyntaxError, TokenError, TypeError (bad call arity) ...
        raise FamilyError(f"cannot parse {what} {text!r}: {type(exc).__name__}: {_first_line(exc)}") from None
    if isinstance(out, tuple):
        raise FamilyError(f"cannot parse {what} {text!r}: a bare tuple; write a vector output in brackets [a, b]")
    items = out if isinstance(out, list) else [out]
    for item in items:
        if not isinstance(item, sp.Expr):
            raise FamilyError(f"cannot parse {what} {text!r}: component {item!r} is not an expression")
    return out


def _check_tokens(text: str, what: str, name_ok, variables: str) -> None:
    """Reject any token outside the grammar (names via ``name_ok``), naming the culprit."""
    if not text.strip():
        raise FamilyError(f"{what} is empty")
    for tok in _tokens(text, what):
        if tok.type == tokenize.NAME:
            if keyword.iskeyword(tok.string) or not name_ok(tok.string):
                raise FamilyError(
                    f"unknown name {tok.string!r} in {what} {text!r}; allowed: variables "
                    f"{variables}; functions {', '.join(sorted(ALLOWED_FUNCTIONS))}; "
                    f"constants pi, E"
                )
        elif tok.type == tokenize.NUMBER:
            if re.search(r"[jJ]$", tok.string):
                raise FamilyError(f"complex number {tok.string!r} in {what} {text!r} is not allowed")
        elif tok.type == tokenize.OP:
            if tok.string not in _OPS:
                hint = " (use ** for powers)" if tok.string == "^" else ""
                raise FamilyError(f"operator {tok.string!r} is not allowed in {what} {text!r}{hint}")
        else:
            raise FamilyError(f"unexpected token {tok.string!r} in {what} {text!r}")


# ----------------------------------------------------------------------------- factories
def _check_d(d: int) -> int:
    if isinstance(d, bool) or int(d) != d or int(d) < 1:
        raise FamilyError(f"d must be a positive integer, got {d!r}")
    return int(d)


def _feature_family(phi: Sequence[sp.Expr], units, bias: bool, name: str) -> SymbolicFamily:
    """``h = W φ + c`` with ``θ = (vec_row(W), c)`` (the numeric ``FeatureFamily`` order)."""
    d, k = len(units), len(phi)
    params = param_symbols(d * (k + int(bias)))
    w = sp.Matrix(d, k, params[: d * k])  # row-major: W[i, j] = θ[i k + j]
    out = w * sp.Matrix(phi)
    if bias:
        out = out + sp.Matrix(params[d * k :])
    return SymbolicFamily(out, units, params, name=name)


def linear(d: int, bias: bool = True) -> SymbolicFamily:
    """Linear family ``h(u) = W u (+ c)``, ``θ = (vec_row(W), c)``, ``p = d(d + bias)``.

    Mirrors :func:`depthsat_theory.families.linear` (same coordinate order).

    Args:
        d: unit dimension.
        bias: include the output bias ``c``.

    Returns:
        The :class:`SymbolicFamily` named ``"linear"`` (``"linear-nobias"``).

    Raises:
        FamilyError: if ``d < 1``.
    """
    units = unit_symbols(_check_d(d))
    return _feature_family(units, units, bias, "linear" if bias else "linear-nobias")


def _check_degree(degree: int) -> int:
    if isinstance(degree, bool) or int(degree) != degree or int(degree) < 1:
        raise FamilyError(f"polynomial degree must be a positive integer, got {degree!r}")
    return int(degree)


def polynomial(d: int, degree: int, bias: bool = True) -> SymbolicFamily:
    """Polynomial features: every monomial of total degree ``1..D`` (``k = C(d + D, D) − 1``), ``h = W φ (+ c)``.

    Mirrors :func:`depthsat_theory.families.polynomial` (spec ``poly:D``), in the order of
    :func:`depthsat_theory.families.builtin.monomial_exponents` (by degree, then lexicographic).

    Args:
        d: unit dimension.
        degree: the largest total degree ``D ≥ 1``.
        bias: include the output bias ``c``.

    Returns:
        The :class:`SymbolicFamily` named ``"poly:D"`` (``"poly:D-nobias"``).

    Raises:
        FamilyError: if ``d < 1`` or ``degree < 1``.
    """
    from depthsat_theory.families.builtin import monomial_exponents

    units = unit_symbols(_check_d(d))
    deg = _check_degree(degree)
    phi = [sp.Mul(*(units[i] for i in c)) for c in monomial_exponents(len(units), deg)]
    return _feature_family(phi, units, bias, f"poly:{deg}" + ("" if bias else "-nobias"))


def powers(d: int, degree: int, bias: bool = True) -> SymbolicFamily:
    """Elementwise powers ``φ(u) = (u, u², …, u^D)`` (``k = D d``), ``h = W φ (+ c)``.

    Mirrors :func:`depthsat_theory.families.powers` (spec ``powers:D``): ``φ_{(q−1)d + j} = u_j^q``.

    Args:
        d: unit dimension.
        degree: the largest power ``D ≥ 1``.
        bias: include the output bias ``c``.

    Returns:
        The :class:`SymbolicFamily` named ``"powers:D"`` (``"powers:D-nobias"``).

    Raises:
        FamilyError: if ``d < 1`` or ``degree < 1``.
    """
    units = unit_symbols(_check_d(d))
    deg = _check_degree(degree)
    phi = [u**q for q in range(1, deg + 1) for u in units]
    return _feature_family(phi, units, bias, f"powers:{deg}" + ("" if bias else "-nobias"))


def product(d: int, rank: int) -> SymbolicFamily:
    """Degenerate product family ``h(u) = U V u`` (``U ∈ R^{d×R}``, ``V ∈ R^{R×d}``, both 0).

    ``θ = (vec_row(U), vec_row(V))``, ``p = 2 d R``, as
    :func:`depthsat_theory.families.product`.  ``A ≡ 0`` (theory label thm-reparameterization): degenerate.

    Args:
        d: unit dimension.
        rank: inner dimension ``R ≥ 1``.

    Returns:
        The :class:`SymbolicFamily` named ``"product:R"``.

    Raises:
        FamilyError: if ``d < 1`` or ``rank < 1``.
    """
    units = unit_symbols(_check_d(d))
    if isinstance(rank, bool) or int(rank) != rank or int(rank) < 1:
        raise FamilyError(f"product rank must be a positive integer, got {rank!r}")
    r = int(rank)
    params = param_symbols(2 * d * r)
    big_u = sp.Matrix(d, r, params[: d * r])
    big_v = sp.Matrix(r, d, params[d * r :])
    return SymbolicFamily(big_u * big_v * sp.Matrix(units), units, params, name=f"product:{r}")


def elementwise_square_param(d: int, bias: bool = True) -> SymbolicFamily:
    """The linear family reparameterized by ``θ = ξ ⊙ ξ`` (theory label thm-reparameterization, degenerate).

    ``h(u) = W(ξ) u (+ c(ξ))`` with ``(vec_row(W), c) = ξ ⊙ ξ``; parameters are named
    ``x1..xp``.  ``Dχ(0) = 0`` so ``A ≡ 0`` and ``T = {0}``.

    Args:
        d: unit dimension.
        bias: include the output bias ``c``.

    Returns:
        The :class:`SymbolicFamily` with parameters ``x1..xp``, ``p = d(d + bias)``.

    Raises:
        FamilyError: if ``d < 1``.
    """
    base = linear(d, bias=bias)
    xi = param_symbols(base.p, prefix="x")
    fam = base.subs_params({t: x**2 for t, x in zip(base.params, xi, strict=False)}, xi, name=f"{base.name}∘(ξ⊙ξ)")
    return fam


def random_features(d: int, k: int, activation: str, W, a, bias: bool = True) -> SymbolicFamily:
    """Random-feature family ``h(u) = V act(W u + a) (+ c)`` with *given* feature weights.

    ``θ = (vec_row(V), c)``, ``V ∈ R^{d×k}`` (the numeric ``FeatureFamily`` order), so
    passing the numeric family's ``proj.weight`` and ``proj.bias`` reproduces
    :func:`depthsat_theory.families.random_features` exactly.  A zero-output family
    (theory/definitions.md, T5 ``thm-zero-output``): ``A(u) v = δV φ(u) + δc`` and saturation
    holds iff ``G = E[m φ̃ᵀ] = 0``.

    Args:
        d: unit dimension.
        k: number of features.
        activation: ``"relu"`` (``Max(0, x)``), ``"tanh"``, ``"gelu"`` (erf form)
            or ``"identity"``.
        W: ``k × d`` feature weights (nested lists, numpy/torch array or Matrix;
            floats are converted exactly).
        a: ``k`` feature biases.
        bias: include the output bias ``c``.

    Returns:
        The :class:`SymbolicFamily` named ``"<activation>:<k>:given"``.

    Raises:
        FamilyError: on an unknown activation or wrong weight shapes.
    """
    d = _check_d(d)
    acts = {"relu": _relu, "tanh": sp.tanh, "gelu": _gelu, "identity": lambda x: x}
    if activation not in acts:
        raise FamilyError(f"unknown activation {activation!r}; use one of {sorted(acts)}")
    wmat = _exact_matrix(W)
    avec = _exact_matrix(a)
    if wmat.shape != (k, d):
        raise FamilyError(f"W must be {k} × {d}, got {wmat.shape}")
    avec = avec.reshape(len(avec), 1)
    if avec.rows != k:
        raise FamilyError(f"a must have {k} entries, got {avec.rows}")
    units = unit_symbols(d)
    pre = wmat * sp.Matrix(units) + avec
    phi = [acts[activation](e) for e in pre]
    return _feature_family(phi, units, bias, f"{activation}:{k}:given")


def _exact_matrix(x) -> sp.Matrix:
    if isinstance(x, sp.MatrixBase):
        return sp.Matrix(x).applyfunc(exact)
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], (list, tuple)):
        return sp.Matrix([[exact(v) for v in row] for row in x])
    if isinstance(x, (list, tuple)):
        return sp.Matrix([exact(v) for v in x])
    return sp.Matrix([exact(x)])
