"""Memory measurements at 12B's shape, on small models (run by tests/test_memory.py; prints `RESULT {json}` lines).

    grad_accum MODEL_DIR OUT        torchrun 2 ranks: bytes of gradients FSDP2 holds between the backwards of a
                                    4-micro-batch accumulation cycle, --gradient_sync backward vs step, and the
                                    resulting gradients vs a single-process reference
    load MODEL_DIR new|old [--kl] [--fsdp_version V] [--strategy S] [--lora_rank R]
                                    1 process or torchrun: peak RSS increase while building + loading + sharding the
                                    policy (policy.build_policy = new; from_pretrained on every rank = old), and
                                    the loaded weights vs the files
    export MODEL_DIR [--fsdp_version V]   torchrun: peak RSS increase per rank while gathering the export
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from fastvideo import distributed  # noqa: E402


def _rss_mib() -> float:
    from fastvideo.logging import current_memory_gb

    return current_memory_gb(torch.device("cpu")) * 1024


def _hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS) to the current RSS


def _result(obj: dict) -> None:
    print("RESULT " + json.dumps({"rank": distributed.get_rank(), **obj}), flush=True)


def _batch(config, n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens, text = 64, 16
    side = int(tokens ** 0.5)
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)),
                                     indexing="ij"), -1).reshape(-1, 3)
    return dict(hidden_states=torch.randn(n, tokens, config.in_channels, generator=g),
                encoder_hidden_states=torch.randn(n, text, config.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(n, config.pooled_projection_dim, generator=g),
                timestep=torch.rand(n, generator=g), guidance=torch.full((n,), 3.5),
                img_ids=ids, txt_ids=torch.zeros(text, 3), return_dict=False)


def _fsdp_grad_bytes(model) -> tuple[int, int]:
    """(bytes of unsharded gradients FSDP2 holds, bytes of sharded gradient shards) on this rank right now."""
    from torch.distributed.fsdp import FSDPModule

    unsharded = sharded = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                # sync off: fp32 params keep the unsharded param's .grad, bf16 ones an fp32 accumulated copy
                unsharded_param = getattr(fp, "_unsharded_param", None)
                for acc in (fp.unsharded_accumulated_grad,
                            unsharded_param.grad if unsharded_param is not None else None):
                    if acc is not None:
                        unsharded += acc.numel() * acc.element_size()
                grad = fp.sharded_param.grad
                if grad is not None:
                    local = grad._local_tensor if hasattr(grad, "_local_tensor") else grad
                    sharded += local.numel() * local.element_size()
    return unsharded, sharded


def grad_accum(model_dir: str, micro_batches: int = 4) -> None:
    from fastvideo.models.flux import load_transformer
    from fastvideo.parallel import set_gradient_sync, shard_model, transformer_blocks

    info = distributed.init_distributed("cpu")
    rank, world = info.rank, info.world_size
    per_rank = 2
    batches = [_batch(load_transformer(model_dir).config, per_rank * world, seed=10 + i) for i in range(micro_batches)]
    # single-process reference: the mean over micro-batches of the whole-batch losses
    ref = load_transformer(model_dir).train()
    for b in batches:
        (ref(**b)[0].square().mean() / micro_batches).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    full_bytes = 4 * sum(p.numel() for p in ref.parameters())
    unit_bytes = 4 * max(sum(p.numel() for p in b.parameters()) for b in transformer_blocks(ref))
    del ref

    results = {}
    for mode in ("backward", "step"):
        torch.manual_seed(0)
        model = shard_model(load_transformer(model_dir).train(), fsdp_version=2)
        peak_unsharded = peak_total = 0
        for i, b in enumerate(batches):
            local = {k: (v[rank * per_rank:(rank + 1) * per_rank] if torch.is_tensor(v) and k not in
                         ("img_ids", "txt_ids") else v) for k, v in b.items()}
            set_gradient_sync(model, mode == "backward" or i == micro_batches - 1)
            # each rank's loss is its share of the whole-batch mean; FSDP averages gradients over ranks
            (model(**local)[0].square().mean() / micro_batches).backward()
            if i < micro_batches - 1:  # between backwards of the cycle
                unsharded, sharded = _fsdp_grad_bytes(model)
                peak_unsharded = max(peak_unsharded, unsharded)
                peak_total = max(peak_total, unsharded + sharded)
        grads = full_state_dict_of_grads(model)
        max_err = 0.0
        if rank == 0:
            max_err = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
        results[mode] = {"peak_unsharded_bytes": peak_unsharded, "peak_grad_bytes": peak_total, "max_err": max_err,
                         "grads": grads}
        del model
    if rank == 0:
        step_vs_backward = max((results["step"]["grads"][n] - g).abs().max().item()
                               for n, g in results["backward"]["grads"].items())
    else:
        step_vs_backward = 0.0
    _result({"world": world, "full_fp32_grad_bytes": full_bytes, "unit_bytes": unit_bytes,
             "step_vs_backward": step_vs_backward,
             **{f"{m}_{k}": v for m, r in results.items() for k, v in r.items() if k != "grads"}})
    distributed.cleanup()


def full_state_dict_of_grads(model) -> dict[str, torch.Tensor]:
    """Full gradients (rank 0) of an FSDP2 model: every rank takes part in the gathers."""
    from torch.distributed.tensor import DTensor

    from fastvideo.parallel import clean_name

    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[clean_name(name)] = g.detach().clone()
    return out


def _policy_args(model_dir: str, fsdp_version: int = 2, strategy: str = "full", lora_rank: int = 0):
    return argparse.Namespace(pretrained_model_name_or_path=model_dir, lora_rank=lora_rank, lora_alpha=None,
                              lora_target_modules=None, seed=0, fsdp_version=fsdp_version,
                              fsdp_sharding_strategy=strategy, mixed_precision="fp32", use_cpu_offload=False,
                              gradient_checkpointing=False, compile=False, use_ema=False, ema_decay=0.99,
                              sp_size=1, attention_backend="auto")


def _max_diff_vs_file(sd: dict, model_dir: str) -> float:
    """Rank 0: largest |loaded - file| over every tensor (keys must match exactly)."""
    if not distributed.is_main_process():
        return 0.0
    from safetensors.torch import load_file

    files = sorted((Path(model_dir) / "transformer").glob("*.safetensors"))
    on_disk = {k: v for f in files for k, v in load_file(f).items()}
    sd = {k.replace(".base_layer.", "."): v for k, v in sd.items() if "lora_" not in k}
    assert set(on_disk) == set(sd), f"loaded keys differ from the file's: {sorted(set(on_disk) ^ set(sd))[:4]}"
    return max((sd[k].float() - v.float()).abs().max().item() for k, v in on_disk.items())


def load(model_dir: str, how: str, kl: bool, fsdp_version: int, strategy: str, lora_rank: int) -> None:
    from fastvideo import policy
    from fastvideo.parallel import full_state_dict

    info = distributed.init_distributed("cpu")
    from diffusers import FluxTransformer2DModel  # noqa: F401  (library code lands before the baseline)
    import peft  # noqa: F401

    args = _policy_args(model_dir, fsdp_version, strategy, lora_rank)
    distributed.barrier()
    baseline = _rss_mib()
    _reset_peak()
    if how == "new":
        policy = policy.build_policy(args, info.device, need_reference=kl)
        model = policy.model
    else:  # what build_policy did before: every rank loads the whole fp32 model, then shards it
        import copy

        from fastvideo.models.flux import load_transformer
        from fastvideo.parallel import shard_model

        model = load_transformer(model_dir, dtype=torch.float32, device="cpu").train()
        ref = copy.deepcopy(model).requires_grad_(False) if kl else None
        model = shard_model(model)
        if ref is not None:
            ref = shard_model(ref)
    peak = _hwm_mib() - baseline
    distributed.barrier()
    _result({"world": info.world_size, "how": how, "kl": kl, "peak_rss_increase_mib": peak,
             "max_abs_diff_vs_file": _max_diff_vs_file(full_state_dict(model), model_dir)})
    distributed.cleanup()


def export(model_dir: str, fsdp_version: int) -> None:
    """Peak RSS increase of each rank while gathering the full state dict for export (rank 0 keeps it)."""
    from fastvideo import policy
    from fastvideo.parallel import full_state_dict

    info = distributed.init_distributed("cpu")
    model = policy.build_policy(_policy_args(model_dir, fsdp_version), info.device, need_reference=False).model
    distributed.barrier()
    baseline = _rss_mib()
    _reset_peak()
    sd = full_state_dict(model)
    peak = _hwm_mib() - baseline
    distributed.barrier()
    _result({"fsdp_version": fsdp_version, "peak_rss_increase_mib": peak, "keys": len(sd),
             "max_abs_diff_vs_file": _max_diff_vs_file(sd, model_dir)})
    distributed.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("grad_accum", "load", "export"))
    parser.add_argument("model_dir")
    parser.add_argument("how", nargs="?", default="new", choices=("new", "old"))
    parser.add_argument("--kl", action="store_true")
    parser.add_argument("--fsdp_version", type=int, default=2)
    parser.add_argument("--strategy", default="full")
    parser.add_argument("--lora_rank", type=int, default=0)
    cli = parser.parse_args()
    if cli.command == "grad_accum":
        grad_accum(cli.model_dir)
    elif cli.command == "load":
        load(cli.model_dir, cli.how, cli.kl, cli.fsdp_version, cli.strategy, cli.lora_rank)
    else:
        export(cli.model_dir, cli.fsdp_version)
