#!/usr/bin/env python
"""Where the time of ``FeatureStatistics.update`` goes, and what the proposed changes would save.

Captures ``z, g`` at the 8 sites of the benchmark model (``diagnose_speed.py``'s setting)
for one probe batch, then times, interleaved and median of ``--reps``:

* the library's ``FeatureStatistics.update`` (whole call) and its parts, re-executed
  step by step outside the library (same operations, same order, same dtypes):
  ``checks`` (the two ``isfinite`` scans and the underflow check), ``norms`` (the float64
  ``‖g‖², max ‖g‖, ‖z‖²`` of ``_common``), ``features`` (float64 ``φ̃``), ``to64 g``, ``Σ``
  (float64 ``φ̃ᵀφ̃``) and ``G`` (float64 ``gᵀφ̃``);
* prototypes of the proposals (benchmark-local, the library is not changed):

  - ``P1 f32-gemm``: features and the two GEMMs in float32, each batch's ``Σ_b, G_b``
    added to float64 running sums (rounding ``~ sqrt(B)·eps32`` per batch instead of
    ``eps64``, never accumulated across batches);
  - ``P2 f32-fused``: as P1 but one GEMM ``[φ̃ | g]ᵀ φ̃`` giving ``Σ_b`` and ``G_bᵀ`` at once;
  - ``P3 f32-sym``: as P1 but ``Σ_b`` from the 3 upper blocks of a 2×2 block split
    (``3/4`` of the Gram work; BLAS ``syrk`` would be ``1/2``);
  - ``P4 f64-fused``: float64 kept, one fused GEMM and no repeated conversions.

Also prints the accuracy of P1/P2 against the float64 library on the whole probe
(relative Frobenius error of ``Σ``, ``G`` and the relative change of every site's ``s``).

Run:  PYTHONPATH=. python benchmarks/profile_update.py [--quick] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

THREADS = int(os.environ.get("BENCH_THREADS", "2"))
for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, str(THREADS))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from diagnose_speed import DEPTH, Probe, family_for, make_model

from depthsat_theory.capture import SiteRecorder
from depthsat_theory.families import to_rows
from depthsat_theory.statistics import FeatureStatistics, default_rtol, pinv_quadratic
from depthsat_theory.tasks import classification_loss

torch.set_num_threads(THREADS)


def capture(model, x, y, sites):
    with SiteRecorder(model, sites) as rec:
        rec.backward(classification_loss(model(x), y).sum())
        return {s: (rec.z[s], rec.g[s]) for s in sites}


class Proto:
    """Prototype accumulators (float64 running sums, per-batch products in ``dt``)."""

    def __init__(self, fam, d, mode):
        self.fam, self.d, self.mode = fam, d, mode
        self.k = fam.augmented_dim((d,), "vector")
        self.dt = torch.float64 if mode == "f64-fused" else torch.float32
        self.fmap = fam.frozen_feature_map((d,), "vector", dtype=self.dt)
        self.sigma = torch.zeros(self.k, self.k, dtype=torch.float64)
        self.cross = torch.zeros(d, self.k, dtype=torch.float64)
        self.n = 0

    def update(self, z, g):
        with torch.no_grad():
            zt, gt = z.to(self.dt), g.to(self.dt)
            phi = self.fam.augmented_features(self.fmap, zt).reshape(-1, self.k)
            rows_g = to_rows(gt, "vector").reshape(-1, self.d)
            if self.mode in ("f32-fused", "f64-fused"):
                both = torch.cat([phi, rows_g], dim=1).T @ phi
                self.sigma += both[: self.k]
                self.cross += both[self.k :]
            elif self.mode == "f32-sym":
                h = self.k // 2
                a, b = phi[:, :h], phi[:, h:]
                s11, s12, s22 = a.T @ a, a.T @ b, b.T @ b
                self.sigma[:h, :h] += s11
                self.sigma[:h, h:] += s12
                self.sigma[h:, :h] += s12.T
                self.sigma[h:, h:] += s22
                self.cross += rows_g.T @ phi
            else:
                self.sigma += phi.T @ phi
                self.cross += rows_g.T @ phi
            self.n += z.shape[0]

    def score(self, rtol):
        sig = (self.sigma / self.n).numpy()
        big_g = (self.cross / self.n).numpy()
        return pinv_quadratic(sig, big_g, rtol)[0] ** 0.5


def parts(fam, d):
    fmap = fam.frozen_feature_map((d,), "vector", dtype=torch.float64)
    k = fam.augmented_dim((d,), "vector")
    sig = torch.zeros(k, k, dtype=torch.float64)
    cross = torch.zeros(d, k, dtype=torch.float64)

    def checks(z, g):
        torch.isfinite(z).all()
        torch.isfinite(g).all()

    def norms(z, g):
        g64 = g.to(torch.float64)
        per_ex = g64.flatten(1).pow(2).sum(1)
        bool((per_ex == 0).any())
        float(per_ex.sum()), float(per_ex.max().sqrt())
        float(z.to(torch.float64).pow(2).sum())

    def features(z, g):
        with torch.no_grad():
            return fam.augmented_features(fmap, z.to(torch.float64))

    phi_cache = {}

    def to64g(z, g):
        return to_rows(g.to(torch.float64), "vector")

    def gram(z, g):
        phi = phi_cache.setdefault(id(z), features(z, g)).reshape(-1, k)
        sig.add_(phi.T @ phi)

    def crossg(z, g):
        phi = phi_cache.setdefault(id(z), features(z, g)).reshape(-1, k)
        cross.add_(g.to(torch.float64).reshape(-1, d).T @ phi)

    return {
        "checks": checks,
        "norms": norms,
        "features f64": features,
        "to64 g": to64g,
        "Σ f64 gemm": gram,
        "G f64 gemm": crossg,
    }


def _over_sites(f, zg: dict, sites: list):
    """A job calling ``f(z, g)`` (or ``f[site](z, g)`` for a mapping) at every site."""
    if isinstance(f, dict):
        return lambda: [f[s](*zg[s]) for s in sites]
    return lambda: [f(*zg[s]) for s in sites]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--family", default="relu:4d")
    args = ap.parse_args()
    d, n, bs = (64, 2048, 512) if args.quick else (256, 8192, 1024)
    model = make_model(d)
    sites = [f"blocks.{i}" for i in range(DEPTH)]
    fam = family_for(args.family, d)
    probe = Probe(n, bs)
    x, y = next(iter(probe))
    zg = capture(model, x, y, sites)
    print(
        f"# update() breakdown, family {fam.spec}, d={d}, batch={bs}, {len(sites)} sites, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}"
    )

    jobs = {}
    lib = {s: FeatureStatistics(fam, (d,), "vector") for s in sites}
    jobs["library update()"] = lambda: [lib[s].update(*zg[s]) for s in sites]
    jobs["floor fwd+bwd (1 batch)"] = lambda: (
        model.zero_grad(set_to_none=True),
        classification_loss(model(x), y).sum().backward(),
    )
    jobs["floor-nograd + taps"] = lambda: capture(model, x, y, sites)
    pf = parts(fam, d)
    for name, f in pf.items():
        jobs[name] = _over_sites(f, zg, sites)
    protos = {m: {s: Proto(fam, d, m) for s in sites} for m in ("f32-gemm", "f32-fused", "f32-sym", "f64-fused")}
    for m, acc in protos.items():
        jobs[f"P {m}"] = _over_sites({s: acc[s].update for s in sites}, zg, sites)
    for f in jobs.values():
        f()
    times = {k: [] for k in jobs}
    for _ in range(args.reps):
        for k, f in jobs.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med["floor fwd+bwd (1 batch)"]
    for k in jobs:
        print(
            f"  {k:26s} {med[k] * 1e3:9.1f} ms  {med[k] / floor:6.2f}x floor-batch  "
            f"{med[k] / med['library update()']:6.1%} of update()"
        )

    # accuracy over the whole probe
    ref = {s: FeatureStatistics(fam, (d,), "vector") for s in sites}
    acc = {m: {s: Proto(fam, d, m) for s in sites} for m in ("f32-gemm", "f32-fused")}
    for xb, yb in probe:
        zgb = capture(model, xb, yb, sites)
        for s in sites:
            ref[s].update(*zgb[s])
            for m in acc:
                acc[m][s].update(*zgb[s])
    for m in acc:
        es, eg, ds = 0.0, 0.0, 0.0
        for s in sites:
            r = ref[s]
            res = r.result()
            rtol = default_rtol(torch.float32, r.k)
            es = max(es, float((acc[m][s].sigma - r.sigma).norm() / r.sigma.norm()))
            eg = max(eg, float((acc[m][s].cross - r.cross).norm() / r.cross.norm()))
            ds = max(ds, abs(acc[m][s].score(rtol) - res.score) / res.score)
        print(f"  accuracy {m}: max over sites |ΔΣ|/|Σ| = {es:.1e}, |ΔG|/|G| = {eg:.1e}, |Δs|/s = {ds:.1e}")


if __name__ == "__main__":
    main()
