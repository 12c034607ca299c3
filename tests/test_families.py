"""The family spec registry (depthsat_theory.families.specs): one grammar for every reader."""

from __future__ import annotations

import pytest
import torch

from depthsat_theory.families import (
    FAMILY_SPECS,
    FamilyError,
    FeatureFamily,
    GeneralFamily,
    family_help,
    family_specs,
    is_family_name,
    parse_family,
    to_rows,
)
from depthsat_theory.statistics import statistics_for
from depthsat_theory.vocabulary import Layout

#: every written form of the grammar, as documented in the CLI help before the registry
DOCUMENTED = (
    "linear, linear-nobias, poly:D, powers:D, relu:K[:SEED], gelu:K[:SEED], tanh:K[:SEED], "
    "even:abs, even:square, preln:K[:SEED], conv1x1, conv3x3:K[:SEED], "
    "attention:K[:SEED], product:R"
)


def test_family_specs_is_the_documented_grammar():
    assert family_specs() == DOCUMENTED
    assert list(FAMILY_SPECS) == [
        "linear",
        "linear-nobias",
        "poly",
        "powers",
        "relu",
        "gelu",
        "tanh",
        "even",
        "preln",
        "conv1x1",
        "conv3x3",
        "attention",
        "product",
    ]
    lines = family_help().splitlines()
    assert len(lines) == len(FAMILY_SPECS)
    assert lines[7].startswith("even:abs | even:square: ")


@pytest.mark.parametrize(
    ("spec", "canonical", "p_at_4"),
    [
        ("linear", "linear", 4 * 5),
        ("linear-nobias", "linear-nobias", 4 * 4),
        ("poly:3", "poly:3", 4 * (34 + 1)),  # C(4 + 3, 3) - 1 = 34 monomials of degree 1..3 in 4 variables
        ("powers:3", "powers:3", 4 * (3 * 4 + 1)),
        ("relu:7", "relu:7:0", 4 * 8),
        (" TANH:7:2 ", "tanh:7:2", 4 * 8),
        ("even:square", "even:square", 4 * 5),
        ("preln:6:1", "preln:6:1", 4 * 7),
        ("product:2", "product:2", 2 * 4 * 2),
    ],
)
def test_parse_family_builds_the_named_factory(spec, canonical, p_at_4):
    fam = parse_family(spec)
    assert fam.spec == canonical
    assert fam.param_dim((4,)) == p_at_4  # d (k + bias) for feature families, 2 d R for product


def test_parsed_families_compute_their_documented_maps():
    z = torch.randn(3, 4, dtype=torch.float64)
    rows = to_rows(z, Layout.VECTOR)
    sq = parse_family("even:square")
    assert isinstance(sq, FeatureFamily)
    assert torch.equal(sq.frozen_feature_map((4,), "vector")(z), rows * rows)
    pw = parse_family("powers:2")
    assert torch.equal(pw.frozen_feature_map((4,), "vector")(z), torch.cat([rows, rows**2], dim=-1))
    prod = parse_family("product:1")
    assert isinstance(prod, GeneralFamily)
    theta = torch.arange(8, dtype=torch.float64)  # U = (0, 1, 2, 3)ᵀ, V = (4, 5, 6, 7)
    u, v = theta[:4].reshape(4, 1), theta[4:].reshape(1, 4)
    assert torch.allclose(prod.functional(theta, z, "vector"), z @ v.T @ u.T)


def test_attention_heads_and_layouts_come_from_the_registry():
    att = parse_family("attention:6:1")
    assert att.layouts == (Layout.SEQUENCE,)
    assert att.unit == "tensor"
    assert parse_family("conv3x3:4").layouts == (Layout.IMAGE,)
    assert parse_family("linear").layouts == (Layout.VECTOR, Layout.SEQUENCE, Layout.IMAGE)
    with pytest.raises(FamilyError, match="does not fit a 'vector' site"):
        att.check_site((4,), "vector")
    with pytest.raises(FamilyError, match="unknown site layout 'bogus': use one of vector, sequence, image"):
        parse_family("linear").check_site((4,), "bogus")


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("bogus", "unknown family"),
        ("a:1", "unknown family 'a'"),
        ("poly:2:1", "poly takes 1 argument "),
        ("relu", "relu takes 1 to 2 arguments"),
        ("relu:8:1:2", "relu takes 1 to 2 arguments"),
        ("relu:x", "integer arguments"),
        ("linear:3", "linear takes no arguments"),
        ("even:cube", "even takes one of abs, square"),
        ("poly:17", "degree must be in 1..16"),
        ("relu:0", "width must be in"),
        ("product:0", "rank must be >= 1"),
    ],
)
def test_bad_specs_name_the_spec_and_the_grammar(spec, why):
    with pytest.raises(FamilyError, match="bad family spec") as err:
        parse_family(spec)
    assert why in str(err.value)
    assert str(err.value).endswith(DOCUMENTED)


def test_is_family_name():
    assert is_family_name("relu") and is_family_name(" Poly ") and is_family_name("linear-nobias")
    assert not is_family_name("mymodule") and not is_family_name("relu:8")


# ----------------------------------------------------------------------------- poly:D is polynomial
@pytest.mark.parametrize(("d", "degree"), [(1, 4), (2, 2), (3, 3), (4, 2)])
def test_poly_is_every_monomial_up_to_degree_d(d, degree):
    """k = C(d + D, D) − 1 and T = span of the monomials of degree ≤ D (dense Jacobian check)."""
    import itertools
    import math

    import numpy as np

    fam = parse_family(f"poly:{degree}")
    k = math.comb(d + degree, degree) - 1  # monomials of degree 1..D; the constant is the bias
    assert fam.feature_dim((d,), "vector") == k and fam.param_dim((d,)) == d * (k + 1)
    assert parse_family(f"powers:{degree}").feature_dim((d,), "vector") == degree * d
    torch.manual_seed(d * 10 + degree)
    n = 3 * (k + 1) + 5
    z = torch.randn(n, d, dtype=torch.float64)
    # hand basis: exponent vectors α ∈ {0..D}^d with |α| ≤ D (the constant included), per output coordinate
    alphas = [a for a in itertools.product(range(degree + 1), repeat=d) if sum(a) <= degree]
    assert len(alphas) == k + 1
    mono = np.stack([np.prod(z.numpy() ** np.array(a), axis=1) for a in alphas], axis=1)  # (n, k + 1)
    basis = np.kron(mono, np.eye(d))  # rows (example, output coordinate), columns (monomial, coordinate)
    theta0 = torch.zeros(fam.param_dim((d,)), dtype=torch.float64)
    fam.functional(theta0, z, "vector")  # frozen feature map built outside the transform
    jac = torch.func.jacrev(lambda th: fam.functional(th, z, "vector").reshape(-1))(theta0).numpy()
    rank = np.linalg.matrix_rank
    assert rank(jac) == rank(basis) == rank(np.hstack([jac, basis])) == d * (k + 1)
    # the score is the norm of the projection of g onto the monomial span
    g = torch.randn(n, d, dtype=torch.float64)
    coef, *_ = np.linalg.lstsq(basis, g.numpy().reshape(-1), rcond=None)
    st = statistics_for(fam, (d,), "vector")
    st.update(z, g)
    assert st.result().score == pytest.approx(math.sqrt(float(((basis @ coef) ** 2).sum()) / n), rel=1e-8)


def test_poly_feature_count_limit_is_one_clear_line():
    from depthsat_theory.families.builtin import MAX_POLY_FEATURES

    fam = parse_family("poly:3")
    with pytest.raises(FamilyError) as info:  # C(67, 3) = 67·66·65/6 = 47905, minus the constant
        fam.param_dim((64,))
    assert str(info.value) == (
        f"family 'poly:3' at a site of width d = 64 has C(d + D, D) - 1 = 47904 monomial features, above "
        f"the limit {MAX_POLY_FEATURES}; use a lower degree, 'powers:3' (elementwise powers, 192 features) "
        f"or random features 'relu:K'"
    )
    with pytest.raises(FamilyError, match="47904 monomial features"):
        statistics_for(fam, (64,), "vector")
    assert parse_family("powers:3").param_dim((64,)) == 64 * (3 * 64 + 1)
