"""Pilot of the KJV budget sweep: one seed, depths 1 and 4, the full configuration's sizes at 1,000 steps.

Run: OMP_NUM_THREADS=1 .venv/bin/python experiments/logs/pilot_kjv.py  (log: experiments/logs/pilot_kjv.log)
Reports train/test loss per depth (does the deeper model fit the training set better?) and the CPU
seconds of training and of the whole model (diagnosis on probe and training windows, cross-fit).
"""

import dataclasses
import time

import torch

from depthsat_theory.experiments import budget_sweep as B

torch.set_num_threads(1)
cfg = dataclasses.replace(
    B.KJV_CONFIGS["full"],
    depths=(1, 4),
    seeds=(0,),
    budget=dataclasses.replace(B.KJV_CONFIGS["full"].budget, steps=1000),
)
splits = B._load(cfg, 0)
print("sizes", splits.sizes(), flush=True)
for depth in cfg.depths:
    c0, w0 = time.process_time(), time.time()
    record, _ = B._one_model(cfg, splits, depth, 0)
    r = record["runs"][0]
    print(
        f"depth {depth}: train {r['train_loss']:.4f} val {r['val_loss']:.4f} test {r['test_loss']:.4f} nats/char, "
        f"train wall {r['train_wall_s']} s, model cpu {time.process_time() - c0:.1f} s wall {time.time() - w0:.1f} s",
        flush=True,
    )
