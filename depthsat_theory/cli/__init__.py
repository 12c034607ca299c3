"""Command-line interface ``depthsat``: parsing, flags, inputs and rendering; no computation.

Parsing is in the module :mod:`depthsat_theory.cli.app`, flags in :mod:`.flags`, inputs in
:mod:`.inputs` and rendering in :mod:`.render`. The package re-exports the typer application
:data:`~depthsat_theory.cli.app.app` and :func:`~depthsat_theory.cli.app.main`, so the attribute
``depthsat_theory.cli.app`` is the typer object, not the module of the same name (import that by
its full name, ``importlib.import_module("depthsat_theory.cli.app")``).

Errors in user input end with a one-line ``error: …`` on stderr and exit status 2
(no traceback); ``check`` exits 1 when it finds a counterexample.
"""

from depthsat_theory.cli.app import app, main

__all__ = ["app", "main"]
