"""``python -m proofs_checks``: the same command as ``depthsat proofs``.

It takes the same options, ``[--quick] [--seed S] [--only T2,T4] [--json PATH]``, defined once in
``depthsat_theory.cli``.
"""

from __future__ import annotations

import sys

from depthsat_theory.cli import main

if __name__ == "__main__":
    sys.argv = ["depthsat", "proofs", *sys.argv[1:]]
    main()
