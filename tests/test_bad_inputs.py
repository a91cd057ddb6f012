"""The bad-input matrix (issue #12): every user mistake is refused before any model loads, with a message that names
the fix; paths read from manifests, indexes and pair files stay inside their folder; and the repository's own code
loads nothing unsafely (no pickles, no shell, no remote code)."""
from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO, load_script, validate_flags

from fastvideo.models import flux
from fastvideo.objectives import parse_grpo_args, validate_grpo
from fastvideo.data import EmbeddingDataset, EmbeddingWriter, StoreSpec, read_prompt_file
from fastvideo.rewards import build_reward


def _grpo(tmp_path: Path, *flags: str, world: int = 1) -> dict:
    """validate_grpo on a stub model folder and manifest (flag checks need no real files)."""
    return validate_flags(tmp_path, parse_grpo_args, validate_grpo, *flags, world=world)


def _store(out: Path, fingerprint: str = "fp-test", msl: int = 8, prompts: int = 5) -> Path:
    """A small embedding store (random rows, shards of 2 prompts) written by EmbeddingWriter; returns the manifest."""
    writer = EmbeddingWriter(out, [f"prompt {i}" for i in range(prompts)], StoreSpec("/m", fingerprint, msl, "fp32", 2))
    for shard in writer.shards:
        n = shard.num_prompts
        writer.write_shard(shard, {"prompt_embeds": torch.randn(n, msl, 4), "pooled_prompt_embeds": torch.randn(n, 3)},
                           [False] * n)
    writer.finalize()
    return out / "manifest.json"


def _model_stub(tmp_path: Path, tiny_flux_dir: Path) -> Path:
    """A model folder with the tiny FLUX's model_index.json, transformer and VAE (copied: tests may damage them)."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(tiny_flux_dir / "model_index.json", model)
    for component in ("transformer", "vae"):
        shutil.copytree(tiny_flux_dir / component, model / component)
    return model


def _grpo_on(model: Path, tmp_path: Path, *flags: str) -> dict:
    """validate_grpo with a real model folder (the checks that read its configs and weight headers run)."""
    data = tmp_path / "manifest.json"
    data.write_text("{}")
    return validate_grpo(parse_grpo_args(["--pretrained_model_name_or_path", str(model), "--data_json_path",
                                          str(data), *flags]), 1)


# --------------------------------------------------------------------------------------------- the matrix
def test_h_w_not_a_multiple_of_the_models_multiple(tiny_flux_dir):
    # the tiny VAE has scale factor 4: with 2x2 packing, sizes are multiples of 8
    with pytest.raises(ValueError, match=r"height 100 \(--h\) must be a positive multiple of 8.*pass e.g. --h 96 or "
                                         r"104"):
        flux.latent_geometry(tiny_flux_dir, 100, 64)
    with pytest.raises(ValueError, match=r"width 60 \(--w\).*pass e.g. --w 56 or 64"):
        flux.latent_geometry(tiny_flux_dir, 64, 60)


def test_num_generations_below_two_for_grpo(tmp_path):
    with pytest.raises(ValueError, match="--num_generations must be >= 2 .a group needs two samples"):
        _grpo(tmp_path, "--num_generations", "1")


@pytest.mark.parametrize("flags, world, fix", [
    (("--prompts_per_step", "2", "--num_generations", "6", "--train_batch_size", "5"), 1,
     "use --train_batch_size 1, 2, 3, 4, 6 or 12"),
    (("--prompts_per_step", "3", "--num_generations", "3"), 2, "divisible by the number of ranks .2.; e.g. "
                                                               "--prompts_per_step 4"),
    (("--prompts_per_step", "2", "--num_generations", "6", "--train_batch_size", "2",
      "--gradient_accumulation_steps", "4"), 1, "use --gradient_accumulation_steps 1, 2, 3 or 6"),
])
def test_batch_sizes_that_do_not_divide(tmp_path, flags, world, fix):
    with pytest.raises(ValueError, match=fix):
        _grpo(tmp_path, *flags, world=world)


def test_manifest_from_another_model(tmp_path, tiny_flux_dir):
    dataset = EmbeddingDataset(_store(tmp_path / "emb", fingerprint="encoders-of-another-model"))
    with pytest.raises(ValueError, match="other text encoders.*re-run preprocess_embeddings.py with this "
                                         "--model_path"):
        dataset.check_encoders(tiny_flux_dir)


def test_manifest_of_another_sequence_length(tmp_path, tiny_flux_dir):
    # a shard of a run with another --max_sequence_length dropped into the store
    _store(tmp_path / "other", msl=4)
    manifest = _store(tmp_path / "emb", msl=8)
    shutil.copy(tmp_path / "other" / "shard-00001.safetensors", tmp_path / "emb")
    with pytest.raises(ValueError, match="shard-00001.*max_sequence_length 4 .manifest: 8.*another preprocessing "
                                         "run.*new --output_dir"):
        EmbeddingDataset(manifest)
    # evaluation embeddings whose text length differs from the training ones (checked before models load)
    from fastvideo.training import Run

    fingerprint = flux.encoders_fingerprint(tiny_flux_dir)
    args = parse_grpo_args(["--pretrained_model_name_or_path", str(tiny_flux_dir), "--h", "64", "--w", "64",
                            "--reward", "jpeg_compressibility", "--data_json_path",
                            str(_store(tmp_path / "train", fingerprint, msl=8)), "--eval_prompts",
                            str(_store(tmp_path / "eval", fingerprint, msl=4))])
    with pytest.raises(ValueError, match="--eval_prompts has 4 text tokens.*--max_sequence_length 8"):
        Run.sampling_inputs(SimpleNamespace(args=args, out=tmp_path / "out", device=torch.device("cpu")))


def test_missing_or_truncated_shards(tmp_path):
    manifest = _store(tmp_path / "emb")
    shard = tmp_path / "emb" / "shard-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])  # an interrupted copy
    with pytest.raises(ValueError, match="shard-00001.*truncated.*re-run preprocess_embeddings.py with the same "
                                         "--output_dir"):
        EmbeddingDataset(manifest)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="shard-00001.*missing.*re-run preprocess_embeddings.py"):
        EmbeddingDataset(manifest)
    # a complete file with fewer rows than the manifest records for it
    writer = EmbeddingWriter(tmp_path / "short", ["a"], StoreSpec("/m", "fp-test", 8, "fp32", 2))
    writer.write_shard(writer.shards[0], {"prompt_embeds": torch.randn(1, 8, 4),
                                          "pooled_prompt_embeds": torch.randn(1, 3)}, [False])
    shutil.copy(tmp_path / "short" / "shard-00000.safetensors", shard)
    with pytest.raises(ValueError, match="shard-00001.*not the shard .* records.*num_prompts 1 .manifest: 2"):
        EmbeddingDataset(manifest)


def test_corrupt_safetensors_in_the_model_folder(tmp_path, tiny_flux_dir):
    model = _model_stub(tmp_path, tiny_flux_dir)
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"diffusion_pytorch_model.safetensors is not a complete safetensors file "
                                         r"\(truncated.*re-download the model"):
        _grpo_on(model, tmp_path)
    weights.write_bytes(b"<html>404 Not Found</html>" * 10)  # a failed download saved as the file
    with pytest.raises(ValueError, match="transformer.*header length .*exceeds.*re-download the model"):
        _grpo_on(model, tmp_path)
    shutil.copy(tiny_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors", weights)
    vae = model / "vae" / "diffusion_pytorch_model.safetensors"
    vae.write_bytes(vae.read_bytes()[:4])
    with pytest.raises(ValueError, match=r"vae.*shorter than the 8-byte header.*re-download the model"):
        _grpo_on(model, tmp_path)


def test_corrupt_safetensors_embedding_shard(tmp_path):
    manifest = _store(tmp_path / "emb")
    shard = tmp_path / "emb" / "shard-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[8:20] = b"\xff" * 12  # garbage in the JSON header
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="shard-00002.*header is not JSON.*re-run preprocess_embeddings.py"):
        EmbeddingDataset(manifest)


def test_corrupt_safetensors_text_encoder_fails_preprocessing_before_loading(tmp_path, tiny_flux_dir, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_flux_dir, model)
    weights = model / "text_encoder_2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\n")
    with pytest.raises(SystemExit) as stop:  # a bad input: one line naming the fix, exit status 2
        _preprocess_main(["--model_path", str(model), "--prompt_file", str(prompts), "--output_dir",
                          str(tmp_path / "out"), "--device", "cpu"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1
    assert re.search("error: .*text_encoder_2.*truncated.*re-download the model", lines[0]), lines
    assert not (tmp_path / "out").exists()


def test_reward_checkpoint_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="--hps_checkpoint .*nope.pt.* is not a file.*fix the path given to "
                                                "--hps_checkpoint"):
        build_reward("hpsv2:1.0", "cpu", hps_checkpoint=str(tmp_path / "nope.pt"))
    with pytest.raises(FileNotFoundError, match="needs --hps_checkpoint.*pass --hps_checkpoint /path/to/it"):
        build_reward("hpsv2:1.0", "cpu")


def test_reward_checkpoint_of_the_wrong_architecture(tmp_path, hps_flags):
    from fastvideo.rewards.hpsv2 import TINY_MODEL_CONFIG

    checkpoint = hps_flags[hps_flags.index("--hps_checkpoint") + 1]
    other = json.loads(json.dumps(TINY_MODEL_CONFIG))
    other["embed_dim"] = 48
    config = tmp_path / "vit-other.json"
    config.write_text(json.dumps(other))
    with pytest.raises(ValueError, match="--hps_checkpoint.*does not fit the architecture --hps_model.*pass the "
                                         "matching model name or config JSON to --hps_model"):
        build_reward("hpsv2:1.0", "cpu", hps_checkpoint=checkpoint, hps_model=str(config))


def test_reward_checkpoint_corrupt(tmp_path, hps_flags):
    config = hps_flags[hps_flags.index("--hps_model") + 1]
    checkpoint = Path(hps_flags[hps_flags.index("--hps_checkpoint") + 1])
    cut = tmp_path / "hps-cut.pt"
    cut.write_bytes(checkpoint.read_bytes()[:5000])
    with pytest.raises(ValueError, match="--hps_checkpoint .*hps-cut.pt.* cannot be read as a weights-only "
                                         "checkpoint.*re-download it"):
        build_reward("hpsv2:1.0", "cpu", hps_checkpoint=str(cut), hps_model=config)
    pickled = tmp_path / "hps-object.pt"
    torch.save({"state_dict": SimpleNamespace(x=1)}, pickled)  # a pickled object: weights_only refuses it
    with pytest.raises(ValueError, match="cannot be read as a weights-only checkpoint.*plain state dict"):
        build_reward("hpsv2:1.0", "cpu", hps_checkpoint=str(pickled), hps_model=config)


def test_lora_target_modules_that_match_nothing(tmp_path, tiny_flux_dir):
    model = _model_stub(tmp_path, tiny_flux_dir)
    with pytest.raises(ValueError, match="--lora_target_modules attn.to_qq matches no linear layer.*e.g. .*attn.to_q "
                                         "attn.to_k"):
        _grpo_on(model, tmp_path, "--lora_rank", "2", "--lora_target_modules", "attn.to_q", "attn.to_qq")
    _grpo_on(model, tmp_path, "--lora_rank", "2", "--lora_target_modules", "attn.to_q", "proj_mlp")


def test_empty_prompt_file(tmp_path):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n   \n")
    with pytest.raises(ValueError, match="contains no prompts; write one prompt per line"):
        read_prompt_file(empty)


def test_prompt_file_with_a_non_utf8_line(tmp_path):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"a red cube\ncaf\xe9 sign\n")  # Latin-1
    with pytest.raises(ValueError, match="line 2: not valid UTF-8.*re-save the file as UTF-8"):
        read_prompt_file(bad)


def test_resume_from_a_path_that_is_not_a_checkpoint(tmp_path):
    from fastvideo.checkpoint import checkpoint_step

    (tmp_path / "weights").mkdir()
    with pytest.raises(ValueError, match="is not a checkpoint folder.*OUTPUT_DIR/checkpoints/step-N or --resume_from "
                                         "latest"):
        checkpoint_step(tmp_path / "weights")
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder; use 'latest'"):
        _grpo(tmp_path, "--resume_from", str(tmp_path / "nope"))


# ------------------------------------------------------------------------------------------------ safe paths
@pytest.mark.parametrize("entry, problem", [("/etc/passwd", "is an absolute path"),
                                            ("../other/shard-00000.safetensors", "outside"),
                                            ("link.safetensors", "outside")])
def test_manifest_paths_cannot_leave_their_folder(tmp_path, entry, problem):
    manifest = _store(tmp_path / "emb")
    _store(tmp_path / "other")
    (tmp_path / "emb" / "link.safetensors").symlink_to(tmp_path / "other" / "shard-00000.safetensors")
    record = json.loads(manifest.read_text())
    record["shards"][0]["file"] = entry
    manifest.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=f"manifest.json: entry .*{problem}.*rewrite .*manifest.json"):
        EmbeddingDataset(manifest)


def test_weight_index_paths_cannot_leave_their_folder(tmp_path, tiny_flux_dir):
    model = _model_stub(tmp_path, tiny_flux_dir)
    (model / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"proj_out.weight": "../vae/diffusion_pytorch_model.safetensors"}}))
    with pytest.raises(ValueError, match="index.json: entry .*outside"):
        _grpo_on(model, tmp_path)


def test_pair_file_paths_cannot_leave_their_folder(tmp_path):
    from PIL import Image

    from fastvideo.preference import read_preference_file

    Image.new("RGB", (64, 64)).save(tmp_path / "outside.png")
    pairs = tmp_path / "run" / "pairs.jsonl"
    pairs.parent.mkdir()
    Image.new("RGB", (64, 64), "red").save(pairs.parent / "a.png")
    pairs.write_text(json.dumps({"prompt": "p", "chosen": "a.png", "rejected": "../outside.png"}) + "\n"
                     + json.dumps({"prompt": "p", "chosen": str(tmp_path / "outside.png"), "rejected": "a.png"}))
    with pytest.raises(ValueError, match=r"(?s)pairs.jsonl:1: rejected ../outside.png: resolves to .*outside the "
                                         r"pair file's folder.*pairs.jsonl:2: chosen .*is an absolute path; write it "
                                         r"relative"):
        read_preference_file(pairs, ["p"], 64, 64)


# ----------------------------------------------------------------------------------------------- safe loading
SCANNED = [*sorted((REPO / "fastvideo").rglob("*.py")), *sorted(REPO.glob("*.py")),
           *sorted((REPO / "benchmarks").rglob("*.py")), *sorted((REPO / "scripts").rglob("*.py"))]


def _unsafe_calls(path: Path, root: Path = REPO) -> list[str]:
    """``file:line: what`` for each unsafe call in a Python file: torch.load without weights_only=True, pickle /
    np.load(allow_pickle=True), subprocess with shell=True, trust_remote_code=True."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        keywords = {k.arg: k.value for k in node.keywords}
        true = {k for k, v in keywords.items() if isinstance(v, ast.Constant) and v.value is True}
        where = f"{path.relative_to(root)}:{node.lineno}"
        if func.endswith("torch.load") and "weights_only" not in true:
            found.append(f"{where}: {func}(...) without weights_only=True")
        if func.startswith(("pickle.", "cPickle.", "dill.")) and func.split(".")[-1] in ("load", "loads", "Unpickler"):
            found.append(f"{where}: {func}")
        if func.endswith(("np.load", "numpy.load")) and "allow_pickle" in true:
            found.append(f"{where}: {func}(allow_pickle=True)")
        found += [f"{where}: {func}({k}=True)" for k in ("shell", "trust_remote_code") if k in true]
    return found


def test_sources_load_nothing_unsafely():
    assert len(SCANNED) > 30 and REPO / "fastvideo" / "checkpoint.py" in SCANNED
    unsafe = [line for path in SCANNED for line in _unsafe_calls(path)]
    assert not unsafe, "unsafe loading (use weights_only=True, safetensors, argument lists):\n" + "\n".join(unsafe)


def test_the_scan_finds_what_it_looks_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import pickle, subprocess, torch\nimport numpy as np\ntorch.load('a')\n"
                     "torch.load('b', weights_only=False)\npickle.loads(b'')\nsubprocess.run('ls', shell=True)\n"
                     "np.load('c', allow_pickle=True)\nf(trust_remote_code=True)\n"
                     "torch.load('ok', weights_only=True)\n")
    assert [line.split(": ", 1)[1] for line in _unsafe_calls(probe, tmp_path)] == [
        "torch.load(...) without weights_only=True", "torch.load(...) without weights_only=True", "pickle.loads",
        "subprocess.run(shell=True)", "np.load(allow_pickle=True)", "f(trust_remote_code=True)"]


# ------------------------------------------------------------------------------------------------- helpers
def _preprocess_main(argv: list[str]) -> None:
    """preprocess_embeddings.main in this process (its input checks run before any encoder loads)."""
    load_script(REPO / "preprocess_embeddings.py", "preprocess_embeddings").main(argv)
