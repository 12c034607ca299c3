"""Shared pytest fixtures for the depthsat_theory test suite."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> torch.device:
    """Every engine test runs on CPU, and on CUDA too where a GPU is present.

    Session-scoped so that hypothesis ``@given`` tests may take it.
    """
    return torch.device(request.param)
