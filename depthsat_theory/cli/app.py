"""The ``depthsat`` commands (typer): parse the options, call the library, hand the result to :mod:`.render`.

Errors in user input end with a one-line ``error: …`` on stderr and exit status 2
(no traceback); ``check`` exits 1 when it finds a counterexample.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import typer

from depthsat_theory.bounds import BoundError, interval_from_probe, plan_bound
from depthsat_theory.capture.probe import unpack_batch
from depthsat_theory.cli import render
from depthsat_theory.cli.experiment import experiment_app
from depthsat_theory.cli.flags import BOUND_OPTION_DEFAULTS, CHECK_FLAGS, FLAGS, respell
from depthsat_theory.cli.inputs import (
    UserError,
    audit_target,
    check_output_path,
    check_writable,
    diagnose_target,
    load_probe,
    model_sites,
    parse_device,
)
from depthsat_theory.families import FamilyError, FeatureFamily, family_specs, parse_family
from depthsat_theory.io import is_stdout
from depthsat_theory.statistics import StatisticsError, statistics_for
from depthsat_theory.statistics.decrease import DEFAULT_EPSILON_NATS, epsilon_from_nats, guaranteed_decrease
from depthsat_theory.statistics.feature import GRAM_MODES, PRODUCT_DTYPES
from depthsat_theory.statistics.realizability import crossfit_realizability
from depthsat_theory.statistics.secondorder import CrossBlockStatistics
from depthsat_theory.vocabulary import Layout

__all__ = ["app", "main"]

#: The ``depthsat`` command line (typer); the console script calls :func:`main`. It is re-exported as
#: ``depthsat_theory.cli.app``, an attribute that hides this module's name on the package (import
#: the module by its full name: ``importlib.import_module("depthsat_theory.cli.app")``).
#:
#: :meta hide-value:
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="First-order residual depth saturation: checks, scores and diagnostics.",
)
app.add_typer(experiment_app, name="experiment")


DEVICE_HELP = "Where the model runs: cpu, cuda (cuda:N) or auto (cuda when available)."


def _split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


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
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP + " Models are trained on the CPU."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Verify the iff theorem (T2) on random insertions into trained models and constructions."""
    from depthsat_theory.check import CheckConfig, run_check, write_report_atomic
    from depthsat_theory.optimizers import DESCENT_COMPATIBLE
    from depthsat_theory.tasks import default_cache_dir

    cache = cache_dir or default_cache_dir()
    cfg = CheckConfig(
        instances=instances,
        seed=seed,
        optimizers=_split(optimizers) if optimizers else DESCENT_COMPATIBLE,
        kinds=_split(kinds),
        construction_fraction=construction_fraction,
        cache_dir=str(cache),
        device=device,
    )
    try:
        try:
            cfg.validate()
        except ValueError as exc:
            raise ValueError(respell(str(exc), CHECK_FLAGS)) from None
        check_writable(report)
        if Path(cache).exists() and not Path(cache).is_dir():
            raise OSError(f"the cache folder {cache} is a file, not a folder")
    except (ValueError, OSError) as exc:
        render.fail(exc)
    t0 = time.perf_counter()
    with render.progress(disable=quiet) as bar:
        task = bar.add_task("training models", total=instances)
        rep = run_check(cfg, progress=lambda k, d: bar.update(task, advance=k, description=d))
        bar.update(task, description="done")
    failure = None
    try:
        write_report_atomic(rep, report)
    except OSError as exc:  # the folder changed during the run: print the summary, then say so
        failure = f"--report {report}: could not write ({exc}); the summary above was not saved"
    where = "stdout" if is_stdout(report) else report if failure is None else "not written"
    render.print_check_summary(rep, time.perf_counter() - t0, where, stderr=is_stdout(report))
    if failure is not None:
        render.fail(failure)
    if rep["counterexamples"]:
        raise typer.Exit(1)


# ----------------------------------------------------------------------------- score
def _refuse_bound_options_without_delta(given: dict[str, object]) -> None:
    """The bound options only act on the interval: refuse them when ``--delta`` is absent."""
    flags = [FLAGS[k] for k, default in BOUND_OPTION_DEFAULTS.items() if given[k] != default]
    if flags:
        names = flags[0] if len(flags) == 1 else ", ".join(flags[:-1]) + " and " + flags[-1]
        verb = "needs" if len(flags) == 1 else "need"
        raise UserError(f"{names} {verb} --delta (the bound options only apply to the interval)")


GRAM_HELP = (
    "Feature-family statistics: 'features' streams the k̃×k̃ Gram, 'units' keeps the feature rows and factors "
    "them once at the end (thm-unit-gram: no k̃² work per row; for k̃ much larger than the probe), 'auto' "
    "(default) units at sites with k̃ ≥ 1025 while the rows are at most k̃/2. Same score within its bound."
)
PRODUCTS_HELP = (
    "Dtype of the per-batch products of feature families, summed in float64: 'float64' (default) or 'float32' "
    "(about half the cost; wider rounding bound and resolution, thm-score-error: ill-conditioned sites may "
    "become undetermined)."
)


def _check_choice(flag: str, value: str, choices) -> None:
    """A one-line error for a value outside ``choices``."""
    if value not in choices:
        raise UserError(f"{flag} {value!r}: use one of {', '.join(choices)}")


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
    matrix_bound: str = typer.Option(
        "worst-case", "--matrix-bound", help="Matrix step of the bound: worst-case or empirical-bernstein."
    ),
    alpha: float = typer.Option(0.05, "--alpha", help="Level of the noise test behind 'improvable', in (0, 0.215]."),
    beta: float | None = typer.Option(
        None,
        "--beta",
        help=(
            "Smoothness β of the loss in the added field at this site: also s²/(2β), guaranteed only if β is "
            "proven here (½‖W‖₂² for a cross-entropy head W at the head's input; prop-beta-composed deeper); "
            "unchecked on a dumped probe."
        ),
    ),
    second_order: bool = typer.Option(
        False, "--second-order", help="Also the saddle score of the Hessian's cross block (relu:K, gelu:K, tanh:K)."
    ),
    crossfit: bool = typer.Option(
        False,
        "--crossfit",
        help="Also cross-fitted estimates of r and ρ (consistent for continuous units; biased low, with intervals).",
    ),
    crossfit_regression: str = typer.Option(
        "knn", "--crossfit-regression", help="Regression of the cross-fit: knn or local-linear (less bias, moderate d)."
    ),
    gram: str = typer.Option("auto", "--gram", help=GRAM_HELP),
    products: str = typer.Option("float64", "--products", help=PRODUCTS_HELP),
) -> None:
    """Saturation quantities of a dumped probe (activations z, activation gradients g)."""
    constants: dict[str, Any] = dict(
        grad_max=grad_max,
        leverage_max=leverage_max,
        feature_norm_max=feature_norm_max,
        eig_floor=eig_floor,
        ridge=ridge,
        variance=variance,
    )
    try:
        if delta is None:
            _refuse_bound_options_without_delta(
                {
                    **constants,
                    "epsilon": epsilon,
                    "candidates": candidates,
                    "bootstrap": bootstrap,
                    "matrix_bound": matrix_bound,
                }
            )
        if not 0.0 < alpha <= 0.215:
            raise UserError(f"--alpha {alpha}: the noise test is valid for 0 < alpha <= 0.215")
        _check_choice("--gram", gram, GRAM_MODES)
        _check_choice("--products", products, PRODUCT_DTYPES)
        z, g = load_probe(probe)
        fam = parse_family(family)
        acc = statistics_for(fam, (z.shape[1],), Layout.VECTOR, pool_ties=True, gram=gram, products=products)
        acc.update(torch.from_numpy(z), torch.from_numpy(g))
        result = acc.result(alpha=alpha)
        interval = None
        if beta is not None and not (math.isfinite(beta) and beta > 0):
            raise UserError(f"--beta {beta}: the smoothness constant must be a positive finite number")
        if delta is not None and epsilon is None and beta is not None:
            epsilon = epsilon_from_nats(DEFAULT_EPSILON_NATS, beta)
        if delta is not None:
            interval = interval_from_probe(
                z,
                g,
                fam,
                delta=delta,
                epsilon=epsilon,
                candidates=candidates,
                bootstrap=bootstrap,
                matrix_bound=matrix_bound,
                **constants,
            )
        out = render.score_fields(result, interval)
        out.update(_beyond_fields(fam, z, g, result.score, beta, second_order))
        if crossfit_regression != "knn" and not crossfit:
            raise UserError("--crossfit-regression needs --crossfit")
        if crossfit:
            try:
                est = crossfit_realizability(
                    z,
                    g,
                    score_squared=result.score_squared_unbiased,
                    score_squared_se=result.score_squared_se,
                    regression=crossfit_regression,
                )
            except ValueError as exc:
                raise UserError(f"--crossfit: {exc}") from None
            out.update(est.to_dict())
    except (UserError, FamilyError, StatisticsError, BoundError) as exc:
        render.fail(exc)
    render.print_score(out, probe, as_json=as_json)


def _beyond_fields(fam, z, g, score: float, beta: float | None, second_order: bool) -> dict:
    """``beta``/``guaranteed_decrease`` (``thm-guaranteed-decrease``) and the saddle score (``thm-strict-saddle``)."""
    out: dict[str, Any] = {}
    if beta is not None:
        out["beta"] = beta
        out["guaranteed_decrease"] = guaranteed_decrease(score, beta)
        out["beta_status"] = (
            "unchecked (a dumped probe has no model to run the step −Πg/β on: holds only if β is proven at this site)"
        )
    if second_order:
        if not isinstance(fam, FeatureFamily):
            raise UserError(f"--second-order needs a random-feature family (relu:K, gelu:K, tanh:K), not {fam.spec!r}")
        cross = CrossBlockStatistics(fam, (z.shape[1],), Layout.VECTOR)
        cross.update(torch.from_numpy(z), torch.from_numpy(g))
        out.update(cross.result().to_dict())
    return out


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
    try:
        plan = plan_bound(
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
        render.fail(exc)
    render.print_bound(plan.to_dict(), delta, as_json=as_json)


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
        None,
        "--model",
        help="Audit at a site of a model (needs --site): mlp, cnn, gpt, a zoo name or package.module:attr "
        "with (inputs, targets) tensor batches.",
    ),
    site: str | None = typer.Option(None, "--site", help="Site name for --model (e.g. blocks.1)."),
    seed: int = typer.Option(0, "--seed", help="Training seed of --model."),
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Audit a residual family: function preservation, tangent rank, regularity, certificate, score."""
    from depthsat_theory.audit import AuditError, report_table
    from depthsat_theory.capture import NotFunctionPreservingError, SiteError

    if os.getcwd() not in sys.path:  # 'module:attr' resolves from the current folder too
        sys.path.insert(0, os.getcwd())
    try:
        if probe is not None and model is not None:
            raise UserError("give either --probe or --model/--site, not both")
        if (model is None) != (site is None):
            raise UserError("--model and --site go together (e.g. --model mlp --site blocks.1)")
        rep = _audit(family, probe, model, site, seed, device)
    except (UserError, AuditError, FamilyError, StatisticsError, SiteError, NotFunctionPreservingError) as exc:
        render.fail(exc)
    render.print_audit(rep, report_table(rep), as_json=as_json)


def _audit(family: str, probe: Path | None, model: str | None, site: str | None, seed: int, device: str) -> Any:
    """The audit report on a probe file, at a site of a trained model, or on the synthetic probe."""
    from depthsat_theory.audit import audit_family, audit_model, load_family, synthetic_probe
    from depthsat_theory.tasks import KINDS, default_cache_dir, trained_task

    if probe is not None:
        z, g = load_probe(probe)
        fam = load_family(family, d=z.shape[1])
        return audit_family(fam, z, g, layout=Layout.VECTOR, probe=f"{probe} ({z.shape[0]} × {z.shape[1]})")
    if model is not None and site is not None:
        fam = load_family(family)
        if model in KINDS:  # the whole probe set of a model trained here
            dev = parse_device(device)
            task = trained_task(model, seed, cache_dir=default_cache_dir())
            net: Any = task.model.to(dev)
            x, y, loss, layout, names = task.inputs.to(dev), task.targets.to(dev), task.loss, task.layout, None
            label = f"{model} (seed {seed}) probe set, {task.inputs.shape[0]} examples, site {site}"
        else:
            net, x, y, loss, layout, names, label = audit_target(model, seed, device, site)
        return audit_model(fam, net, site, x, y, loss, layout=layout, sites=names or model_sites(net, x), probe=label)
    fam = load_family(family)
    z, g, probe_layout, probe_label = synthetic_probe(fam)
    return audit_family(fam, z, g, layout=probe_layout, probe=probe_label)


# ----------------------------------------------------------------------------- diagnose
@app.command("diagnose")
def diagnose_cmd(
    model: str = typer.Option(
        ...,
        "--model",
        help="Model: mlp, cnn, gpt (trained here, cached), a zoo name, hf:PATH (a local Hugging Face causal LM "
        "checkpoint folder) or package.module:attr (a factory returning (model, loss_fn, batches)).",
    ),
    sites: str | None = typer.Option(None, "--sites", help="Comma-separated site module names (default: discovered)."),
    family: str = typer.Option("linear", "--family", help=f"Residual family spec: {family_specs()}."),
    delta: float | None = typer.Option(None, "--delta", help="Add (1-δ) intervals, union-bounded over the sites."),
    rho: bool = typer.Option(False, "--rho", help="Also r̂ and ρ̂ (pools exactly equal units)."),
    n_batches: int | None = typer.Option(None, "--batches", help="Probe batches (default: the whole probe set)."),
    batch_size: int | None = typer.Option(
        None,
        "--batch-size",
        help="Examples per probe batch (default: 64 for mlp/cnn/gpt, the zoo model's own, 4 for hf:PATH; "
        "a factory makes its own).",
    ),
    seed: int = typer.Option(
        0, "--seed", help="Training seed of mlp/cnn/gpt; probe/training seed of zoo models; probe seed of hf:PATH."
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Write the diagnosis as JSON (atomically)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write PATH.png and PATH.svg: score against depth."),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="Save partial statistics here; resume from it."),
    checkpoint_every: int = typer.Option(1, "--checkpoint-every", help="Batches between checkpoint writes."),
    text: Path | None = typer.Option(
        None, "--text", help="hf:PATH only: probe text file, one window per 4 consecutive lines (default: the KJV)."
    ),
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    beta: float | None = typer.Option(
        None,
        "--beta",
        help=(
            "Smoothness β of the loss in the added field at the diagnosed sites: report s²/(2β). Each site's β is "
            "checked by running the step −Πg/β on the probe; where it removes less, β is marked refuted and no "
            "decrease is reported. ½‖W‖₂² (cross-entropy head W) holds at the head's input only."
        ),
    ),
    second_order: bool = typer.Option(
        False, "--second-order", help="Also the saddle score of the Hessian's cross block (relu:K, gelu:K, tanh:K)."
    ),
    curvature: bool = typer.Option(
        False,
        "--curvature",
        help="Also the measured curvature κ along Πg and the local decrease s²/(2κ), at vector, sequence and "
        "image sites (the field acts on every token or pixel); a site without κ gets a note saying why.",
    ),
    gram: str = typer.Option("auto", "--gram", help=GRAM_HELP),
    products: str = typer.Option("float64", "--products", help=PRODUCTS_HELP),
    until_decided: bool = typer.Option(
        False,
        "--until-decided",
        help="Read probe batches until every site is decided by the anytime-valid noise test "
        "(theory/decision.md, thm-anytime-noise-test; level 0.05 whatever the stopping) or the budget is spent; "
        "reports per site the examples used, the example and batch of the decision, and the anytime forecast. "
        "Feature families, one process, not with --delta.",
    ),
    max_examples: int | None = typer.Option(
        None,
        "--max-examples",
        help="With --until-decided: the budget in probe examples (no batch that would pass it is read; "
        "default: the whole probe).",
    ),
    decision: bool = typer.Option(
        False,
        "--decision",
        help="Also decide per site: add depth here, train longer first, enough depth or undetermined, from the "
        "stationarity score of the existing last linear map at the site and the score beyond training "
        "(theory/decision.md; feature families; one process).",
    ),
) -> None:
    """Saturation score of every residual-stream site of a model, one forward+backward per batch."""
    from depthsat_theory.capture import SiteError
    from depthsat_theory.diagnose import DiagnoseError, DiagnoseOptions, diagnose
    from depthsat_theory.diagnose import distributed as dist

    dist.init_from_env()
    main_rank = dist.is_main()
    done = [0]  # probe batches done (for the interruption message)
    try:
        check_output_path("--json", json_path)
        check_output_path("--plot", plot, stdout=False)
        check_output_path("--checkpoint", checkpoint, stdout=False)
        _check_choice("--gram", gram, GRAM_MODES)
        _check_choice("--products", products, PRODUCT_DTYPES)
        target = diagnose_target(model, seed, n_batches, batch_size, device=device, text=text)

        def advance(k: int, tot: int | None) -> None:
            done[0] = k
            bar.update(task, completed=k, total=tot)

        with render.progress(disable=quiet or not main_rank) as bar:
            task = bar.add_task("probe batches", total=None)
            options = DiagnoseOptions(
                sites=list(_split(sites)) if sites else target.sites,
                family=family,
                delta=delta,
                realizability=rho,
                layout=target.layout,
                checkpoint=checkpoint,
                description=target.description,
                checkpoint_every=checkpoint_every,
                config={"model": model, "seed": seed, "batch_size": batch_size, "device": str(target.device)},
                progress=advance,
                beta=beta,
                second_order=second_order,
                curvature=curvature,
                gram=gram,
                products=products,
                until_decided=until_decided,
                max_examples=max_examples,
                decision=decision,
                **target.extra,
            )
            res = diagnose(target.model, target.loss_fn, target.batches, options=options)
    except KeyboardInterrupt:
        if checkpoint is None:
            msg = (
                f"interrupted after {done[0]} probe batches: nothing was kept (no --checkpoint); "
                f"rerun with --checkpoint PATH to keep partial statistics and resume"
            )
        else:
            msg = (
                f"interrupted after {done[0]} probe batches: {checkpoint} keeps the statistics as of its last write "
                f"(every {checkpoint_every} batches); rerun the same command to resume from it"
            )
        render.err_console.print(msg, markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    except (UserError, DiagnoseError, FamilyError, StatisticsError, SiteError, BoundError, OSError) as exc:
        render.fail(exc)
    if main_rank:
        _write_diagnosis(res, json_path, plot)


def _write_diagnosis(res: Any, json_path: Path | None, plot: Path | None) -> None:
    """Write ``--json`` and ``--plot``, print the table (on stderr when the JSON goes to stdout), then any error.

    The table is printed even when a write fails, so the work is never lost; the failure is then one line
    naming the flag (exit status 2).
    """
    written: list[Path] = []
    failure = None
    for flag, path in (("--json", json_path), ("--plot", plot)):
        if path is None or failure is not None:
            continue
        try:
            if flag == "--json":
                res.write_json(path)
                written += [] if is_stdout(path) else [path]
            else:
                written += res.plot(path)
        except OSError as exc:
            failure = f"{flag} {path}: could not write ({exc}); the results above were not saved there"
    render.print_diagnosis(res, written, stderr=json_path is not None and is_stdout(json_path))
    if failure is not None:
        render.fail(failure)


# ----------------------------------------------------------------------------- grow
@app.command("grow")
def grow_cmd(
    model: str = typer.Option(
        ...,
        "--model",
        help="Model: mlp, cnn, gpt (trained here, cached), a zoo name, hf:PATH (a local Hugging Face causal LM "
        "checkpoint folder) or package.module:attr (a factory returning (model, loss_fn, batches)).",
    ),
    blocks: int = typer.Option(..., "--blocks", help="Number of blocks K to insert."),
    out: Path = typer.Option(..., "--out", help="New or empty folder for the grown model and grow-report.json."),
    family: str | None = typer.Option(
        None,
        "--family",
        help="Family of the inserted blocks (default: zero-output layer copies for Llama/GPT-2, else linear).",
    ),
    positions: str = typer.Option("auto", "--positions", help="auto (ranked), even, or site indices i,j."),
    delta: float | None = typer.Option(None, "--delta", help="Rank by certified lower ends of (1-δ) intervals."),
    train_steps: int = typer.Option(0, "--train-steps", help="Adam steps on the probe batches after growth."),
    freeze_old: bool = typer.Option(False, "--freeze-old", help="Train only the new blocks (LLaMA-Pro)."),
    lr: float = typer.Option(1e-4, "--lr", help="Learning rate of the first-step preview and of training."),
    n_batches: int | None = typer.Option(None, "--batches", help="Probe batches (default: the whole probe set)."),
    batch_size: int | None = typer.Option(None, "--batch-size", help="Examples per probe batch."),
    seed: int = typer.Option(0, "--seed", help="Training seed of mlp/cnn/gpt; probe/training seed of zoo models."),
    text: Path | None = typer.Option(
        None, "--text", help="hf:PATH only: probe text file, one window per 4 consecutive lines (default: the KJV)."
    ),
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    eval_text: Path | None = typer.Option(
        None,
        "--eval-text",
        help="Held-out text file (language models): its loss before growth and after training is reported.",
    ),
    checkpoint: Path | None = typer.Option(
        None, "--checkpoint", help="Training checkpoint file: written as training goes, resumed from when it exists."
    ),
    checkpoint_every: int = typer.Option(1, "--checkpoint-every", help="Training steps between checkpoint writes."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
    until_decided: bool = typer.Option(
        False,
        "--until-decided",
        help="Stream the diagnosis until every site is decided by the anytime-valid noise test (as diagnose "
        "--until-decided); --positions auto then picks the decided sites first.",
    ),
    max_examples: int | None = typer.Option(
        None, "--max-examples", help="With --until-decided: the budget in probe examples (default: the whole probe)."
    ),
) -> None:
    """Diagnose, pick K sites, insert zero-output blocks there, preview the first step, train, write."""
    from depthsat_theory.capture import NotFunctionPreservingError, SiteError
    from depthsat_theory.diagnose import DiagnoseError
    from depthsat_theory.grow import GrowError
    from depthsat_theory.grow.run import check_out_dir, grow, held_out_batches, interrupted_message, write_grown

    try:
        check_output_path("--out", out, folder=True)
        check_out_dir(out)
        if family is not None:
            parse_family(family)
        target = diagnose_target(model, seed, n_batches, batch_size, device=device, text=text)
        held = None
        if eval_text is not None:
            size = int(unpack_batch(target.batches[0])[1].shape[0])
            n_probe = sum(int(unpack_batch(b)[1].shape[0]) for b in target.batches)
            held = held_out_batches(target.tokenizer, eval_text, n_probe, size, seed=seed, device=target.device)
        with render.progress(disable=quiet) as bar:
            rep = grow(
                target.model,
                target.loss_fn,
                target.batches,
                sites=target.sites,
                blocks=blocks,
                family=family,
                positions=positions,
                train_steps=train_steps,
                freeze_old=freeze_old,
                lr=lr,
                layout=target.layout,
                diagnose_kwargs={
                    **target.extra,
                    "delta": delta,
                    "until_decided": until_decided,
                    "max_examples": max_examples,
                },
                description=target.description,
                eval_batches=held,
                checkpoint=checkpoint,
                checkpoint_every=checkpoint_every,
                progress=render.phase_progress(bar),
            )
    except KeyboardInterrupt:
        render.err_console.print(interrupted_message(checkpoint), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    except (
        UserError,
        GrowError,
        DiagnoseError,
        FamilyError,
        StatisticsError,
        SiteError,
        NotFunctionPreservingError,
    ) as exc:
        render.fail(exc)
    failure, written = None, []
    try:
        written = write_grown(rep, out, tokenizer=target.tokenizer)
    except GrowError as exc:  # the folder changed during the run: print the results, then say so
        failure = f"{exc}; the grown model was not saved"
    except OSError as exc:
        failure = f"--out {out}: could not write the grown model ({exc}); it was not saved"
    render.print_grow(rep.to_dict(), written)
    if failure is not None:
        render.fail(failure)


# ----------------------------------------------------------------------------- prune-candidates
@app.command("prune-candidates")
def prune_candidates_cmd(
    model: str = typer.Option(..., "--model", help="Model, as for diagnose (mlp, cnn, gpt, a zoo name, hf:PATH, ...)."),
    measure: bool = typer.Option(False, "--measure", help="Also remove each layer and measure the loss change."),
    n_batches: int | None = typer.Option(None, "--batches", help="Probe batches (default: the whole probe set)."),
    batch_size: int | None = typer.Option(None, "--batch-size", help="Examples per probe batch."),
    seed: int = typer.Option(0, "--seed", help="Training seed of mlp/cnn/gpt; probe seed of zoo and hf: models."),
    text: Path | None = typer.Option(None, "--text", help="hf:PATH only: probe text file."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the ranking as JSON (atomically)."),
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Which layer to remove: block influence and first-order removal change, next to the growth score."""
    from depthsat_theory.capture import SiteError
    from depthsat_theory.diagnose import DiagnoseError, diagnose, discover_sites
    from depthsat_theory.grow import GrowError
    from depthsat_theory.grow.prune import prune_candidates
    from depthsat_theory.io import atomic_write

    try:
        check_output_path("--json", json_path)
        target = diagnose_target(model, seed, n_batches, batch_size, device=device, text=text)
        sites = target.sites or discover_sites(target.model, unpack_batch(target.batches[0])[0])
        with render.progress(disable=quiet) as bar:
            task = bar.add_task("probe batches (removal)", total=len(target.batches))
            ranking = prune_candidates(
                target.model,
                target.loss_fn,
                target.batches,
                sites,
                measure=measure,
                progress=lambda k, tot: bar.update(task, completed=k, total=tot),
            )
            task2 = bar.add_task("probe batches (growth)", total=len(target.batches))
            diag = diagnose(
                target.model,
                target.loss_fn,
                target.batches,
                sites=sites,
                layout=target.layout,
                description=target.description,
                progress=lambda k, tot: bar.update(task2, completed=k, total=tot),
                **target.extra,
            )
        data = ranking.to_dict()
        growth = {s: diag[s].to_dict().get("relative_score") for s in sites}
        for row in data["candidates"]:
            row["growth_relative_score"] = growth[row["site"]]
        data["description"] = target.description
        data["loss_units"] = diag.loss_units
        if json_path is not None:
            text_out = json.dumps(data, indent=1, ensure_ascii=False, allow_nan=True)
            atomic_write(json_path, lambda fh: fh.write(text_out))
    except KeyboardInterrupt:
        render.err_console.print("interrupted: nothing was kept; rerun the command", markup=False, highlight=False)
        raise typer.Exit(130) from None
    except (UserError, GrowError, DiagnoseError, FamilyError, StatisticsError, SiteError, OSError) as exc:
        render.fail(exc)
    render.print_prune(data)


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
    from proofs_checks import Context, run_and_report

    claims = list(_split(only)) if only else None
    raise typer.Exit(run_and_report(Context(seed=seed, quick=quick), only=claims, json_path=json_path, quiet=quiet))


# ----------------------------------------------------------------------------- entry point
def main() -> None:
    """Console-script entry point.

    Unexpected exceptions end with one ``error: internal error …`` line and exit
    status 3 (``1`` means "counterexample found", ``2`` bad input); set
    ``DEPTHSAT_DEBUG=1`` to see the traceback.
    """
    if os.environ.get("DEPTHSAT_DEBUG"):
        app()
        return
    from depthsat_theory.extras import MissingExtraError
    from depthsat_theory.tasks import CacheDirError, DataUnavailableError

    try:
        status = app(standalone_mode=False)
    except (CacheDirError, DataUnavailableError, MissingExtraError) as exc:  # models, data, optional extras
        render.err_console.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except _USAGE_ERROR as exc:  # unknown option, unparsable value: one line too
        msg = exc.format_message()
        if msg:  # (an empty message: typer already printed the help of a bare command)
            parts, ctx = [], exc.ctx
            while ctx is not None and ctx.parent is not None:  # the subcommand path below the root
                parts.append(ctx.info_name)
                ctx = ctx.parent
            name = " ".join(["depthsat", *reversed(parts)])
            render.err_console.print(f"error: {msg} (see {name} --help)", markup=False, highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except Exception as exc:
        render.err_console.print(
            f"error: internal error ({type(exc).__name__}: {exc}); rerun with DEPTHSAT_DEBUG=1 for the traceback",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(3)
    sys.exit(status if isinstance(status, int) else 0)


# click's UsageError, whether typer vendors click or depends on it
_USAGE_ERROR: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
