"""From a score to a decision (theory/decision.md).

- :mod:`.headline`: the bias-corrected score ``s_U`` with its interval, and the plug-in beside its
  chance level (``def-bias-corrected-score``, ``prop-plugin-chance-level``, ``prop-headline-interval``);
- :mod:`.sequential`: an anytime-valid noise test to stream a probe until it decides
  (``thm-anytime-noise-test``);
- :mod:`.beyond`: the stationarity score, the score beyond training and the decision *add depth here* /
  *train longer first* / *enough depth* / *undetermined* (``prop-beyond-training``, ``def-depth-decision``).
"""

from depthsat_theory.decision.beyond import BeyondTraining, DepthDecision, beyond_training, decide
from depthsat_theory.decision.headline import Headline, headline, headline_from_moments
from depthsat_theory.decision.sequential import AnytimeNoiseTest, AnytimeSiteTest, sequential_examples_needed

__all__ = [
    "AnytimeNoiseTest",
    "AnytimeSiteTest",
    "BeyondTraining",
    "DepthDecision",
    "Headline",
    "beyond_training",
    "decide",
    "headline",
    "headline_from_moments",
    "sequential_examples_needed",
]
