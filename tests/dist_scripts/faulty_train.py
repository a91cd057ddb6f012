"""Run a trainer with a fault injected, for the reliability tests (under torchrun or alone).

    FAULT=nan_reward python faulty_train.py train_grpo_flux.py ARGS...   # every reward component of the 2nd sample
                                                                         # of each rank's batch is NaN
    FAULT=inf_grad python faulty_train.py train_nft.py ARGS...           # every gradient norm is inf
    FAULT=kill_at_meta:N python faulty_train.py ...  # SIGKILL rank 0 as it writes the N-th checkpoint's meta.json
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

fault = os.environ["FAULT"]
if fault == "nan_reward":
    import fastvideo.rewards as rewards

    build = rewards.build_reward

    def build_nan_reward(*args, **kwargs):  # each component's scorer returns NaN for the 2nd image: RewardFn sees it
        reward_fn = build(*args, **kwargs)

        def nan_on_second(scorer):
            def score(images, prompts):
                out = scorer(images, prompts)
                values = out if isinstance(out, dict) else {"score": out}
                bad = torch.arange(len(prompts)) == 1
                values = {k: torch.where(bad.to(v.device), torch.nan, v.float()) for k, v in values.items()}
                return values if isinstance(out, dict) else values["score"]
            return score

        reward_fn.components = [(name, weight, nan_on_second(scorer)) for name, weight, scorer in reward_fn.components]
        return reward_fn

    rewards.build_reward = build_nan_reward
elif fault == "inf_grad":
    import fastvideo.parallel as parallel

    clip = parallel.clip_grad_norm
    parallel.clip_grad_norm = lambda model, max_norm: clip(model, max_norm) * float("inf")
elif fault.startswith("kill_at_meta:"):
    import signal

    import fastvideo.checkpoint as checkpoint

    write_json, calls = checkpoint._write_json, []

    def write_json_or_die(path, obj):
        if path.name == "meta.json":
            calls.append(path)
            if len(calls) == int(fault.split(":")[1]):
                os.kill(os.getpid(), signal.SIGKILL)
        write_json(path, obj)

    checkpoint._write_json = write_json_or_die
else:
    raise SystemExit(f"unknown FAULT={fault}")

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(str(REPO / script), run_name="__main__")
