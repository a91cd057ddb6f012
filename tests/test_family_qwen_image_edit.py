"""The Qwen-Image-Edit edit family (fastvideo/models/qwen_image_edit.py) against the stock diffusers
QwenImageEditPipeline on the seeded tiny folder: the folder and auto-detection, the stored rows (prompt embeddings
that see the source through the VLM, the packed source latents), one velocity over the target's and the source's
grids, the ODE end point with and without true CFG (the negative prompt encoded with each source), the edit store's
per-example negative rows, the vision-token count the planner uses, and the LoRA export in the stock pipeline.
Default tier, ~15 s; the trainers on it: tests/test_editing.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastvideo import models
from fastvideo.lora import save_lora_for_diffusers
from fastvideo.models import qwen_image_edit as qe
from fastvideo.rollout import guided_velocity
from helpers import random_lora

PROMPTS = ["make the red circle blue", "remove the square"]
MSL = 16
PLUS_MSL = 32  # the Plus text adds "Picture 1: " (and "Picture 2: ") before the instruction
SIZE = 64  # the tiny preset's target size; the sources are 48 x 64 (another grid than the target's)
SOURCE_HW = (48, 64)


@pytest.fixture(scope="module")
def folder(tiny_preset) -> Path:
    return tiny_preset("qwen-image-edit-tiny")


@pytest.fixture(scope="module")
def family() -> qe.QwenImageEdit:
    return models.resolve("qwen-image-edit")


@pytest.fixture(scope="module")
def pipe(folder):
    from diffusers import QwenImageEditPipeline

    pipeline = QwenImageEditPipeline.from_pretrained(folder, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture
def source_size(monkeypatch):
    """The stock pipeline resizes every source to a 1024² area (``calculate_dimensions``); at the tiny size it keeps
    the source's own, as an edit store made with --edit_size does (the one change to the stock call)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    h, w = SOURCE_HW
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: (w, h, None))


@pytest.fixture(scope="module")
def parts(folder, family):
    vae = family.load_vae(folder)
    return {"enc": family.load_text_encoders(folder), "transformer": family.load_transformer(folder), "vae": vae,
            "geometry": models.geometry_for(family, vae, SIZE, SIZE, condition=SOURCE_HW)}


@pytest.fixture(scope="module")
def sources() -> list[Image.Image]:
    """Two 64 x 48 RGB sources with structure (a gradient and a block), not noise."""
    h, w = SOURCE_HW
    out = []
    for k in range(2):
        a = np.zeros((h, w, 3), dtype=np.uint8)
        a[..., 0] = np.linspace(0, 255, w)[None, :].astype(np.uint8)
        a[..., 1] = 60 + 100 * k
        a[8:20, 10 + 12 * k:26 + 12 * k, 2] = 230
        out.append(Image.fromarray(a))
    return out


def _tensor(images: list[Image.Image]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.asarray(i, dtype=np.float32) / 255).permute(2, 0, 1) for i in images])


def test_stock_pipeline_loads_the_tiny_folder_and_auto_finds_the_edit_family(folder, pipe, family, tmp_path):
    assert type(pipe).__name__ == "QwenImageEditPipeline" and type(pipe.processor).__name__ == "Qwen2VLProcessor"
    assert models.resolve("auto", folder) is family and family.edit and family.negative_sees_source
    files = lambda root: {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}  # noqa: E731
    assert files(qe.build_tiny(tmp_path / "again", seed=0)) == files(folder)
    assert models.family_of(family.load_transformer(folder)) is family  # the tag, not the (Qwen-Image) class


def test_stored_rows_see_the_source_and_equal_the_pipelines(pipe, parts, family, sources):
    images = _tensor(sources)
    rows, truncated = family.encode_edits(parts["enc"], parts["vae"], images, PROMPTS, MSL)
    assert set(rows) == set(family.embedding_keys) and truncated == [False, False]
    with torch.no_grad():
        pe, pm = pipe.encode_prompt(PROMPTS, image=sources)
        pixels = pipe.image_processor.preprocess(sources, *SOURCE_HW).unsqueeze(2)
        _, image_latents = pipe.prepare_latents(pixels, 2, 16, SIZE, SIZE, torch.float32, torch.device("cpu"),
                                                torch.Generator().manual_seed(0))
    vision = qe.vision_tokens(*SOURCE_HW, qe.TINY_PROCESSOR_CONFIG)
    assert vision == 4  # 48 x 64 -> smart_resize 56 x 56 -> 4 x 4 patches -> 2 x 2 merged tokens
    assert rows["prompt_embeds"].shape == (2, vision + MSL, 32)  # rows padded to the vision tokens + MSL
    n = pe.shape[1]
    assert torch.equal(rows["prompt_embeds"][:, :n], pe) and not rows["prompt_embeds"][:, n:].any()
    assert torch.equal(rows["prompt_embeds_mask"][:, :n], pm) and not rows["prompt_embeds_mask"][:, n:].any()
    ids = parts["enc"].processor(text=[qe.EDIT_TEMPLATE.format(PROMPTS[0])], images=sources[:1]).input_ids[0]
    assert parts["enc"].tokenizer.decode(ids[qe.EDIT_TEMPLATE_DROP]) == "<|vision_start|>"  # the kept rows' start
    assert rows["image_latents"].shape == image_latents.shape == (2, parts["geometry"].condition_tokens, 64)
    assert torch.allclose(rows["image_latents"], image_latents, atol=1e-6)
    other, _ = family.encode_edits(parts["enc"], parts["vae"], images.flip(0), PROMPTS, MSL)
    assert (other["prompt_embeds"] - rows["prompt_embeds"]).abs().max() > 1e-3  # the VLM sees the source


def test_velocity_is_the_target_rows_of_one_call_over_both_grids(parts, family, sources):
    geometry, model = parts["geometry"], parts["transformer"]
    rows, _ = family.encode_edits(parts["enc"], parts["vae"], _tensor(sources), PROMPTS, MSL)
    rows = family.collate(rows)
    x = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(1))
    shared = family.conditioning(geometry, rows, None, torch.device("cpu"))
    assert shared["img_shape"] == (1, 8, 8) and shared["source_shapes"] == [(1, 6, 8)]
    with torch.no_grad():
        v = family.predict_velocity(model, x, torch.tensor(0.6), rows, shared)
        full = model(hidden_states=torch.cat([x, rows["image_latents"]], 1), timestep=torch.full((2,), 0.6),
                     encoder_hidden_states=rows["prompt_embeds"], encoder_hidden_states_mask=rows["prompt_embeds_mask"],
                     img_shapes=[[(1, 8, 8), (1, 6, 8)]] * 2, return_dict=False)[0]
        swapped = family.predict_velocity(model, x, torch.tensor(0.6),
                                          {**rows, "image_latents": rows["image_latents"].flip(0)}, shared)
    assert v.shape == (2, *geometry.packed_shape) and v.dtype == torch.float32
    assert torch.equal(v, full[:, :geometry.seq_len])
    assert (v - swapped).abs().mean() > 1e-3 * v.abs().mean()  # the source latents change it


@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_adapter_euler_loop_equals_the_stock_pipeline(pipe, parts, family, sources, source_size, cfg_scale):
    """3 Euler steps; with true CFG the negative prompt " " is encoded with each source (as the pipeline does) and the
    combined velocity is rescaled to the conditional norm (Qwen-Image's ``combine_guidance``)."""
    geometry, steps = parts["geometry"], 3
    noise = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(0))
    negative = {"negative_prompt": [" ", " "], "true_cfg_scale": cfg_scale} if cfg_scale > 1 else {}
    with torch.no_grad():
        images = pipe(image=sources, prompt=PROMPTS, latents=noise, num_inference_steps=steps, output_type="pt",
                      height=SIZE, width=SIZE, **negative).images
        rows, _ = family.encode_edits(parts["enc"], parts["vae"], _tensor(sources), PROMPTS, MSL)
        if cfg_scale > 1:
            uncond, _ = family.encode_edits(parts["enc"], parts["vae"], _tensor(sources), [" ", " "], MSL)
            rows.update({f"negative_{k}": uncond[k] for k in ("prompt_embeds", "prompt_embeds_mask")})
        shared = family.conditioning(geometry, rows, None, torch.device("cpu"))
        sigmas, x = family.sigmas(steps, geometry.seq_len), noise
        for i in range(steps):
            v = guided_velocity(family, parts["transformer"], x, sigmas[i], rows, shared, cfg_scale)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        ours = family.decode(parts["vae"], x, geometry)
    diff = (ours - images).abs().max().item() * 255
    print(f"cfg {cfg_scale}: sampling max |diff| x 255 = {diff:.3g}")
    assert ours.shape == images.shape == (2, 3, SIZE, SIZE)
    assert diff < 1
    assert (images[0] - images[1]).abs().mean() > 0.01  # another source and instruction, another edit


def test_the_edit_store_keeps_a_negative_row_per_source(folder, family, parts, tmp_path):
    """preprocess_embeddings.py's two calls (in this process): the negative prompt's rows are encoded with each
    source and live in the shards (no negative.safetensors); get_batch returns them; another negative prompt
    re-encodes the shards."""
    from fastvideo.data import NEGATIVE_FILE, EmbeddingDataset, open_prompt_store, write_prompt_store
    from fastvideo.edits import EditSources

    (tmp_path / "images").mkdir()
    lines = []
    for i in range(3):
        a = np.full((*SOURCE_HW, 3), 200, np.uint8)
        a[4 + 6 * i:20 + 6 * i, 6:30] = (220, 30, 30)
        Image.fromarray(a).save(tmp_path / "images" / f"{i}.png")
        lines.append(f'{{"image": "images/{i}.png", "prompt": "{PROMPTS[i % 2]}"}}')
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")

    def preprocess(negative: str) -> dict:
        writer = open_prompt_store(None, folder, tmp_path / "store", edit_file=tmp_path / "pairs.jsonl",
                                   max_sequence_length=MSL, shard_size=2, negative_prompt=negative)
        return write_prompt_store(writer, device=torch.device("cpu"))

    preprocess(" ")
    ds = EmbeddingDataset(tmp_path / "store").use(family, negative=True)
    assert ds.manifest["negative"] == {"prompt": " ", "per_example": True}
    assert not (tmp_path / "store" / NEGATIVE_FILE).exists()
    sources = EditSources.open(tmp_path / "pairs.jsonl").load(range(3))
    with torch.no_grad():
        negative, _ = family.encode_edits(parts["enc"], parts["vae"], sources, [" "] * 3, MSL)
    batch = ds.get_batch([2, 0, 2])
    width = batch["negative_prompt_embeds"].shape[1]
    assert batch["negative_prompt_embeds"].shape[0] == 3 and batch["prompt_embeds"].shape[1] == width
    torch.testing.assert_close(batch["negative_prompt_embeds"], negative["prompt_embeds"][[2, 0, 2], :width],
                               rtol=0, atol=1e-5)
    assert (batch["negative_prompt_embeds"][0] - batch["negative_prompt_embeds"][1]).abs().max() > 1e-3  # per source
    assert preprocess(" ")["kept"] == 2  # a re-run keeps the finished shards
    assert preprocess("blurry")["encoded"] == 2  # another negative prompt re-encodes them
    assert EmbeddingDataset(tmp_path / "store").negative_prompt == "blurry"


def test_vision_tokens_match_the_processor_and_qwens_settings(parts):
    """``vision_tokens`` (the planner's text length) = the processor's grid; at Qwen-Image-Edit's settings a 1024²
    source is 1,369 tokens (smart_resize to 1036² = 74² patches of 14 px, merged 2 x 2 -> 37²)."""
    processor = parts["enc"].processor
    for h, w in ((48, 64), (96, 160), (200, 120)):
        grid = processor.image_processor(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_grid_thw"][0]
        assert qe.vision_tokens(h, w, qe.TINY_PROCESSOR_CONFIG) == int(grid.prod()) // 4, (h, w)
    assert qe.vision_tokens(1024, 1024) == 37 * 37 == 1369
    assert models.resolve("qwen-image-edit").text_tokens(512, condition=(1024, 1024)) == 1369 + 512


def test_lora_export_loads_in_the_stock_pipeline_and_changes_the_edit(folder, parts, family, sources, source_size,
                                                                      tmp_path):
    from diffusers import QwenImageEditPipeline

    model = random_lora(family, folder)
    out = save_lora_for_diffusers(model, tmp_path / "lora", family=family)
    pipeline = QwenImageEditPipeline.from_pretrained(folder, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    call = dict(image=sources[0], prompt=PROMPTS[0], num_inference_steps=2, output_type="pt", height=SIZE, width=SIZE)
    latents = torch.randn(1, *parts["geometry"].packed_shape, generator=torch.Generator().manual_seed(3))
    before = pipeline(latents=latents, **call).images
    pipeline.load_lora_weights(out)
    after = pipeline(latents=latents, **call).images
    assert (after - before).abs().max() > 0.02
    with torch.no_grad():
        rows, _ = family.encode_edits(parts["enc"], parts["vae"], _tensor(sources[:1]), PROMPTS[:1], MSL)
        shared = family.conditioning(parts["geometry"], rows, None, torch.device("cpu"))
        ours = family.predict_velocity(model, latents, torch.tensor(0.7), rows, shared)
        stock = family.predict_velocity(pipeline.transformer, latents, torch.tensor(0.7), rows, shared)
    assert torch.allclose(stock, ours, atol=1e-5)  # the export restores the trained adapter in the edit pipeline


def test_flops_count_the_source_tokens_and_the_planner_assumes_the_pipelines_source(parts, family, sources, folder):
    """One velocity call's FLOPs (torch's counter) = Qwen-Image's formula at L + Ls image tokens and the stored text
    length (the source's vision tokens inside it); without an edit store the planner's source is the pipeline's 1024²
    area at the target's aspect ratio (``calculate_dimensions``)."""
    from fastvideo import flops

    geometry, model = parts["geometry"], parts["transformer"]
    rows, _ = family.encode_edits(parts["enc"], parts["vae"], _tensor(sources), PROMPTS, MSL)
    shared = family.conditioning(geometry, rows, None, torch.device("cpu"))
    x = torch.zeros(2, *geometry.packed_shape)
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, k: seen.append(family.forward_tokens(a, k)), with_kwargs=True)
    try:
        with torch.no_grad():
            counted = flops.counted_flops(lambda: family.predict_velocity(model, x, torch.tensor(0.5), rows, shared))
    finally:
        hook.remove()
    tokens, text = geometry.seq_len + geometry.condition_tokens, rows["prompt_embeds"].shape[1]
    assert seen == [(2, tokens, text)]
    assert counted == family.transformer_flops(model.config, tokens, text, 2)
    assert family.default_condition_size(512, 512) == (1024, 1024)
    assert family.default_condition_size(480, 832) == (768, 1344)  # the pipeline's calculate_dimensions(1024², 832/480)
    assert models.geometry_for(family, folder, SIZE, SIZE).condition.height == 1024


# ------------------------------------------------------------------------------ QwenImageEditPlusPipeline (2509)
@pytest.fixture(scope="module")
def plus(tiny_preset):
    """The tiny Plus folder, its family, the stock QwenImageEditPlusPipeline and the family's parts."""
    from diffusers import QwenImageEditPlusPipeline

    folder = tiny_preset("qwen-image-edit-plus-tiny")
    family = models.resolve("qwen-image-edit-plus")
    pipeline = QwenImageEditPlusPipeline.from_pretrained(folder, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    vae = family.load_vae(folder)
    return {"folder": folder, "family": family, "pipe": pipeline, "enc": family.load_text_encoders(folder),
            "vae": vae, "transformer": family.load_transformer(folder),
            "geometry": models.geometry_for(family, vae, SIZE, SIZE, condition=SOURCE_HW)}


@pytest.fixture
def plus_vae_size(monkeypatch):
    """The Plus pipeline resizes each source to a 1024² area for the VAE and to a 384² area for the VLM; the VAE's
    keeps the source's own size here (as a store made with --edit_size), the VLM's is the pipeline's."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as mod

    stock, (h, w) = mod.calculate_dimensions, SOURCE_HW
    monkeypatch.setattr(mod, "calculate_dimensions",
                        lambda area, ratio: (w, h) if area == mod.VAE_IMAGE_SIZE else stock(area, ratio))


def test_plus_rows_name_the_picture_and_see_it_at_384_squared(plus, sources):
    """The stored rows equal QwenImageEditPlusPipeline.encode_prompt of the condition image it makes (the source
    resized with Lanczos to a 384² area: 448 x 320 for a 4:3 source), one example per call (the pipeline's batch)."""
    family, enc, pipe = plus["family"], plus["enc"], plus["pipe"]
    assert models.resolve("auto", plus["folder"]) is family and family.edit and family.negative_sees_source
    assert models.family_of(family.load_transformer(plus["folder"])) is family
    assert family.vlm_size(*SOURCE_HW) == (320, 448) == qe.calculate_dimensions(384 * 384, 64 / 48)
    rows, truncated = family.encode_edits(enc, plus["vae"], _tensor(sources), PROMPTS, PLUS_MSL)
    assert truncated == [False, False]
    vision = qe.vision_tokens(320, 448, qe.TINY_PROCESSOR_CONFIG)
    assert vision == 12 and rows["prompt_embeds"].shape == (2, vision + PLUS_MSL, 32)  # 320 x 448 -> 84 x 112 -> 3 x 4
    for i, source in enumerate(sources):
        condition = pipe.image_processor.resize(source, 320, 448)
        with torch.no_grad():
            pe, pm = pipe.encode_prompt(PROMPTS[i], image=[condition])
        n = pe.shape[1]
        assert torch.equal(rows["prompt_embeds"][i, :n], pe[0]) and not rows["prompt_embeds"][i, n:].any()
        assert pm is None or bool(pm.all())  # one prompt per call: no padding (diffusers drops an all-ones mask)
        assert rows["prompt_embeds_mask"][i, :n].all() and not rows["prompt_embeds_mask"][i, n:].any()
    ids = enc.processor(text=[family.instruction_text(PROMPTS[0])], images=sources[:1]).input_ids[0]
    assert enc.tokenizer.decode(ids[qe.EDIT_TEMPLATE_DROP:qe.EDIT_TEMPLATE_DROP + 4]).startswith("Picture 1")
    edit = models.resolve("qwen-image-edit")
    edit_rows, _ = edit.encode_edits(enc, plus["vae"], _tensor(sources), PROMPTS, PLUS_MSL)
    assert edit_rows["prompt_embeds"].shape != rows["prompt_embeds"].shape or \
        (edit_rows["prompt_embeds"] - rows["prompt_embeds"]).abs().max() > 1e-3  # another text than Edit's
    assert torch.equal(edit_rows["image_latents"], rows["image_latents"])  # the same VAE latents


def test_plus_euler_loop_and_lora_export_equal_the_stock_pipeline(plus, sources, plus_vae_size, tmp_path):
    """3 Euler steps with true CFG 4 (negative " " with each source) equal the stock Plus pipeline's, one edit per
    call; a LoRA export loads in it and gives the trained adapter's velocity."""
    family, geometry, steps = plus["family"], plus["geometry"], 3
    noise = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        images = torch.cat([plus["pipe"](image=[s], prompt=p, latents=noise[i:i + 1], num_inference_steps=steps,
                                         output_type="pt", height=SIZE, width=SIZE, negative_prompt=" ",
                                         true_cfg_scale=4.0).images for i, (s, p) in enumerate(zip(sources, PROMPTS))])
        rows, _ = family.encode_edits(plus["enc"], plus["vae"], _tensor(sources), PROMPTS, PLUS_MSL)
        uncond, _ = family.encode_edits(plus["enc"], plus["vae"], _tensor(sources), [" ", " "], PLUS_MSL)
        rows.update({f"negative_{k}": uncond[k] for k in ("prompt_embeds", "prompt_embeds_mask")})
        shared = family.conditioning(geometry, rows, None, torch.device("cpu"))
        sigmas, x = family.sigmas(steps, geometry.seq_len), noise
        for i in range(steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * guided_velocity(family, plus["transformer"], x, sigmas[i], rows,
                                                                  shared, 4.0)
        ours = family.decode(plus["vae"], x, geometry)
    diff = (ours - images).abs().max().item() * 255
    print(f"plus, cfg 4: sampling max |diff| x 255 = {diff:.3g}")
    assert ours.shape == images.shape == (2, 3, SIZE, SIZE) and diff < 1
    model = random_lora(family, plus["folder"])
    plus["pipe"].load_lora_weights(save_lora_for_diffusers(model, tmp_path / "lora", family=family))
    try:
        with torch.no_grad():
            ours = family.predict_velocity(model, noise, torch.tensor(0.7), rows, shared)
            stock = family.predict_velocity(plus["pipe"].transformer, noise, torch.tensor(0.7), rows, shared)
    finally:
        plus["pipe"].unload_lora_weights()
    assert torch.allclose(stock, ours, atol=1e-5)
    with torch.no_grad():
        base = family.predict_velocity(plus["transformer"], noise, torch.tensor(0.7), rows, shared)
    assert (ours - base).abs().max() > 1e-3  # the adapter changes the velocity


def test_plus_vision_tokens_for_the_planner():
    """At Qwen's processor settings the Plus VLM sees a 1024² source as 384² -> smart_resize 392² = 28² patches of
    14 px, merged 2 x 2 -> 196 tokens (Qwen-Image-Edit's: 1,369); a 480 x 832 source: calculate_dimensions(384²,
    832/480) = 288 x 512 -> 280 x 504 -> 10 x 18 = 180."""
    family = models.resolve("qwen-image-edit-plus")
    assert family.text_tokens(512, condition=(1024, 1024)) == 196 + 512
    assert family.vlm_size(480, 832) == (288, 512) and family.text_tokens(0, condition=(480, 832)) == 180
    assert family.default_condition_size(480, 832) == (768, 1344)  # the VAE's source: the 1024² area, as Edit's


def test_plus_two_sources_per_edit_from_the_edit_file_to_the_stock_pipelines_edit(plus, sources, plus_vae_size,
                                                                                 tmp_path):
    """An edit file line naming two sources ("images": [...]) -> a store with both (sources/<id>.png, <id>.1.png;
    manifest sources_per_edit 2; the rows see "Picture 1" and "Picture 2", the latents of both in order) -> 3 Euler
    steps with true CFG 4 over the target's and both sources' grids equal the stock Plus pipeline given both images."""
    from fastvideo.data import EmbeddingDataset, open_prompt_store, write_prompt_store

    family = plus["family"]
    (tmp_path / "images").mkdir()
    for i, image in enumerate(sources):
        image.save(tmp_path / "images" / f"{i}.png")
    pair = {"images": ["images/0.png", "images/1.png"], "prompt": "put the block of picture 2 into picture 1"}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair) + "\n" + json.dumps({**pair, "prompt": "swap them"}) + "\n")
    writer = open_prompt_store(None, plus["folder"], tmp_path / "store", edit_file=tmp_path / "pairs.jsonl",
                               max_sequence_length=PLUS_MSL, shard_size=2, negative_prompt=" ")
    write_prompt_store(writer, device=torch.device("cpu"))
    ds = EmbeddingDataset(tmp_path / "store").use(family, negative=True)
    assert ds.condition_size == (*SOURCE_HW, 2) and ds.manifest["edit"]["sources_per_edit"] == 2
    assert (tmp_path / "store" / "sources" / "00000001.1.png").is_file()
    assert torch.equal(ds.source_images([0]), _tensor(sources[:1]))  # what a reward compares with: Picture 1
    geometry = models.geometry_for(family, plus["vae"], SIZE, SIZE, condition=ds.condition_size)
    assert geometry.condition_tokens == 2 * geometry.condition.seq_len == 2 * 48
    batch = ds.get_batch([0])
    assert batch["image_latents"].shape == (1, 2 * 48, 64)
    with torch.no_grad():
        conditions = [plus["pipe"].image_processor.resize(s, 320, 448) for s in sources]
        pe, _ = plus["pipe"].encode_prompt(pair["prompt"], image=conditions)
        noise = torch.randn(1, *geometry.packed_shape, generator=torch.Generator().manual_seed(4))
        stock = plus["pipe"](image=list(sources), prompt=pair["prompt"], latents=noise, num_inference_steps=3,
                             output_type="pt", height=SIZE, width=SIZE, negative_prompt=" ",
                             true_cfg_scale=4.0).images
        n = pe.shape[1]
        assert torch.allclose(batch["prompt_embeds"][:, :n], pe, atol=1e-6) and not batch["prompt_embeds"][:, n:].any()
        assert ds.manifest["shapes"]["prompt_embeds"] == [2 * 12 + PLUS_MSL, 32]  # both pictures' tokens + msl
        shared = family.conditioning(geometry, batch, None, torch.device("cpu"))
        assert shared["source_shapes"] == [(1, 6, 8), (1, 6, 8)]
        sigmas, x = family.sigmas(3, geometry.seq_len), noise
        for i in range(3):
            x = x + (sigmas[i + 1] - sigmas[i]) * guided_velocity(family, plus["transformer"], x, sigmas[i], batch,
                                                                  shared, 4.0)
        ours = family.decode(plus["vae"], x, geometry)
    diff = (ours - stock).abs().max().item() * 255
    print(f"plus, 2 sources, cfg 4: sampling max |diff| x 255 = {diff:.3g}")
    assert diff < 1
    swapped = {**batch, "image_latents": torch.cat([batch["image_latents"][:, 48:], batch["image_latents"][:, :48]], 1)}
    with torch.no_grad():
        v = family.predict_velocity(plus["transformer"], noise, torch.tensor(0.5), batch, shared)
        w = family.predict_velocity(plus["transformer"], noise, torch.tensor(0.5), swapped, shared)
    assert (v - w).abs().max() > 1e-3  # the sources' order matters, as the pipeline's Picture 1 / Picture 2
