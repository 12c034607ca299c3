"""The one registry of built-in family spec strings (``linear``, ``poly:2``, ``relu:128:0``, …).

A spec is ``NAME`` followed by its arguments, separated by colons.  Each registered
:class:`FamilySpec` names its factory (:mod:`depthsat_theory.families.builtin`), its
argument grammar and a help line; :func:`parse_family`, :func:`family_specs`,
:func:`family_help` and :func:`is_family_name` (used by the audit's loader, which must not
import a module called ``relu``) all read :data:`FAMILY_SPECS`, so the grammar is written
once.

Grammar (integers are decimal; an omitted ``SEED`` is 0)::

    linear | linear-nobias | poly:D | powers:D | relu:K[:SEED] | gelu:K[:SEED] | tanh:K[:SEED]
    even:abs | even:square | preln:K[:SEED] | conv1x1 | conv3x3:K[:SEED]
    attention:K[:SEED] | product:R
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from depthsat_theory.families.base import FamilyError, ResidualFamily
from depthsat_theory.families.builtin import (
    EVEN_KINDS,
    causal_attention,
    conv1x1,
    conv3x3,
    even_features,
    linear,
    polynomial,
    powers,
    preln_mlp,
    product,
    random_features,
)

__all__ = [
    "FAMILY_SPECS",
    "FamilySpec",
    "family_help",
    "family_specs",
    "is_family_name",
    "parse_family",
]


@dataclass(frozen=True)
class FamilySpec:
    """One built-in family name, its argument grammar and its factory.

    Attributes:
        name: the spec's head (lower case), e.g. ``"relu"``.
        build: factory called with the parsed arguments, in the order of
            ``required + optional`` (integers) or with the one word argument.
        help: a one-line description.
        required: names of the required integer arguments, e.g. ``("K",)``.
        optional: names of optional integer arguments (default 0), e.g. ``("SEED",)``.
        words: the choices of a single word argument (``even:abs``), else empty.
    """

    name: str
    build: Callable[..., ResidualFamily]
    help: str
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    words: tuple[str, ...] = ()

    @property
    def forms(self) -> tuple[str, ...]:
        """The spec's written forms, e.g. ``("relu:K[:SEED]",)`` or ``("even:abs", "even:square")``."""
        if self.words:
            return tuple(f"{self.name}:{w}" for w in self.words)
        text = ":".join((self.name, *self.required))
        return (text + "".join(f"[:{a}]" for a in self.optional),)

    def parse(self, args: list[str]) -> ResidualFamily:
        """Build the family from the arguments after the name.

        Args:
            args: the colon-separated arguments (lower case, stripped).

        Returns:
            The family built by ``build`` (missing optional integers as 0).

        Raises:
            FamilyError: on a wrong number of arguments, a word not in ``words`` or a
                non-integer argument (the reason only; :func:`parse_family` adds the spec).
        """
        if self.words:
            if len(args) != 1 or args[0] not in self.words:
                raise FamilyError(f"{self.name} takes one of {', '.join(self.words)}")
            return self.build(args[0])
        lo, hi = len(self.required), len(self.required) + len(self.optional)
        if not lo <= len(args) <= hi:
            raise FamilyError(f"{self.name} takes {_arity(lo, hi)} ({' | '.join(self.forms)})")
        if not all(a.isdigit() for a in args):
            raise FamilyError(f"{self.name} takes integer arguments ({' | '.join(self.forms)})")
        values = [int(a) for a in args] + [0] * (hi - len(args))
        return self.build(*values)


def _arity(lo: int, hi: int) -> str:
    if hi == 0:
        return "no arguments"
    if lo == hi:
        return "1 argument" if lo == 1 else f"{lo} arguments"
    return f"{lo} to {hi} arguments"


def _heads_for(width: int) -> int:
    """Attention heads for a width: 4, 2 or 1, the largest that divides it."""
    return next(h for h in (4, 2, 1) if width % h == 0)


def _random(activation: str) -> FamilySpec:
    return FamilySpec(
        activation,
        lambda k, seed: random_features(k, activation, seed),
        f"random features act(Ω u + β) with {activation}, width K, seed SEED",
        ("K",),
        ("SEED",),
    )


#: The built-in family specs by name, in the order of :func:`family_specs`.
FAMILY_SPECS: dict[str, FamilySpec] = {
    s.name: s
    for s in (
        FamilySpec("linear", linear, "linear map W u + c on rows"),
        FamilySpec("linear-nobias", lambda: linear(bias=False), "linear map W u on rows (no output bias)"),
        FamilySpec(
            "poly", polynomial, "all monomials of total degree 1..D of the row (C(d+D, D) - 1 features)", ("D",)
        ),
        FamilySpec("powers", powers, "elementwise powers u_i, u_i², …, u_i^D (D·d features, no cross terms)", ("D",)),
        _random("relu"),
        _random("gelu"),
        _random("tanh"),
        FamilySpec("even", even_features, "even elementwise features |u| or u²", words=EVEN_KINDS),
        FamilySpec("preln", preln_mlp, "pre-LN MLP block of width K, seed SEED", ("K",), ("SEED",)),
        FamilySpec("conv1x1", conv1x1, "zero 1×1 convolution (image sites)"),
        FamilySpec("conv3x3", conv3x3, "conv3×3(C, K) → ReLU → zero conv1×1 (image sites)", ("K",), ("SEED",)),
        FamilySpec(
            "attention",
            lambda k, seed: causal_attention(k, heads=_heads_for(k), seed=seed),
            "pre-LN causal self-attention of width K, 4, 2 or 1 heads (sequence sites)",
            ("K",),
            ("SEED",),
        ),
        FamilySpec("product", product, "degenerate product U V u of rank R (T = {0})", ("R",)),
    )
}


def family_specs() -> str:
    """A one-line description of the built-in family spec grammar (every form, comma-separated).

    Returns:
        Every form of :data:`FAMILY_SPECS`, comma-separated.
    """
    return ", ".join(form for spec in FAMILY_SPECS.values() for form in spec.forms)


def family_help() -> str:
    """One line per built-in family: its forms and its help line.

    Returns:
        One line ``"<form> | <form>: <help>"`` per family (forms joined by ``" | "``), newline-separated.
    """
    return "\n".join(f"{' | '.join(s.forms)}: {s.help}" for s in FAMILY_SPECS.values())


def is_family_name(name: str) -> bool:
    """Whether ``name`` (case-insensitive) is the head of a built-in spec (``relu``, ``poly``, …).

    Args:
        name: a spec head (surrounding whitespace ignored).

    Returns:
        ``True`` if it names a built-in family.
    """
    return name.strip().lower() in FAMILY_SPECS


def parse_family(spec: str) -> ResidualFamily:
    """Build a built-in residual family from a spec string (grammar in the module docstring).

    Args:
        spec: e.g. ``"linear"``, ``"poly:2"``, ``"relu:128:1"``, ``"even:abs"``,
            ``"product:2"`` (case-insensitive, surrounding blanks ignored).

    Returns:
        A fresh :class:`~depthsat_theory.families.ResidualFamily`.

    Raises:
        FamilyError: on an unknown name, a malformed argument list or an argument
            out of range (the message lists the grammar).
    """
    head, *args = spec.strip().lower().split(":")
    entry = FAMILY_SPECS.get(head)
    try:
        if entry is None:
            raise FamilyError(f"unknown family {head!r}" if args else "unknown family")
        return entry.parse(args)
    except FamilyError as exc:
        raise FamilyError(f"bad family spec {spec!r}: {exc}; valid specs: {family_specs()}") from None
