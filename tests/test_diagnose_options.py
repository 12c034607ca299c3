"""DiagnoseOptions: one documented options object shared by diagnose() and the CLI.

The keyword form and the options form are the same call; keywords given with ``options`` override its
fields; an unknown keyword, a non-options object and options that cannot go together are refused.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

from depthsat_theory.diagnose import DiagnoseError, DiagnoseOptions, diagnose
from depthsat_theory.tasks import ResidualMLP, classification_loss

DT = torch.float64


def _problem(n=24, batch=8):
    torch.manual_seed(0)
    model = ResidualMLP(in_dim=4, width=3, depth=2, n_classes=3).to(DT).eval()
    x = torch.randn(n, 4, dtype=DT)
    y = torch.randint(0, 3, (n,))
    return model, [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]


def test_options_object_and_keywords_are_the_same_call():
    model, batches = _problem()
    by_kw = diagnose(model, classification_loss, batches, family="poly:2", delta=0.2, description="toy")
    opts = DiagnoseOptions(family="poly:2", delta=0.2, description="toy")
    by_obj = diagnose(model, classification_loss, batches, options=opts)
    assert by_obj.to_dict() == by_kw.to_dict()
    assert by_obj.delta == 0.2 and by_obj.family == "poly:2" and by_obj.description == "toy"


def test_keywords_override_the_options_fields():
    model, batches = _problem()
    opts = DiagnoseOptions(delta=0.2, description="shared")
    plain = diagnose(model, classification_loss, batches, options=opts, delta=None)
    assert plain.delta is None and all(sd.interval is None for sd in plain.sites)
    assert plain.description == "shared"  # the fields not overridden are kept
    assert opts.delta == 0.2  # the shared object is not modified


def test_unknown_keyword_and_wrong_options_type_are_refused():
    model, batches = _problem()
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) deltta.*DiagnoseOptions"):
        diagnose(model, classification_loss, batches, deltta=0.1)
    with pytest.raises(TypeError, match="options must be a DiagnoseOptions, got dict"):
        diagnose(model, classification_loss, batches, options={"delta": 0.1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reduction": "avg"}, "reduction must be one of"),
        ({"gram": "x"}, "gram must be one of"),
        ({"checkpoint_every": 0}, "checkpoint_every must be >= 1"),
        ({"max_examples": 10}, "max_examples needs until_decided"),
        ({"until_decided": True, "max_examples": 0}, "max_examples must be >= 1"),
        ({"until_decided": True, "max_examples": 2.5}, "whole number"),
        ({"until_decided": True, "delta": 0.1}, "until_decided with delta"),
        ({"until_decided": True, "second_order": True}, "need the whole probe"),
        ({"until_decided": True, "decision": True}, "decision does not go with until_decided"),
    ],
)
def test_options_that_cannot_go_together_are_refused_in_one_line(kwargs, match):
    model, batches = _problem()
    with pytest.raises(DiagnoseError, match=match) as err:
        diagnose(model, classification_loss, batches, options=DiagnoseOptions(**kwargs))
    assert "\n" not in str(err.value)


def test_every_option_is_documented_and_is_a_keyword_of_the_cli_command():
    doc = inspect.getdoc(DiagnoseOptions) or ""
    attrs = doc.split("Attributes:", 1)[1]
    documented = set(re.findall(r"^    (\w+):", attrs, flags=re.M))
    fields = {f.name for f in dataclasses.fields(DiagnoseOptions)}
    assert fields == documented
    # the defaults reproduce the historical keyword defaults of diagnose()
    d = DiagnoseOptions()
    assert (d.family, d.delta, d.reduction, d.kinks, d.gram, d.products, d.checkpoint_every) == (
        "linear",
        None,
        "none",
        True,
        "auto",
        "float64",
        1,
    )
