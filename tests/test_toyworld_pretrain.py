"""The pretrained toy FLUX: deterministic pretraining, the shipped weights (loadable, accuracy band, reproduced by the
script), the prompt files and the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO
from safetensors.torch import load_file

from fastvideo.models import flux
from fastvideo.toyworld import scenes
from fastvideo.toyworld.scenes import write_prompt_files
from fastvideo.toyworld.pretrain import (EVAL_FILE, INFO_FILE, SHIPPED, PretrainConfig, build_from_shipped,
                                         cpu_fingerprint, evaluate, pretrain, weights_digest)

SMALL = PretrainConfig(num_scenes=64, vae_steps=3, vae_batch=8, steps=3, batch=8, warmup=1, eval_prompts=4,
                       sample_steps=2, heads=2, head_dim=8, double_layers=1, single_layers=1, layout="tidy",
                       cond_dropout=0.5)


def _weights(folder) -> dict[str, torch.Tensor]:
    return {f"{part}/{k}": v for part in ("vae", "transformer")
            for k, v in load_file(folder / part / "diffusion_pytorch_model.safetensors").items()}


# slow for the default suite's time: pretraining itself runs only here and in the evidence tier (the reproduction
# below); its configuration checks run by default (test_pretrain_config_is_checked)
@pytest.mark.slow(cover="test_toyworld_pretrain.py::test_pretrain_config_is_checked", cost_s=40)
def test_pretrain_is_deterministic_and_loads_in_fluxpipeline(tmp_path, monkeypatch):
    from diffusers import FluxPipeline

    from fastvideo.toyworld import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "PREFIX_STEPS", 2)
    a = pretrain(tmp_path / "a", SMALL, log=None)
    b = pretrain(tmp_path / "b", SMALL, log=None)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((a / EVAL_FILE).read_text()) == json.loads((b / EVAL_FILE).read_text())
    info = json.loads((a / INFO_FILE).read_text())
    assert info["config"]["steps"] == 3 and info["recommended"]["max_sequence_length"] == SMALL.text_len
    assert info["cpu"] == cpu_fingerprint() and " / " in info["cpu"]  # what the bit-for-bit variant is keyed on
    # the digests a stopped run re-makes: the whole VAE and the transformer EMA after PREFIX_STEPS (2 here) steps
    digests, vae = pretrain_module.pretrain_prefix(SMALL)
    assert digests == info["digests"] and set(digests) == {"vae", "transformer_prefix"}
    assert digests["vae"] == pretrain_module.weights_digest(flux.load_vae(a))
    cfg_free = pretrain(tmp_path / "d", PretrainConfig(**{**SMALL.__dict__, "cond_dropout": 0.0}), log=None)
    assert not torch.equal(_weights(cfg_free)["transformer/proj_out.weight"], wa["transformer/proj_out.weight"])
    other = pretrain(tmp_path / "c", PretrainConfig(**{**SMALL.__dict__, "seed": 1}), log=None)
    assert not torch.equal(_weights(other)["transformer/proj_out.weight"], wa["transformer/proj_out.weight"])

    pipe = FluxPipeline.from_pretrained(a, local_files_only=True)
    image = pipe("two red circles left of a blue square", height=64, width=64, num_inference_steps=2,
                 max_sequence_length=16, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()


def test_pretrain_config_is_checked():
    with pytest.raises(ValueError, match="multiple of 8"):
        PretrainConfig(size=60)
    with pytest.raises(ValueError, match="steps must be >= 1|batch must be >= 1"):
        PretrainConfig(batch=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        PretrainConfig(layout="neat")
    with pytest.raises(ValueError, match=r"cond_dropout must be in \[0, 1\)"):
        PretrainConfig(cond_dropout=1.0)


# evidence: the shipped model's accuracy bands; the model built from the shipped weights and the verifier run by default
# in the toy-world tests (e.g. the study's smoke run, test_algorithms_study.py)
@pytest.mark.evidence(cover="test_algorithms_study.py::test_smoke_runs_grpo_and_awm", cost_s=5)
def test_shipped_model_follows_training_prompts_and_composes_heldout_pairs(tmp_path):
    """Seeded: 128 train and 128 held-out prompts, ODE samples at the recommended settings (32 px, 8 Euler steps, no
    CFG), scored by the verifier (here: train score 0.799, strict 0.508; held-out score 0.670, strict 0.328, shape
    0.469). Held-out prompts pair two known objects never seen together; the model composes them well above chance
    (issue 31's bars: held-out strict >= 0.15, training strict >= 0.25), below its training-prompt accuracy (room for
    RL)."""
    folder = build_from_shipped(tmp_path / "toy")
    shipped_eval = json.loads((SHIPPED / EVAL_FILE).read_text())
    info = json.loads((folder / INFO_FILE).read_text())
    cfg = PretrainConfig(**info["config"])
    transformer = flux.load_transformer(folder).eval()
    vae = flux.load_vae(folder).eval()
    encoders = flux.load_text_encoders(folder)
    geometry = flux.latent_geometry(vae, cfg.size, cfg.size)
    with torch.no_grad():
        result = evaluate(transformer, vae, encoders, cfg, geometry, num_prompts=128)
    # chance (a valid scene of another prompt of the split, docs/toy-world.md), train / held-out: score 0.235 / 0.248,
    # colour 0.50 / 0.53, shape 0.18 / 0.20, count 0.19, position 0.08 / 0.07, strict 0.002 / 0.000
    train, heldout = result["train"], result["heldout"]
    assert train["score"] > 0.7 and train["strict"] >= 0.3, train
    assert train["color"] > 0.95 and train["shape"] > 0.65 and train["count"] > 0.65 and train["position"] > 0.55, train
    assert 0.55 < heldout["score"] < train["score"] and 0.15 <= heldout["strict"] < train["strict"], heldout
    assert heldout["color"] > 0.9 and heldout["shape"] > 0.35 and heldout["count"] > 0.5, heldout
    assert heldout["position"] > 0.4, heldout
    # the shipped eval.json (256 prompts per split) agrees with this 128-prompt evaluation
    for split in ("train", "heldout"):
        assert abs(shipped_eval[split]["score"] - result[split]["score"]) < 0.05
    assert shipped_eval["heldout"]["strict"] >= 0.15 and shipped_eval["train"]["strict"] >= 0.25, shipped_eval


def test_prompt_files(tmp_path):
    files = write_prompt_files(tmp_path)
    train, heldout = (files[k].read_text().splitlines() for k in ("train", "heldout"))
    ref_train, ref_heldout = scenes.split_prompts()
    assert sorted(train) == ref_train and sorted(heldout) == ref_heldout
    assert train != ref_train  # shuffled, so the first N lines are a uniform sample
    assert write_prompt_files(tmp_path / "again")["heldout"].read_text() == files["heldout"].read_text()
    assert write_prompt_files(tmp_path / "other", seed=1)["heldout"].read_text() != files["heldout"].read_text()


def test_cli_refuses_a_non_empty_out(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("keep me")
    proc = subprocess.run([sys.executable, "-m", "fastvideo.toyworld", "build", "--out", str(tmp_path / "x")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and "not empty" in proc.stderr
    assert (tmp_path / "x" / "file").read_text() == "keep me"


SHIPPED_INFO = json.loads((SHIPPED / INFO_FILE).read_text())
SAME_CPU = SHIPPED_INFO.get("cpu") == cpu_fingerprint()


PREFIX_SCRIPT = """
import json, sys
from fastvideo.toyworld.pretrain import PretrainConfig, pretrain_prefix
cfg = PretrainConfig(**json.loads(sys.argv[1]))
digests, vae = pretrain_prefix(cfg)
vae.save_pretrained(sys.argv[2], safe_serialization=True)
print(json.dumps(digests))
"""


@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def prefix(tmp_path_factory):
    """(digests, VAE folder) of ``pretrain_prefix`` with the shipped config at the shipped weights' thread count: the
    whole VAE phase and the transformer's first ``PREFIX_STEPS`` steps (minutes instead of the whole run)."""
    out = tmp_path_factory.mktemp("prefix") / "vae"
    env = {**os.environ, "OMP_NUM_THREADS": str(SHIPPED_INFO["threads"])}
    proc = subprocess.run([sys.executable, "-c", PREFIX_SCRIPT, json.dumps(SHIPPED_INFO["config"]), str(out)],
                          cwd=REPO, env=env, check=True, capture_output=True, text=True, timeout=3600)
    return json.loads(proc.stdout.strip().splitlines()[-1]), out


# evidence (minutes): pretraining reproduces the shipped weights that the default suite's toy_world fixture loads
@pytest.mark.evidence(cover="test_toyworld_pretrain.py::test_pretrain_config_is_checked", cost_s=95)
@pytest.mark.skipif(not SAME_CPU, reason="bit-for-bit needs the CPU the shipped weights were made on (toyworld.json "
                                         f"'cpu': {SHIPPED_INFO.get('cpu')}, here: {cpu_fingerprint()}); the "
                                         "cross-CPU variant below runs instead")
def test_pretrain_reproduces_the_shipped_weights(prefix):
    """On the CPU that made them, the shipped config with their thread count re-makes the recorded digests bit for
    bit: the shipped VAE itself and the transformer's EMA after PREFIX_STEPS steps (the whole run records it)."""
    digests, _ = prefix
    assert digests == SHIPPED_INFO["digests"]
    assert digests["vae"] == weights_digest(flux.load_vae(SHIPPED))


# evidence (the run shared with the test above)
@pytest.mark.evidence(cover="test_toyworld_pretrain.py::test_pretrain_config_is_checked", cost_s=5)
def test_pretrain_on_this_cpu_gives_the_shipped_vae(prefix):
    """On any CPU, pretraining gives the shipped VAE up to the float32 summation order of its kernels: every tensor of
    at least 256 values, and the whole VAE, within 3% (relative norm) of the shipped one. A smaller tensor (a
    GroupNorm's 16 biases) is checked within the whole: its relative norm is set by one or two values, so the drift
    that summation order leaves is not averaged out there (on an AMD EPYC against the shipped Intel Xeon weights: three
    16-value biases at 3.4-3.5%, every larger tensor within 2.1%, the whole VAE 0.74%)."""
    _, folder = prefix
    made = load_file(folder / "diffusion_pytorch_model.safetensors")
    shipped = load_file(SHIPPED / "vae" / "diffusion_pytorch_model.safetensors")
    assert made.keys() == shipped.keys()

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()

    far = {k: r for k in made if made[k].numel() >= 256 and (r := rel(made[k], shipped[k])) > 0.03}
    assert not far, f"tensors more than 3% from the shipped weights: {far}"
    whole = rel(torch.cat([made[k].flatten() for k in made]), torch.cat([shipped[k].flatten() for k in made]))
    assert whole <= 0.03, f"the whole VAE is {whole:.2%} from the shipped weights"
