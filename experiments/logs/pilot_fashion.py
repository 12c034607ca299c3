"""Pilot of the budget sweep: train and test loss against depth on Fashion-MNIST (argv: steps, width)."""

import sys
import time

import torch

from depthsat_theory.experiments import recipe as R
from depthsat_theory.tasks.models import classification_loss

torch.set_num_threads(1)
steps = int(sys.argv[1])
width = int(sys.argv[2])
sp = R.load_splits("fashion", 0, R.Sizes(train=None, val=4096, probe=8192, test=10000))
print("sizes", sp.sizes(), flush=True)
for depth in (1, 2, 4, 8):
    m = R.build_model("mlp", depth, sp, seed=0, width=width)
    t = time.process_time()
    fit = R.train_budget(m, sp.train.x, sp.train.y, classification_loss, seed=1, recipe=R.BudgetRecipe(steps=steps))
    cpu = time.process_time() - t
    tr = R.evaluate(m, R.Split(sp.train.x[:8192], sp.train.y[:8192]), sp)
    te = R.evaluate(m, sp.test, sp)
    print(
        f"width {width} depth {depth}: train {tr} test {te} cpu {cpu:.1f}s ({1000 * cpu / steps:.2f} ms/step) "
        f"wall {fit['wall_s']:.1f}",
        flush=True,
    )
