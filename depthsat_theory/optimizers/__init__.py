"""Zero-state first-step maps ``P`` of real optimizers (T3).

- :mod:`.base`: :class:`ZeroStateUpdate`, the abstract first-step map;
- :mod:`.first_steps`: one frozen dataclass per optimizer (SGD, momentum, Nesterov, Adam,
  AdamW, RMSprop, Adagrad, signSGD, Lion, the planted rotation);
- :mod:`.updates`: the registry :data:`UPDATES`, :data:`DESCENT_COMPATIBLE`, :func:`get_update`,
  :func:`resolve_update`;
- :mod:`.torch_optim`: :class:`SignSGD`, :class:`Lion`, :class:`RotationOptimizer`
  (``torch.optim.Optimizer`` subclasses for maps torch does not ship);
- :mod:`.compatibility`: :func:`is_descent_compatible` (numeric predicate) and :func:`threshold`;
- :mod:`.numerics`: argument validation and exact float inner products.
"""

from depthsat_theory.optimizers.base import ZeroStateUpdate
from depthsat_theory.optimizers.compatibility import is_descent_compatible
from depthsat_theory.optimizers.numerics import threshold
from depthsat_theory.optimizers.torch_optim import Lion, RotationOptimizer, SignSGD
from depthsat_theory.optimizers.updates import DESCENT_COMPATIBLE, UPDATES, get_update, resolve_update

__all__ = [
    "DESCENT_COMPATIBLE",
    "UPDATES",
    "Lion",
    "RotationOptimizer",
    "SignSGD",
    "ZeroStateUpdate",
    "get_update",
    "is_descent_compatible",
    "resolve_update",
    "threshold",
]
