"""Shared pytest fixtures for the depthsat_theory test suite."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# CI draws the same hypothesis examples every run (a red CI must be reproducible);
# local runs explore new examples each time.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> torch.device:
    """Every engine test runs on CPU, and on CUDA too where a GPU is present.

    Session-scoped so that hypothesis ``@given`` tests may take it.
    """
    return torch.device(request.param)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    """Cache folder for trained weights shared by the checker tests.

    ``$DEPTHSAT_CACHE`` when set (CI keeps it between runs), else a session temp dir.
    """
    return os.environ.get("DEPTHSAT_CACHE") or str(tmp_path_factory.mktemp("depthsat-cache"))
