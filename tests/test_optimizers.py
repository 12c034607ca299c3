"""Tests for depthsat_theory.optimizers.updates (zero-state first-step maps).

Expected values are derived independently of the module under test: either
from the real ``torch.optim`` step, or from closed forms / reference
implementations written here in numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from depthsat_theory.optimizers import (
    DESCENT_COMPATIBLE,
    UPDATES,
    Lion,
    RotationOptimizer,
    SignSGD,
    ZeroStateUpdate,
    get_update,
    is_descent_compatible,
    resolve_update,
    threshold,
)

ALL_NAMES = sorted(UPDATES)
EXPECTED_NAMES = {
    "sgd",
    "momentum",
    "nesterov",
    "adam",
    "adamw",
    "rmsprop",
    "adagrad",
    "signsgd",
    "lion",
    "rotation",
}
DT = torch.float64
LR = 0.037

_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=_DEVICES)
def opt_device(request) -> str:
    return request.param


# ---------------------------------------------------------------------------
# independent references (numpy)
# ---------------------------------------------------------------------------


def _np_rotation(b: np.ndarray) -> np.ndarray:
    out = np.zeros_like(b)
    for k in range(len(b) // 2):
        x, y = b[2 * k], b[2 * k + 1]
        out[2 * k], out[2 * k + 1] = -y, x
    return out


CLOSED_FORMS = {
    "sgd": lambda b: b.copy(),
    "momentum": lambda b: b.copy(),
    "nesterov": lambda b: (1 + 0.9) * b,
    "adam": lambda b: b / (np.abs(b) + 1e-8),
    "adamw": lambda b: b / (np.abs(b) + 1e-8),
    "rmsprop": lambda b: b / (np.sqrt(1 - 0.99) * np.abs(b) + 1e-8),
    "adagrad": lambda b: b / (np.sqrt(0.1 + b * b) + 1e-10),
    "signsgd": np.sign,
    "lion": np.sign,
    "rotation": _np_rotation,
}


def _np_lion(theta, grads, lr, beta1, beta2, wd):
    """Chen et al. (2023) Alg. 2, verbatim, in numpy."""
    m = np.zeros_like(theta)
    for g in grads:
        c = beta1 * m + (1 - beta1) * g
        theta = theta - lr * (np.sign(c) + wd * theta)
        m = beta2 * m + (1 - beta2) * g
    return theta


def _fsum_dot(a: np.ndarray, b: np.ndarray) -> float:
    return math.fsum((np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)).tolist())


def _mixed_gradient(d: int, seed: int) -> np.ndarray:
    """Gaussian entries over several decades, with a few exact zeros."""
    rng = np.random.default_rng(seed)
    b = rng.standard_normal(d) * 10.0 ** rng.uniform(-6, 2, size=d)
    b[rng.choice(d, size=3, replace=False)] = 0.0
    return b


# ---------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------


def test_registry_contents():
    assert set(UPDATES) == EXPECTED_NAMES
    assert set(DESCENT_COMPATIBLE) == EXPECTED_NAMES - {"rotation"}
    assert isinstance(DESCENT_COMPATIBLE, tuple)
    for name, u in UPDATES.items():
        assert isinstance(u, ZeroStateUpdate)
        assert u.name == name
        assert get_update(name) is u
        assert u.descent_compatible == (name != "rotation")


def test_registered_hyperparameters():
    assert get_update("momentum").momentum == 0.9
    assert get_update("nesterov").momentum == 0.9
    assert get_update("adam").betas == (0.9, 0.999) and get_update("adam").eps == 1e-8
    assert get_update("adamw").weight_decay == 0.01
    assert get_update("rmsprop").alpha == 0.99 and get_update("rmsprop").eps == 1e-8
    assert get_update("adagrad").initial_accumulator_value == 0.1
    assert get_update("adagrad").eps == 1e-10
    assert get_update("lion").betas == (0.9, 0.99) and get_update("lion").weight_decay == 0.0


def test_base_class_is_abstract():
    with pytest.raises(TypeError):
        ZeroStateUpdate("x", True)  # type: ignore[abstract]


@pytest.mark.parametrize("name", ["ADAM", "lamb", "", "sgd "])
def test_unknown_name_raises_listing_valid_names(name):
    with pytest.raises(ValueError) as exc:
        get_update(name)
    for valid in EXPECTED_NAMES:
        assert valid in str(exc.value)


# ---------------------------------------------------------------------------
# 1. the map equals the real first step
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_NAMES)
def test_map_equals_real_first_step(name, opt_device):
    u = get_update(name)
    b_np = _mixed_gradient(17, seed=1)  # odd length: rotation's trailing entry
    b = torch.tensor(b_np, dtype=DT, device=opt_device)
    # 9 + 8 entries: a rotation pair straddles the two parameters
    p1 = torch.zeros(3, 3, dtype=DT, device=opt_device, requires_grad=True)
    p2 = torch.zeros(2, 4, dtype=DT, device=opt_device, requires_grad=True)
    p1.grad = b[:9].reshape(3, 3).clone()
    p2.grad = b[9:].reshape(2, 4).clone()
    opt = u.make_optimizer([p1, p2], LR)
    assert isinstance(opt, torch.optim.Optimizer)
    opt.step()
    theta1 = torch.cat([p1.detach().reshape(-1), p2.detach().reshape(-1)]).cpu().numpy()

    predicted = (-LR * u.first_step(b)).cpu().numpy()
    np.testing.assert_allclose(theta1, predicted, rtol=1e-12, atol=1e-300)
    # and against the independent closed form
    np.testing.assert_allclose(theta1, -LR * CLOSED_FORMS[name](b_np), rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("sgd", torch.optim.SGD),
        ("momentum", torch.optim.SGD),
        ("nesterov", torch.optim.SGD),
        ("adam", torch.optim.Adam),
        ("adamw", torch.optim.AdamW),
        ("rmsprop", torch.optim.RMSprop),
        ("adagrad", torch.optim.Adagrad),
        ("signsgd", SignSGD),
        ("lion", Lion),
        ("rotation", RotationOptimizer),
    ],
)
def test_make_optimizer_uses_real_class(name, cls):
    p = torch.zeros(2, dtype=DT, requires_grad=True)
    opt = get_update(name).make_optimizer([p], 0.1)
    assert type(opt) is cls
    assert opt.param_groups[0]["lr"] == 0.1
    if name == "nesterov":
        assert opt.param_groups[0]["nesterov"] and opt.param_groups[0]["momentum"] == 0.9
    if name == "momentum":
        assert opt.param_groups[0]["momentum"] == 0.9
        assert not opt.param_groups[0]["nesterov"]


@pytest.mark.parametrize("dampening", [0.0, 0.5])
def test_torch_momentum_first_step_ignores_dampening(dampening):
    b = torch.tensor(_mixed_gradient(9, seed=2), dtype=DT)
    p = torch.zeros(9, dtype=DT, requires_grad=True)
    p.grad = b.clone()
    torch.optim.SGD([p], lr=LR, momentum=0.9, dampening=dampening).step()
    np.testing.assert_allclose(p.detach().numpy(), -LR * b.numpy(), rtol=1e-14, atol=0)


def test_lion_matches_paper_pseudocode_two_steps(opt_device):
    rng = np.random.default_rng(3)
    theta0 = rng.standard_normal(7)
    g1, g2 = rng.standard_normal(7), rng.standard_normal(7)
    lr, beta1, beta2, wd = 0.05, 0.5, 0.9, 0.3
    # step 2: m = 0.1 g1, c = 0.05 g1 + 0.5 g2.
    # coords 0-1: g2 = -0.5 g1 -> c = -0.2 g1 (swapping beta1/beta2 in c would
    #   give +0.04 g1); coords 2-3: g2 = -0.05 g1 -> c = +0.025 g1, opposite
    #   to sign(g2), so the momentum decides the step.
    g2[:2] = -0.5 * g1[:2]
    g2[2:4] = -0.05 * g1[2:4]
    expected = _np_lion(theta0, [g1, g2], lr, beta1, beta2, wd)

    p = torch.tensor(theta0, dtype=DT, device=opt_device, requires_grad=True)
    opt = Lion([p], lr=lr, betas=(beta1, beta2), weight_decay=wd)
    for g in (g1, g2):
        p.grad = torch.tensor(g, dtype=DT, device=opt_device)
        opt.step()
    np.testing.assert_allclose(p.detach().cpu().numpy(), expected, rtol=1e-13, atol=1e-15)
    # sanity: momentum really mattered (plain signSGD would differ)
    without_momentum = theta0 - lr * (np.sign(g1) + wd * theta0)
    without_momentum = without_momentum - lr * (np.sign(g2) + wd * without_momentum)
    assert not np.allclose(expected, without_momentum)
    # stored momentum after two steps: beta2*(1-beta2)*g1 + (1-beta2)*g2
    m = opt.state[p]["exp_avg"].cpu().numpy()
    np.testing.assert_allclose(m, beta2 * (1 - beta2) * g1 + (1 - beta2) * g2, rtol=1e-13)


def test_lion_first_step_is_sign(opt_device):
    b = _mixed_gradient(11, seed=4)
    p = torch.zeros(11, dtype=DT, device=opt_device, requires_grad=True)
    p.grad = torch.tensor(b, dtype=DT, device=opt_device)
    Lion([p], lr=LR).step()
    np.testing.assert_array_equal(p.detach().cpu().numpy(), -LR * np.sign(b))


def test_signsgd_is_stateless_sign_step():
    rng = np.random.default_rng(5)
    theta = rng.standard_normal(6)
    p = torch.tensor(theta, dtype=DT, requires_grad=True)
    opt = SignSGD([p], lr=0.25)
    for _ in range(2):
        g = rng.standard_normal(6)
        p.grad = torch.tensor(g, dtype=DT)
        opt.step()
        theta = theta - 0.25 * np.sign(g)
    np.testing.assert_allclose(p.detach().numpy(), theta, rtol=0, atol=1e-15)


def test_rotation_optimizer_multiple_groups_and_missing_grad():
    # pairs straddle parameters and groups; the param without a grad is skipped
    a = torch.zeros(3, dtype=DT, requires_grad=True)
    skipped = torch.ones(2, dtype=DT, requires_grad=True)
    c = torch.zeros(2, 2, dtype=DT, requires_grad=True)
    a.grad = torch.tensor([1.0, 2.0, 3.0], dtype=DT)
    c.grad = torch.tensor([[4.0, 5.0], [6.0, 7.0]], dtype=DT)
    opt = RotationOptimizer([{"params": [a, skipped], "lr": 0.5}, {"params": [c], "lr": 2.0}])
    opt.step()
    # g = [1..7]; R(g) = [-2, 1, -4, 3, -6, 5, 0]
    np.testing.assert_array_equal(a.detach().numpy(), -0.5 * np.array([-2.0, 1.0, -4.0]))
    np.testing.assert_array_equal(skipped.detach().numpy(), [1.0, 1.0])
    np.testing.assert_array_equal(c.detach().numpy(), -2.0 * np.array([[3.0, -6.0], [5.0, 0.0]]))


@pytest.mark.parametrize("cls", [SignSGD, Lion, RotationOptimizer])
def test_optimizer_step_closure_returns_loss(cls):
    p = torch.zeros(4, dtype=DT, requires_grad=True)
    opt = cls([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p - torch.arange(4, dtype=DT)).pow(2).sum()
        loss.backward()
        return loss

    assert float(opt.step(closure).detach()) == 0.0 + 1.0 + 4.0 + 9.0
    assert p.grad is not None  # the closure's backward ran
    assert not bool((p == 0).all())  # and the step used its gradient


@pytest.mark.parametrize("cls", [SignSGD, Lion, RotationOptimizer])
def test_custom_optimizers_reject_bad_lr(cls):
    p = torch.zeros(2, dtype=DT, requires_grad=True)
    for lr in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            cls([p], lr=lr)


def test_make_optimizer_rejects_bad_lr():
    p = torch.zeros(2, dtype=DT, requires_grad=True)
    for name in ALL_NAMES:
        with pytest.raises(ValueError):
            get_update(name).make_optimizer([p], -0.1)


# ---------------------------------------------------------------------------
# 2. closed forms of the maps
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_NAMES)
def test_first_step_closed_form(name, opt_device):
    b_np = _mixed_gradient(21, seed=6)
    b = torch.tensor(b_np, dtype=DT, device=opt_device)
    out = get_update(name).first_step(b)
    assert out.shape == b.shape and out.dtype == b.dtype and out.device == b.device
    np.testing.assert_allclose(out.cpu().numpy(), CLOSED_FORMS[name](b_np), rtol=1e-13, atol=0)


def test_closed_form_spot_values():
    b = torch.tensor([3.0, -4.0, 0.0], dtype=DT)
    np.testing.assert_allclose(get_update("nesterov").first_step(b).numpy(), [5.7, -7.6, 0.0])
    np.testing.assert_allclose(
        get_update("adagrad").first_step(b).numpy(),
        [3 / (math.sqrt(9.1) + 1e-10), -4 / (math.sqrt(16.1) + 1e-10), 0.0],
        rtol=1e-15,
    )
    np.testing.assert_allclose(
        get_update("rmsprop").first_step(b).numpy(),
        [3 / (0.3 + 1e-8), -4 / (0.4 + 1e-8), 0.0],
        rtol=1e-14,
    )
    np.testing.assert_array_equal(get_update("rotation").first_step(b).numpy(), [4.0, 3.0, 0.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_first_step_preserves_low_precision_dtype(dtype):
    b = torch.tensor([0.5, -2.0, 0.0, 1.0], dtype=dtype)
    for name in ALL_NAMES:
        out = get_update(name).first_step(b)
        assert out.dtype == dtype and out.shape == b.shape


# ---------------------------------------------------------------------------
# 3. descent compatibility
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_NAMES)
def test_is_descent_compatible_matches_declaration(name):
    expected = name in DESCENT_COMPATIBLE
    assert is_descent_compatible(get_update(name)) is expected
    assert is_descent_compatible(get_update(name), dim=5, n=16, seed=7) is expected


def test_is_descent_compatible_detects_planted_failures():
    class Negated(ZeroStateUpdate):
        def _map(self, b):
            return -b

        def make_optimizer(self, params, lr):  # pragma: no cover - unused
            raise NotImplementedError

    class Shifted(ZeroStateUpdate):  # <b, b + 1> > 0 often, but P(0) != 0
        def _map(self, b):
            return b + 1.0

        def make_optimizer(self, params, lr):  # pragma: no cover - unused
            raise NotImplementedError

    class Cubed(ZeroStateUpdate):  # <b, b^3> = sum b_i^4 > 0: must pass, tiny rows included
        def _map(self, b):
            return b**3

        def make_optimizer(self, params, lr):  # pragma: no cover - unused
            raise NotImplementedError

    class FirstCoordOnly(ZeroStateUpdate):  # <b,P(b)> = b_0^2, zero when b_0 = 0
        def _map(self, b):
            out = torch.zeros_like(b)
            out[0] = b[0]
            return out

        def make_optimizer(self, params, lr):  # pragma: no cover - unused
            raise NotImplementedError

    class NonzeroAtZero(ZeroStateUpdate):  # <b, P(b)> = |b|^2 > 0, but P(0) = 1
        def _map(self, b):
            return b.clone() if bool((b != 0).any()) else torch.ones_like(b)

        def make_optimizer(self, params, lr):  # pragma: no cover - unused
            raise NotImplementedError

    class NaNOffZero(ZeroStateUpdate):  # P(0) = 0 but P(b) = NaN elsewhere
        def _map(self, b):
            return b * math.nan

        def make_optimizer(self, params, lr):  # pragma: no cover - unused
            raise NotImplementedError

    assert is_descent_compatible(NaNOffZero("nan", False)) is False
    assert is_descent_compatible(NonzeroAtZero("nz0", False)) is False
    assert is_descent_compatible(Negated("neg", False)) is False
    assert is_descent_compatible(Shifted("shift", False)) is False
    assert is_descent_compatible(Cubed("cube", True)) is True
    # only the sparse rows / basis vectors expose this one
    assert is_descent_compatible(FirstCoordOnly("first", False)) is False
    dense = torch.tensor([[1.0, 2.0], [-3.0, 0.5]], dtype=DT)
    assert is_descent_compatible(FirstCoordOnly("first", False), samples=dense) is True


def test_is_descent_compatible_custom_samples_and_extremes():
    rows = torch.tensor(
        [[5e-324, 0.0, 0.0], [1e300, -1e-300, 0.0], [0.0, 0.0, 0.0], [-1e-200, 2.0, 1e200]],
        dtype=DT,
    )
    for name in ALL_NAMES:
        assert is_descent_compatible(get_update(name), samples=rows) is (name in DESCENT_COMPATIBLE)
    rows32 = torch.tensor([[1e-30, -1e-38, 0.0], [1e30, 2.0, -3.0]], dtype=torch.float32)
    for name in DESCENT_COMPATIBLE:
        assert is_descent_compatible(get_update(name), samples=rows32) is True


@pytest.mark.parametrize(
    "samples",
    [
        torch.ones(4, dtype=DT),  # 1-D
        torch.ones(2, 0, dtype=DT),  # no columns
        torch.ones(2, 3, dtype=torch.int64),
        torch.tensor([[1.0, float("nan")]], dtype=DT),
        torch.tensor([[1.0, float("inf")]], dtype=DT),
        [[1.0, 2.0]],
    ],
)
def test_is_descent_compatible_rejects_bad_samples(samples):
    with pytest.raises(ValueError):
        is_descent_compatible(get_update("sgd"), samples=samples)


def test_is_descent_compatible_rejects_bad_args():
    with pytest.raises(ValueError):
        is_descent_compatible(get_update("sgd"), dim=0)
    with pytest.raises(ValueError):
        is_descent_compatible(get_update("sgd"), n=-3)
    with pytest.raises(TypeError):
        is_descent_compatible(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown update"):
        is_descent_compatible("sgdd")
    with pytest.raises(ValueError, match="no hyperparameter 'epsilon'"):
        is_descent_compatible("adam", {"epsilon": 1e-3})


@pytest.mark.parametrize("name", ALL_NAMES)
def test_is_descent_compatible_accepts_a_name_like_the_symbolic_engine(name):
    """The shared argument convention: a registry name is the registered map."""
    assert is_descent_compatible(name) is is_descent_compatible(get_update(name)) is get_update(name).descent_compatible


def test_resolve_update_applies_hyperparameter_overrides():
    assert resolve_update("sgd") is get_update("sgd")
    adam = get_update("adam")
    assert resolve_update(adam) is adam
    loose = resolve_update("adam", {"eps": 0.5})
    assert loose.eps == 0.5 and loose.betas == adam.betas and loose.name == "adam"
    # P(b) = b / (|b| + eps): with eps = 0.5 and b = 0.5 the step is exactly 1/2
    b = torch.tensor([0.5, -1.5], dtype=DT)
    assert torch.equal(loose.first_step(b), torch.tensor([0.5, -0.75], dtype=DT))
    # overrides reach the numeric predicate
    assert is_descent_compatible("adam", {"eps": 1.0}) is True
    with pytest.raises(ValueError, match="no hyperparameter 'name'"):
        resolve_update("adam", {"name": "x"})
    with pytest.raises(TypeError):
        resolve_update(3.0)  # type: ignore[arg-type]


_finite = st.one_of(
    st.just(0.0),
    st.floats(min_value=1e-100, max_value=1e100),
    st.floats(min_value=-1e100, max_value=-1e-100),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_finite, min_size=1, max_size=16).filter(lambda v: any(x != 0.0 for x in v)))
def test_property_inner_product_sign(values):
    b_np = np.array(values, dtype=np.float64)
    b = torch.tensor(b_np, dtype=DT)
    for name, u in UPDATES.items():
        p = u.first_step(b).numpy()
        inner = _fsum_dot(b_np, p)
        if name in DESCENT_COMPATIBLE:
            assert inner > 0.0, (name, values)
        else:
            assert inner == 0.0, (name, values)


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=0, max_value=40))
def test_property_zero_maps_to_zero(d):
    z = torch.zeros(d, dtype=DT)
    for u in UPDATES.values():
        out = u.first_step(z)
        assert out.shape == (d,)
        assert bool((out == 0).all())


# ---------------------------------------------------------------------------
# 4. weight decay is inert at theta = 0
# ---------------------------------------------------------------------------


def _first_step_of(make, b: torch.Tensor) -> np.ndarray:
    p = torch.zeros_like(b, requires_grad=True)
    p.grad = b.clone()
    make([p]).step()
    return p.detach().cpu().numpy()


def test_weight_decay_inert_at_zero(opt_device):
    b = torch.tensor(_mixed_gradient(13, seed=8), dtype=DT, device=opt_device)
    assert get_update("adamw").weight_decay > 0.0
    via_registry = _first_step_of(lambda ps: get_update("adamw").make_optimizer(ps, LR), b)
    no_decay = _first_step_of(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0), b)
    np.testing.assert_array_equal(via_registry, no_decay)

    sgd_decay = _first_step_of(lambda ps: torch.optim.SGD(ps, lr=LR, weight_decay=0.3), b)
    sgd_plain = _first_step_of(lambda ps: torch.optim.SGD(ps, lr=LR), b)
    np.testing.assert_array_equal(sgd_decay, sgd_plain)

    adam_decay = _first_step_of(lambda ps: torch.optim.Adam(ps, lr=LR, weight_decay=0.3), b)
    adam_plain = _first_step_of(lambda ps: torch.optim.Adam(ps, lr=LR), b)
    np.testing.assert_array_equal(adam_decay, adam_plain)

    lion_decay = _first_step_of(lambda ps: Lion(ps, lr=LR, weight_decay=0.3), b)
    np.testing.assert_array_equal(lion_decay, -LR * np.sign(b.cpu().numpy()))


def test_weight_decay_not_inert_away_from_zero():
    # control: the same comparison from theta != 0 does detect the decay
    b = torch.tensor(_mixed_gradient(13, seed=9), dtype=DT)

    def step(make):
        p = torch.ones_like(b, requires_grad=True)
        p.grad = b.clone()
        make([p]).step()
        return p.detach().numpy()

    assert not np.array_equal(
        step(lambda ps: torch.optim.SGD(ps, lr=LR, weight_decay=0.3)),
        step(lambda ps: torch.optim.SGD(ps, lr=LR)),
    )


# ---------------------------------------------------------------------------
# 5. threshold, predicted_change_rate, validation
# ---------------------------------------------------------------------------


def test_threshold_zeroes_exactly_small_entries(opt_device):
    b = torch.tensor([0.5, -0.5, 0.25, -0.75, 0.0, 1e-300, -2.0], dtype=DT, device=opt_device)
    out = threshold(b, 0.5)
    np.testing.assert_array_equal(out.cpu().numpy(), [0.0, 0.0, 0.0, -0.75, 0.0, 0.0, -2.0])
    assert out.dtype == b.dtype and out.device == b.device
    out0 = threshold(b, 0.0)
    np.testing.assert_array_equal(out0.cpu().numpy(), b.cpu().numpy())
    assert bool((threshold(b, math.inf) == 0).all())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=20),
    st.floats(min_value=0.0, max_value=1e6),
)
def test_property_threshold(values, tau):
    b_np = np.array(values, dtype=np.float64)
    out = threshold(torch.tensor(b_np, dtype=DT), tau).numpy()
    small = np.abs(b_np) <= tau
    assert np.all(out[small] == 0.0)
    np.testing.assert_array_equal(out[~small], b_np[~small])


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("tau", [0.0, 1e-3, 0.7])
def test_predicted_change_rate_by_hand(name, tau):
    b_np = _mixed_gradient(15, seed=10)
    b_np[0] = 1e-3  # exactly at a threshold: must be zeroed for tau = 1e-3
    kept = np.where(np.abs(b_np) <= tau, 0.0, b_np)
    expected = -float(np.dot(b_np, CLOSED_FORMS[name](kept)))
    got = get_update(name).predicted_change_rate(torch.tensor(b_np, dtype=DT), tau)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)
    if name in DESCENT_COMPATIBLE and np.any(kept != 0):
        assert got < 0.0
    if name == "rotation" and tau == 0.0:
        assert got == 0.0  # exact cancellation when nothing is thresholded


def test_predicted_change_rate_sign_threshold_values():
    b = torch.tensor([0.3, -0.01, 0.02, -2.0], dtype=DT)
    # signsgd: -sum_{|b_i| > tau} |b_i|
    assert get_update("signsgd").predicted_change_rate(b, 0.02) == pytest.approx(-2.3, rel=1e-15)
    assert get_update("lion").predicted_change_rate(b) == pytest.approx(-2.33, rel=1e-15)
    assert get_update("sgd").predicted_change_rate(b) == pytest.approx(-(0.09 + 0.0001 + 0.0004 + 4.0), rel=1e-15)


def test_predicted_change_rate_rotation_exactly_zero():
    b = torch.tensor(_mixed_gradient(1001, seed=11), dtype=DT)
    assert get_update("rotation").predicted_change_rate(b) == 0.0


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([1.0, float("nan")], dtype=DT),
        torch.tensor([float("-inf"), 1.0], dtype=DT),
        torch.ones(2, 3, dtype=DT),
        torch.tensor(1.0, dtype=DT),
        torch.tensor([1, 2, 3]),
        [1.0, 2.0],
    ],
)
def test_bad_vector_raises(bad):
    u = get_update("adam")
    with pytest.raises(ValueError):
        u.first_step(bad)
    with pytest.raises(ValueError):
        u.predicted_change_rate(bad)
    with pytest.raises(ValueError):
        threshold(bad, 0.1)


@pytest.mark.parametrize("tau", [-1e-12, -1.0, float("nan"), "0.1", None])
def test_bad_tau_raises(tau):
    b = torch.tensor([1.0, 2.0], dtype=DT)
    with pytest.raises(ValueError):
        threshold(b, tau)
    with pytest.raises(ValueError):
        get_update("signsgd").predicted_change_rate(b, tau)


def test_error_messages_name_the_argument():
    with pytest.raises(ValueError, match=r"\bb\b.*1-D"):
        get_update("sgd").first_step(torch.ones(2, 2, dtype=DT))
    with pytest.raises(ValueError, match=r"\bb\b.*finite"):
        get_update("sgd").first_step(torch.tensor([float("nan")], dtype=DT))
    with pytest.raises(ValueError, match=r"tau"):
        threshold(torch.ones(2, dtype=DT), -1.0)
