#!/usr/bin/env python
"""The float32-products fast path's error against exact truth and against the float64 path.

For each probe: the exact score of the stored arrays in rational arithmetic
(:func:`proofs_checks.t8_numerics.exact_score`, linear family with bias) or a numpy float64
least-squares score of the family's own features (``relu:K``), then the default float64-products
``ŝ``, its bound ``e`` and verdict, and the same for ``products="float32"`` (chunks of 128 rows
accumulated in float32: ``L_32 = 128 + ⌈B/128⌉ − 1``), with the measured ``|ŝ − s|`` against the fast
path's ``e``. Probes: the verdict reproducers'
near-threshold construction (cancelling pairs plus a planted signal), the collinear reproducer
``z = (t, t + ε w)`` (exact ``s = AG_rms = 1``), a direction of amplitude ``η`` carrying the whole
gradient, and a well-conditioned ``relu:64`` site. Seconds on one thread.

Run:  PYTHONPATH=. python benchmarks/fast_products_error.py [--markdown]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from depthsat_theory import parse_family
from depthsat_theory.statistics import statistics_for
from proofs_checks.t8_numerics import collinear_signal, exact_score, near_threshold_probe


def _result(z, g, products, family="linear", batch=400):
    st = statistics_for(parse_family(family), tuple(z.shape[1:]), "vector", products=products)
    for i in range(0, z.shape[0], batch):
        st.update(z[i : i + batch], g[i : i + batch])
    return st.result()


def _hidden(eta: float):
    rng = np.random.default_rng(0)
    n, d = 400, 8
    zz = rng.standard_normal((n, d))
    w = rng.standard_normal(n)
    zz[:, 1] = zz[:, 0] + eta * w
    zz = zz.astype(np.float32).astype(np.float64)
    design = np.concatenate([zz[:, [0, *range(2, d)]], np.ones((n, 1))], 1)
    g = np.zeros((n, d))
    g[:, 0] = w - design @ np.linalg.lstsq(design, w, rcond=None)[0]
    return torch.from_numpy(zz).float(), torch.from_numpy(g).float()


def probes():
    """``(name, z, g, family, truth)``."""
    rng = np.random.default_rng(11)
    for eps in (1e-1, 1e-2, 1e-3):
        z, g0, v = near_threshold_probe(rng, eps, 600, torch.float32)
        base = _result(z, g0, "float64")
        vv = torch.from_numpy(np.stack([v, v], 1) / np.sqrt(np.mean(v * v)))
        for mult in (0.0, 30.0, 1e4):
            g = (g0.double() + mult * base.tol * vv).float()
            yield (
                f"near-threshold ε={eps:g}, c={mult:g}·e64",
                z,
                g,
                "linear",
                exact_score(z.double().numpy(), g.double().numpy()),
            )
    for eps in (1e-1, 1e-3):
        z, g = collinear_signal(eps, torch.float32)
        yield f"collinear ε={eps:g}", z, g, "linear", exact_score(z.double().numpy(), g.double().numpy())
    for eta in (1e-5, 1e-3):
        z, g = _hidden(eta)
        yield f"hidden direction η={eta:g}", z, g, "linear", exact_score(z.double().numpy(), g.double().numpy())
    fam = parse_family("relu:64:0")
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(2048, 6, generator=gen)
    g = torch.sin(z @ torch.randn(6, 6, generator=gen)) / 20
    phi = fam.augmented_features(fam.frozen_feature_map((6,), "vector"), z.double()).reshape(2048, -1).numpy()
    coef = np.linalg.lstsq(phi, g.double().numpy(), rcond=None)[0]
    yield "relu:64, smooth target (lstsq)", z, g, "relu:64:0", float(np.sqrt(((phi @ coef) ** 2).sum() / 2048))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    head = "| probe | exact s | float64: ŝ, e, verdict | float32: ŝ, e, dropped, verdict | \\|ŝ32 − s\\|/e32 |"
    print(head if args.markdown else head.replace("|", " "))
    if args.markdown:
        print("|---|---:|---|---|---:|")
    for name, z, g, fam, truth in probes():
        r64, r32 = _result(z, g, "float64", fam), _result(z, g, "float32", fam)
        dropped = r32.tangent_dim - r32.tangent_rank
        ratio = abs(r32.score - truth) / r32.score_error if r32.score_error > 0 else float("nan")
        row = (
            f"| {name} | {truth:.3g} | {r64.score:.3g}, {r64.score_error:.2g}, {r64.verdict.value} | "
            f"{r32.score:.3g}, {r32.score_error:.2g}, {dropped}, {r32.verdict.value} | {ratio:.2g} |"
        )
        print(row if args.markdown else row.replace("|", " "), flush=True)


if __name__ == "__main__":
    main()
