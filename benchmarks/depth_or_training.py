"""Depth or more training on an under-trained tiny GPT: ``diagnose(decision=True)`` against what training does.

The newcomer's case of theory/decision.md: the project's CharGPT (2 blocks × 64, KJV characters) stopped after
``--steps`` of its 300-step recipe, so every site reads *improvable*.  The script reports, per site, the plain
verdict, the stationarity score of the existing last map (``blocks.i.mlp.2``), the score beyond training and the
decision; then it checks the decision against the outcome: ``--more`` Adam steps on the existing weights, against
the same steps on the model grown by one zero-output block (a ReLU MLP of width 64) at each site in turn.

Usage (CPU, one thread: about 1.5 min with 32 probe windows, 6 min with 1024)::

    OMP_NUM_THREADS=1 python benchmarks/depth_or_training.py --steps 60 --more 60 --probe 1024

Nothing is written; the figures go to stdout.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

from depthsat_theory.diagnose import diagnose
from depthsat_theory.tasks.data import CharVocabulary, kjv_sequences, load_kjv_text
from depthsat_theory.tasks.models import CharGPT, token_loss
from depthsat_theory.tasks.training import train_gpt


class Grown(nn.Module):
    """``block`` followed by a zero-output residual MLP ``z + W₂ relu(W₁ z)`` (``W₂ = 0``)."""

    def __init__(self, block: nn.Module, d: int, width: int = 64):
        super().__init__()
        self.block = block
        self.new = nn.Sequential(nn.Linear(d, width), nn.ReLU(), nn.Linear(width, d))
        nn.init.zeros_(self.new[2].weight)
        nn.init.zeros_(self.new[2].bias)

    def forward(self, x):
        z = self.block(x)
        return z + self.new(z)


def train(model, windows, steps, *, start=0):
    """The project's gpt recipe (AdamW, OneCycle over 300 steps) on batches ``[start, start + steps)``."""
    train_gpt(model, windows, steps=steps, start=start)
    model.eval()


@torch.no_grad()
def probe_loss(model, x, y) -> float:
    return float(token_loss(model(x), y).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="training steps before the diagnosis (of 300)")
    ap.add_argument("--more", type=int, default=60, help="further steps: existing weights vs grown model")
    ap.add_argument("--probe", type=int, default=32, help="probe windows (64 characters each)")
    ap.add_argument("--seeds", type=int, default=1, help="initialisations of each grown block")
    ap.add_argument("--baseline", action="store_true", help="also time diagnose() without the decision")
    args = ap.parse_args()
    torch.manual_seed(0)
    vocab = CharVocabulary(load_kjv_text())
    windows = kjv_sequences(vocab, 300 * 32, 64, seed=0, split="train")
    probe = kjv_sequences(vocab, args.probe, 64, seed=1, split="probe")
    x, y = probe[:, :-1], probe[:, 1:]
    model = CharGPT(vocab.size, d_model=64, n_layers=2, n_heads=4, seq_len=64)
    train(model, windows, args.steps)
    m64 = copy.deepcopy(model).double().eval()
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, len(x), 8)]
    t0 = time.perf_counter()
    res = diagnose(m64, token_loss, batches, decision=True, kinks=False, description=f"CharGPT after {args.steps}")
    took = time.perf_counter() - t0
    print(f"probe loss after {args.steps} steps: {res.loss:.4f} nats/token-mean; diagnose(decision=True) {took:.1f} s")
    if args.baseline:
        t0 = time.perf_counter()
        diagnose(m64, token_loss, batches, kinks=False)
        print(f"diagnose() without the decision: {time.perf_counter() - t0:.1f} s")
    for sd in res.sites:
        st, bt = sd.stationarity, sd.beyond_training
        print(
            f"{sd.site}: verdict {sd.result.verdict.value}, s/AG_rms {sd.result.relative_score:.3f} "
            f"(noise ratio {sd.result.noise_ratio:.1f}); "
            + (
                "no decision inputs"
                if st is None
                else f"s_old/AG_rms {st.relative_score:.3f} (noise ratio {st.noise_ratio:.1f}, {st.verdict.value}), "
                f"s_beyond/AG_rms {bt.relative_score:.3f} (noise ratio {bt.noise_ratio:.2f}, {bt.verdict.value})"
            )
            + f" -> {sd.decision.value}"
        )
        print(f"    {sd.decision_reason}")
    if args.more:
        trained = copy.deepcopy(model)
        train(trained, windows, args.more, start=args.steps)
        line = [f"{args.more} more steps: existing weights {probe_loss(trained, x, y):.4f}"]
        for sd in res.sites:  # the same steps on the model grown by one zero-output block at each site in turn
            for seed in range(args.seeds):
                torch.manual_seed(100 + seed)
                grown = copy.deepcopy(model)
                i = int(sd.site.split(".")[1])
                grown.blocks[i] = Grown(grown.blocks[i], 64)
                train(grown, windows, args.more, start=args.steps)
                line.append(f"grown at {sd.site} (seed {seed}) {probe_loss(grown, x, y):.4f}")
        print(", ".join(line))


if __name__ == "__main__":
    main()
