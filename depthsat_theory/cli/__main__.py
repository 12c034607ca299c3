"""``python -m depthsat_theory.cli`` (used by torchrun)."""

from depthsat_theory.cli import main

if __name__ == "__main__":  # importing the module (autosummary, pydoc) must not run the CLI
    main()
