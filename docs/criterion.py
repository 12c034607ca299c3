"""Draw docs/criterion.png, the README's picture (``python docs/criterion.py``; needs the ``plot`` extra)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from depthsat_theory.figures import criterion_figure

if __name__ == "__main__":
    out = Path(__file__).with_name("criterion.png")
    criterion_figure().savefig(out, dpi=110)
    print(f"wrote {out}")
