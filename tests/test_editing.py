"""Image editing end to end on the tiny FLUX.1-Kontext (``flux-kontext-tiny``) through the product's commands:
``preprocess_embeddings.py --edit_file`` (stored rows = the adapter's ``encode_edits``; the stored sources
are the pixels it encoded; a re-run keeps finished shards and re-encodes the one whose image changed), bad edit files
refused with the line named before any model loads, and GRPO with LoRA and true CFG on 2 ranks (on-policy at the first
update; the export loads in the stock ``FluxKontextPipeline`` and changes its edits). The slow tier adds online DPO,
DiffusionNFT, AWM and a GRPO full fine-tune on edits. The adapter itself is checked against the stock pipeline in
tests/test_family_flux_kontext.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import REPO, run_in_one_job, run_torchrun

H = W = 32  # target and source size (the tiny VAE: 4x, so 8 x 8 latents, 16 packed tokens each)
MSL = 16
INSTRUCTIONS = ["make the red square blue", "remove the square", "move the square to the left",
                "add a yellow circle above the square", "make the blue square green", "remove the red square"]
EDIT_GRPO = "test_editing.py::test_grpo_lora_with_cfg_on_edits_is_on_policy_and_exports_a_kontext_lora"


def write_edits(root: Path, n: int = len(INSTRUCTIONS), size: tuple[int, int] = (H, W)) -> Path:
    """``n`` structured sources (a coloured square on grey, each moved) and ``root/pairs.jsonl`` naming them."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        a = np.full((*size, 3), 200, np.uint8)
        a[4 + i:14 + i, 6:18] = (220, 30, 30) if i % 2 else (30, 30, 220)
        Image.fromarray(a).save(root / "images" / f"{i}.png")
        lines.append(json.dumps({"image": f"images/{i}.png", "prompt": INSTRUCTIONS[i % len(INSTRUCTIONS)]}))
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return root / "pairs.jsonl"


def edit_store(root: Path, model: Path, negative_prompt: str) -> dict:
    """A tiny edit model folder and its edit store of ``write_edits`` (6 edits in shards of 2, with
    ``negative_prompt``), written in this process by preprocess_embeddings.py's two calls (the ranks' sharding is
    family-free: tests/test_preprocess.py)."""
    from fastvideo.data import open_prompt_store, write_prompt_store

    pairs = write_edits(root)
    writer = open_prompt_store(None, model, root / "store", edit_file=pairs, max_sequence_length=MSL, shard_size=2,
                               negative_prompt=negative_prompt)
    write_prompt_store(writer, device=torch.device("cpu"))
    return {"model": model, "pairs": pairs, "store": root / "store", "root": root}


@pytest.fixture(scope="session")
def kontext(tiny_preset, tmp_path_factory) -> dict:
    """The tiny Kontext folder and its edit store (negative prompt ""), once per session: the slow tests read it too."""
    return edit_store(tmp_path_factory.mktemp("edits"), tiny_preset("flux-kontext-tiny"), "")


def test_preprocessing_stores_what_encode_edits_gives(kontext):
    from fastvideo import models
    from fastvideo.data import EmbeddingDataset
    from fastvideo.edits import EditSources

    family = models.resolve("auto", kontext["model"])
    ds = EmbeddingDataset(kontext["store"]).use(family, negative=True)
    assert ds.condition_size == (H, W) and ds.condition_keys == ("image_latents",) and len(ds) == 6
    assert ds.prompts == INSTRUCTIONS and ds.manifest["edit"]["file"] == str(kontext["pairs"])
    sources = EditSources.open(kontext["pairs"]).load(range(6))
    assert torch.equal(ds.source_images(list(range(6))), sources)  # the stored PNGs: the pixels that were encoded
    with torch.no_grad():
        expected, _ = family.encode_edits(family.load_text_encoders(kontext["model"]),
                                          family.load_vae(kontext["model"]), sources, INSTRUCTIONS, MSL)
    batch = ds.get_batch([5, 0, 5])
    for key in family.embedding_keys:
        torch.testing.assert_close(batch[key], expected[key][[5, 0, 5]], rtol=0, atol=1e-5, msg=key)
    assert "negative_image_latents" not in batch and batch["negative_prompt_embeds"].shape == (3, MSL, 32)
    with pytest.raises(ValueError, match="holds edits but the flux1 family takes no source image"):
        EmbeddingDataset(kontext["store"]).use(models.resolve("flux1"))


def test_a_rerun_keeps_finished_shards_and_re_encodes_a_changed_image(kontext, tmp_path):
    import shutil

    store = tmp_path / "store"
    shutil.copytree(kontext["store"], store)
    root = tmp_path / "data"
    shutil.copytree(kontext["root"] / "images", root / "images")
    shutil.copy(kontext["pairs"], root / "pairs.jsonl")
    before = {p.name: p.read_bytes() for p in store.glob("shard-*")}
    Image.fromarray(np.zeros((H, W, 3), np.uint8)).save(root / "images" / "3.png")  # shard 1 (ids 2, 3) changes
    from fastvideo.data import open_prompt_store, write_prompt_store

    writer = open_prompt_store(None, kontext["model"], store, edit_file=root / "pairs.jsonl", max_sequence_length=MSL,
                               shard_size=2, negative_prompt="")  # preprocess_embeddings.py's two calls, one process
    done = write_prompt_store(writer, device=torch.device("cpu"))
    assert (done["encoded"], done["kept"]) == (1, 2), done
    after = {p.name: p.read_bytes() for p in store.glob("shard-*")}
    assert after["shard-00000.safetensors"] == before["shard-00000.safetensors"]
    assert after["shard-00001.safetensors"] != before["shard-00001.safetensors"]
    from fastvideo.data import EmbeddingDataset

    assert float(EmbeddingDataset(store).source_images([3]).max()) == 0.0


@pytest.mark.parametrize("line,fix", [
    ('{"image": "images/0.png", "prompt": "ok"}\n{"image": "images/1.png"', r"line 2: not valid JSON"),
    ('{"image": "images/0.png", "prompt": "ok"}\n\n{"image": "images/1.png"}', r"line 3: needs the string key"),
    ('{"image": "images/0.png", "images": ["images/1.png"], "prompt": "a"}', r"line 1: needs .* either \"image\""),
    ('{"images": [], "prompt": "a"}', r"line 1: needs .*\"images\" \(a non-empty list of strings\)"),
    ('{"images": ["images/0.png", "images/1.png"], "prompt": "a"}\n{"images": ["images/1.png"], "prompt": "b"}',
     r"line 2 names 1 source images but line 1 names 2.*split the file"),
    ('{"images": ["images/0.png", "images/1.png"], "prompt": "a"}',
     r"names 2 source images per edit, but the flux-kontext family takes one.*qwen-image-edit-plus"),
    ('{"image": "images/0.png", "prompt": "   "}', r"line 1: the instruction .* is empty"),
    ('{"image": "images/0.png", "prompt": "a"}\n{"image": "nope.png", "prompt": "b"}',
     r"line 2: source image 'nope.png' .* does not exist; image paths are relative to the edit file"),
    ('{"image": "images/0.png", "prompt": "a"}\n{"image": "broken.png", "prompt": "b"}',
     r"line 2: .*broken.png is not a readable image"),
    ('{"image": "images/0.png", "prompt": "a"}\n{"image": "big.png", "prompt": "b"}',
     r"line 2: big.png is 48x32 but line 1's source is 32x32.*--edit_size WxH"),
])
def test_bad_edit_files_are_refused_naming_the_line(kontext, tmp_path, line, fix):
    """Checked in the parent process before any model or rank starts (``open_prompt_store``), with the line named."""
    from fastvideo.data import open_prompt_store

    write_edits(tmp_path, 2)
    (tmp_path / "broken.png").write_text("not an image")
    Image.fromarray(np.zeros((32, 48, 3), np.uint8)).save(tmp_path / "big.png")
    pairs = tmp_path / "bad.jsonl"
    pairs.write_text(line + "\n")
    with pytest.raises((ValueError, FileNotFoundError), match=fix):
        open_prompt_store(None, kontext["model"], tmp_path / "out", edit_file=pairs, max_sequence_length=MSL)
    assert not (tmp_path / "out").exists()  # nothing written


def test_sizes_and_flag_mixups_are_refused_before_encoding(kontext, tmp_path):
    from fastvideo.data import open_prompt_store
    from fastvideo.tiny import build_tiny_flux

    pairs = write_edits(tmp_path, 2, size=(36, 36))
    with pytest.raises(ValueError, match=r"source images of 36 x 36 .*--edit_size.*multiple of 8"):
        open_prompt_store(None, kontext["model"], tmp_path / "out", edit_file=pairs, max_sequence_length=MSL)
    writer = open_prompt_store(None, kontext["model"], tmp_path / "out", edit_file=pairs, edit_size=(32, 40),
                               max_sequence_length=MSL)  # --edit_size 40x32 resizes them: taken
    assert writer.sources.load([0]).shape == (1, 3, 32, 40)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\n")
    with pytest.raises(ValueError, match="edits a source image: pass --edit_file"):
        open_prompt_store(prompts, kontext["model"], tmp_path / "out", max_sequence_length=MSL)
    flux = build_tiny_flux(tmp_path / "flux")
    with pytest.raises(ValueError, match="--edit_file needs an edit model family"):
        open_prompt_store(None, flux, tmp_path / "out", edit_file=pairs, max_sequence_length=MSL)
    from fastvideo.edits import parse_edit_size

    assert parse_edit_size("40x32") == (32, 40)
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        parse_edit_size("32")
    assert not (tmp_path / "out").exists()


def _train_args(kontext: dict, out: Path, *extra: str) -> list[str]:
    """A trainer's flags (2 steps of 2 edits x 4 samples on the tiny Kontext, jpeg reward), without the script."""
    return ["--pretrained_model_name_or_path", str(kontext["model"]), "--data_json_path",
            str(kontext["store"]), "--output_dir", str(out), "--device", "cpu", "--h", str(H), "--w", str(W),
            "--sampling_steps", "4", "--num_generations", "4", "--prompts_per_step", "2", "--rollout_batch_size", "4",
            "--train_batch_size", "2", "--reward", "jpeg_compressibility:1.0", "--learning_rate", "1e-3", "--seed", "3",
            "--no-progress_bar", "--max_train_steps", "2", "--checkpointing_steps", "100", *extra]


def _kontext_edit(model: Path, lora: Path | None, source: Image.Image) -> torch.Tensor:
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(model, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    return pipe(image=source, prompt=INSTRUCTIONS[0], height=H, width=W, max_area=H * W, _auto_resize=False,
                num_inference_steps=2, output_type="pt", max_sequence_length=MSL,
                generator=torch.Generator().manual_seed(0)).images


# A user reward (weight 0: logged, not trained on) that computes an edit's distance from its source by its definition,
# the mean absolute pixel difference: the logged source_distance must equal it
DISTANCE_PLUGIN = """
def edit_distance():
    def score(images, prompts, sources=None, **context):
        return (images.double() - sources.double()).abs().flatten(1).mean(dim=1).float()

    score.takes_sources = score.needs_sources = True
    return score
"""


def test_grpo_lora_with_cfg_on_edits_is_on_policy_and_exports_a_kontext_lora(kontext, tmp_path):
    """GRPO on edits, LoRA rank 4, true CFG 2 (the source rows in both halves of one batched forward), --reward_overlap
    (the sources travel with each micro-batch): the first update's ratios are 1, the update reaches the adapter, the
    source distance logged beside the reward is each edit's true distance from its source (a user reward computing
    it by definition), and the export changes the stock Kontext pipeline's edit."""
    out = tmp_path / "grpo"
    (tmp_path / "distance_check.py").write_text(DISTANCE_PLUGIN)
    args = _train_args(kontext, out, "--lora_rank", "4", "--cfg_scale", "2", "--timestep_fraction", "0.7",
                       "--reward_overlap")
    args[args.index("jpeg_compressibility:1.0")] = "jpeg_compressibility:1.0,distance_check:edit_distance:0"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    run_torchrun(["train_grpo_flux.py", *args], env={"PYTHONPATH": path})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
    assert rows[0]["ratio_first_update_max_dev"] < 1e-5 and rows[0]["grad_norm"] > 0, rows[0]
    for r in rows:  # a random model's edit is not its source, and the watch reads its true distance
        assert r["reward_mean"] == pytest.approx(r["reward_jpeg_compressibility"])  # weight 0: not trained on
        assert r["reward_source_distance"] > 0.02
        assert r["reward_source_distance"] == pytest.approx(r["reward_edit_distance"], rel=1e-5, abs=1e-7), r
    source = Image.open(kontext["root"] / "images" / "0.png").convert("RGB")
    base, tuned = _kontext_edit(kontext["model"], None, source), _kontext_edit(kontext["model"], out / "final", source)
    assert torch.isfinite(tuned).all() and (tuned - base).abs().max() > 1e-4


def test_edit_rewards_receive_the_sources_and_log_the_source_distance():
    """A scorer that takes sources gets each edit's own; the others score the edit alone; ``source_distance`` is 0 for
    an edit that returns its source and large for one that ignores it (a source of another size is resized first);
    a reward that needs sources refuses a batch without (a text-to-image run)."""
    from fastvideo.rewards import RewardFn

    seen = {}

    def preserve(images, prompts, sources=None):  # 1 - mean |edit - source|: a reward that sees the source
        seen["sources"] = sources
        return 1 - (images - sources).abs().mean(dim=(1, 2, 3))

    preserve.takes_sources = preserve.needs_sources = True
    brightness = lambda images, prompts: images.mean(dim=(1, 2, 3))  # noqa: E731
    fn = RewardFn([("preserve", 2.0, preserve), ("brightness", 1.0, brightness)])
    g = torch.Generator().manual_seed(0)
    sources = torch.rand(3, 3, 16, 16, generator=g)
    edits = torch.stack([sources[0], torch.rand(3, 16, 16, generator=g), sources[2] * 0.5])
    out = fn(edits, ["a", "b", "c"], sources)
    assert seen["sources"] is not None and torch.equal(seen["sources"], sources)
    assert out["source_distance"][0] == 0 and out["source_distance"][1] > 0.25  # unchanged; ignored (uniform noise)
    torch.testing.assert_close(out["source_distance"], (edits - sources).abs().mean(dim=(1, 2, 3)))
    torch.testing.assert_close(out["total"], 2 * out["preserve"] + out["brightness"])
    assert "source_distance" not in fn.names  # logged, never trained on
    small = torch.nn.functional.avg_pool2d(sources, 2)  # an 8 x 8 source of a 16 x 16 edit: resized first
    resized = torch.nn.functional.interpolate(small, size=(16, 16), mode="bilinear", antialias=True)
    torch.testing.assert_close(RewardFn([("brightness", 1.0, brightness)])(edits, ["a", "b", "c"], small)[
        "source_distance"], (edits - resized).abs().mean(dim=(1, 2, 3)))
    with pytest.raises(ValueError, match="'preserve' compares an edit with its source image: it scores edit runs"):
        fn(edits, ["a", "b", "c"])
    with pytest.raises(ValueError, match="one .3, h, w. source per edit"):
        fn(edits, ["a", "b", "c"], sources[:2])


@pytest.mark.slow(cover="test_sequence_parallel.py::test_sp2_equals_sp1_on_two_ranks", cost_s=20)
def test_kontext_sp2_on_two_ranks_equals_one_rank(kontext, tmp_path):
    """Kontext GRPO LoRA with true CFG, Ulysses --sp_size 2 over the target + source tokens (16 + 16) on 2 ranks (one
    data-parallel replica) against 1 rank, one step: the same rollout (its rewards and source distances) and the same
    gradient to float rounding."""
    flags = ("--lora_rank", "4", "--cfg_scale", "2", "--fsdp_version", "2", "--max_train_steps", "1")
    run_torchrun(["train_grpo_flux.py", *_train_args(kontext, tmp_path / "sp2", *flags, "--sp_size", "2")])
    run_torchrun(["train_grpo_flux.py", *_train_args(kontext, tmp_path / "sp1", *flags)], nproc=1)
    sp2, sp1 = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                for name in ("sp2", "sp1"))
    assert len(sp2) == len(sp1) == 1
    for key in ("reward_mean", "reward_source_distance"):
        assert sp2[0][key] == pytest.approx(sp1[0][key], rel=1e-6), key
    assert sp2[0]["grad_norm"] == pytest.approx(sp1[0]["grad_norm"], rel=1e-5) and sp2[0]["grad_norm"] > 0


@pytest.mark.slow(cover=EDIT_GRPO, cost_s=40)
def test_dpo_nft_awm_and_a_full_fine_tune_on_edits(kontext, tmp_path):
    """In one 2-rank job, 2 steps each on the edit store: offline DPO on a pair file of edits (made by
    ``python -m fastvideo.preference`` on the store), online DPO (CFG rollout), DiffusionNFT and AWM with LoRA, then
    sample.py on the full fine-tune with the edit file as its prompts (each edit written with its source),
    and GRPO as a full fine-tune: finite losses, a moving policy, LoRA exports the Kontext pipeline loads, and a
    transformer folder that differs from the base model's."""
    from diffusers import FluxTransformer2DModel

    lora = ["--lora_rank", "4"]
    pairs = tmp_path / "pairs"  # offline DPO's pair file of edits: the best and worst of 3 edits of each source
    proc = subprocess.run([sys.executable, "-m", "fastvideo.preference", "--model_path", str(kontext["model"]),
                           "--data_json_path", str(kontext["store"]), "--output_dir", str(pairs), "--num_pairs", "4",
                           "--num_generations", "3", "--h", str(H), "--w", str(W), "--sampling_steps", "2",
                           "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all("image" in json.loads(line) for line in (pairs / "pairs.jsonl").read_text().splitlines())
    run_in_one_job([
        ("train_dpo.py", ["--pretrained_model_name_or_path", str(kontext["model"]), "--data_json_path",
                          str(kontext["store"]), "--output_dir", str(tmp_path / "offline"), "--device", "cpu", "--h",
                          str(H), "--w", str(W), "--preference_file", str(pairs / "pairs.jsonl"),
                          "--train_batch_size", "2", "--learning_rate", "1e-3", "--seed", "3", "--no-progress_bar",
                          "--max_train_steps", "2", "--checkpointing_steps", "100", *lora]),
        ("train_dpo.py", _train_args(kontext, tmp_path / "dpo", *lora, "--cfg_scale", "2")),
        ("train_nft.py", _train_args(kontext, tmp_path / "nft", *lora)),
        ("train_nft.py", _train_args(kontext, tmp_path / "awm", *lora, "--objective", "awm", "--awm_timesteps", "2")),
        ("train_grpo_flux.py", _train_args(kontext, tmp_path / "full", "--lora_rank", "0", "--learning_rate", "1e-4",
                                           "--timestep_fraction", "0.7")),
    ], tmp_path)
    source = Image.open(kontext["root"] / "images" / "0.png").convert("RGB")
    base = _kontext_edit(kontext["model"], None, source)
    for name in ("offline", "dpo", "nft", "awm"):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows), (name, rows)
        assert (_kontext_edit(kontext["model"], tmp_path / name / "final", source) - base).abs().max() > 1e-4, name
    tuned = FluxTransformer2DModel.from_pretrained(tmp_path / "full" / "final", local_files_only=True)
    start = FluxTransformer2DModel.from_pretrained(kontext["model"] / "transformer", local_files_only=True)
    assert any(not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), start.state_dict().values()))
    # sample.py on the full fine-tune and the edit file itself (encoded as an edit store): each edit with its source
    samples = tmp_path / "samples"
    proc = subprocess.run([sys.executable, "sample.py", "--run_dir", str(tmp_path / "full"), "--prompts",
                           str(kontext["pairs"]), "--output_dir", str(samples), "--max_prompts", "2",
                           "--num_images_per_prompt", "1"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    index = [json.loads(line) for line in (samples / "index.jsonl").read_text().splitlines()]
    assert [Path(r["source"]).name for r in index] == ["00000000.png", "00000001.png"]
    assert Path(index[0]["source"]).parent == samples / "embeddings" / "sources"  # the edit file, encoded here
    for r in index:  # the distance sample.py logged is the one between the PNGs it names
        edit = np.asarray(Image.open(samples / r["path"]), dtype=np.float64) / 255
        original = np.asarray(Image.open(r["source"]), dtype=np.float64) / 255
        assert abs(r["source_distance"] - np.abs(edit - original).mean()) < 3e-3, r


# ------------------------------------------------------------------------------------------ Qwen-Image-Edit
@pytest.fixture(scope="session")
def qwen_edit(tiny_preset, tmp_path_factory) -> dict:
    """The tiny Qwen-Image-Edit folder and its edit store (negative prompt " ", encoded with each source), once per
    session."""
    return edit_store(tmp_path_factory.mktemp("qwen-edits"), tiny_preset("qwen-image-edit-tiny"), " ")


def _qwen_edit(model: Path, lora: Path | None, source: Image.Image, **call) -> torch.Tensor:
    """The stock QwenImageEditPipeline's edit of ``source`` (its source kept at its own size: the pipeline would
    resize it to a 1024² area, as ``--edit_size`` does for a store)."""
    from unittest import mock

    from diffusers import QwenImageEditPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    pipe = QwenImageEditPipeline.from_pretrained(model, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    with mock.patch.object(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: (W, H, None)):
        return pipe(image=source, prompt=INSTRUCTIONS[0], height=H, width=W, num_inference_steps=2, output_type="pt",
                    generator=torch.Generator().manual_seed(0), **call).images


@pytest.mark.slow(cover="test_family_qwen_image_edit.py::test_the_edit_store_keeps_a_negative_row_per_source",
                  cost_s=30)
def test_qwen_image_edit_trainers_with_a_negative_per_source(qwen_edit, tmp_path):
    """In one 2-rank job on the Qwen-Image-Edit store (its negative rows encoded with each source): GRPO with LoRA,
    true CFG 4 and --reward_overlap (ratio 1 at the first update), online DPO with CFG, DiffusionNFT, and GRPO as a
    full fine-tune; the LoRA exports change the stock QwenImageEditPipeline's edit (with its own true CFG), the full
    fine-tune's folder loads as QwenImageTransformer2DModel and differs; sample.py edits with CFG."""
    from diffusers import QwenImageTransformer2DModel

    lora = ["--lora_rank", "4"]
    run_in_one_job([
        ("train_grpo_flux.py", _train_args(qwen_edit, tmp_path / "grpo", *lora, "--cfg_scale", "4",
                                           "--timestep_fraction", "0.7", "--reward_overlap")),
        ("train_dpo.py", _train_args(qwen_edit, tmp_path / "dpo", *lora, "--cfg_scale", "4")),
        ("train_nft.py", _train_args(qwen_edit, tmp_path / "nft", *lora, "--cfg_scale", "1")),
        ("train_grpo_flux.py", _train_args(qwen_edit, tmp_path / "full", "--lora_rank", "0", "--learning_rate",
                                           "1e-4", "--timestep_fraction", "0.7", "--cfg_scale", "1")),
    ], tmp_path)
    grpo = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert grpo[0]["ratio_first_update_max_dev"] < 1e-5 and grpo[0]["grad_norm"] > 0, grpo[0]
    assert all(0.02 < r["reward_source_distance"] < 1 for r in grpo), grpo
    source = Image.open(qwen_edit["root"] / "images" / "0.png").convert("RGB")
    cfg = {"negative_prompt": " ", "true_cfg_scale": 4.0}
    base = _qwen_edit(qwen_edit["model"], None, source, **cfg)
    for name in ("grpo", "dpo", "nft"):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows), (name, rows)
        tuned = _qwen_edit(qwen_edit["model"], tmp_path / name / "final", source, **cfg)
        assert torch.isfinite(tuned).all() and (tuned - base).abs().max() > 1e-4, name
    tuned = QwenImageTransformer2DModel.from_pretrained(tmp_path / "full" / "final", local_files_only=True)
    start = QwenImageTransformer2DModel.from_pretrained(qwen_edit["model"] / "transformer", local_files_only=True)
    assert any(not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), start.state_dict().values()))
    samples = tmp_path / "samples"
    proc = subprocess.run([sys.executable, "sample.py", "--run_dir", str(tmp_path / "grpo"), "--prompts",
                           str(qwen_edit["pairs"]), "--output_dir", str(samples), "--max_prompts", "2",
                           "--num_images_per_prompt", "1", "--cfg_scale", "4"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    index = [json.loads(line) for line in (samples / "index.jsonl").read_text().splitlines()]
    assert len(index) == 2 and all(0 < r["source_distance"] < 1 for r in index), index
    assert json.loads((samples / "embeddings" / "manifest.json").read_text())["negative"]["per_example"]
