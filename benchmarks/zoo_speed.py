#!/usr/bin/env python
"""``diagnose()`` on the zoo's pretrained models against a plain forward+backward of the same probe.

Models (offline, from packages; GUIDE.md): ``smollm2`` (SmolLM2-135M, 30 sites, 16 windows of ≤ 128 tokens in
batches of 4), ``minilm`` (all-MiniLM-L6-v2, 6 sites, 32 sentences in batches of 16), ``efficientnet-lite0``
(16 images in batches of 8): the zoo's default probes, float32, CPU.

Methods, interleaved **pass by pass** in a rotating order (``diagnose()`` streams the whole probe and
finishes, so batch-level interleaving would not time it as used), one warm-up round discarded, the ratio is
the median over ``≥ 3`` rounds of the per-round ratio to the plain pass of the same round:

* ``plain``: for every probe batch, ``zero_grad``, the zoo's per-example losses, ``.sum().backward()``
  (parameter gradients included, as in training);
* ``diagnose``: ``depthsat_theory.diagnose.diagnose`` with the CLI's arguments (family ``linear``, every
  site, the zoo's mask and reduction), end to end: probe loop, kink-tie counting, finishing step;
* ``diagnose-nokinks``: the same with ``kinks=False`` (what the kink-tie counter costs).

The load average is printed before and after each model; only ratios are meaningful on a shared machine.

Run:  PYTHONPATH=. python benchmarks/zoo_speed.py [--models smollm2 minilm efficientnet-lite0] [--reps 3]
      [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

THREADS = int(os.environ.get("BENCH_THREADS", "2"))
for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, str(THREADS))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as speed_matrix.py: before torch loads libgomp
ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch

from depthsat_theory.diagnose import diagnose
from depthsat_theory.experiments.record import provenance
from depthsat_theory.tasks import zoo
from depthsat_theory.tasks.custom import zoo_diagnose_extras


def _plain(zm) -> None:
    for x, y in zm.batches:
        zm.model.zero_grad(set_to_none=True)
        zm.losses(x, y).sum().backward()
    zm.model.zero_grad(set_to_none=True)


def _diagnose(zm, kinks: bool):
    return diagnose(
        zm.model, zm.loss_fn, zm.batches, sites=list(zm.sites), layout=zm.layout, kinks=kinks, **zoo_diagnose_extras(zm)
    )


def one_model(name: str, reps: int, n_examples: int | None, nokinks: bool) -> dict:
    zm = zoo.load(name, n_examples=n_examples)
    methods = {
        "plain": lambda: _plain(zm),
        "diagnose": lambda: _diagnose(zm, True),
    }
    if nokinks:
        methods["diagnose-nokinks"] = lambda: _diagnose(zm, False)
    names = list(methods)
    times: dict = {k: [] for k in names}
    load0 = os.getloadavg()[0]
    for r in range(reps + 1):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            methods[k]()
            dt = time.perf_counter() - t0
            if r:
                times[k].append(dt)
    row = {
        "model": name,
        "sites": len(zm.sites),
        "examples": zm.n_examples,
        "batches": len(zm.batches),
        "plain_s": statistics.median(times["plain"]),
        "load": [load0, os.getloadavg()[0]],
    }
    for k in names[1:]:
        row[k] = statistics.median(a / b for a, b in zip(times[k], times["plain"], strict=True))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["smollm2", "minilm", "efficientnet-lite0"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n", type=int, nargs="*", default=None, help="probe examples per model (default: the zoo's)")
    ap.add_argument("--no-kinks-variant", action="store_true", help="leave out diagnose(kinks=False)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.reps < 3:
        ap.error("--reps must be at least 3 (the ratios are medians over rounds)")
    print(f"# zoo_speed: {THREADS} threads, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}", flush=True)
    started = time.time()
    rows = []
    for i, name in enumerate(args.models):
        n = args.n[i] if args.n and i < len(args.n) and args.n[i] > 0 else None
        row = one_model(name, args.reps, n, not args.no_kinks_variant)
        rows.append(row)
        print(
            f"{name:18s} sites={row['sites']:<3d} n={row['examples']:<3d} | diagnose {row['diagnose']:.2f}x  "
            f"without kink counting {row.get('diagnose-nokinks', float('nan')):.2f}x | "
            f"plain {row['plain_s']:.2f} s/pass | "
            f"load {row['load'][0]:.1f}->{row['load'][1]:.1f}",
            flush=True,
        )
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"provenance": provenance(seeds=[], config=vars(args), started=started), "rows": rows}, indent=1)
        )
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
