"""SmolLM2: one zero-output layer copy + continued pretraining, timed at two step counts in one process.

The difference of the two CPU times over the difference of the step counts is the CPU time of one step.
Usage: smollm2_unit_cost.py BATCH MAX_TOKENS POSITION STEPS_A,STEPS_B
"""

import json
import os
import sys
import time

import torch

from depthsat_theory.experiments import expand as E
from depthsat_theory.tasks.zoo import kjv_verses, token_loss_masked

torch.set_num_threads(1)
batch, tokens, position = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
counts = [int(x) for x in sys.argv[4].split(",")]
cfg = E.ExpandConfig("unit", "smollm2", 1, (0,), max(counts), batch, tokens, 12, 8, 8, 8, 2e-4)
c = time.process_time()
base, tok, _ = E._load(cfg)
load = time.process_time() - c
parts = E.split_verses(kjv_verses())
heldout = E._windows(tok, parts["heldout"], cfg.heldout_windows, cfg.eval_batch_size, 0, cfg)
out = {"batch": batch, "max_tokens": tokens, "position": position, "load_cpu_s": round(load, 1), "runs": []}
for n in counts:
    cfg_n = E.ExpandConfig("unit", "smollm2", 1, (0,), n, batch, tokens, 12, 8, 8, 8, 2e-4)
    train = E._windows(tok, parts["train"], n * batch, batch, 0, cfg_n)
    shape = [
        tuple(t.shape) for t in (train[0].values() if isinstance(train[0], dict) else train[0]) if hasattr(t, "shape")
    ]
    c = time.process_time()
    w = time.perf_counter()
    res = E._run_arm(base, token_loss_masked, [position], train, heldout, cfg_n, 0)
    out["runs"].append(
        {
            "steps": n,
            "cpu_s": round(time.process_time() - c, 2),
            "wall_s": round(time.perf_counter() - w, 1),
            "train_wall_s": res["train_seconds"],
            "batch_shapes": shape,
            "new_parameters": res["new_parameters"],
            "loss_before": res["loss_before"],
            "loss_after": res["loss_after"],
        }
    )
    print(json.dumps(out["runs"][-1]), flush=True)
a, b = out["runs"][0], out["runs"][-1]
out["cpu_s_per_step"] = round((b["cpu_s"] - a["cpu_s"]) / (b["steps"] - a["steps"]), 2)
out["loadavg"] = os.getloadavg()[0]
print(json.dumps(out), flush=True)
