"""Wan2.2 in the Wan family (fastvideo/models/wan.py) against the stock diffusers WanPipeline on the seeded tiny
presets: TI2V-5B's layout (``wan22-ti2v-tiny``: the 48-channel VAE that patchifies 2x2, a timestep per video token
under the pipeline's ``expand_timesteps``) sampled with CFG against the pipeline with the Euler scheduler, its VAE
round trip, its FLOP formula against torch's counter, and the real 5B config's size."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from fastvideo import flops, models
from fastvideo.models import wan, wan_presets

PROMPTS = ["a red cube rolling on a wooden table", "a cat jumping over a fence"]
TEXT_TOKENS = 32
H = W = 64
FRAMES = 5


def _tiny_layout(build, folder) -> dict:
    """A tiny Wan2.2 folder (``build(folder, seed=0)``), the stock pipeline with the Euler scheduler on its
    flow_shift, and the adapter's loads."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    folder = build(folder, seed=0)
    family = models.resolve("auto", folder)
    pipe = WanPipeline.from_pretrained(folder, local_files_only=True)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    pipe.set_progress_bar_config(disable=True)
    return {"folder": folder, "family": family, "pipe": pipe, "enc": family.load_text_encoders(folder),
            "transformer": family.load_transformer(folder), "vae": family.load_vae(folder),
            "geometry": family.latent_geometry(folder, H, W, FRAMES)}


def _cfg_loop(family, transformer, enc, geometry, noise, steps, scale, folder):
    """The adapter's CFG Euler loop on ``PROMPTS`` against the family's negative prompt: (latents, sigmas)."""
    cond, _ = family.encode_prompts(enc, PROMPTS, TEXT_TOKENS)
    uncond, _ = family.encode_prompts(enc, [family.defaults.negative_prompt] * 2, TEXT_TOKENS)
    rows = {"prompt_embeds": torch.cat([cond["prompt_embeds"], uncond["prompt_embeds"]])}
    shared = family.conditioning(geometry, rows, None, torch.device("cpu"))
    sigmas, x = family.sigmas(steps, geometry.seq_len, models.read_scheduler_config(folder)), noise
    for i in range(steps):
        v_cond, v_uncond = family.predict_velocity(transformer, torch.cat([x, x]), sigmas[i], rows, shared).chunk(2)
        x = x + (sigmas[i + 1] - sigmas[i]) * family.combine_guidance(v_cond, v_uncond, scale)
    return x, sigmas


@pytest.fixture(scope="session")
def ti2v(tmp_path_factory):
    """The tiny TI2V layout (``_tiny_layout``)."""
    return _tiny_layout(wan_presets.build_tiny_ti2v, tmp_path_factory.mktemp("tiny-ti2v") / "model")


def test_the_ti2v_layout_loads_with_a_timestep_per_token(ti2v, tmp_path):
    family, pipe, geometry = ti2v["family"], ti2v["pipe"], ti2v["geometry"]
    assert isinstance(family, wan.Wan) and pipe.config.expand_timesteps and pipe.transformer_2 is None
    assert pipe.vae.config.z_dim == 48 and pipe.vae.config.scale_factor_spatial == 16
    assert pipe.scheduler.config.shift == wan_presets.TI2V_FLOW_SHIFT == 5.0  # the Euler scheduler on its shift
    assert models.read_scheduler_config(ti2v["folder"])["flow_shift"] == 5.0
    assert wan.expands_timesteps(ti2v["transformer"].config)
    # a transformer/ folder inside the pipeline's is tagged from the pipeline's model_index.json too
    assert wan.expands_timesteps(family.build_transformer(ti2v["folder"] / "transformer").config)
    # 16x in space (the VAE's 2x2 patchify x 8), then the transformer's 2x2 patches: 32-pixel multiples
    assert geometry.latent_shape == (48, 2, 4, 4) and geometry.packed_shape == (2 * 2 * 2, 192)
    with pytest.raises(ValueError, match=r"multiple of 32 .*--h 32 or 64"):
        family.latent_geometry(ti2v["folder"], 48, W, FRAMES)
    real = wan_presets.write_config_ti2v(tmp_path / "ti2v-5b")
    model = family.build_transformer(real, torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == wan_presets.WAN22_TI2V_5B_TRANSFORMER_PARAMETERS
    assert wan.expands_timesteps(model.config)
    # its native 704 x 1280 x 121 frames: 31 latent frames of 22 x 40 patches
    assert family.latent_geometry(real, 704, 1280, 121).seq_len == 31 * 22 * 40
    kwargs = family.example_inputs(model.config, 2, 64, TEXT_TOKENS, torch.bfloat16, "meta")
    assert kwargs["timestep"].shape == (2, 64)  # the planner traces the per-token modulation


def test_adapter_euler_cfg_loop_equals_the_stock_pipeline(ti2v):
    family, pipe, geometry, steps, scale = ti2v["family"], ti2v["pipe"], ti2v["geometry"], 3, 5.0
    noise = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        videos = pipe(PROMPTS, negative_prompt="", latents=wan.unpack_video(noise, geometry),
                      num_inference_steps=steps, guidance_scale=scale, output_type="pt", height=H, width=W,
                      num_frames=FRAMES, max_sequence_length=TEXT_TOKENS).frames
        x, _ = _cfg_loop(family, ti2v["transformer"], ti2v["enc"], geometry, noise, steps, scale, ti2v["folder"])
        ours = family.decode(ti2v["vae"], x, geometry, micro_batch=2)
    diff = (ours - videos).abs().max().item() * 255
    print(f"sampling max |diff| x 255 = {diff:.3g}")
    assert ours.shape == videos.shape == (2, FRAMES, 3, H, W)
    assert diff < 1
    assert (videos[0] - videos[1]).abs().mean() > 0.02  # the prompt changes the video
    # the per-token timestep is what the pipeline passes: a scalar one differs in the last bits at most
    x0 = noise[:1]
    with torch.no_grad():
        one = {"prompt_embeds": family.encode_prompts(ti2v["enc"], PROMPTS[:1], TEXT_TOKENS)[0]["prompt_embeds"]}
        shared = family.conditioning(geometry, one, None, torch.device("cpu"))
        per_token = family.predict_velocity(ti2v["transformer"], x0, torch.tensor(0.6), one, shared)
        scalar_model = copy.deepcopy(ti2v["transformer"])
        scalar_model.register_to_config(_expand_timesteps=False)
        scalar = family.predict_velocity(scalar_model, x0, torch.tensor(0.6), one, shared)
    assert torch.allclose(per_token, scalar, atol=1e-4)


def test_the_48_channel_vae_round_trip(ti2v):
    family, vae, geometry = ti2v["family"], ti2v["vae"], ti2v["geometry"]
    videos = torch.rand(2, FRAMES, 3, H, W, generator=torch.Generator().manual_seed(1))
    latents = family.encode(vae, videos, geometry)
    assert latents.shape == (2, 8, 192) and latents.dtype == torch.float32
    with torch.no_grad():
        z = vae.encode(videos.permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, 48, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 48, 1, 1, 1)
    assert torch.allclose(wan.unpack_video(latents, geometry), (z - mean) / std, atol=1e-5)
    decoded = family.decode(vae, latents, geometry)
    assert decoded.shape == (2, FRAMES, 3, H, W) and 0 <= decoded.min() and decoded.max() <= 1


def test_ti2v_flops_equal_the_counter(ti2v):
    family, geometry = ti2v["family"], ti2v["geometry"]
    model = copy.deepcopy(ti2v["transformer"]).requires_grad_(True)
    batch, L = 2, geometry.seq_len
    x = torch.randn(batch, *geometry.packed_shape)
    cond = {"prompt_embeds": torch.randn(batch, TEXT_TOKENS, 32)}
    shared = family.conditioning(geometry, cond, None, torch.device("cpu"))
    with torch.no_grad():
        counted = flops.counted_flops(lambda: family.predict_velocity(model, x, torch.tensor(0.5), cond, shared))
    assert counted == family.transformer_flops(model.config, L, TEXT_TOKENS, batch)
    plain = {k: v for k, v in model.config.items() if k != "_expand_timesteps"}
    assert family.transformer_flops(plain, L, TEXT_TOKENS, batch) < counted  # the time MLP per token counts


# ------------------------------------------------------------------------------------------------ Wan2.2-T2V-A14B
@pytest.fixture(scope="session")
def a14b(tmp_path_factory):
    """The tiny two-expert layout (``_tiny_layout``)."""
    return _tiny_layout(wan_presets.build_tiny_a14b, tmp_path_factory.mktemp("tiny-a14b") / "model")


def test_a14b_sampling_switches_experts_as_the_stock_pipeline(a14b):
    """4 steps on the shift-3 grid (timesteps 1000, 858, 602, 9): the first, at or above the boundary (875), runs
    ``transformer``, the others ``transformer_2``; the videos equal WanPipeline's (guidance_scale_2 =
    guidance_scale, its default)."""
    family, pipe, geometry, steps, scale = a14b["family"], a14b["pipe"], a14b["geometry"], 4, 5.0
    noise = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(0))
    calls = []
    for name in ("transformer", "transformer_2"):
        getattr(a14b["transformer"], name).register_forward_pre_hook(
            lambda m, a, k, name=name: calls.append((name, float(k["timestep"][0]))), with_kwargs=True)
    with torch.no_grad():
        videos = pipe(PROMPTS, negative_prompt="", latents=wan.unpack_video(noise, geometry),
                      num_inference_steps=steps, guidance_scale=scale, output_type="pt", height=H, width=W,
                      num_frames=FRAMES, max_sequence_length=TEXT_TOKENS).frames
        x, sigmas = _cfg_loop(family, a14b["transformer"], a14b["enc"], geometry, noise, steps, scale,
                              a14b["folder"])
        ours = family.decode(a14b["vae"], x, geometry, micro_batch=2)
    expected = ["transformer" if float(s) * 1000 >= 875 else "transformer_2" for s in sigmas[:-1]]
    assert [name for name, _ in calls] == expected == ["transformer"] + ["transformer_2"] * 3, calls
    diff = (ours - videos).abs().max().item() * 255
    print(f"sampling max |diff| x 255 = {diff:.3g}")
    assert diff < 1
    # one expert alone would sample other videos: the switch matters
    with torch.no_grad():
        alone, _ = _cfg_loop(family, a14b["transformer"].transformer, a14b["enc"], geometry, noise, steps, scale,
                             a14b["folder"])
    assert (family.decode(a14b["vae"], alone, geometry) - videos).abs().max() > 0.02


def test_a14b_routes_each_sample_by_its_timestep(a14b):
    """A batch that mixes both sides of the boundary (the boundary itself is high noise, as the pipeline's
    ``t >= boundary_timestep``) equals each sample through its own expert, in the batch's order."""
    model, geometry = a14b["transformer"], a14b["geometry"]
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(4, 16, *geometry.latent_shape[1:], generator=generator)
    text = torch.randn(4, TEXT_TOKENS, 32, generator=generator)
    t = torch.tensor([500.0, 875.0, 874.9, 990.0])
    with torch.no_grad():
        out = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        for i, expert in enumerate([model.transformer_2, model.transformer, model.transformer_2, model.transformer]):
            alone = expert(hidden_states=x[i:i + 1], timestep=t[i:i + 1], encoder_hidden_states=text[i:i + 1],
                           return_dict=False)[0]
            assert torch.allclose(out[i:i + 1], alone, atol=1e-6), i
    with pytest.raises(ValueError, match=r"a timestep per sample, shape \(B,\)"):
        model(hidden_states=x, timestep=t[:, None].expand(4, 8), encoder_hidden_states=text)


def test_a14b_exports_load_in_the_stock_pipeline(a14b, tmp_path):
    """LoRA on both experts exports as final/ (``transformer``) and final/transformer_2/ (``load_lora_weights(...,
    load_into_transformer_2=True)``); the pipeline with both equals our adapted model, and sample.py's loader reads
    both back. A full export writes both experts' folders, which ``from_pretrained`` loads."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from fastvideo.lora import add_lora, load_lora_from_diffusers, save_lora_for_diffusers, \
        save_transformer_for_diffusers

    family, folder, geometry = a14b["family"], a14b["folder"], a14b["geometry"]
    model = add_lora(family.load_transformer(folder), rank=4, alpha=8, target_modules=list(family.lora_target_modules),
                     init_seed=0)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    adapted = {n.split(".")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == {"transformer", "transformer_2"}
    out = save_lora_for_diffusers(model, tmp_path / "lora", family=family)
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    assert (out / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()
    pipeline = WanPipeline.from_pretrained(folder, local_files_only=True)
    pipeline.load_lora_weights(out)
    pipeline.load_lora_weights(out / "transformer_2", load_into_transformer_2=True)
    reloaded = load_lora_from_diffusers(family.load_transformer(folder), out)
    x = torch.randn(3, *geometry.latent_shape, generator=generator)
    text = torch.randn(3, TEXT_TOKENS, 32, generator=generator)
    t = torch.tensor([950.0, 300.0, 880.0])
    with torch.no_grad():
        ours = model(hidden_states=x, timestep=t, encoder_hidden_states=text)[0]
        base = a14b["transformer"](hidden_states=x, timestep=t, encoder_hidden_states=text)[0]
        for i, expert in enumerate([pipeline.transformer, pipeline.transformer_2, pipeline.transformer]):
            stock = expert(hidden_states=x[i:i + 1], timestep=t[i:i + 1], encoder_hidden_states=text[i:i + 1],
                           return_dict=False)[0]
            assert torch.allclose(stock, ours[i:i + 1], atol=1e-5), i
        assert torch.allclose(reloaded(hidden_states=x, timestep=t, encoder_hidden_states=text)[0], ours, atol=1e-5)
    assert (ours - base).abs().max() > 0.05

    full = family.load_transformer(folder)
    with torch.no_grad():
        full.transformer_2.proj_out.bias.add_(0.5)
    save_transformer_for_diffusers(full, None, tmp_path / "full", family=family)
    high = WanTransformer3DModel.from_pretrained(tmp_path / "full")
    low = WanTransformer3DModel.from_pretrained(tmp_path / "full" / "transformer_2")
    assert torch.equal(low.proj_out.bias, full.transformer_2.proj_out.bias)
    assert torch.equal(high.proj_out.bias, full.transformer.proj_out.bias)
    assert "_boundary_timestep" not in json.loads((tmp_path / "full" / "config.json").read_text())


def test_a14b_routing_under_fsdp_on_two_ranks_that_disagree(a14b):
    """tests/dist_scripts/experts_checks.py on 2 ranks: rank 0's samples all above the boundary and rank 1's all
    below (then a mixed batch beside a high-noise one): the FSDP2-sharded LoRA model's outputs equal the unsharded
    ones and its gradients (FSDP's mean over ranks) equal the two ranks' by-hand mean, in both experts (~8 s)."""
    from helpers import REPO, run_torchrun

    proc = run_torchrun([str(REPO / "tests" / "dist_scripts" / "experts_checks.py"), str(a14b["folder"])])
    line = next(l for l in proc.stdout.splitlines() if l.startswith("EXPERTS_CHECKS "))
    rows = json.loads(line.split(" ", 1)[1])
    for call, row in rows.items():
        assert row["experts_with_grad"] == ["transformer", "transformer_2"], (call, row)
        assert row["output_max_diff"] < 1e-5, (call, row)
        # fp32 sums of ~1e-2 gradients in another order: ~1e-9 apart (measured 7e-9); mixed shards would be ~1e-2
        assert row["grad_max"] > 1e-3 and row["grad_max_diff"] < 1e-6, (call, row)


def _train(folder, root, name, *extra, nproc=2):
    """preprocess (once per folder) then GRPO, 1 step at 64 x 64 x 5 frames with CFG 5 on ``nproc`` ranks."""
    from helpers import run_torchrun

    from fastvideo.logging import read_metrics

    emb = root / f"{folder.parent.name}-emb"
    if not (emb / "manifest.json").is_file():
        prompts = root / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS + ["a dog running on a beach", "two birds flying"]) + "\n")
        run_torchrun(["preprocess_embeddings.py", "--model_path", str(folder), "--prompt_file", str(prompts),
                      "--output_dir", str(emb), "--max_sequence_length", "16", "--negative_prompt", "",
                      "--device", "cpu"], nproc=1)
    out = root / name
    run_torchrun(["train_grpo_flux.py", "--pretrained_model_name_or_path", str(folder), "--data_json_path",
                  str(emb / "manifest.json"), "--output_dir", str(out), "--device", "cpu", "--h", str(H), "--w",
                  str(W), "--num_frames", str(FRAMES), "--sampling_steps", "4", "--num_generations", "4",
                  "--prompts_per_step", "2", "--rollout_batch_size", "4", "--train_batch_size", "2",
                  "--timestep_fraction", "0.7", "--timestep_selection", "random", "--reward",
                  "jpeg_compressibility:1.0", "--learning_rate", "1e-2", "--seed", "3", "--no-progress_bar",
                  "--max_train_steps", "1", "--cfg_scale", "5", *extra], nproc=nproc)
    return out, read_metrics(out / "metrics.jsonl")


# the two Wan2.2 layouts through a real trainer on 2 ranks (~45 s): slow; their velocity calls, exports and FSDP
# routing are checked in the default tier above, and the pretend-CUDA harness traces every trainer on both
@pytest.mark.slow(cover="test_family_wan22.py::test_a14b_routing_under_fsdp_on_two_ranks_that_disagree", cost_s=45)
def test_wan22_grpo_on_two_ranks_starts_on_policy_and_exports_what_the_pipeline_loads(a14b, ti2v, tmp_path):
    """GRPO with LoRA on both A14B experts (random trained timesteps: a micro-batch's samples on both sides of the
    boundary): ratio 1 at the first update, both experts' exports load in WanPipeline and change its videos; a full
    fine-tune of the high-noise expert leaves the low-noise one exactly as loaded; TI2V's LoRA run starts on-policy."""
    from diffusers import WanPipeline, WanTransformer3DModel
    from safetensors.torch import load_file

    out, rows = _train(a14b["folder"], tmp_path, "a14b-lora", "--lora_rank", "4")
    assert len(rows) == 1 and rows[0]["ratio_first_update_max_dev"] < 1e-5, rows[0]
    lora_files = [out / "final" / "pytorch_lora_weights.safetensors",
                  out / "final" / "transformer_2" / "pytorch_lora_weights.safetensors"]
    for file in lora_files:  # both experts trained: their lora_B moved off zero
        assert max(float(t.abs().max()) for k, t in load_file(file).items() if "lora_B" in k) > 0, file
    pipe = WanPipeline.from_pretrained(a14b["folder"], local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt=PROMPTS[0], negative_prompt="", num_inference_steps=4, guidance_scale=5.0, output_type="pt",
                height=H, width=W, num_frames=FRAMES, max_sequence_length=16,
                latents=torch.randn(1, *a14b["geometry"].latent_shape, generator=torch.Generator().manual_seed(3)))
    before = pipe(**call).frames
    pipe.load_lora_weights(out / "final")
    pipe.load_lora_weights(out / "final" / "transformer_2", load_into_transformer_2=True)
    assert (pipe(**call).frames - before).abs().max() > 1e-3

    out, rows = _train(a14b["folder"], tmp_path, "a14b-full-high", "--lora_rank", "0", "--train_experts", "high",
                       nproc=1)
    assert rows[0]["ratio_first_update_max_dev"] < 1e-5
    for sub, moved in (("", True), ("transformer_2", False)):
        exported = WanTransformer3DModel.from_pretrained(out / "final" / sub)
        base = getattr(a14b["transformer"], sub or "transformer")
        same = all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), base.state_dict().values()))
        assert same != moved, sub

    out, rows = _train(ti2v["folder"], tmp_path, "ti2v-lora", "--lora_rank", "4")
    assert len(rows) == 1 and rows[0]["ratio_first_update_max_dev"] < 1e-5, rows[0]
    pipe = WanPipeline.from_pretrained(ti2v["folder"], local_files_only=True)
    pipe.load_lora_weights(out / "final")


def test_a14b_plan_holds_a_stand_in_row_of_the_other_expert(a14b):
    """The planner (GRPO, LoRA, world size 8) adds one row's activations of an expert beside the micro-batch's: a
    rank whose rows all belong to one expert runs the other on a stand-in row when another rank needs it, and both
    graphs live until the backward."""
    from fastvideo.memory import plan_grpo
    from fastvideo.objectives import parse_grpo_args, validate_grpo

    args = parse_grpo_args(["--pretrained_model_name_or_path", str(a14b["folder"]), "--dry_run", "--h", str(H),
                            "--w", str(W), "--num_frames", str(FRAMES), "--lora_rank", "4", "--cfg_scale", "5",
                            "--train_batch_size", "1", "--prompts_per_step", "8", "--num_generations", "4"])
    plan = plan_grpo(args, validate_grpo(args, 8), 8, "cuda")
    items = {i.name: i for i in plan.items}
    stand_in = items["experts: one stand-in row through the other expert"]
    trained = next(i for name, i in items.items() if name.startswith("activations, micro-batch of 2"))
    assert stand_in.phase == "train" and 0 < stand_in.device < trained.device  # one row of the CFG pair's two
