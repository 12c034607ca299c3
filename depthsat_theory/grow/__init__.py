"""Act on the verdict: grow a network where the criterion says depth still pays.

- :func:`insert_blocks`: zero-output residual blocks of any family after sites of any ``nn.Module``;
- :func:`expand_layers`: zero-output copies of Hugging Face transformer layers (LLaMA-Pro), with
  ``layer_idx``, config, ``post_init`` and ``save_pretrained`` handled;
- :func:`zero_state_param_groups` and :func:`preview_first_step`: train the new parameters from
  zero optimizer state, and see the first step's predicted and measured loss change (T3);
- :func:`rank_sites`: where to grow, by the scale-free score of a diagnosis;
- :func:`grow` (:mod:`.run`): diagnose, pick, grow, train, report (``depthsat grow``).
"""

from depthsat_theory.grow.blocks import Growth, insert_blocks
from depthsat_theory.grow.errors import GrowError, NotFunctionPreservingError
from depthsat_theory.grow.hf import (
    ARCHITECTURES,
    Architecture,
    Expansion,
    discover_zeroed,
    drop_gguf_marker,
    expand_layers,
    find_architecture,
    load_grown,
    resolve_architecture,
)
from depthsat_theory.grow.optim import FirstStepPreview, preview_first_step, zero_state_param_groups
from depthsat_theory.grow.ranking import (
    BY_CERTIFIED,
    BY_HEADLINE,
    BY_POINT,
    RankedSite,
    SiteRanking,
    even_positions,
    rank_sites,
)

__all__ = [
    "ARCHITECTURES",
    "BY_CERTIFIED",
    "BY_HEADLINE",
    "BY_POINT",
    "Architecture",
    "Expansion",
    "FirstStepPreview",
    "GrowError",
    "Growth",
    "NotFunctionPreservingError",
    "RankedSite",
    "SiteRanking",
    "discover_zeroed",
    "drop_gguf_marker",
    "even_positions",
    "expand_layers",
    "find_architecture",
    "insert_blocks",
    "load_grown",
    "preview_first_step",
    "rank_sites",
    "resolve_architecture",
    "zero_state_param_groups",
]
