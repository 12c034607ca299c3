"""KJV pilot at a lower learning rate: seed 0, 600 steps, depths 1 and 4 at lr 1e-3.

Run after the KJV sweep showed the train loss rising with depth at lr 3e-3 (training and train/test
loss only, no diagnosis).

Run: OMP_NUM_THREADS=1 .venv/bin/python experiments/logs/pilot_kjv_lr.py  (log: pilot_kjv_lr.log)
"""

import dataclasses
import time

import torch

from depthsat_theory.experiments import budget_sweep as B

torch.set_num_threads(1)
base = B.KJV_CONFIGS["full"]
splits = B._load(base, 0)
for lr in (1e-3,):
    cfg = dataclasses.replace(base, budget=dataclasses.replace(base.budget, lr=lr))
    for depth in (1, 4):
        c0 = time.process_time()
        model, fit = B._train(cfg, splits, depth, 0)
        m = B._metrics(model, splits, cfg.train_eval)
        print(
            f"lr {lr:g} depth {depth}: train {m['train_loss']:.4f} test {m['test_loss']:.4f} nats/char, "
            f"final running {fit['final_running_loss']:.4f}, cpu {time.process_time() - c0:.1f} s",
            flush=True,
        )
