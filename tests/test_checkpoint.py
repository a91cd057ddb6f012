"""fastvideo.checkpoint: atomic save/resume, checkpoint discovery and pruning, the sharded EMA."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from fastvideo.checkpoint import (EMA, checkpoint_path, latest_checkpoint, list_checkpoints, load_checkpoint,
                                  prune_checkpoints, save_checkpoint)
from fastvideo.lora import add_lora
from fastvideo.parallel import full_state_dict


def tiny_transformer(lora: bool = False):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                   guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    if lora:
        add_lora(model, rank=2, alpha=4, init_seed=0)
    return model


def training_state(lora: bool = False, perturb: int | None = None):
    model = tiny_transformer(lora)
    if perturb is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(perturb)) * 0.1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    return model, opt, sched, EMA(model, 0.9)


def train_step(model, opt, sched, ema, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    out = model(hidden_states=torch.randn(2, 16, 16, generator=g),
                encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
                pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.rand(2, generator=g),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3), guidance=torch.full((2,), 3.5),
                return_dict=False)[0]
    out.square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    ema.update()


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("lora", [False, True])
def test_resume_continues_bit_identically_world_size_one(tmp_path, lora):
    model, opt, sched, ema = training_state(lora)
    train_step(model, opt, sched, ema, 0)
    train_step(model, opt, sched, ema, 1)
    straight, straight_ema = weights(model), [t.clone() for t in ema.shadow]

    model, opt, sched, ema = training_state(lora)
    train_step(model, opt, sched, ema, 0)
    saved_rng = torch.get_rng_state()
    next_draw = torch.rand(8)  # what the saved RNG state draws next
    with warnings.catch_warnings(record=True) as caught:  # one process, no process group: DCP's notice is silenced
        warnings.simplefilter("always")
        path = save_checkpoint(checkpoint_path(tmp_path, 1), model=model, optimizer=opt, lr_scheduler=sched, ema=ema,
                               extra={"step": 1, "sampler": {"position": 7}, "rng": saved_rng})
    assert not [w for w in caught if issubclass(w.category, UserWarning)], [str(w.message) for w in caught]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["trainable_only"] is lora and meta["has_ema"] and meta["step"] == 1
    assert latest_checkpoint(tmp_path) == path == tmp_path / "checkpoints" / "step-1"

    model, opt, sched, ema = training_state(lora, perturb=3)  # reseeds: the global RNG is back at the saved state
    torch.rand(100)  # ... so move it on: only the checkpoint can give the saved state back now
    assert not torch.equal(torch.get_rng_state(), saved_rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = load_checkpoint(path, model=model, optimizer=opt, lr_scheduler=sched, ema=ema)
    assert not [w for w in caught if issubclass(w.category, UserWarning)], [str(w.message) for w in caught]
    assert extra["step"] == 1 and extra["sampler"] == {"position": 7} and torch.equal(extra["rng"], saved_rng)
    torch.set_rng_state(extra["rng"])
    assert torch.equal(torch.rand(8), next_draw)  # the restored state continues the saved run's draws
    assert sched.last_epoch == 1 and ema.num_updates == 1
    train_step(model, opt, sched, ema, 1)
    resumed = weights(model)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, straight_ema))


def test_lora_checkpoint_holds_only_the_adapter(tmp_path):
    model, opt, sched, ema = training_state(lora=True)
    train_step(model, opt, sched, ema, 0)
    path = save_checkpoint(checkpoint_path(tmp_path, 1), model=model, optimizer=opt, extra={"step": 1})
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(path / "state")).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)
    full, full_opt, _, _ = training_state(lora=False)
    with pytest.raises(ValueError, match="LoRA settings"):
        load_checkpoint(path, model=full, optimizer=full_opt)
    full_path = save_checkpoint(checkpoint_path(tmp_path, 2), model=full, optimizer=full_opt, extra={})
    with pytest.raises(ValueError, match="missing .*lora_A"):  # a full fine-tune checkpoint into a LoRA model
        load_checkpoint(full_path, model=model, optimizer=opt)


def test_failed_save_leaves_the_previous_checkpoint_and_no_leftovers(tmp_path, monkeypatch):
    model, opt, sched, ema = training_state()
    train_step(model, opt, sched, ema, 0)
    good = save_checkpoint(checkpoint_path(tmp_path, 1), model=model, optimizer=opt, extra={"step": 1})

    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def crash_on_ema(state, *args, **kwargs):
        if "ema" in state:
            raise RuntimeError("simulated I/O failure")
        return real_save(state, *args, **kwargs)

    monkeypatch.setattr(dcp, "save", crash_on_ema)
    with pytest.raises(RuntimeError, match="simulated"):
        save_checkpoint(checkpoint_path(tmp_path, 2), model=model, optimizer=opt, ema=ema, extra={"step": 2})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-1"]  # the partial save is removed
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(FileNotFoundError, match="latest_checkpoint"):
        load_checkpoint(tmp_path / "checkpoints" / "step-2", model=model, optimizer=opt)


def test_latest_and_prune(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (5, 20, 100, 30):
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}" / "meta.json").write_text("{}")
    (root / "step-200").mkdir()  # no meta.json: incomplete
    (root / "step-300.tmp-abcd").mkdir()  # an interrupted save
    (root / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == root / "step-100"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-5", "step-20", "step-30", "step-100"]
    assert latest_checkpoint(tmp_path / "nowhere") is None
    removed = prune_checkpoints(tmp_path, total_limit=0)  # 0 / None keep every checkpoint, drop stale tmp dirs
    assert [p.name for p in removed] == ["step-300.tmp-abcd"] and len(list_checkpoints(tmp_path)) == 4
    removed = prune_checkpoints(tmp_path, total_limit=2)
    assert sorted(p.name for p in removed) == ["step-20", "step-5"]
    assert sorted(p.name for p in root.iterdir()) == ["notes", "step-100", "step-200", "step-30"]


def test_load_errors(tmp_path):
    model, opt, _, _ = training_state()
    with pytest.raises(FileNotFoundError, match="meta.json"):
        load_checkpoint(tmp_path / "checkpoints" / "step-9", model=model, optimizer=opt)
    with pytest.raises(ValueError, match="step-<N>"):
        save_checkpoint(tmp_path / "final", model=model, optimizer=opt, extra={})


def test_ema_math_swap_and_state_dict():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="--ema_decay"):
        EMA(model, 1.0)
    ema = EMA(model, decay=0.75, warmup=False)
    assert ema.names == ["weight"]
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update()
    expected = 0.75 * start + 0.25 * model.weight.detach()
    assert torch.allclose(ema.shadow[0], expected)
    live = model.weight.detach().clone()
    with ema.swap_into(model):
        assert torch.equal(model.weight, ema.shadow[0])
    assert torch.equal(model.weight, live)
    state = ema.state_dict()
    other = EMA(model, decay=0.75, warmup=False)
    other.load_state_dict(state)
    assert torch.equal(other.shadow[0], ema.shadow[0]) and other.num_updates == 1
    with pytest.raises(ValueError, match="different model"):
        with other.swap_into(torch.nn.Linear(3, 2)):
            pass


def test_ema_warmup_schedule_follows_the_weights_early():
    """Warm-up decay min(decay, (1+t)/(10+t)): after 300 constant-decay-0.995 updates ~22% of the base weights remain
    in the EMA; with the warm-up it is ~0.995^300 * (prefix product) < 3%. The counter that drives it round-trips."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    warm, const = EMA(model, decay=0.995), EMA(model, decay=0.995, warmup=False)
    with torch.no_grad():
        model.weight.fill_(1.0)  # the trained weights moved away from the base (0) at once
    decays = []
    for _ in range(300):
        decays.append(warm.current_decay())
        warm.update()
        const.update()
    assert decays[:3] == pytest.approx([1 / 10, 2 / 11, 3 / 12]) and decays[-1] == pytest.approx(300 / 309)
    base_share_const = 1 - const.shadow[0].item()
    base_share_warm = 1 - warm.shadow[0].item()
    assert base_share_const == pytest.approx(0.995 ** 300, rel=1e-4) and base_share_const > 0.2
    assert base_share_warm < 0.03
    other = EMA(model, decay=0.995)
    other.load_counters(warm.counters())
    assert other.current_decay() == warm.current_decay() == pytest.approx(301 / 310)
    other.num_updates = 5000
    assert other.current_decay() == 0.995  # the bound once (1+t)/(10+t) exceeds it


@pytest.fixture(scope="module")
def dist(tiny_flux_dir, tmp_path_factory):
    from dist_scripts.c1_launch import dist_results

    return dist_results(tiny_flux_dir, tmp_path_factory)


def test_sharded_checkpoints(dist):
    """torchrun 2 ranks, FSDP2 and FSDP1, full fine-tune and LoRA: save -> load into a fresh sharded model +
    optimizer restores identical params, optimizer state, scheduler and EMA, and 2 steps straight == 1 + save/load +
    1 bit for bit; the sharded EMA equals an unsharded EMA; an FSDP2 checkpoint loads into FSDP1
    (tests/dist_scripts/checkpoint_checks.py)."""
    # 2 FSDP versions x (resume full, resume LoRA, EMA) + the shard_grad_op/offload resume + the FSDP2->FSDP1 load
    dist.assert_section_ok("checkpoint", expected=8)


def test_sharded_checkpoint_resumes_in_a_single_process(dist, tiny_flux_dir):
    """DCP reshards: the 2-rank FSDP2 LoRA checkpoint loads into an unsharded model (world size 1)."""
    from diffusers import FluxTransformer2DModel

    path = dist.work_dir / "cross" / "checkpoints" / "step-1"
    expected = torch.load(dist.work_dir / "cross_expected.pt")
    model = FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer", local_files_only=True)
    add_lora(model, rank=4, alpha=8, init_seed=123)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    ema = EMA(model, 0.9)
    extra = load_checkpoint(path, model=model, optimizer=opt, ema=ema)
    assert extra == {"step": 1}
    got = full_state_dict(model)
    assert all(torch.equal(got[k], v) for k, v in expected["params"].items())
    with ema.swap_into(model):
        got_ema = full_state_dict(model, trainable_only=True)
    assert set(got_ema) == set(expected["ema"])
    assert all(torch.equal(got_ema[k], v) for k, v in expected["ema"].items())


def test_unstepped_adam_state_is_what_a_first_step_creates():
    """``fill_unstepped_adam_state`` gives parameters without a gradient so far (Qwen-Image's unused last text
    branch) Adam's initial state, so checkpoints hold every parameter: the state changes nothing (a later first step
    from it equals a first step from no state), and parameters already stepped keep theirs."""
    import copy

    from fastvideo.checkpoint import fill_unstepped_adam_state

    torch.manual_seed(0)
    used, unused = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW([*used.parameters(), *unused.parameters()], lr=0.1, weight_decay=0.01)
    used(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    stepped = {k: v.clone() for k, v in opt.state[used.weight].items()}
    twin = copy.deepcopy(unused)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1, weight_decay=0.01)
    assert fill_unstepped_adam_state(opt) == 2 and fill_unstepped_adam_state(opt) == 0
    assert all(torch.equal(opt.state[used.weight][k], v) for k, v in stepped.items())
    assert float(opt.state[unused.weight]["step"]) == 0 and not opt.state[unused.weight]["exp_avg"].any()
    x = torch.randn(5, 3)
    for model, optimizer in ((unused, opt), (twin, twin_opt)):
        optimizer.zero_grad()
        model(x).square().sum().backward()
        optimizer.step()
    assert torch.equal(unused.weight, twin.weight) and torch.equal(unused.bias, twin.bias)
