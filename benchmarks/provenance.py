"""What made a benchmark's figures: the command, the commit, the versions and the machine (results JSON)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def provenance() -> dict:
    """The command line, UTC start time, git commit (and whether the tree was dirty), versions and load.

    Returns:
        A JSON-ready ``dict``; ``commit`` is ``None`` outside a git checkout.
    """
    import torch

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no")
    try:
        gromo = version("gromo")
    except PackageNotFoundError:  # GroMo is optional
        gromo = None
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gromo": gromo,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_start": os.getloadavg()[0],
    }
