#!/usr/bin/env python
"""The unit path (theory/numerics.md ``thm-unit-gram``) against the Gram path on a wide family: cost and accuracy.

``relu:4096`` (``k̃ = 4097``) at ``d = 256`` on :class:`~depthsat_theory.tasks.ResidualMLP` (float32, eval,
random weights), ``1`` or ``8`` sites, probes of ``n ≤ k̃/2`` examples (batches of 1024 or fewer).  Methods,
interleaved batch by batch as in ``speed_matrix.py`` (one warm-up round discarded, medians over rounds):

* ``plain``: forward + ``loss.sum().backward()``;
* ``gram``: ``FeatureStatistics(gram="features")``, the ``k̃ × k̃`` Gram streamed per batch, then ``result()``;
* ``units``: ``FeatureStatistics(gram="auto")``, which at these sizes keeps the rows and factors them in
  ``result()`` (a thin SVD of ``n × k̃``).

Each method's pass time includes its ``result()`` at every site (the unit path moves work there).
Accuracy: ``|ŝ_units − ŝ_gram| / ŝ``, both rounding bounds, ranks, verdicts, per site.

Run:  PYTHONPATH=. python benchmarks/unit_gram.py [--sites 1 8] [--n 1024 2048] [--reps 3] [--json out.json]
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
from speed_matrix import flop_floor, make_batches, make_model

from depthsat_theory.capture import accumulate
from depthsat_theory.families import parse_family
from depthsat_theory.statistics import FeatureStatistics
from depthsat_theory.tasks import classification_loss


def one_config(spec: str, d: int, nsites: int, n: int, bs: int, reps: int, gram_once: bool, repeat: int) -> dict:
    depth = max(8, nsites)
    model = make_model(d, depth, "cpu")
    fam = parse_family(f"{spec}:0")
    sites = [f"blocks.{round(i * (depth - 1) / max(nsites - 1, 1))}" for i in range(nsites)]
    batches = make_batches(max(1, n // bs), bs, "cpu")
    if repeat > 1:  # each input `repeat` times with independent labels: rank n/repeat, so ŝ < AG_rms
        batches = [(x[::repeat].repeat_interleave(repeat, 0), y) for x, y in batches]
    kt = fam.augmented_dim((d,), "vector")
    times: dict = {k: [] for k in ("plain", "gram", "units")}
    finish: dict = {k: [] for k in ("gram", "units")}
    results: dict = {}
    for r in range(reps + 1):
        names = ["plain", "units"] + (["gram"] if not gram_once or r == reps else [])
        stats = {
            k: {s: FeatureStatistics(fam, (d,), "vector", gram="features" if k == "gram" else "auto") for s in sites}
            for k in names[1:]
        }
        acc = dict.fromkeys(names, 0.0)
        for i, (x, y) in enumerate(batches):
            for k in names[i % len(names) :] + names[: i % len(names)]:
                t0 = time.perf_counter()
                if k == "plain":
                    model.zero_grad(set_to_none=True)
                    classification_loss(model(x), y).sum().backward()
                else:
                    accumulate(model, sites, [(x, y)], classification_loss, stats[k])
                acc[k] += time.perf_counter() - t0
        fin = {}
        for k in names[1:]:
            t0 = time.perf_counter()
            results[k] = {s: st.result() for s, st in stats[k].items()}
            fin[k] = time.perf_counter() - t0
            acc[k] += fin[k]
        if r:
            for k in names:
                times[k].append((acc[k], acc["plain"]))
            times.setdefault("units-update", []).append((acc["units"] - fin["units"], acc["plain"]))
            for k in names[1:]:
                finish[k].append(fin[k])
        used_units = all(st._kept is not None for st in stats["units"].values())
    rel = [
        abs(results["units"][s].score - results["gram"][s].score) / max(results["gram"][s].score, 1e-300) for s in sites
    ]
    row = {
        "family": spec,
        "d": d,
        "gram_rounds": len(times["gram"]),
        "sites": nsites,
        "n": n,
        "repeat": repeat,
        "batch": bs,
        "unit_path_used": used_units,
        "gram_x_plain": statistics.median(a / b for a, b in times["gram"]),
        "units_x_plain": statistics.median(a / b for a, b in times["units"]),
        "units_update_x_plain": statistics.median(a / b for a, b in times["units-update"]),
        "gram_finish_s": statistics.median(finish["gram"]),
        "units_finish_s": statistics.median(finish["units"]),
        "plain_s": statistics.median(a for a, _ in times["plain"]),
        "max_rel_ds": max(rel),
        "max_err_over_s": max(
            results[k][s].score_error / max(results[k][s].score, 1e-300) for k in ("gram", "units") for s in sites
        ),
        "same_verdicts": all(results["units"][s].verdict is results["gram"][s].verdict for s in sites),
        "same_ranks": all(results["units"][s].tangent_rank == results["gram"][s].tangent_rank for s in sites),
        "verdicts": sorted({str(results["units"][s].verdict.value) for s in sites}),
        "floor32": flop_floor(spec, d, depth, nsites)["floor32"],
        "state_mib_gram": nsites * 2 * kt**2 * 8 / 2**20,
        "state_mib_units": nsites * n * (kt + d) * 8 / 2**20,
    }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="relu:4096")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--gram-once", action="store_true", help="run the Gram path in the last round only (slow k̃)")
    ap.add_argument("--repeat", type=int, default=1, help="repeat each input this often (labels differ)")
    ap.add_argument("--sites", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--n", type=int, nargs="*", default=[1024, 2048])
    ap.add_argument("--bs", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(
        f"# unit_gram: {args.family} d={args.d}, {THREADS} threads, torch {torch.__version__}, "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows = []
    for nsites in args.sites:
        for n in args.n:
            load0 = os.getloadavg()[0]
            row = one_config(args.family, args.d, nsites, n, min(args.bs, n), args.reps, args.gram_once, args.repeat)
            row["load"] = [load0, os.getloadavg()[0]]
            rows.append(row)
            head = f"sites={nsites} n={n}: gram {row['gram_x_plain']:.2f}x [{row['gram_rounds']} rounds]"
            head += f" (finish {row['gram_finish_s']:.2f} s)"
            unit = f"units {row['units_x_plain']:.2f}x (batches alone {row['units_update_x_plain']:.2f}x,"
            unit += f" finish {row['units_finish_s']:.2f} s)"
            acc = f"max |Δŝ|/ŝ {row['max_rel_ds']:.1e}, max e/ŝ {row['max_err_over_s']:.1e}"
            same = f"same verdicts {row['same_verdicts']} ({row['verdicts']}), same ranks {row['same_ranks']}"
            mem = f"state {row['state_mib_gram']:.0f} vs {row['state_mib_units']:.0f} MiB"
            tail = f"plain {row['plain_s']:.2f} s | load {load0:.1f}->{row['load'][1]:.1f}"
            print(f"{head}  {unit}  floor32 {row['floor32']:.2f}x | {acc}, {same} | {mem} | {tail}", flush=True)
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
