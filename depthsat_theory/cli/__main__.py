"""``python -m depthsat_theory.cli`` (used by torchrun)."""

from depthsat_theory.cli import main

main()
