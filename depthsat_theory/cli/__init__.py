"""Command-line interface ``depthsat``: parsing (:mod:`.app`), flags (:mod:`.flags`),
inputs (:mod:`.inputs`) and rendering (:mod:`.render`); no computation.

Errors in user input end with a one-line ``error: …`` on stderr and exit status 2
(no traceback); ``check`` exits 1 when it finds a counterexample.
"""

from depthsat_theory.cli.app import app, main

__all__ = ["app", "main"]
