"""Command-line interface ``depthsat``: parsing, flags, inputs and rendering; no computation.

Parsing is in ``depthsat_theory.cli.app`` (the module behind the typer :data:`app`), flags in
:mod:`.flags`, inputs in :mod:`.inputs` and rendering in :mod:`.render`.

Errors in user input end with a one-line ``error: …`` on stderr and exit status 2
(no traceback); ``check`` exits 1 when it finds a counterexample.
"""

from depthsat_theory.cli.app import app, main

__all__ = ["app", "main"]
