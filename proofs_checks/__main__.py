"""``python -m proofs_checks [--quick] [--seed S] [--only T2,T4] [--json PATH]``: the same
command as ``depthsat proofs`` (one definition of the options, in ``depthsat_theory.cli``)."""

from __future__ import annotations

import sys

from depthsat_theory.cli import main

if __name__ == "__main__":
    sys.argv = ["depthsat", "proofs", *sys.argv[1:]]
    main()
