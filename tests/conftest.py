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


# ----------------------------------------------------------------------------- engine cases
# Cases as data (tests/cases.py), expanded here over engine × case × device.
from cases import CASE_IDS, CASES, DEVICES, ENGINES, EXACT_CASE_IDS, EXACT_CASES  # noqa: E402


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request):
    """One engine test case (:class:`cases.Case`)."""
    return request.param


@pytest.fixture(params=EXACT_CASES, ids=EXACT_CASE_IDS)
def exact_case(request):
    """One case with an exact finite measure (the symbolic engine applies)."""
    return request.param


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    """The engine answering a case: ``"numeric"``, ``"dense"`` or ``"symbolic"``."""
    return request.param


@pytest.fixture(params=DEVICES)
def case_device(request) -> torch.device:
    """CPU, and CUDA: the CUDA ids always appear and are skipped with a reason without a GPU."""
    return torch.device(request.param)
