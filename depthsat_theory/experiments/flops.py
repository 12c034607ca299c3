"""Training compute of a model, counted in multiply-adds per example (forward + backward).

The count covers the dense products: every ``nn.Linear`` and ``nn.Conv2d`` (``nn.Conv1d``) call in
one forward pass, measured with forward hooks on one example, and their two backward products:

- the weight gradient (``∂J/∂W = δᵀ x``): as many multiply-adds as the forward product, when the
  weight requires grad;
- the input gradient (``∂J/∂x = δ W``): as many again, when the layer's input requires grad (not for
  a first layer fed with raw data).

Element-wise work (biases, normalisation, activations, residual additions, pooling) is ``O(d)`` per
row against the ``O(d²)`` products and is not counted; nor are products outside modules (e.g. an
attention ``q kᵀ`` written with ``@``).  One multiply-add is two FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["TrainingCost", "training_cost"]


@dataclass(frozen=True)
class TrainingCost:
    """Multiply-adds per example of one training step (forward + backward) of a model.

    Attributes:
        forward: multiply-adds of the forward pass.
        weight_grad: multiply-adds of the weight gradients.
        input_grad: multiply-adds of the input gradients.
    """

    forward: int
    weight_grad: int
    input_grad: int

    @property
    def macs(self) -> int:
        """Multiply-adds per example per forward + backward pass."""
        return self.forward + self.weight_grad + self.input_grad

    @property
    def flops(self) -> int:
        """FLOPs per example per forward + backward pass (2 per multiply-add)."""
        return 2 * self.macs


def _layer_macs(module: nn.Module, out: Tensor) -> int:
    """Forward multiply-adds of one call of a Linear/Conv layer on one example (``out``: its output)."""
    if isinstance(module, nn.Linear):
        return int(out.numel()) * module.in_features
    assert isinstance(module, nn.Conv1d | nn.Conv2d)
    kernel = 1
    for k in module.kernel_size:
        kernel *= int(k)
    return int(out.numel()) * (module.in_channels // module.groups) * kernel


def training_cost(model: nn.Module, example: Any) -> TrainingCost:
    """Count the multiply-adds of one forward and backward pass of ``model`` on one example.

    Args:
        model: any ``nn.Module`` whose dense products are ``nn.Linear``/``nn.Conv1d``/``nn.Conv2d``
            calls (other products are not seen; see the module docstring).
        example: a batch of exactly one example (a tensor of shape ``(1, ...)``), as the model takes it.

    Returns:
        A :class:`TrainingCost` (multiply-adds per example; ``.flops`` doubles them).

    Raises:
        ValueError: if ``example`` is not a tensor with a leading batch dimension of 1.
    """
    if not isinstance(example, Tensor) or example.dim() < 1 or example.shape[0] != 1:
        raise ValueError("example must be a tensor holding one example, shape (1, ...); slice the batch as x[:1]")
    counts = {"forward": 0, "weight_grad": 0, "input_grad": 0}

    def hook(module: nn.Module, inputs: tuple, out: Tensor) -> None:
        macs = _layer_macs(module, out)
        counts["forward"] += macs
        if module.weight.requires_grad:
            counts["weight_grad"] += macs
        if inputs and isinstance(inputs[0], Tensor) and inputs[0].requires_grad:
            counts["input_grad"] += macs

    layers = (nn.Linear, nn.Conv1d, nn.Conv2d)
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, layers)]
    was_training = model.training
    try:
        model.eval()  # BatchNorm: a single example is fine in eval mode; the products are the same
        with torch.enable_grad():
            model(example)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return TrainingCost(**counts)
