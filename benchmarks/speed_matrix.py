#!/usr/bin/env python
"""Where depthsat stands: its one-pass statistics against a plain pass and GroMo, over a grid.

Grid: families ``linear``, ``relu:1024``, ``relu:4096``; ``1``, ``8`` or ``32`` sites;
widths ``d`` from 128 to 1024 (:class:`~depthsat_theory.tasks.ResidualMLP`, GELU, hidden ``2d``,
depth ``max(8, sites)``, float32, eval, random weights); batches of 1024 synthetic examples.
For every configuration the methods run **interleaved batch by batch** (``diagnose_speed.py``'s
protocol: every method processes batch ``i``, in a rotating order, before any sees ``i + 1``);
one warm-up round is discarded; each ratio is the **median over ≥ 3 rounds** of the per-round
ratio to the plain pass of the same round.  The load average is printed before and after each
configuration: only the ratios are meaningful on a shared machine.

Methods: ``plain`` (forward + ``loss.sum().backward()``), ``depthsat`` (the library's probe loop,
float64 products), ``depthsat-f32`` (``products="float32"``: float32 batch products summed in
float64, the opt-in fast path with the wider rounding bound), ``gromo`` (GroMo 0.1.0's second-layer
``tensor_s``/``tensor_m`` for the same features, float32; ``diagnose_speed.py``'s ``gromo-min``).

The **flop floor** printed next to each ratio counts multiply-adds per batch:
plain ``3F`` (``F`` the forward's, the backward twice that); statistics per site (features
``B d K``, ``Σ`` symmetric ``B k̃²/2``, ``G`` ``B d k̃``): ``floor32 = 1 + stats/plain``, the issue's
float32 floor; ``floor32q`` (printed ``+q``) adds the noise moment ``E[XᵀX]`` (a second symmetric
``B k̃²/2``), which the noise test needs and GroMo does not compute.  ``impl64`` is what the float64
path computes (``Σ`` and the noise moment ``E[XᵀX]`` each ``5/8 B k̃²``, block triangular), weighted ×2
for float64's half rate.

Run:  PYTHONPATH=. python benchmarks/speed_matrix.py [--tiny | --quick | --full] [--reps 3] [--json out.json]
      [--no-gromo] [--device cuda] [--memory] [--one-chunk]
``--tiny`` (CI): d = 64, 2 sites, batches of 256, linear and relu:256, 3 rounds: seconds.
``--memory``: peak resident memory of the probe loop with the only site at the bottom or the top of
a 32-block model (fresh child process per point).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

THREADS = int(os.environ.get("BENCH_THREADS", "2"))
for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, str(THREADS))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning threads collapse on a loaded machine
ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch
from diagnose_speed import LinearGrowingBlock, gromo_model, steps_for

from depthsat_theory.capture import accumulate
from depthsat_theory.experiments.record import provenance
from depthsat_theory.families import parse_family
from depthsat_theory.statistics import FeatureStatistics
from depthsat_theory.statistics import feature as feature_mod
from depthsat_theory.tasks import ResidualMLP, classification_loss

torch.set_num_threads(THREADS)
IN_DIM, CLASSES = 64, 10


def make_model(d: int, depth: int, device: str):
    torch.manual_seed(0)
    return ResidualMLP(in_dim=IN_DIM, width=d, depth=depth, n_classes=CLASSES).eval().to(device)


def make_batches(nb: int, bs: int, device: str):
    out = []
    for i in range(nb):
        gen = torch.Generator().manual_seed(1000 + i)
        x, y = torch.randn(bs, IN_DIM, generator=gen), torch.randint(0, CLASSES, (bs,), generator=gen)
        out.append((x.to(device), y.to(device)))
    return out


def flop_floor(spec: str, d: int, depth: int, nsites: int) -> dict:
    """Multiply-add counts per example and the floors (see the module docstring)."""
    forward = IN_DIM * d + depth * 4 * d * d + CLASSES * d
    plain = 3 * forward
    k = d if spec == "linear" else int(spec.split(":")[1])
    kt = k + 1
    feats = 0 if spec == "linear" else d * k
    stats32 = feats + kt * kt / 2 + d * kt
    impl64 = feats + 2 * (5 / 8) * kt * kt + d * kt
    return {
        "plain_macs": plain,
        "floor32": 1 + nsites * stats32 / plain,
        "floor32q": 1 + nsites * (stats32 + kt * kt / 2) / plain,
        "impl64": 1 + 2 * nsites * impl64 / plain,
    }


def _steps(name, model, kw):
    if name == "plain":
        return steps_for("floor", model, kw)
    if name == "gromo":
        return steps_for("gromo-min", model, kw)
    products = "float32" if name.startswith("depthsat-f32") else "float64"
    fam, sites, d = kw["fam"], kw["sites"], kw["d"]
    # the Gram path streamed per batch (as in the earlier tables): at 2 batches of relu:4096 the default
    # gram="auto" would keep the rows and move the work into result(), which these rows do not time
    # (benchmarks/unit_gram.py times the unit path with its finishing step)
    stats = {s: FeatureStatistics(fam, (d,), "vector", products=products, gram="features") for s in sites}

    def step(x, y):
        accumulate(model, sites, [(x, y)], classification_loss, stats)

    if name == "depthsat-f32-1chunk":  # the float32 path before chunking: one float32 product per batch

        def one_chunk(x, y):
            chunk, feature_mod.PRODUCT_CHUNK_ROWS = feature_mod.PRODUCT_CHUNK_ROWS, 1 << 30
            try:
                step(x, y)
            finally:
                feature_mod.PRODUCT_CHUNK_ROWS = chunk

        return one_chunk, lambda: None
    return step, lambda: None


def interleaved(names, model, batches, kw, reps, device) -> dict:
    """Seconds per pass, per method and round (round 0 discarded); methods alternate batch by batch."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: dict = {k: [] for k in names}
    for r in range(reps + 1):
        state = {k: _steps(k, model, kw) for k in names}
        acc = dict.fromkeys(names, 0.0)
        for i, (x, y) in enumerate(batches):
            for k in names[i % len(names) :] + names[: i % len(names)]:
                sync()
                t0 = time.perf_counter()
                state[k][0](x, y)
                sync()
                acc[k] += time.perf_counter() - t0
        if r:
            for k in names:
                times[k].append(acc[k])
    return times


def configurations(mode: str) -> list[tuple[str, int, int, int]]:
    """``(family, d, sites, batches)`` of a mode."""
    if mode == "tiny":
        return [("linear", 64, 2, 3), ("relu:256", 64, 2, 3)]
    if mode == "quick":
        return [("linear", 256, 8, 4), ("relu:1024", 256, 8, 4), ("relu:4096", 256, 8, 2)]
    grid = [(f, 256, s, 4) for f in ("linear", "relu:1024") for s in (1, 8, 32)]
    grid += [("relu:4096", 256, s, 2) for s in (1, 8)]
    grid += [(f, d, 8, 4) for f in ("linear", "relu:1024") for d in (128, 512, 1024)]
    return grid


def run(args) -> list[dict]:
    rows = []
    for spec, d, nsites, nb in configurations(args.mode):
        if (args.family and spec not in args.family.split(",")) or (args.sites and nsites not in args.sites):
            continue
        depth = max(8, nsites)
        model = make_model(d, depth, args.device)
        fam = parse_family(spec if spec == "linear" else f"{spec}:0")
        sites = [f"blocks.{round(i * (depth - 1) / max(nsites - 1, 1))}" for i in range(nsites)]
        kw = dict(fam=fam, sites=sites, d=d)
        names = ["plain", "depthsat"] + ([] if args.no_f32 else ["depthsat-f32"])
        names += ["depthsat-f32-1chunk"] if args.one_chunk else []
        if LinearGrowingBlock is not None and not args.no_gromo and args.device == "cpu":
            kw["gm"] = gromo_model(model, fam, sites, d)
            names.append("gromo")
        load0 = os.getloadavg()[0]
        times = interleaved(names, model, make_batches(nb, args.bs, args.device), kw, args.reps, args.device)
        load1 = os.getloadavg()[0]
        floor = flop_floor(spec, d, depth, nsites)
        row = {"family": spec, "d": d, "sites": nsites, "depth": depth, "load": [load0, load1], **floor}
        for k in names[1:]:
            row[k] = statistics.median(a / b for a, b in zip(times[k], times["plain"], strict=True))
        row["plain_s"] = statistics.median(times["plain"])
        rows.append(row)
        gro = f"{row['gromo']:6.2f}x" if "gromo" in row else "     -"
        f32 = f"{row['depthsat-f32']:6.2f}x" if "depthsat-f32" in row else "     -"
        if "depthsat-f32-1chunk" in row:
            f32 += f" (1 chunk {row['depthsat-f32-1chunk']:.2f}x)"
        print(
            f"{spec:10s} d={d:<5d} sites={nsites:<3d} | ours {row['depthsat']:6.2f}x  f32 {f32}"
            f"  gromo {gro} | floor32 {floor['floor32']:5.2f}x (+q {floor['floor32q']:5.2f}x)"
            f" impl64 {floor['impl64']:5.2f}x"
            f" | plain {row['plain_s']:.3f} s/pass | load {load0:.1f}->{load1:.1f}",
            flush=True,
        )
    return rows


def _child_memory(site: str, d: int, bs: int, nb: int) -> None:
    model = make_model(d, 32, "cpu")
    fam = parse_family("linear")
    batches = make_batches(nb, bs, "cpu")
    stats = {site: FeatureStatistics(fam, (d,), "vector")}
    accumulate(model, [site], batches[:1], classification_loss, stats)  # warm-up
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    base = _status("VmRSS")
    accumulate(model, [site], batches, classification_loss, stats)
    print(json.dumps({"site": site, "peak_mib": _status("VmHWM") - base}))


def _status(key: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def memory(args) -> list[dict]:
    """Peak memory of the probe loop, site at the bottom versus the top of a 32-block model."""
    out = []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    for site in ("blocks.0", "blocks.31"):
        cmd = [sys.executable, __file__, "--_child-memory", site, "--bs", str(args.bs)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
        line = (
            res.stdout.strip().splitlines()[-1]
            if res.returncode == 0
            else json.dumps({"site": site, "error": res.stderr[-300:]})
        )
        out.append(json.loads(line))
        print(f"memory: site {site:9s} of 32 blocks (d = 256, batch {args.bs}): {out[-1]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    for m in ("tiny", "quick", "full"):
        mode.add_argument(f"--{m}", dest="mode", action="store_const", const=m)
    ap.set_defaults(mode="quick")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bs", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-gromo", action="store_true")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--family", default=None, help="only these families of the grid (comma-separated)")
    ap.add_argument("--sites", type=int, nargs="*", default=None, help="only these site counts of the grid")
    ap.add_argument("--no-f32", action="store_true", help="leave out the opt-in float32-products rows")
    ap.add_argument("--one-chunk", action="store_true", help="also float32 products in one chunk per batch")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_child-memory", dest="child_memory", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bs is None:
        args.bs = 256 if args.mode == "tiny" else 1024
    if args.child_memory:
        _child_memory(args.child_memory, 256, args.bs, 4)
        return
    if args.reps < 3:
        ap.error("--reps must be at least 3 (the ratios are medians over rounds)")
    print(
        f"# speed_matrix: {args.mode}, {THREADS} threads, batch {args.bs}, {args.reps} rounds interleaved by batch, "
        f"device {args.device}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"load {os.getloadavg()[0]:.1f}; GroMo {'0.1.0' if LinearGrowingBlock is not None else 'absent'}",
        flush=True,
    )
    started = time.time()
    rows = run(args)
    config = {**vars(args), "gromo": "0.1.0" if LinearGrowingBlock is not None else None}
    config["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    report = {"provenance": provenance(seeds=[], config=config, started=started), "rows": rows}
    if args.memory:
        report["memory"] = memory(args)
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
