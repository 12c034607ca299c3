#!/usr/bin/env python
"""Speed and memory of the one-pass saturation diagnosis against baselines in the same process.

Setting: a :class:`~depthsat_theory.tasks.models.ResidualMLP` with 8 blocks,
width ``d = 256`` (hidden ``2d``, GELU), float32, eval mode, random weights (seed 0); a
synthetic probe of ``n = 8192`` examples (``x ~ N(0, I_64)``, 10 classes) in batches of
1024; all 8 block outputs ``blocks.0 … blocks.7`` as sites; 2 CPU threads.

Every number printed in the main table is a *ratio* to the floor measured in the same
process.  The methods are interleaved **batch by batch** (every method processes probe
batch ``i``, in a rotating order, before any method sees batch ``i + 1``; a method's time
for a pass is the sum of its batch times), one warm-up pass is discarded, and the ratio is
the median over ``--reps`` rounds of the per-round ratio; ``(min)`` is ``min t / min t_floor``.
Bursts of load from other processes therefore hit numerator and denominator alike.
``--interleave pass`` alternates whole passes instead (needed for ``--diagnose``, which
owns its loop).

Methods (what is timed, from the first batch to the statistics in hand):

floor            one forward + ``loss.sum().backward()`` per batch (parameter gradients
                 included: a plain training step without the optimizer).
floor-nograd     one forward + ``torch.autograd.grad(loss, x)`` per batch, parameters
                 frozen: the least backward that reaches every site.  This is the real
                 lower bound of any method that needs ``g`` at the lowest site.
depthsat         ``depthsat_theory.capture.probe.accumulate`` with a
                 :class:`~depthsat_theory.statistics.FeatureStatistics` per site: one
                 forward + one backward for all 8 sites, float64 ``G``, ``Σ`` (the pass).
depthsat+finish  the same plus ``result()`` at every site (eigh of ``Σ``, ``s² = tr(GΣ⁺Gᵀ)``).
diagnose()       ``depthsat_theory.diagnose.diagnose`` end to end (pass + finish), if the
                 module imports.
naive            one full pass over the probe per site (``accumulate`` with one site).
gromo-min        GroMo 0.1.0: a ``LinearGrowingBlock`` inserted after each site (a
                 module ``x ↦ block(site(x))``; the block adds its own identity), all
                 parameters frozen, ``x.requires_grad_()``, ``loss.sum().backward()``.
                 linear: ``hidden_features=0`` (the zero block), per batch
                 ``block.update_computation(update_covariance_loss_gradient=False)``
                 = ``tensor_s_growth`` (S = Σ x̃x̃ᵀ) and ``tensor_m_prev`` (M = Σ x̃gᵀ);
                 relu:K: ``hidden_features=K`` with the first layer set to depthsat's
                 random features (Ω, β), ReLU between, zero second layer; only the second
                 layer's ``tensor_s`` (Σ φ̃φ̃ᵀ) and ``tensor_m`` (Σ φ̃gᵀ) are initialised
                 and updated: exactly ``Σ`` and ``G``.  Float32 (the model's dtype).
gromo-full       the same blocks with GroMo's own ``block.init_computation()`` /
                 ``block.update_computation()`` defaults: also the gradient covariance
                 E = Σ g gᵀ and, for relu:K, the growth statistics (S_growth, M_prev and the
                 cross covariance P).
dense            ``depthsat_theory.engines.dense.dense_saturation`` (torch.func Jacobian +
                 lstsq) at small sizes, against FeatureStatistics on the same ``z, g``.

Memory: the peak resident set (``VmHWM`` after ``clear_refs``) above the resident set
just before the run, measured in a fresh child process per point with
``MALLOC_MMAP_THRESHOLD_=65536`` (so freed tensors leave the resident set).  Batches
are generated on the fly in the memory runs, so a flat column means the method itself
holds nothing per example.

Run:  PYTHONPATH=. python benchmarks/diagnose_speed.py [--quick] [--reps 3] [--finish] [--json out.json]
      [--only main|dense|scaling|memory] [--no-naive] [--no-memory] [--no-scaling]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

THREADS = int(os.environ.get("BENCH_THREADS", "2"))
for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, str(THREADS))

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
from torch import nn

from depthsat_theory.capture import accumulate
from depthsat_theory.engines import dense_saturation
from depthsat_theory.families import parse_family
from depthsat_theory.statistics import FeatureStatistics
from depthsat_theory.tasks import ResidualMLP, classification_loss

torch.set_num_threads(THREADS)

try:
    from depthsat_theory.diagnose import diagnose as _diagnose
except Exception as exc:  # the module is being written concurrently
    _diagnose = None
    _DIAGNOSE_ERR = f"{type(exc).__name__}: {exc}"
else:
    _DIAGNOSE_ERR = ""

try:
    import gromo  # noqa: F401
    from gromo.containers.growing_block import LinearGrowingBlock
except Exception as exc:
    LinearGrowingBlock = None
    _GROMO_ERR = f"{type(exc).__name__}: {exc}"
else:
    _GROMO_ERR = ""

IN_DIM, CLASSES, DEPTH = 64, 10, 8


# ----------------------------------------------------------------------------- setting
def make_model(d: int, depth: int = DEPTH) -> nn.Module:
    torch.manual_seed(0)
    return ResidualMLP(in_dim=IN_DIM, width=d, depth=depth, n_classes=CLASSES).eval()


def batch(i: int, bs: int):
    gen = torch.Generator().manual_seed(1000 + i)
    return (torch.randn(bs, IN_DIM, generator=gen), torch.randint(0, CLASSES, (bs,), generator=gen))


class Probe:
    """``n`` examples in batches of ``bs``; materialised (timing) or generated lazily (memory)."""

    def __init__(self, n: int, bs: int, lazy: bool = False):
        self.n, self.bs, self.lazy = n, bs, lazy
        self.nb = math.ceil(n / bs)
        self._data = None if lazy else [batch(i, self._size(i)) for i in range(self.nb)]

    def _size(self, i):
        return min(self.bs, self.n - i * self.bs)

    def __len__(self):
        return self.nb

    def __iter__(self):
        for i in range(self.nb):
            yield batch(i, self._size(i)) if self.lazy else self._data[i]


def family_for(spec: str, d: int):
    """``linear`` or ``relu:K`` (``K`` may be written ``4d``)."""
    spec = spec.replace("4d", str(4 * d))
    return parse_family(spec)


class frozen:
    """Temporarily set ``requires_grad=False`` on a module's parameters."""

    def __init__(self, model):
        self.ps = [p for p in model.parameters() if p.requires_grad]

    def __enter__(self):
        for p in self.ps:
            p.requires_grad_(False)

    def __exit__(self, *exc):
        for p in self.ps:
            p.requires_grad_(True)


# ----------------------------------------------------------------------------- methods
def run_floor(model, probe, **_):
    for x, y in probe:
        model.zero_grad(set_to_none=True)
        classification_loss(model(x), y).sum().backward()
    model.zero_grad(set_to_none=True)


def run_floor_nograd(model, probe, **_):
    with frozen(model):
        for x, y in probe:
            x = x.clone().requires_grad_(True)
            torch.autograd.grad(classification_loss(model(x), y).sum(), x)


def depthsat_stats(fam, sites, d):
    return {s: FeatureStatistics(fam, (d,), "vector") for s in sites}


def run_depthsat(model, probe, *, fam, sites, d, finish=False, **_):
    stats = depthsat_stats(fam, sites, d)
    accumulate(model, sites, probe, classification_loss, stats)
    if finish:
        for s in sites:
            stats[s].result()
    return stats


def run_diagnose(model, probe, *, fam, sites, **_):
    return _diagnose(model, classification_loss, probe, sites=sites, family=fam)


def run_naive(model, probe, *, fam, sites, d, **_):
    stats = depthsat_stats(fam, sites, d)
    for s in sites:
        accumulate(model, [s], probe, classification_loss, {s: stats[s]})
    return stats


class _After(nn.Module):
    """``x ↦ block(site(x))``: a GroMo growing block adds its own identity branch."""

    def __init__(self, site, block):
        super().__init__()
        self.site, self.block = site, block

    def forward(self, x):
        return self.block(self.site(x))


def gromo_model(model, fam, sites, d):
    """A copy of ``model`` with a GroMo ``LinearGrowingBlock`` after every site (untimed setup)."""
    new = copy.deepcopy(model)
    blocks = {}
    for s in sites:
        idx = int(s.split(".")[1])
        if fam.spec == "linear":
            blk = LinearGrowingBlock(
                d, d, hidden_features=0, activation=nn.Identity(), kwargs_layer={"use_bias": True}, name=s
            )
        else:
            k = fam.feature_dim((d,), "vector")
            blk = LinearGrowingBlock(
                d,
                d,
                hidden_features=k,
                pre_activation=nn.Identity(),
                mid_activation=nn.ReLU(),
                kwargs_layer={"use_bias": True},
                name=s,
            )
            proj = fam.frozen_feature_map((d,), "vector").proj
            with torch.no_grad():
                blk.first_layer.layer.weight.copy_(proj.weight.float())
                blk.first_layer.layer.bias.copy_(proj.bias.float())
                blk.second_layer.layer.weight.zero_()
                blk.second_layer.layer.bias.zero_()
        new.blocks[idx] = _After(new.blocks[idx], blk)
        blocks[s] = blk
    for p in new.parameters():
        p.requires_grad_(False)
    return new, blocks


def run_gromo(model, probe, *, gm, full=False, gm_full=None, **_):
    gmodel, blocks = gm_full if (full and gm_full is not None) else gm
    hidden = next(iter(blocks.values())).hidden_neurons
    for blk in blocks.values():
        blk.reset_computation()
        if full or hidden == 0:
            blk.init_computation()
        else:
            sl = blk.second_layer
            sl.store_input = True
            sl.store_pre_activity = True
            sl.tensor_s.init()
            sl.tensor_m.init()
    for x, y in probe:
        x = x.clone().requires_grad_(True)
        classification_loss(gmodel(x), y).sum().backward()
        for blk in blocks.values():
            if full:
                blk.update_computation()
            elif hidden == 0:
                blk.update_computation(update_covariance_loss_gradient=False)
            else:
                blk.second_layer.tensor_s.update()
                blk.second_layer.tensor_m.update()
    out = {}
    for s, blk in blocks.items():
        sl = blk.second_layer
        if hidden == 0:
            out[s] = (sl.tensor_s_growth(), sl.tensor_m_prev())
        else:
            out[s] = (sl.tensor_s(), sl.tensor_m())
    for blk in blocks.values():
        blk.reset_computation()
    return out


METHODS = {
    "floor": run_floor,
    "floor-nograd": run_floor_nograd,
    "depthsat": run_depthsat,
    "depthsat+finish": lambda m, p, **kw: run_depthsat(m, p, finish=True, **kw),
    "diagnose()": run_diagnose,
    "naive": run_naive,
    "gromo-min": run_gromo,
    "gromo-full": lambda m, p, **kw: run_gromo(m, p, full=True, **kw),
}


# ----------------------------------------------------------------------------- per-batch steps
def steps_for(name, model, kw):
    """A fresh ``(step(x, y), finish())`` pair for one pass of method ``name``, batch by batch.

    Used by the batch-interleaved timing: every method processes batch ``i`` before any
    method sees batch ``i+1``, so bursts of load from other processes hit all methods alike.
    """
    fam, sites, d = kw.get("fam"), kw.get("sites"), kw.get("d")
    if name == "floor":

        def step(x, y):
            model.zero_grad(set_to_none=True)
            classification_loss(model(x), y).sum().backward()

        return step, lambda: model.zero_grad(set_to_none=True)
    if name == "floor-nograd":

        def step(x, y):
            with frozen(model):
                x = x.clone().requires_grad_(True)
                torch.autograd.grad(classification_loss(model(x), y).sum(), x)

        return step, lambda: None
    if name in ("depthsat", "depthsat+finish"):
        stats = depthsat_stats(fam, sites, d)

        def step(x, y):  # the library's own loop, one batch at a time
            accumulate(model, sites, [(x, y)], classification_loss, stats)

        def finish():
            if name == "depthsat+finish":
                for s in sites:
                    stats[s].result()

        return step, finish
    if name == "naive":
        stats = depthsat_stats(fam, sites, d)

        def step(x, y):
            for s in sites:
                accumulate(model, [s], [(x, y)], classification_loss, {s: stats[s]})

        return step, lambda: None
    if name in ("gromo-min", "gromo-full"):
        full = name == "gromo-full"
        gmodel, blocks = kw["gm_full" if full else "gm"]  # separate copies: state must not mix
        hidden = next(iter(blocks.values())).hidden_neurons
        for blk in blocks.values():
            blk.reset_computation()
            if full or hidden == 0:
                blk.init_computation()
            else:
                sl = blk.second_layer
                sl.store_input = True
                sl.store_pre_activity = True
                sl.tensor_s.init()
                sl.tensor_m.init()

        def step(x, y):
            x = x.clone().requires_grad_(True)
            classification_loss(gmodel(x), y).sum().backward()
            for blk in blocks.values():
                if full:
                    blk.update_computation()
                elif hidden == 0:
                    blk.update_computation(update_covariance_loss_gradient=False)
                else:
                    blk.second_layer.tensor_s.update()
                    blk.second_layer.tensor_m.update()

        def finish():
            for blk in blocks.values():
                sl = blk.second_layer
                (sl.tensor_s_growth(), sl.tensor_m_prev()) if hidden == 0 else (sl.tensor_s(), sl.tensor_m())
                blk.reset_computation()

        return step, finish
    raise KeyError(name)


def batch_interleaved(names, model, probe, kw, reps) -> dict:
    """Seconds per full pass, per method and round; methods alternate batch by batch."""
    times = {k: [] for k in names}
    data = list(probe)
    for r in range(reps + 1):  # round 0 is the warm-up
        state = {k: steps_for(k, model, kw) for k in names}
        acc = dict.fromkeys(names, 0.0)
        for i, (x, y) in enumerate(data):
            order = names[i % len(names) :] + names[: i % len(names)]  # rotate the position
            for k in order:
                t0 = time.perf_counter()
                state[k][0](x, y)
                acc[k] += time.perf_counter() - t0
        for k in names:
            t0 = time.perf_counter()
            state[k][1]()
            acc[k] += time.perf_counter() - t0
        if r:
            for k in names:
                times[k].append(acc[k])
    return times


# ----------------------------------------------------------------------------- timing
def timed(fn, *args, **kw) -> float:
    t0 = time.perf_counter()
    fn(*args, **kw)
    return time.perf_counter() - t0


def interleaved(jobs: dict, reps: int, warmups: dict | None = None) -> dict:
    """``jobs``: name -> zero-arg callable. Warm-up once, then ``reps`` interleaved rounds.

    ``warmups`` (same keys, optional): cheaper warm-up callables (e.g. one batch).
    """
    times = {k: [] for k in jobs}
    for k, f in jobs.items():
        (warmups or {}).get(k, f)()  # warm-up (lazy feature maps, allocator, BLAS buffers)
    for _ in range(reps):
        for k, f in jobs.items():
            times[k].append(timed(f))
    return times


def med(v):
    return statistics.median(v)


def ratios(times: dict, name: str, ref: str) -> tuple[float, float]:
    """(median over rounds of t_name / t_ref in the same round, min t_name / min t_ref)."""
    per_round = [a / b for a, b in zip(times[name], times[ref], strict=False)]
    return med(per_round), min(times[name]) / min(times[ref])


# ----------------------------------------------------------------------------- memory (children)
def _rss():
    with open("/proc/self/status") as fh:
        s = fh.read()
    return (int(re.search(r"VmHWM:\s+(\d+)", s).group(1)) / 1024, int(re.search(r"VmRSS:\s+(\d+)", s).group(1)) / 1024)


def child_memory(args) -> None:
    """Child-process entry: one method at one point; prints a JSON line."""
    d, n, bs, spec, nsites, method = args.d, args.n, args.bs, args.family, args.sites, args.method
    model = make_model(d)
    sites = [f"blocks.{i}" for i in range(nsites)]
    fam = family_for(spec, d)
    kw = dict(fam=fam, sites=sites, d=d)
    if method.startswith("gromo"):
        kw["gm"] = gromo_model(model, fam, sites, d)
    warm = Probe(bs, bs, lazy=True)
    METHODS[method](model, warm, **kw)  # warm-up on one batch
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        resettable = True
    except OSError:
        resettable = False
    _, base = _rss()
    t = timed(METHODS[method], model, Probe(n, bs, lazy=True), **kw)
    peak, _ = _rss()
    print(json.dumps({"peak_mib": peak - base, "base_mib": base, "time_s": t, "resettable": resettable}))


def memory_point(method, *, d, n, bs, family, sites) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        __file__,
        "--_child",
        "--method",
        method,
        "--d",
        str(d),
        "--n",
        str(n),
        "--bs",
        str(bs),
        "--family",
        family,
        "--sites",
        str(sites),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def state_mib(fam, d, nsites) -> float:
    """Analytic float64 state of the depthsat accumulators: ``8 (k̃² + d k̃)`` bytes per site."""
    k = fam.augmented_dim((d,), "vector")
    return nsites * 8 * (k * k + d * k) / 2**20


def finish_times(model, probe, fam, sites, d, reps) -> dict:
    """``result()`` at every site: as is, with OpenBLAS at 1 thread, and with torch's eigh.

    torch's OpenMP threads spin after each parallel region; numpy's OpenBLAS threads then
    compete with them for the same cores, which slows the float64 ``eigh`` of ``Σ``.
    """
    stats = run_depthsat(model, probe, fam=fam, sites=sites, d=d)

    def default():
        for s in sites:
            stats[s].result()

    def blas1():
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1, user_api="blas"):
            default()

    t = interleaved({"default": default, "blas1": blas1}, max(reps, 3))
    return {k: med(v) for k, v in t.items()}


# ----------------------------------------------------------------------------- checks
def check_gromo_agrees(model, probe, fam, sites, d) -> float:
    """Max relative difference between GroMo's (S, M) and depthsat's (Σ, G) at the sites."""
    st = run_depthsat(model, probe, fam=fam, sites=sites, d=d)
    go = run_gromo(model, probe, gm=gromo_model(model, fam, sites, d))
    worst = 0.0
    for s in sites:
        sig, g = torch.from_numpy(st[s].feature_gram()), torch.from_numpy(st[s].cross_gradient())
        s_g, m_g = go[s][0].double(), go[s][1].double()
        worst = max(worst, float((s_g - sig).norm() / sig.norm()), float((m_g.T - g).norm() / g.norm()))
    return worst


def dense_rows(quick: bool):
    rows = []
    cases = (
        [(64, 8, "linear"), (64, 8, "relu:32")]
        if quick
        else [(128, 16, "linear"), (128, 16, "relu:64"), (256, 32, "linear"), (128, 32, "relu:128")]
    )
    for n, d, spec in cases:
        gen = torch.Generator().manual_seed(7)
        z = torch.randn(n, d, generator=gen)
        g = torch.randn(n, d, generator=gen) / n
        fam = parse_family(spec)
        p = fam.param_dim((d,))

        def stream(fam=fam, d=d, z=z, g=g):
            st = FeatureStatistics(fam, (d,), "vector")
            st.update(z, g)
            return st.result()

        def dense(fam=fam, z=z, g=g):
            return dense_saturation(fam, z, g, "vector")

        res = stream()
        ref = dense()
        t = interleaved({"stream": stream, "dense": dense}, 3)
        rows.append(
            {
                "n": n,
                "d": d,
                "family": spec,
                "p": p,
                "jacobian_mib": n * d * p * 8 / 2**20,
                "dense_s": med(t["dense"]),
                "stream_s": med(t["stream"]),
                "speedup": med(t["dense"]) / med(t["stream"]),
                "score_rel_diff": abs(res.score - ref.score) / ref.score,
            }
        )
    return rows


# ----------------------------------------------------------------------------- main
def fmt_ratio(x):
    return f"{x:6.2f}x"


def main_table(args):
    d, n, bs = args.d, args.n, args.bs
    sites = [f"blocks.{i}" for i in range(DEPTH)]
    model = make_model(d)
    probe = Probe(n, bs)
    out = {"families": {}}
    for spec in ("linear", "relu:4d"):
        fam = family_for(spec, d)
        kw = dict(fam=fam, sites=sites, d=d)
        names = ["floor", "floor-nograd", "depthsat"]
        if args.finish:
            names.append("depthsat+finish")
        if _diagnose is not None and args.diagnose:
            names.append("diagnose()")
        if LinearGrowingBlock is not None:
            kw["gm"] = gromo_model(model, fam, sites, d)
            kw["gm_full"] = gromo_model(model, fam, sites, d)
            names += ["gromo-min", "gromo-full"]
        if not args.no_naive:
            names.append("naive")
        jobs, warm = {}, {}
        one = Probe(bs, bs)
        for name in names:
            jobs[name] = functools.partial(METHODS[name], model, probe, **kw)
            warm[name] = functools.partial(METHODS[name], model, one, **kw)
        print(
            f"\n## family {fam.spec} (k̃ = {fam.augmented_dim((d,), 'vector')}), d={d}, n={n}, "
            f"batch={bs}, {len(sites)} sites, {THREADS} threads, {args.reps} rounds interleaved by {args.interleave}",
            flush=True,
        )
        print(
            f"  {'method':16s} {'median s':>9s} {'min s':>7s} | {'x floor':>8s} {'(min)':>6s} | "
            f"{'x nograd':>8s} {'(min)':>6s}"
        )
        if args.interleave == "batch" and "diagnose()" not in names:
            times = batch_interleaved(names, model, probe, kw, args.reps)
        else:
            times = interleaved(jobs, args.reps, warm)
        rows = []
        for name in names:
            m = med(times[name])
            rf, rf_min = ratios(times, name, "floor")
            rn, rn_min = ratios(times, name, "floor-nograd")
            rows.append(
                {
                    "method": name,
                    "median_s": m,
                    "min_s": min(times[name]),
                    "ratio_floor": rf,
                    "ratio_floor_min": rf_min,
                    "ratio_floor_nograd": rn,
                    "ratio_floor_nograd_min": rn_min,
                    "times": times[name],
                }
            )
            print(
                f"  {name:16s} {m:9.3f} {min(times[name]):7.3f} | {rf:7.2f}x {rf_min:5.2f}x | "
                f"{rn:7.2f}x {rn_min:5.2f}x",
                flush=True,
            )
        fin = finish_times(model, Probe(bs, bs), fam, sites, d, args.reps)
        print(
            f"  finish only (result() at {len(sites)} sites): {fin['default'] * 1e3:.0f} ms; with numpy's "
            f"OpenBLAS limited to 1 thread (threadpoolctl): {fin['blas1'] * 1e3:.0f} ms"
        )
        if LinearGrowingBlock is not None:
            agree = check_gromo_agrees(model, Probe(2 * bs, bs), fam, sites, d)
            print(f"  check: GroMo (S, M) vs depthsat (Σ, Gᵀ) max rel. diff {agree:.1e} (float32 vs float64)")
        else:
            agree = None
            print(f"  gromo not importable: {_GROMO_ERR}")
        if _diagnose is None:
            print(f"  diagnose() not importable: {_DIAGNOSE_ERR}")
        out["families"][fam.spec] = {"rows": rows, "gromo_agreement": agree, "finish": fin}
    return out


def scaling(args):
    """Time ratio (and memory in child processes) as n, d, k and the number of sites grow."""
    q = args.quick
    base = dict(d=64 if q else 256, n=1024 if q else 4096, bs=256 if q else 1024)
    points = []
    ns = [512, 1024, 2048] if q else [2048, 4096, 8192, 16384]
    ds = [32, 64] if q else [64, 128, 256]
    ks = ["linear", "relu:128", "relu:256"] if q else ["linear", "relu:256", "relu:512", "relu:1024"]
    ss = [1, 4, 8] if q else [1, 2, 4, 8]
    for n in ns:
        points.append(("n", dict(base, n=n, family="relu:4d", sites=8)))
    for d in ds:
        points.append(("d", dict(base, d=d, family="relu:4d", sites=8)))
    for k in ks:
        points.append(("k", dict(base, family=k, sites=8)))
    for s in ss:
        points.append(("sites", dict(base, family="relu:4d", sites=s)))
    cache = {}
    rows = []
    print(
        "\n## scaling (depthsat pass / floor: median of per-round ratios, batch-interleaved; memory: peak RSS "
        "above the pre-run RSS in a fresh child process; state = analytic float64 G, Σ)"
    )
    print(
        f"  {'vary':6s} {'n':>6s} {'d':>4s} {'family':>9s} {'sites':>5s} | {'floor s':>8s} {'depthsat s':>10s} "
        f"{'ratio':>6s} {'(min)':>6s} | {'mem floor':>9s} {'mem depthsat':>12s} {'state':>7s} (MiB)"
    )
    for vary, pt in points:
        d, n, bs, spec, nsites = pt["d"], pt["n"], pt["bs"], pt["family"], pt["sites"]
        key = (d, n, bs, spec, nsites)
        if key in cache:
            row = dict(cache[key], vary=vary)
        else:
            model = make_model(d)
            probe = Probe(n, bs)
            fam = family_for(spec, d)
            sites = [f"blocks.{i}" for i in range(nsites)]
            t = batch_interleaved(
                ["floor", "depthsat"], model, probe, dict(fam=fam, sites=sites, d=d), args.scaling_reps
            )
            row = {
                "vary": vary,
                "n": n,
                "d": d,
                "bs": bs,
                "family": fam.spec,
                "sites": nsites,
                "floor_s": med(t["floor"]),
                "depthsat_s": med(t["depthsat"]),
                "ratio": ratios(t, "depthsat", "floor")[0],
                "ratio_min": ratios(t, "depthsat", "floor")[1],
                "state_mib": state_mib(fam, d, nsites),
            }
            if not args.no_memory:
                mf = memory_point("floor", d=d, n=n, bs=bs, family=spec, sites=nsites)
                md = memory_point("depthsat", d=d, n=n, bs=bs, family=spec, sites=nsites)
                row["mem_floor_mib"] = mf.get("peak_mib")
                row["mem_depthsat_mib"] = md.get("peak_mib")
            cache[key] = row
        rows.append(row)
        mf = row.get("mem_floor_mib")
        mdp = row.get("mem_depthsat_mib")
        print(
            f"  {vary:6s} {n:6d} {d:4d} {row['family']:>9s} {nsites:5d} | {row['floor_s']:8.3f} "
            f"{row['depthsat_s']:10.3f} {row['ratio']:6.2f} {row['ratio_min']:6.2f} | "
            f"{(f'{mf:9.1f}' if mf is not None else '      n/a')} "
            f"{(f'{mdp:12.1f}' if mdp is not None else '         n/a')} {row['state_mib']:7.1f}",
            flush=True,
        )
    return rows


def memory_in_n(args):
    """Peak RSS above the pre-run RSS, per method, as n grows (fresh child per point)."""
    q = args.quick
    d, bs = (64, 512) if q else (256, 1024)
    ns = [1024, 8192] if q else [2048, 8192, 32768]
    methods = ["floor", "depthsat"] + (["gromo-min"] if LinearGrowingBlock is not None else [])
    print(f"\n## memory flat in n (d={d}, batch={bs}, 8 sites; MiB of peak RSS above the pre-run RSS)")
    rows = []
    for spec in ("linear", "relu:4d"):
        for method in methods:
            vals = []
            for n in ns:
                r = memory_point(method, d=d, n=n, bs=bs, family=spec, sites=8)
                vals.append(r.get("peak_mib"))
                rows.append({"family": spec, "method": method, "n": n, **r})
            print(
                f"  {spec:8s} {method:10s} "
                + "  ".join(
                    f"n={n}: {v:7.1f}" if v is not None else f"n={n}: failed" for n, v in zip(ns, vals, strict=False)
                ),
                flush=True,
            )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (d=64, n=2048, batch 512)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scaling-reps", type=int, default=3)
    ap.add_argument("--json", type=str, default=None, help="write all measurements to this file")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--finish", action="store_true", help="also time depthsat + result() at every site")
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="also time depthsat_theory.diagnose.diagnose (forces pass-level interleaving)",
    )
    ap.add_argument(
        "--interleave",
        choices=["batch", "pass"],
        default="batch",
        help="alternate methods batch by batch (default, robust to bursty load) or pass by pass",
    )
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--only", choices=["main", "dense", "scaling", "memory"], default=None)
    # child-process mode (memory points)
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="depthsat", help=argparse.SUPPRESS)
    ap.add_argument("--d", type=int, default=None)
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--bs", type=int, default=None)
    ap.add_argument("--family", default="linear", help=argparse.SUPPRESS)
    ap.add_argument("--sites", type=int, default=8, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        return child_memory(args)
    if args.d is None:
        args.d = 64 if args.quick else 256
    if args.n is None:
        args.n = 2048 if args.quick else 8192
    if args.bs is None:
        args.bs = 512 if args.quick else 1024

    load = os.getloadavg()
    print(f"# depthsat diagnose speed — {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, load avg {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}, "
        f"gromo {getattr(sys.modules.get('gromo'), '__version__', 'n/a') if not _GROMO_ERR else 'missing'}"
    )
    res = {
        "config": {
            "d": args.d,
            "n": args.n,
            "bs": args.bs,
            "threads": THREADS,
            "reps": args.reps,
            "torch": torch.__version__,
            "loadavg_start": load,
            "quick": args.quick,
        }
    }
    if args.only in (None, "main"):
        res["main"] = main_table(args)
    if args.only in (None, "dense"):
        rows = dense_rows(args.quick)
        print("\n## dense torch.func reference vs streaming FeatureStatistics (same z, g; update + result)")
        for r in rows:
            print(
                f"  n={r['n']:4d} d={r['d']:3d} {r['family']:9s} p={r['p']:5d} Jacobian {r['jacobian_mib']:6.1f} MiB: "
                f"dense {r['dense_s']:.3f} s, streaming {r['stream_s']:.4f} s ({r['speedup']:.0f}x faster), "
                f"|Δs|/s = {r['score_rel_diff']:.1e}"
            )
        res["dense"] = rows
    if args.only in (None, "scaling") and not args.no_scaling:
        res["scaling"] = scaling(args)
    if args.only in (None, "memory") and not args.no_memory:
        res["memory"] = memory_in_n(args)
    load = os.getloadavg()
    print(f"\n# load avg at end {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}")
    res["config"]["loadavg_end"] = load
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=float))


if __name__ == "__main__":
    main()
