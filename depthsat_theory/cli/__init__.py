"""Command-line interface: ``depthsat check`` and ``depthsat score``.

Errors in user input end with a one-line ``error: …`` on stderr and exit status 2
(no traceback); ``check`` exits 1 when it finds a counterexample.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from depthsat_theory.families import FamilyError, family_specs, parse_family
from depthsat_theory.statistics import StatisticsError, statistics_for

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="First-order residual depth saturation: checks, scores and diagnostics.",
)
console = Console() if sys.stdout.isatty() else Console(width=120)
err_console = Console(stderr=True)


class UserError(Exception):
    """Bad user input: reported as one line, exit status 2."""


def _fail(msg: str) -> None:
    err_console.print(f"error: {msg}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


# ----------------------------------------------------------------------------- check
@app.command()
def check(
    instances: int = typer.Option(300, "--instances", "-n", help="Number of random instances N."),
    seed: int = typer.Option(0, "--seed", "-s", help="Seed of the instance draw and of training."),
    report: Path = typer.Option(
        Path("depthsat-report.json"), "--report", "-r", help="Where the JSON report is written (atomically)."
    ),
    optimizers: str | None = typer.Option(
        None,
        "--optimizers",
        help="Comma-separated zero-state updates to draw from (default: all descent-compatible; "
        "add 'rotation' to plant a non-descent-compatible map).",
    ),
    kinds: str = typer.Option(
        "mlp,cnn,gpt",
        "--models",
        help="Trained model kinds: mlp, cnn, gpt (the exact constructions, a least-squares readout "
        "on the digits MLP and an odd MLP on synthetic data, are drawn in addition).",
    ),
    construction_fraction: float = typer.Option(
        0.25, "--construction-fraction", help="Share of exact saturated constructions."
    ),
    cache_dir: Path | None = typer.Option(
        None, "--cache-dir", help="Cache of trained weights (default $DEPTHSAT_CACHE or ~/.cache/depthsat)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Verify the iff theorem (T2) on random insertions into trained models and constructions."""
    from depthsat_theory.check import CheckConfig, run_check, write_report_atomic
    from depthsat_theory.optimizers import DESCENT_COMPATIBLE

    opts = tuple(o.strip() for o in optimizers.split(",") if o.strip()) if optimizers else DESCENT_COMPATIBLE
    cache = cache_dir or os.environ.get("DEPTHSAT_CACHE") or Path.home() / ".cache" / "depthsat"
    cfg = CheckConfig(
        instances=instances,
        seed=seed,
        optimizers=opts,
        kinds=tuple(k.strip() for k in kinds.split(",") if k.strip()),
        construction_fraction=construction_fraction,
        cache_dir=str(cache),
    )
    try:
        cfg.validate()
        _writable(report)
        if Path(cache).exists() and not Path(cache).is_dir():
            raise OSError(f"the cache folder {cache} is a file, not a folder")
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    t0 = time.perf_counter()
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        disable=quiet,
        transient=False,
    ) as bar:
        task = bar.add_task("training models", total=instances)
        rep = run_check(cfg, progress=lambda k, d: bar.update(task, advance=k, description=d))
        bar.update(task, description="done")
    write_report_atomic(rep, report)
    _print_check_summary(rep, time.perf_counter() - t0, report)
    if rep["counterexamples"]:
        raise typer.Exit(1)


def _writable(path: Path) -> None:
    if path.is_dir():
        raise OSError(f"--report {path} is a directory; give a file path")
    folder = path.resolve().parent
    if not folder.is_dir():
        raise OSError(f"--report folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise OSError(f"--report folder {folder} is not writable")


def _print_check_summary(rep: dict, wall: float, path: Path) -> None:
    summ = rep["summary"]
    cols = [
        ("predicted_improvable", "pred. impr."),
        ("predicted_saturated", "pred. sat."),
        ("agree", "agree"),
        ("counterexample", "counterex."),
        ("undecided", "undecided"),
        ("degenerate", "degenerate"),
    ]
    table = Table(title=f"depthsat check: {rep['instances']} instances, seed {rep['seed']}")
    table.add_column("group", no_wrap=True)
    for _, head in cols:
        table.add_column(head, justify="right", no_wrap=True)
    for key in ("model", "data", "construction", "family", "optimizer"):
        for val, counts in summ[key].items():
            table.add_row(f"{key}: {'real data' if val == 'None' else val}", *[str(counts.get(c, 0)) for c, _ in cols])
        table.add_section()
    console.print(table)
    for reason, count in summ["reasons"].items():
        console.print(f"  {count} × {reason}", markup=False)
    if summ["planted_reasons"]:
        console.print(
            "planted non-descent-compatible updates (T2 assumes descent compatibility, so "
            "these counterexamples are expected and show that the checker can fail):",
            markup=False,
        )
        for reason, count in summ["planted_reasons"].items():
            console.print(f"  {count} × {reason}", markup=False)
    console.print(
        f"total: {rep['agree']} agree, {rep['counterexamples']} counterexamples "
        f"({summ['planted_counterexamples']} planted), {rep['undecided']} undecided, "
        f"{rep['degenerate']} degenerate (T = {{0}})",
        markup=False,
    )
    console.print(f"wall time {wall:.1f} s; report: {path}", markup=False)


# ----------------------------------------------------------------------------- score
@app.command()
def score(
    probe: Path = typer.Option(..., "--probe", help="NPZ file with arrays z and g, each n × d."),
    family: str = typer.Option(..., "--family", help=f"Residual family spec: {family_specs()}."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    delta: float | None = typer.Option(None, "--delta", help="Add a (1-δ) interval for s and a certificate."),
    epsilon: float | None = typer.Option(None, "--epsilon", help="ε of the 'certified ε-saturated' verdict."),
    grad_max: float | None = typer.Option(None, "--grad-max", help="γ ≥ ‖g(x)‖_F a.s. (default: probe AG_max)."),
    leverage_max: float | None = typer.Option(None, "--leverage-max", help="L ≥ leverage a.s. (default: probe)."),
    feature_norm_max: float | None = typer.Option(None, "--feature-norm-max", help="B ≥ ‖φ̃(u)‖ a.s.; L = B²/(μ+λ)."),
    eig_floor: float | None = typer.Option(None, "--eig-floor", help="μ ≤ every nonzero eigenvalue of Σ."),
    ridge: float = typer.Option(0.0, "--ridge", help="λ ≥ 0: bound the ridge score s_λ ≤ s."),
    variance: float | None = typer.Option(None, "--variance", help="V ≥ E‖G_x Σ^{+1/2}‖² (default: probe)."),
    candidates: int = typer.Option(1, "--candidates", help="Union bound over this many candidates."),
    bootstrap: int = typer.Option(200, "--bootstrap", help="Bootstrap resamples with --delta (0: none)."),
) -> None:
    """Saturation quantities of a dumped probe (activations z, activation gradients g)."""
    from depthsat_theory.bounds import BoundError, score_report

    if delta is None:  # the bound options only act on the interval: refuse them silently ignored
        given = [
            flag
            for flag, val, default in (
                ("--epsilon", epsilon, None),
                ("--grad-max", grad_max, None),
                ("--leverage-max", leverage_max, None),
                ("--feature-norm-max", feature_norm_max, None),
                ("--eig-floor", eig_floor, None),
                ("--ridge", ridge, 0.0),
                ("--variance", variance, None),
                ("--candidates", candidates, 1),
                ("--bootstrap", bootstrap, 200),
            )
            if val != default
        ]
        if given:
            names = given[0] if len(given) == 1 else ", ".join(given[:-1]) + " and " + given[-1]
            _fail(
                f"{names} need{'s' if len(given) == 1 else ''} --delta (the bound options only apply to the interval)"
            )
    try:
        z, g = _load_probe(probe)
        fam = parse_family(family)
        acc = statistics_for(fam, (z.shape[1],), "vector", pool_ties=True)
        acc.update(torch.from_numpy(z), torch.from_numpy(g))
        res = acc.result()
        bounds = (
            None
            if delta is None
            else score_report(
                z,
                g,
                fam,
                delta=delta,
                epsilon=epsilon,
                grad_max=grad_max,
                leverage_max=leverage_max,
                feature_norm_max=feature_norm_max,
                eig_floor=eig_floor,
                ridge=ridge,
                variance=variance,
                candidates=candidates,
                bootstrap=bootstrap,
            )
        )
    except (UserError, FamilyError, StatisticsError, BoundError) as exc:
        _fail(str(exc))
    out = {
        "score": res.score,
        "raw_score": res.raw_score,
        "ag_max": res.ag_max,
        "ag_rms": res.ag_rms,
        "realizability_defect": res.realizability_defect,
        "tangent_rank": res.tangent_rank,
        "tangent_dim": res.tangent_dim,
        "saturated": res.saturated,
        "degenerate": res.degenerate,
        "tol": res.tol,
        "n": res.n,
        "family": res.family,
        "relative_score": res.relative_score,
        "activation_scaled_score": res.activation_scaled_score,
        "dtype": res.dtype,
        "cutoff": res.cutoff,
        "note": (
            "empirical measure of the probe; raw_score and realizability_defect pool exactly "
            "equal rows only: exact on finite/discrete populations, biased upward for "
            "continuous rows (raw_score -> ag_rms)"
        ),
    }
    out = {k: (None if isinstance(v, float) and v != v else v) for k, v in out.items()}
    out.update(bounds or {})
    if as_json:
        sys.stdout.write(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
        return
    table = Table(title=f"{probe.name}: family {res.family}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for k, v in out.items():
        if k != "note":
            table.add_row(k, f"{v:.6g}" if isinstance(v, float) else _cell(v))
    console.print(table)
    console.print(out["note"], markup=False)


def _cell(v) -> str:
    if isinstance(v, dict) and "value" in v:
        return f"{v['value']:.6g} ({v['source']})"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {_cell(x) if isinstance(x, dict) else x}" for k, x in v.items())
    if isinstance(v, list):
        return "\n".join(str(x) for x in v)
    return str(v)


# ----------------------------------------------------------------------------- bound
@app.command()
def bound(
    delta: float = typer.Option(..., "--delta", help="Confidence parameter δ in (0, 1)."),
    n: int | None = typer.Option(None, "--n", help="Probe size: report the half-width."),
    epsilon: float | None = typer.Option(None, "--epsilon", help="Target half-width: report the n needed."),
    grad_max: float | None = typer.Option(None, "--grad-max", help="γ ≥ ‖g(x)‖_F a.s. (required)."),
    leverage_max: float | None = typer.Option(None, "--leverage-max", help="L ≥ leverage a.s."),
    feature_norm_max: float | None = typer.Option(None, "--feature-norm-max", help="B ≥ ‖φ̃(u)‖ a.s.; L = B²/(μ+λ)."),
    eig_floor: float | None = typer.Option(None, "--eig-floor", help="μ ≤ every nonzero eigenvalue of Σ."),
    ridge: float = typer.Option(0.0, "--ridge", help="λ ≥ 0 (ridge score s_λ)."),
    variance: float | None = typer.Option(None, "--variance", help="V ≥ E‖G_x Σ^{+1/2}‖² (default: γ²L)."),
    dim: int | None = typer.Option(None, "--dim", help="D ≥ rank Σ (default ⌊L⌋; required with --ridge)."),
    score_max: float | None = typer.Option(None, "--score-max", help="S ≥ s_λ (default min(γ, √V))."),
    candidates: int = typer.Option(1, "--candidates", help="Union bound over this many candidates."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Half-width of the finite-sample bound for a probe size, or the probe size for a half-width."""
    from depthsat_theory.bounds import BoundError, bound_report

    try:
        out = bound_report(
            delta=delta,
            n=n,
            epsilon=epsilon,
            grad_max=grad_max,
            leverage_max=leverage_max,
            feature_norm_max=feature_norm_max,
            eig_floor=eig_floor,
            ridge=ridge,
            variance=variance,
            dim=dim,
            score_max=score_max,
            candidates=candidates,
        )
    except BoundError as exc:
        _fail(str(exc))
    if as_json:
        sys.stdout.write(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
        return
    table = Table(title=f"finite-sample bound (thm-finite-sample), δ = {delta:g}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for k, v in out.items():
        table.add_row(k, f"{v:.6g}" if isinstance(v, float) else _cell(v))
    console.print(table)


# ----------------------------------------------------------------------------- audit
@app.command()
def audit(
    family: str = typer.Argument(
        ...,
        help="Built-in spec (poly:2), user family 'module:attr' (imported "
        "from the current folder / PYTHONPATH), or a sympy expression in "
        "u1..ud, t1..tp (e.g. 't1*u1 + t2*u1**3'; optional 'sympy:' prefix).",
    ),
    probe: Path | None = typer.Option(
        None, "--probe", help="NPZ with z and g (n × d); default: a documented synthetic probe."
    ),
    model: str | None = typer.Option(
        None, "--model", help="Audit at a site of a trained model: mlp, cnn or gpt (needs --site)."
    ),
    site: str | None = typer.Option(None, "--site", help="Site name for --model (e.g. blocks.1)."),
    seed: int = typer.Option(0, "--seed", help="Training seed of --model."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Audit a residual family: function preservation, tangent rank, regularity, certificate, score."""
    from depthsat_theory.audit import AuditError, audit_family, audit_model, load_family, report_table, synthetic_probe
    from depthsat_theory.capture import NotFunctionPreservingError, SiteError
    from depthsat_theory.tasks import KINDS, trained_task

    if os.getcwd() not in sys.path:  # 'module:attr' resolves from the current folder too
        sys.path.insert(0, os.getcwd())
    try:
        if probe is not None and model is not None:
            raise UserError("give either --probe or --model/--site, not both")
        if (model is None) != (site is None):
            raise UserError("--model and --site go together (e.g. --model mlp --site blocks.1)")
        if probe is not None:
            z, g = _load_probe(probe)
            fam = load_family(family, d=z.shape[1])
            rep = audit_family(fam, z, g, layout="vector", probe=f"{probe} ({z.shape[0]} × {z.shape[1]})")
        elif model is not None:
            if model not in KINDS:
                raise UserError(f"unknown --model {model!r}; valid: {', '.join(KINDS)}")
            fam = load_family(family)
            task = trained_task(model, seed)
            rep = audit_model(
                fam,
                task.model,
                site,
                task.inputs,
                task.targets,
                task.loss,
                layout=task.layout,
                sites=task.model.site_names(),
                probe=f"{model} (seed {seed}) probe set, {task.inputs.shape[0]} examples, site {site}",
            )
        else:
            fam = load_family(family)
            z, g, layout, label = synthetic_probe(fam)
            rep = audit_family(fam, z, g, layout=layout, probe=label)
    except (UserError, AuditError, FamilyError, StatisticsError, SiteError, NotFunctionPreservingError) as exc:
        _fail(str(exc))
    if as_json:
        sys.stdout.write(json.dumps(rep.to_dict(), indent=1, ensure_ascii=False) + "\n")
        return
    console.print(f"probe: {rep.probe}", markup=False, highlight=False)
    console.print(report_table(rep))
    for note in rep.notes:
        console.print(f"  note: {note}", markup=False, highlight=False)


def _load_probe(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if path.is_dir():
        raise UserError(f"--probe {path} is a directory, not an .npz file")
    if not path.is_file():
        raise UserError(f"--probe {path}: no such file")
    if not zipfile.is_zipfile(path):
        raise UserError(f"--probe {path}: not an .npz archive; save one with numpy.savez(path, z=Z, g=G)")
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in ("z", "g") if k not in data.files]
            if missing:
                raise UserError(
                    f"--probe {path}: missing array(s) {', '.join(missing)} (found: {', '.join(data.files) or 'none'})"
                )
            z, g = data["z"], data["g"]
    except UserError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise UserError(f"--probe {path}: not a readable .npz file ({type(exc).__name__}: {exc})") from None
    arrays = []
    for name, arr in (("z", z), ("g", g)):
        if arr.dtype.kind != "f" or arr.dtype.itemsize not in (4, 8):
            raise UserError(f"array {name} has dtype {arr.dtype}; expected float32 or float64")
        arrays.append(arr.astype(arr.dtype.newbyteorder("="), copy=False))
    z, g = arrays
    for name, arr in (("z", z), ("g", g)):
        if arr.ndim != 2:
            raise UserError(f"array {name} has shape {arr.shape}; expected n × d")
    if z.shape != g.shape:
        raise UserError(f"z has shape {z.shape} but g has shape {g.shape}; they must match")
    if z.shape[0] == 0:
        raise UserError("the probe is empty (n = 0)")
    if z.shape[1] == 0:
        raise UserError("the probe has d = 0 columns")
    for name, arr in (("z", z), ("g", g)):
        if not np.isfinite(arr).all():
            raise UserError(f"array {name} contains NaN or Inf")
    return z, g


# ----------------------------------------------------------------------------- diagnose
@app.command("diagnose")
def diagnose_cmd(
    model: str = typer.Option(..., "--model", help="Model: mlp, cnn, gpt (trained here, cached), or a zoo name."),
    sites: str | None = typer.Option(None, "--sites", help="Comma-separated site module names (default: discovered)."),
    family: str = typer.Option("linear", "--family", help=f"Residual family spec: {family_specs()}."),
    delta: float | None = typer.Option(None, "--delta", help="Add (1-δ) intervals, union-bounded over the sites."),
    rho: bool = typer.Option(False, "--rho", help="Also r̂ and ρ̂ (pools exactly equal units)."),
    n_batches: int | None = typer.Option(None, "--batches", help="Probe batches (default: the whole probe set)."),
    batch_size: int | None = typer.Option(
        None,
        "--batch-size",
        help="Examples per probe batch (default: 64 for mlp/cnn/gpt, the zoo model's own otherwise).",
    ),
    seed: int = typer.Option(0, "--seed", help="Training seed of mlp/cnn/gpt; probe/training seed of zoo models."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the diagnosis as JSON (atomically)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write PATH.png and PATH.svg: score against depth."),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="Save partial statistics here; resume from it."),
    checkpoint_every: int = typer.Option(1, "--checkpoint-every", help="Batches between checkpoint writes."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Saturation score of every residual-stream site of a model, one forward+backward per batch."""
    from depthsat_theory.bounds import BoundError
    from depthsat_theory.capture import SiteError
    from depthsat_theory.diagnose import DiagnoseError, diagnose
    from depthsat_theory.diagnose import distributed as dist

    dist.init_from_env()
    main_rank = dist.is_main()
    try:
        for opt, path in (("--json", json_path), ("--plot", plot)):
            if path is not None and (path.is_dir() or not path.resolve().parent.is_dir()):
                raise UserError(f"{opt} {path}: not a file path in an existing folder")
        net, loss_fn, batches, default_sites, layout, desc, extra = _diagnose_target(model, seed, n_batches, batch_size)
        site_list = [x.strip() for x in sites.split(",") if x.strip()] if sites else default_sites
        with Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err_console,
            disable=quiet or not main_rank,
            transient=False,
        ) as bar:
            task = bar.add_task("probe batches", total=None)
            res = diagnose(
                net,
                loss_fn,
                batches,
                sites=site_list,
                family=family,
                delta=delta,
                realizability=rho,
                layout=layout,
                checkpoint=checkpoint,
                description=desc,
                checkpoint_every=checkpoint_every,
                config={"model": model, "seed": seed, "batch_size": batch_size},
                progress=lambda k, tot: bar.update(task, completed=k, total=tot),
                **extra,
            )
        if main_rank:
            if json_path is not None:
                res.write_json(json_path)
            plots = res.plot(plot) if plot is not None else []
    except (UserError, DiagnoseError, FamilyError, StatisticsError, SiteError, BoundError, OSError) as exc:
        _fail(str(exc))
    if not main_rank:
        return
    out = console if sys.stdout.isatty() else Console(width=160)
    out.print(res.table())
    for note in res.notes:
        out.print(f"  note: {note}", markup=False, highlight=False)
    if res.resumed_from:
        out.print(f"resumed from checkpoint after {res.resumed_from} batches", markup=False)
    for p in ([json_path] if json_path else []) + plots:
        out.print(f"wrote {p}", markup=False, highlight=False)


def _diagnose_target(name: str, seed: int, n_batches: int | None, batch_size: int | None):
    """``(model, loss_fn, batches, sites, layout, description, diagnose kwargs)`` for ``diagnose --model``."""
    from depthsat_theory.tasks import KINDS, trained_task

    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    if n_batches is not None and n_batches < 1:
        raise UserError(f"--batches must be >= 1, got {n_batches}")
    if name in KINDS:
        batch_size = batch_size or 64
        task = trained_task(name, seed)
        x, y = task.inputs, task.targets
        avail = -(-x.shape[0] // batch_size)
        if n_batches is not None and n_batches > avail:
            raise UserError(
                f"--batches {n_batches} exceeds the {name} probe set: {x.shape[0]} examples "
                f"make {avail} batches of {batch_size}"
            )
        count = avail if n_batches is None else n_batches
        batches = [
            (x[i * batch_size : (i + 1) * batch_size], y[i * batch_size : (i + 1) * batch_size]) for i in range(count)
        ]
        desc = f"{name} (seed {seed}, {task.data} probe, {sum(b[0].shape[0] for b in batches)} examples)"
        return task.model, task.loss, batches, task.model.site_names(), task.layout, desc, {}
    try:
        from depthsat_theory.tasks import zoo
    except ImportError:
        zoo = None
    names = tuple(getattr(zoo, "NAMES", ())) if zoo is not None else ()
    if name not in names:
        raise UserError(f"unknown --model {name!r}; valid: {', '.join(tuple(KINDS) + names)}")
    try:
        zm = _zoo_load(zoo, name, n_batches, batch_size, seed)
    except (ImportError, ValueError) as exc:  # zoo.ZooUnavailableError is an ImportError
        raise UserError(f"--model {name}: {exc}") from None
    batches = list(zm.batches)
    if n_batches is not None:
        if n_batches > len(batches):
            raise UserError(f"--batches {n_batches} exceeds the {name} probe: {len(batches)} batches")
        batches = batches[:n_batches]
    extra = {k: getattr(zm, k) for k in ("reduction", "mask_fn", "output_key") if getattr(zm, k, None) is not None}
    if isinstance(getattr(zm, "loss_units", None), str):
        extra["loss_units"] = zm.loss_units if "example" in zm.loss_units else f"{zm.loss_units} per example"
    return zm.model, zm.loss_fn, batches, list(zm.sites), zm.layout, zm.description, extra


def _zoo_load(zoo, name: str, n_batches: int | None, batch_size: int | None, seed: int):
    """``zoo.load`` with ``--batches N`` mapped to ``n_examples = N · batch size``."""
    kw: dict = {"seed": seed}
    if batch_size is not None:
        kw["batch_size"] = batch_size
    if n_batches is not None:
        per = batch_size or getattr(zoo, "DEFAULTS", {}).get(name, (None, 8))[1]
        kw["n_examples"] = n_batches * per
    return zoo.load(name, **kw)


# ----------------------------------------------------------------------------- proofs
@app.command()
def proofs(
    seed: int = typer.Option(0, "--seed", help="Base seed of every check."),
    quick: bool = typer.Option(False, "--quick", help="Fewer instances per check."),
    only: str | None = typer.Option(None, "--only", help="Comma-separated claims, e.g. T2,T4."),
    json_path: str | None = typer.Option(None, "--json", help="Also write the rows as JSON (atomically)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No per-check progress lines."),
) -> None:
    """Run the machine checks of every claim in theory/ (same as python -m proofs_checks); exit 1 on a failure."""
    from proofs_checks._registry import Context
    from proofs_checks._report import run_and_report

    claims = [c.strip() for c in only.split(",") if c.strip()] if only else None
    raise typer.Exit(run_and_report(Context(seed=seed, quick=quick), only=claims, json_path=json_path, quiet=quiet))


def main() -> None:
    """Console-script entry point.

    Unexpected exceptions end with one ``error: internal error …`` line and exit
    status 3 (``1`` means "counterexample found", ``2`` bad input); set
    ``DEPTHSAT_DEBUG=1`` to see the traceback.
    """
    if os.environ.get("DEPTHSAT_DEBUG"):
        app()
        return
    from depthsat_theory.tasks import CacheDirError

    try:
        status = app(standalone_mode=False)
    except CacheDirError as exc:  # raised wherever a command trains or loads a model
        err_console.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except _USAGE_ERROR as exc:  # unknown option, unparsable value: one line too
        msg = exc.format_message()
        if msg:  # (an empty message: typer already printed the help of a bare command)
            name = f"depthsat {exc.ctx.info_name} " if exc.ctx is not None and exc.ctx.parent else "depthsat "
            err_console.print(f"error: {msg} (see {name}--help)", markup=False, highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except Exception as exc:
        err_console.print(
            f"error: internal error ({type(exc).__name__}: {exc}); rerun with DEPTHSAT_DEBUG=1 for the traceback",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(3)
    sys.exit(status if isinstance(status, int) else 0)


# click's UsageError, whether typer vendors click or depends on it
_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")

if __name__ == "__main__":
    main()
