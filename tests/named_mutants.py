"""The named mutants of the verdict code, applied by hand: each must be killed by the suite (``./dev mutate``).

mutmut does not mutate ``@property`` bodies (the verdict rules of :class:`SaturationResult`) and
generates operator-level mutants only; the mutants the issue names (a rounding bound ×1/100 or
×1000, a resolution cutoff ×1/k̃ or absolute, no unit-diagonal scaling, ``Δ`` with ``L`` instead of
``max(L, 1)``, ``V̄`` without ``(1 + Δ)``, the upper end capped at a probe ``γ``) and the verdict
rules are applied here to a copy of the package, one at a time, and the tests that must kill each
are run against it.  Exit status 1 if any survives.

Usage: ``python tests/named_mutants.py [NAME ...]`` from the repository root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIN = "depthsat_theory/statistics/linalg.py"
RES = "depthsat_theory/statistics/result.py"
TAN = "depthsat_theory/statistics/tangent.py"
FEA = "depthsat_theory/statistics/feature.py"
INT = "depthsat_theory/bounds/interval.py"
TER = "depthsat_theory/bounds/terms.py"
KILL = "tests/test_mutation_killers.py"
UNIT = "tests/test_unit_gram.py"
NUM = "tests/test_numerics.py"
BND = "tests/test_bounds.py"
TNG = "tests/test_tangent.py"
SCORE_ERROR_RETURN = "        + score * eta / lam_min\n    )\n"
# the behavioural killers (a verdict on an instance with independent truth), named so that the
# kill is theirs and not only the closed-form pin of score_error that runs first in the file
HALF = KILL + "::test_half_precision_input_rounding_is_within_fifty_times_the_bound"
PLANT = KILL + "::test_signal_at_ten_times_the_theorem_bound_is_improvable"
CUTOFF = KILL + "::test_data_resolution_is_relative_to_the_largest_eigenvalue"
SCALING = KILL + "::test_unit_diagonal_scaling_makes_a_tiny_feature_resolvable"

# name: (file, original text, mutated text, tests that must kill it)
MUTANTS: dict[str, tuple[str, str, str, list[str]]] = {
    "score_error x 1/100": (LIN, SCORE_ERROR_RETURN, SCORE_ERROR_RETURN.replace(")", ") / 100"), [HALF]),
    "score_error x 1000": (LIN, SCORE_ERROR_RETURN, SCORE_ERROR_RETURN.replace(")", ") * 1000"), [PLANT]),
    "cutoff x 1/k": (LIN, "cutoff = chosen * lmax if", "cutoff = chosen * lmax / k if", [CUTOFF]),
    "cutoff absolute": (LIN, "cutoff = chosen * lmax if", "cutoff = chosen if", [CUTOFF]),
    "data rtol x 1/k": (
        LIN,
        "return (RESOLUTION_FACTOR * math.sqrt(max(int(k), 1)) * unit_roundoff(dtype)) ** 2",
        "return (RESOLUTION_FACTOR * math.sqrt(max(int(k), 1)) * unit_roundoff(dtype)) ** 2 / k",
        [KILL, NUM],
    ),
    "no unit-diagonal scaling (Gram)": (
        LIN,
        "torch.from_numpy(mat * np.outer(scale, scale)).to(device)",
        "torch.from_numpy(mat).to(device)",
        [SCALING],
    ),
    "no unit-diagonal scaling (factor)": (
        LIN,
        "torch.from_numpy(factor * scale[None, :]).to(device)",
        "torch.from_numpy(factor).to(device)",
        [SCALING],
    ),
    "no unit-diagonal scaling (scale = 1)": (
        LIN,
        "    scale[live] = 1.0 / np.sqrt(diag[live])\n",
        "    scale[live] = 1.0\n",
        [SCALING],
    ),
    "saturated at equality excluded": (RES, "if self.score <= self.tol:", "if self.score < self.tol:", [KILL]),
    "unresolved ignored": (
        RES,
        "return Verdict.UNDETERMINED if self.unresolved or self._vacuous_bound else Verdict.SATURATED",
        "return Verdict.UNDETERMINED if self._vacuous_bound else Verdict.SATURATED",
        [KILL, NUM],
    ),
    # "infinite bound saturated" (deleting the isfinite check) is equivalent since the vacuous-bound
    # rule: an infinite tol has 2 tol ≥ AG_rms, so the verdict is undetermined either way.
    "degenerate last": (
        RES,
        "        if self.degenerate:\n            return Verdict.DEGENERATE\n        if self.kink_ties",
        "        if self.kink_ties",
        [KILL, NUM],
    ),
    "noise test ignored": (
        RES,
        "if pv is Verdict.IMPROVABLE and self.significant is False:",
        "if False:",
        [KILL, NUM],
    ),
    "noise test at equality significant": (
        RES,
        "return self.noise_ratio > self.noise_threshold",
        "return self.noise_ratio >= self.noise_threshold",
        [KILL],
    ),
    "examples_needed floor": (
        RES,
        "return math.ceil(self.noise_threshold",
        "return math.floor(self.noise_threshold",
        [KILL],
    ),
    "tol not the bound": (
        TAN,
        "tol = err if tol is None else float(tol)",
        "tol = 0.0 if tol is None else float(tol)",
        [KILL, NUM],
    ),
    "score not clipped at AG_rms": (
        TAN,
        "else min(score, ag_rms)\n",
        "else score\n",
        [KILL, NUM, TNG],
    ),
    "noise moment dropped (feature)": (
        FEA,
        '_noise_moment(self.states["q_sum"], phi_x, g_x, kb.g_norm2)',
        "pass",
        [KILL, NUM],
    ),
    "unit path: rows not scaled by 1/sqrt(n)": (
        FEA,
        "factor=(phi / math.sqrt(self.n)).cpu().numpy(),",
        "factor=phi.cpu().numpy(),",
        [UNIT],
    ),
    "unit path: noise variance without D^-1/2": (
        FEA,
        "whiten = spec.vectors * (spec.scale[:, None] / np.sqrt(spec.values))",
        "whiten = spec.vectors * (1.0 / np.sqrt(spec.values))",
        [UNIT],
    ),
    "factor never used (feature)": (
        FEA,
        "factor = self.factor.r.numpy() / np.sqrt(self.n)",
        "factor = None",
        [KILL, NUM, TNG],
    ),
    "Delta with L (not max(L, 1))": (TER, "l1 = max(big_l, 1.0)", "l1 = big_l", [BND]),
    "V-bar without (1 + Delta)": (
        INT,
        "bernstein_mean_upper((1 + dev_hi) * est.v_hat",
        "bernstein_mean_upper(est.v_hat",
        [BND],
    ),
    "upper end capped at a probe gamma": (
        INT,
        '    if const["grad_max"].source != "probe":\n        upper = min(upper, gam)',
        "    if True:\n        upper = min(upper, gam)",
        [BND],
    ),
}


def run(name: str) -> tuple[bool, str]:
    """Apply one mutant to a copy of the package: whether the named tests kill it, and the first that failed."""
    path, old, new, tests = MUTANTS[name]
    with tempfile.TemporaryDirectory(prefix="depthsat-mutant-") as tmp:
        shutil.copytree(ROOT / "depthsat_theory", Path(tmp) / "depthsat_theory")
        shutil.copytree(ROOT / "proofs_checks", Path(tmp) / "proofs_checks")
        shutil.copytree(ROOT / "tests", Path(tmp) / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", Path(tmp) / "pyproject.toml")
        target = Path(tmp) / path
        text = target.read_text("utf-8")
        if text.count(old) != 1:
            raise SystemExit(f"{name}: the original text occurs {text.count(old)} times in {path}")
        target.write_text(text.replace(old, new), "utf-8")
        env = dict(os.environ, PYTHONPATH=tmp)
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        check = subprocess.run(
            [sys.executable, "-c", "import depthsat_theory; print(depthsat_theory.__file__)"],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
        )
        if not check.stdout.startswith(tmp):
            raise SystemExit(f"{name}: the mutated copy was not imported: {check.stdout.strip()} {check.stderr[-500:]}")
    failed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    return proc.returncode != 0, (failed[0] if failed else "")


def main(names: list[str]) -> int:
    """Run every named mutant (or those given); print one line each."""
    survived = 0
    for name in names or list(MUTANTS):
        killed, by = run(name)
        survived += not killed
        print(f"{'killed  ' if killed else 'SURVIVED'} {name}{f'  (by {by})' if by else ''}", flush=True)
    total = len(names or MUTANTS)
    print(f"named mutants: {total - survived}/{total} killed")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
