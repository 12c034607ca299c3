"""The paper's experiments and the questions beyond it, reproducible from the CLI.

Each experiment lives in its own module and writes its results with :func:`.record.write_results`
into ``experiments/results/<name>/`` (CSV tables, a JSON summary with the command, commit, seeds and
software versions, PNG/SVG figures), atomically: a crash never leaves a half-written result folder.
``depthsat experiment NAME --config tiny|full`` runs one; ``tiny`` is what CI runs.
"""

from depthsat_theory.experiments.record import ExperimentError, provenance, summarize, write_results

# the training recipe (data splits, models of any depth, early stopping): import it from
# depthsat_theory.experiments.recipe (kept out of this namespace so that importing the package stays light)

__all__ = ["ExperimentError", "provenance", "summarize", "write_results"]
