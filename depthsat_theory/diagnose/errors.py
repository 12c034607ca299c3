"""Errors of :func:`depthsat_theory.diagnose.diagnose`."""

from __future__ import annotations

__all__ = ["CheckpointError", "DiagnoseError"]


class DiagnoseError(ValueError):
    """Bad input to :func:`diagnose` (no sites, empty probe, NaN loss, family misfit)."""


class CheckpointError(DiagnoseError):
    """A checkpoint cannot be read or belongs to another configuration."""
