"""Rewards: registry/spec parsing, JPEG rewards, HPS v2 (tiny checkpoint), CLIP score, aesthetic, PickScore."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from fastvideo.rewards import REWARD_NAMES, build_reward, parse_reward_spec

PROMPTS = ["a red fox in the snow", "a bowl of ramen", "an astronaut riding a horse"]


def _smooth_images(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """(n,3,h,w) in [0,1]: upsampled low-resolution noise, i.e. image-like content."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 6, 6, generator=g)
    return torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)


def assert_scores_close(got: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    """``got`` == reference within ``atol`` < 0.1 x the scores' spread: a looser atol passes another image's score."""
    spread = (expected.max() - expected.min()).item()
    assert atol < 0.1 * spread, f"atol {atol:g} does not tell these images apart (score spread {spread:.3g})"
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)


def _to_pil(image: torch.Tensor):
    from PIL import Image

    return Image.fromarray((image.permute(1, 2, 0) * 255).round().clamp(0, 255).to(torch.uint8).numpy())


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    """(checkpoint path, config JSON path) of the tiny HPS model."""
    from fastvideo.rewards.hpsv2 import TINY_CHECKPOINT, TINY_CONFIG, build_tiny_hps

    out = build_tiny_hps(tmp_path_factory.mktemp("hps-tiny"), seed=0)
    return out / TINY_CHECKPOINT, out / TINY_CONFIG


@pytest.fixture(scope="module")
def hps_fn(tiny_hps):
    ckpt, cfg = tiny_hps
    return build_reward("hpsv2", "cpu", hps_checkpoint=str(ckpt), hps_model=str(cfg))


@pytest.fixture(scope="module")
def tiny_hf_clip(tmp_path_factory):
    """(model dir, processor dir) of a tiny transformers CLIPModel with a byte-level CLIP tokenizer."""
    from open_clip.tokenizer import bytes_to_unicode
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    root = tmp_path_factory.mktemp("tiny-hf-clip")
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer)
    processor.save_pretrained(root / "processor")
    special = dict(bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                   pad_token_id=vocab["<|endoftext|>"])
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77, **special),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16),
        projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(root / "model")
    return root / "model", root / "processor"


# ----------------------------------------------------------------------------------------------- registry
def test_import_is_light():
    code = ("import sys, fastvideo.rewards, fastvideo.rewards.hpsv2, fastvideo.rewards.pickscore, "
            "fastvideo.rewards.aesthetic, fastvideo.rewards.clipscore, fastvideo.rewards.jpeg; "
            "print(sorted(m for m in ('open_clip', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_parse_reward_spec():
    assert parse_reward_spec("hpsv2:1.0,jpeg_compressibility:0.5") == [("hpsv2", 1.0), ("jpeg_compressibility", 0.5)]
    assert parse_reward_spec(" pickscore , aesthetic: -2e-1 ") == [("pickscore", 1.0), ("aesthetic", -0.2)]
    assert set(REWARD_NAMES) == {"hpsv2", "pickscore", "clipscore", "aesthetic", "jpeg_compressibility",
                                 "jpeg_incompressibility", "toyworld", "toyworld_clean", "toyworld_strict",
                                 "toyworld_motion", "toyworld_motion_strict", "toyworld_edit", "toyworld_edit_strict",
                                 "geneval"}


@pytest.mark.parametrize("spec, match", [
    ("hps:1.0", "unknown reward 'hps'.*valid names: hpsv2, pickscore"),
    ("hpsv2:abc", "malformed weight 'abc'.*valid names"),
    ("hpsv2:", "malformed weight ''"),
    ("hpsv2:nan", "must be finite"),
    ("hpsv2,hpsv2:2", "appears twice"),
    ("", "empty reward spec"),
    ("jpeg_compressibility:1,", "unknown reward ''"),
])
def test_bad_specs_are_value_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        build_reward(spec, "cpu")


@pytest.mark.parametrize("spec, flag", [
    ("hpsv2", "--hps_checkpoint"),
    ("clipscore", "--clip_checkpoint"),
    ("pickscore", "--pickscore_model"),
    ("aesthetic", "--aesthetic_checkpoint"),
    ("jpeg_compressibility,aesthetic", "--aesthetic_checkpoint"),
])
def test_missing_checkpoint_names_the_flag(spec, flag):
    with pytest.raises(FileNotFoundError, match=flag):
        build_reward(spec, "cpu")


def test_missing_paths_name_the_flag(tmp_path, tiny_hps):
    ckpt, _ = tiny_hps
    with pytest.raises(FileNotFoundError, match="--hps_checkpoint.*nope.pt"):
        build_reward("hpsv2", "cpu", hps_checkpoint=str(tmp_path / "nope.pt"))
    with pytest.raises(FileNotFoundError, match="--hps_model"):
        build_reward("hpsv2", "cpu", hps_checkpoint=str(ckpt), hps_model=str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="--pickscore_processor"):
        build_reward("pickscore", "cpu", pickscore_model=str(tmp_path))
    with pytest.raises(ValueError, match="--hps_model 'ViT-Nope'"):
        build_reward("hpsv2", "cpu", hps_checkpoint=str(ckpt), hps_model="ViT-Nope")


def test_bad_inputs():
    fn = build_reward("jpeg_compressibility", "cpu")
    with pytest.raises(ValueError, match="one prompt per image"):
        fn(torch.rand(2, 3, 8, 8), ["only one"])
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        fn(torch.rand(2, 8, 8), ["a", "b"])


# ----------------------------------------------------------------------------------------------- JPEG
def test_jpeg_rewards_rank_flat_above_noise():
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    images, prompts = torch.cat([flat, noise]), ["flat", "noise"]
    comp = build_reward("jpeg_compressibility", "cpu")(images, prompts)["jpeg_compressibility"]
    incomp = build_reward("jpeg_incompressibility", "cpu")(images, prompts)["jpeg_incompressibility"]
    assert comp[0] > comp[1] and incomp[0] < incomp[1]
    torch.testing.assert_close(comp, -incomp)


def test_jpeg_value_is_size_over_500_kb():
    import io

    images = _smooth_images(3, 48, 80)
    sizes = []
    for image in images:
        buffer = io.BytesIO()
        _to_pil(image).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000 / 500)
    out = build_reward("jpeg_incompressibility", "cpu")(images, PROMPTS)
    # exact: the sizes differ by 14-39 bytes (spread 7.8e-5), assert_close's default atol 1e-5 is 5 bytes
    assert_scores_close(out["jpeg_incompressibility"], torch.tensor(sizes, dtype=torch.float32), atol=0)


def test_jpeg_thread_pool_matches_serial(monkeypatch):
    from fastvideo.rewards import jpeg
    from fastvideo.rewards.jpeg import JpegSizeScorer

    monkeypatch.setattr(jpeg, "_PARALLEL_MIN_PIXELS", 0)
    images = torch.rand(3, 3, 40, 40, generator=torch.Generator().manual_seed(1))
    pooled = JpegSizeScorer(-1.0, max_workers=2)(images, PROMPTS)
    serial = JpegSizeScorer(-1.0, max_workers=1)(images, PROMPTS)
    assert torch.equal(pooled, serial)


def test_weighted_sum_and_components():
    images = torch.cat([torch.full((1, 3, 32, 32), 0.3), torch.rand(2, 3, 32, 32)])
    fn = build_reward("jpeg_compressibility:2.0,jpeg_incompressibility:0.5", "cpu")
    out = fn(images, PROMPTS)
    assert list(out) == ["total", "jpeg_compressibility", "jpeg_incompressibility"]
    for value in out.values():
        assert value.shape == (3,) and value.dtype == torch.float32 and value.device.type == "cpu"
    expected = 2.0 * out["jpeg_compressibility"] + 0.5 * out["jpeg_incompressibility"]
    torch.testing.assert_close(out["total"], expected)
    assert fn.weights == {"jpeg_compressibility": 2.0, "jpeg_incompressibility": 0.5}


def test_nan_image_names_reward_and_prompt():
    images = torch.rand(3, 3, 16, 16)
    images[1, 0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="'jpeg_compressibility'.*'a bowl of ramen'.*NaN"):
        build_reward("jpeg_compressibility", "cpu")(images, PROMPTS)


# ----------------------------------------------------------------------------------------------- HPS v2
def test_tiny_hps_is_small_and_deterministic(tmp_path, tiny_hps):
    from fastvideo.rewards.hpsv2 import TINY_CHECKPOINT, build_tiny_hps

    ckpt, cfg = tiny_hps
    assert ckpt.stat().st_size < 5e6
    assert set(json.loads(cfg.read_text())) >= {"embed_dim", "vision_cfg", "text_cfg"}
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(build_tiny_hps(tmp_path / "again", seed=0) / TINY_CHECKPOINT) == digest(ckpt)
    assert digest(build_tiny_hps(tmp_path / "other", seed=1) / TINY_CHECKPOINT) != digest(ckpt)
    state = torch.load(ckpt, weights_only=True)
    assert list(state) == ["state_dict"]  # HPS's checkpoint format, ViT-H-14's key layout
    keys = state["state_dict"].keys()
    assert {"visual.conv1.weight", "visual.proj", "token_embedding.weight", "text_projection", "logit_scale"} <= keys


def test_hps_scores_finite_deterministic_batch_invariant(hps_fn):
    images = _smooth_images(3, 64, 96)
    scores = hps_fn(images, PROMPTS)["hpsv2"]
    assert torch.isfinite(scores).all() and scores.abs().max() <= 1.0
    torch.testing.assert_close(hps_fn(images, PROMPTS)["hpsv2"], scores, rtol=0, atol=0)
    per_image = [hps_fn(images[i:i + 1], PROMPTS[i:i + 1]) for i in range(3)]
    # measured: 8e-8 apart; the scores spread over 0.047
    assert_scores_close(torch.cat([out["hpsv2"] for out in per_image]), scores, atol=1e-6)
    assert_scores_close(torch.cat([out["total"] for out in per_image]), scores, atol=1e-6)
    swapped = hps_fn(images, PROMPTS[::-1])["hpsv2"]
    assert not torch.allclose(swapped, scores)  # the prompt matters


def test_hps_preprocess_pads_rather_than_crops():
    from fastvideo.rewards._common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    from fastvideo.rewards.hpsv2 import hps_preprocess, hps_resize_max_size

    images = 0.2 + 0.6 * _smooth_images(2, 64, 128)  # content never 0
    resized = hps_resize_max_size(images, 224)
    assert resized.shape == (2, 3, 224, 224)
    assert (resized[:, :, :56] == 0).all() and (resized[:, :, 168:] == 0).all()  # 112 rows of content, centred
    assert (resized[:, :, 56:168] > 0).all()
    tall = hps_resize_max_size(images.transpose(2, 3), 224)
    assert (tall[..., :56] == 0).all() and (tall[..., 168:] == 0).all() and (tall[..., 56:168] > 0).all()
    normalized = hps_preprocess(images)
    assert normalized.dtype == torch.float32
    pad_value = -torch.tensor(OPENAI_CLIP_MEAN) / torch.tensor(OPENAI_CLIP_STD)
    torch.testing.assert_close(normalized[0, :, 0, 0], pad_value)


def _hps_reference(image: torch.Tensor) -> torch.Tensor:
    """HPS v2's preprocess_val on one image, in plain torchvision (hpsv2 1.2.0, src/open_clip/transform.py).

    image_transform(224, is_train=False, resize_longest_max=True): ToTensor() of the uint8 PIL image, then
    ResizeMaxSize(224, fill=0): scale = 224 / max(h, w); new_size = round(dim * scale); F.resize(tensor,
    new_size, BICUBIC) (antialias=True, torchvision's default since 0.17); F.pad([pad_w//2, pad_h//2,
    pad_w - pad_w//2, pad_h - pad_h//2], fill=0); then Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD).
    HPS guards resize and pad with ``if scale != 1.0`` (a 224x150 image stays 224x150); we pad it anyway.
    """
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    tensor = TF.to_tensor(_to_pil(image))
    h, w = tensor.shape[1:]
    scale = 224 / float(max(h, w))
    new_size = [round(dim * scale) for dim in (h, w)]
    tensor = TF.resize(tensor, new_size, interpolation=InterpolationMode.BICUBIC, antialias=True)
    pad_h, pad_w = 224 - new_size[0], 224 - new_size[1]
    tensor = TF.pad(tensor, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
    return TF.normalize(tensor, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


@pytest.mark.parametrize("h, w", [
    (64, 64),  # upscaled noise
    (512, 384), (384, 512),  # downscaled, both orientations
    (64, 128), (128, 64), (37, 53),  # upscaled non-square, odd padding
    (224, 150), (150, 224),  # longer side already 224: HPS leaves these unpadded, we pad
])
def test_hps_preprocess_matches_hps_torchvision_transform(h, w):
    from fastvideo.rewards.hpsv2 import hps_preprocess

    g = torch.Generator().manual_seed(h * 1000 + w)
    edges = torch.zeros(1, 3, h, w)
    edges[..., w // 3:2 * w // 3] = 1.0  # hard edges, where bicubic overshoots [0, 1]
    images = torch.cat([torch.rand(2, 3, h, w, generator=g), _smooth_images(1, h, w), edges])
    ours = hps_preprocess(images)
    reference = torch.stack([_hps_reference(image) for image in images])
    assert ours.shape == reference.shape == (4, 3, 224, 224) and ours.dtype == torch.float32
    assert (ours - reference).abs().max().item() < 1e-5
    if max(h, w) == 224:  # unpadded by HPS: the content is the input itself, centred in zero padding
        pad_h, pad_w = 224 - h, 224 - w
        core = ours[..., pad_h // 2:pad_h // 2 + h, pad_w // 2:pad_w // 2 + w]
        std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(1, 3, 1, 1)
        mean = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(1, 3, 1, 1)
        torch.testing.assert_close(core * std + mean, (images * 255).round() / 255, rtol=0, atol=1e-6)


def test_hps_preprocess_differs_from_open_clip_pil_transform():
    """open_clip's PIL path (two uint8 passes, rounded and clipped) is what HPS's own transform is not."""
    from open_clip.transform import image_transform

    from fastvideo.rewards.hpsv2 import hps_preprocess

    transform = image_transform(224, is_train=False, resize_mode="longest", fill_color=0)
    images = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))  # noise, upscaled 3.5x
    pil_path = transform(_to_pil(images[0]))[None]
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(1, 3, 1, 1)
    grey_levels = (hps_preprocess(images) - pil_path).abs() * std * 255
    assert grey_levels.max() > 10  # ~45 levels measured
    torch.testing.assert_close(hps_preprocess(images), _hps_reference(images[0])[None], rtol=0, atol=1e-5)


def test_hps_loader_accepts_module_prefix(tmp_path, tiny_hps, hps_fn):
    ckpt, cfg = tiny_hps
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    prefixed = tmp_path / "ddp.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, prefixed)
    images = _smooth_images(2, 64, 64)
    fn = build_reward("hpsv2", "cpu", hps_checkpoint=str(prefixed), hps_model=str(cfg))
    torch.testing.assert_close(fn(images, PROMPTS[:2])["hpsv2"], hps_fn(images, PROMPTS[:2])["hpsv2"])


def test_hps_architecture_mismatch_names_model_flag(tmp_path, tiny_hps):
    from fastvideo.rewards.hpsv2 import TINY_MODEL_CONFIG

    ckpt, _ = tiny_hps
    other = json.loads(json.dumps(TINY_MODEL_CONFIG))
    other["vision_cfg"]["width"] = 48
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    with pytest.raises(ValueError, match="--hps_checkpoint.*does not fit.*--hps_model"):
        build_reward("hpsv2", "cpu", hps_checkpoint=str(ckpt), hps_model=str(path))


def _open_clip_the_old_way(cfg_path, ckpt):
    """What load_open_clip did before building on the meta device: random init, then open_clip.load_checkpoint."""
    import open_clip
    from open_clip.model import CLIP

    net = CLIP(**json.loads(cfg_path.read_text()))
    open_clip.load_checkpoint(net, str(ckpt), strict=True, weights_only=True)
    return net.eval().requires_grad_(False)


@pytest.mark.parametrize("variant", ["hps", "fp32", "safetensors", "resized"])
def test_open_clip_meta_load_is_bit_identical_to_random_init_then_load(tmp_path, tiny_hps, variant):
    """No random init any more: same tensors (parameters and non-persistent buffers such as the causal attn_mask),
    dtypes, layouts and HPS scores as building the model for real and copying the checkpoint in."""
    import copy

    from fastvideo.rewards._common import load_open_clip
    from fastvideo.rewards.hpsv2 import TINY_MODEL_CONFIG, HPSv2Scorer

    ckpt, cfg = tiny_hps  # fp16 {'state_dict': ...}, HPS's format
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    if variant == "fp32":  # a plain fp32 state dict: its tensors become the model's without a copy
        ckpt = tmp_path / "fp32.pt"
        torch.save({k: v.float() for k, v in state.items()}, ckpt)
    elif variant == "safetensors":
        from safetensors.torch import save_file

        ckpt = tmp_path / "model.safetensors"
        save_file({k: v.float().contiguous() for k, v in state.items()}, str(ckpt))
    elif variant == "resized":  # open_clip interpolates both position embeddings (7x7 -> 8x8 grid, 77 -> 64 tokens)
        ckpt = tmp_path / "fp32.pt"  # (in fp32: CPU has no fp16 antialiased bicubic, with or without this change)
        torch.save({k: v.float() for k, v in state.items()}, ckpt)
        other = json.loads(json.dumps(TINY_MODEL_CONFIG))
        other["vision_cfg"]["image_size"] = 256
        other["text_cfg"]["context_length"] = 64
        cfg = tmp_path / "resized.json"
        cfg.write_text(json.dumps(other))
    net, _, preprocess = load_open_clip(str(cfg), ckpt, torch.device("cpu"), model_flag="--hps_model",
                                        checkpoint_flag="--hps_checkpoint", reward="hpsv2")
    old = _open_clip_the_old_way(cfg, ckpt)
    if variant == "resized":
        assert preprocess["size"] == 256 and net.attn_mask.shape == (64, 64)
        assert net.visual.positional_embedding.shape == (65, 32) and net.positional_embedding.shape == (64, 32)

    tensors = dict(net.named_parameters()) | dict(net.named_buffers())
    reference = dict(old.named_parameters()) | dict(old.named_buffers())
    assert "attn_mask" in tensors and list(tensors) == list(reference)
    for name, t in tensors.items():
        ref = reference[name]
        assert (t.dtype, t.device, t.shape, t.stride()) == (ref.dtype, ref.device, ref.shape, ref.stride()), name
        assert torch.equal(t, ref), name
        assert not t.requires_grad and type(t) is type(ref), name
    assert len({t.data_ptr() for t in tensors.values()}) == len(tensors)  # nothing aliased
    assert not net.training and not any(m.training for m in net.modules())

    scorer = HPSv2Scorer(ckpt, str(cfg), "cpu")
    old_scorer = copy.copy(scorer)
    old_scorer.model = old
    for h, w in [(224, 224), (64, 96), (300, 200)]:
        images = _smooth_images(3, h, w, seed=h)
        assert torch.equal(scorer(images, PROMPTS), old_scorer(images, PROMPTS))


def test_open_clip_meta_load_reports_a_mismatch_as_copying_did(tmp_path, tiny_hps):
    """load_state_dict's strict errors (sizes, missing and unexpected keys) read as they did with a real model."""
    import open_clip
    from open_clip.model import CLIP

    from fastvideo.rewards._common import _load_checkpoint_assigning, _parameters_on_meta
    from fastvideo.rewards.hpsv2 import TINY_MODEL_CONFIG

    ckpt, _ = tiny_hps
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    state["extra.weight"] = state.pop("text_projection")
    broken = tmp_path / "broken.pt"
    torch.save({"state_dict": state}, broken)
    other = json.loads(json.dumps(TINY_MODEL_CONFIG))
    other["vision_cfg"]["width"] = 48
    for config, path in [(other, ckpt), (TINY_MODEL_CONFIG, broken)]:
        with pytest.raises(RuntimeError) as old:
            open_clip.load_checkpoint(CLIP(**json.loads(json.dumps(config))), str(path), strict=True)
        with _parameters_on_meta():
            net = CLIP(**json.loads(json.dumps(config)))
        assert net.text_projection.is_meta and not net.attn_mask.is_meta
        with pytest.raises(RuntimeError) as new:
            _load_checkpoint_assigning(net, path, torch.device("cpu"))
        assert str(new.value) == str(old.value) and "Error(s) in loading state_dict for CLIP" in str(new.value)
        assert "load_state_dict" not in vars(net)  # the instance's override is gone again
    with pytest.raises(ValueError, match="--hps_checkpoint.*does not fit"):
        build_reward("hpsv2", "cpu", hps_checkpoint=str(broken), hps_model=str(tiny_hps[1]))


def test_parameters_on_meta_only_in_the_calling_thread():
    import threading

    from fastvideo.rewards._common import _parameters_on_meta

    built = {}
    with _parameters_on_meta():
        here = torch.nn.Linear(3, 2)
        thread = threading.Thread(target=lambda: built.setdefault("other", torch.nn.Linear(3, 2)))
        thread.start()
        thread.join()
    assert here.weight.is_meta and here.bias.is_meta and type(here.weight) is torch.nn.Parameter
    assert not built["other"].weight.is_meta
    assert not torch.nn.Linear(3, 2).weight.is_meta  # the hook is removed on exit


def test_open_clip_falls_back_to_real_init(monkeypatch, tiny_hps):
    """A tower that cannot be built with meta parameters is initialised for real, then loaded as before."""
    import contextlib

    from fastvideo.rewards import _common

    @contextlib.contextmanager
    def unsupported():
        raise NotImplementedError("no meta kernel")
        yield

    ckpt, cfg = tiny_hps
    monkeypatch.setattr(_common, "_parameters_on_meta", unsupported)
    net, _, _ = _common.load_open_clip(str(cfg), ckpt, torch.device("cpu"), model_flag="-", checkpoint_flag="-",
                                       reward="hpsv2")
    old = _open_clip_the_old_way(cfg, ckpt)
    assert all(torch.equal(t, old.state_dict()[k]) for k, t in net.state_dict().items())
    assert not net.attn_mask.is_meta and torch.equal(net.attn_mask, old.attn_mask)


def test_buffer_derived_from_parameters_falls_back_to_real_init():
    """A buffer computed from a parameter would be left on the meta device (Swin's attn_mask): built for real."""
    from fastvideo.rewards._common import _build_uninitialised

    class Derived(torch.nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(n))
            self.register_buffer("twice", self.w.detach() * 2, persistent=False)

    class Plain(Derived):
        def __init__(self, n: int):
            torch.nn.Module.__init__(self)
            self.w = torch.nn.Parameter(torch.ones(n))
            self.register_buffer("twice", torch.full((n,), 2.0), persistent=False)

    derived = _build_uninitialised(Derived, {"n": 3}, torch.device("cpu"))
    assert not derived.w.is_meta and torch.equal(derived.twice, torch.full((3,), 2.0))
    plain = _build_uninitialised(Plain, {"n": 3}, torch.device("cpu"))
    assert plain.w.is_meta and torch.equal(plain.twice, torch.full((3,), 2.0))


def test_hps_nan_image_names_reward_and_prompt(hps_fn):
    images = _smooth_images(3, 32, 32)
    images[2] = float("nan")
    with pytest.raises(ValueError, match="'hpsv2'.*'an astronaut riding a horse'"):
        hps_fn(images, PROMPTS)


def test_hps_combined_with_jpeg(tiny_hps, hps_fn):
    ckpt, cfg = tiny_hps
    images = _smooth_images(3, 64, 64)
    fn = build_reward("hpsv2:1.0,jpeg_compressibility:0.5", "cpu", hps_checkpoint=str(ckpt), hps_model=str(cfg))
    out = fn(images, PROMPTS)
    assert_scores_close(out["hpsv2"], hps_fn(images, PROMPTS)["hpsv2"], atol=0)  # the same model and inputs
    assert_scores_close(out["total"], out["hpsv2"] + 0.5 * out["jpeg_compressibility"], atol=1e-7)


# ----------------------------------------------------------------------------------------------- CLIP score
def test_clipscore_on_tiny_open_clip(tiny_hps, hps_fn):
    ckpt, cfg = tiny_hps
    fn = build_reward("clipscore", "cpu", clip_checkpoint=str(ckpt), clip_model=str(cfg))
    square = _smooth_images(3, 224, 224)
    scores = fn(square, PROMPTS)["clipscore"]
    assert torch.isfinite(scores).all() and scores.abs().max() <= 1.0
    # At the input size neither crops, pads nor resizes (CLIP's PIL-style and HPS's tensor resize differ
    # elsewhere), so the same weights give HPS's cosine (measured: 5e-8 apart; the scores spread over 0.074).
    assert_scores_close(scores, hps_fn(square, PROMPTS)["hpsv2"], atol=1e-6)
    wide = _smooth_images(3, 64, 128)
    assert not torch.allclose(fn(wide, PROMPTS)["clipscore"], hps_fn(wide, PROMPTS)["hpsv2"], atol=1e-4)


# ----------------------------------------------------------------------------------------------- aesthetic
def _random_laion_mlp(path, input_size: int):
    from fastvideo.rewards.aesthetic import AestheticMLP

    torch.manual_seed(0)
    state = AestheticMLP(input_size).state_dict()
    assert sorted(state) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    torch.save(state, path)
    return path


def test_aesthetic_open_clip(tmp_path, tiny_hps):
    from fastvideo.rewards._common import load_open_clip
    from fastvideo.rewards.aesthetic import load_aesthetic_mlp
    from open_clip.transform import image_transform

    ckpt, cfg = tiny_hps
    mlp_path = _random_laion_mlp(tmp_path / "mlp.pth", 32)
    fn = build_reward("aesthetic", "cpu", aesthetic_checkpoint=str(mlp_path), aesthetic_clip_checkpoint=str(ckpt),
                      aesthetic_clip_model=str(cfg))
    images = _smooth_images(3, 80, 64)
    scores = fn(images, PROMPTS)["aesthetic"]
    assert scores.shape == (3,) and torch.isfinite(scores).all()
    # Reference: the PIL CLIP transform, normalised image embedding, LAION MLP.
    clip, _, _ = load_open_clip(str(cfg), ckpt, torch.device("cpu"), model_flag="-", checkpoint_flag="-",
                                reward="aesthetic")
    pixels = torch.stack([image_transform(224, is_train=False)(_to_pil(image)) for image in images])
    with torch.no_grad():
        emb = torch.nn.functional.normalize(clip.encode_image(pixels), dim=-1)
        expected = load_aesthetic_mlp(mlp_path)(emb).squeeze(-1)
    # measured: 7e-6 apart (PIL's uint8 resize vs ours); the random MLP's scores spread over only 2.8e-3
    assert_scores_close(scores, expected, atol=3e-5)


def test_aesthetic_transformers_clip_and_dim_check(tmp_path, tiny_hf_clip, tiny_hps):
    model_dir, processor_dir = tiny_hf_clip
    from transformers import CLIPImageProcessor

    CLIPImageProcessor.from_pretrained(processor_dir).save_pretrained(model_dir)  # HF CLIP folders ship one
    fn = build_reward("aesthetic", "cpu", aesthetic_checkpoint=str(_random_laion_mlp(tmp_path / "m.pth", 16)),
                      aesthetic_clip_checkpoint=str(model_dir))
    scores = fn(_smooth_images(2, 40, 40), PROMPTS[:2])["aesthetic"]
    assert torch.isfinite(scores).all()
    ckpt, cfg = tiny_hps  # a 32-dim CLIP with a 16-dim MLP
    with pytest.raises(ValueError, match="embeds to 32 dims but the MLP expects 16"):
        build_reward("aesthetic", "cpu", aesthetic_checkpoint=str(tmp_path / "m.pth"),
                     aesthetic_clip_checkpoint=str(ckpt), aesthetic_clip_model=str(cfg))


# ----------------------------------------------------------------------------------------------- PickScore
def test_pickscore_tiny_transformers_clip(tiny_hf_clip):
    from transformers import CLIPModel, CLIPProcessor

    model_dir, processor_dir = tiny_hf_clip
    fn = build_reward("pickscore", "cpu", pickscore_model=str(model_dir), pickscore_processor=str(processor_dir))
    images = _smooth_images(3, 48, 64)
    scores = fn(images, PROMPTS)["pickscore"]
    assert torch.isfinite(scores).all()
    single = torch.cat([fn(images[i:i + 1], PROMPTS[i:i + 1])["pickscore"] for i in range(3)])
    assert_scores_close(single, scores, atol=2e-5)  # measured: 2e-6 apart; the scores spread over 1.17
    # Reference: PickScore's own recipe on PIL images.
    processor = CLIPProcessor.from_pretrained(processor_dir)
    model = CLIPModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        image_inputs = processor(images=[_to_pil(i) for i in images], return_tensors="pt")
        text_inputs = processor(text=PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
        img = model.get_image_features(**image_inputs)
        txt = model.get_text_features(**text_inputs)
        img, txt = (getattr(t, "pooler_output", t) for t in (img, txt))
        img, txt = img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)
        expected = model.logit_scale.exp() * (img * txt).sum(-1)
    # measured: 0.029 apart (PIL's resize vs ours, times logit_scale 14.3); the scores spread over 1.18
    assert_scores_close(scores, expected, atol=0.05)


# ----------------------------------------------------------------------------------------------- on the device
@pytest.mark.parametrize("settings", [
    dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
    dict(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}),  # PickScore's / CLIP-L's processor
    dict(size={"height": 40, "width": 30}, crop_size={"height": 48, "width": 24}, resample=2),  # crop pads a side
    dict(size={"shortest_edge": 24}, do_center_crop=False),
], ids=["tiny", "clip-224", "hw-bilinear-pad", "no-crop"])
def test_hf_clip_transform_is_the_processor_bit_for_bit(settings):
    """The torch-op transform gives exactly what the transformers processor gave the rewards before (its
    torchvision backend on these [0,1] tensors), for portrait, landscape, square and odd sizes."""
    from transformers import CLIPImageProcessor

    from fastvideo.rewards._common import HFClipTransform, quantize_uint8

    processor = CLIPImageProcessor(**settings)
    transform = HFClipTransform.from_processor(processor)
    for h, w in [(48, 64), (64, 48), (224, 224), (33, 100), (720, 1280)]:
        images = quantize_uint8(_smooth_images(2, h, w, seed=h + w))
        expected = processor(images=list(images), do_rescale=False, return_tensors="pt")["pixel_values"]
        assert torch.equal(transform(images), expected.float()), (settings, h, w)


@pytest.fixture
def no_host_copies(monkeypatch):
    """Record every tensor -> numpy/PIL conversion and every .cpu()/.tolist() made while the fixture is active."""
    from PIL import Image

    calls: list[str] = []
    for name in ("numpy", "__array__", "cpu", "tolist"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            if self.dim() >= 3:  # an image or image batch (tokens and scores are 1-2-D)
                calls.append(f"Tensor.{_name}{tuple(self.shape)}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    fromarray = Image.fromarray
    monkeypatch.setattr(Image, "fromarray", lambda *a, **k: calls.append("Image.fromarray") or fromarray(*a, **k))
    return calls


def test_reward_preprocessing_stays_on_the_device(tmp_path, tiny_hf_clip, tiny_hps, hps_fn, no_host_copies):
    """Every CLIP-family reward preprocesses as torch ops on the images' device: on meta-device images (no data:
    a copy to the host or to numpy raises) each preprocessing returns meta tensors, and a whole scoring call on the
    CPU converts no image batch to numpy/PIL and calls no .cpu()/.tolist() on it. (jpeg_* and toyworld analyse
    pixels on the host by design: one copy per batch.)"""
    from transformers import CLIPImageProcessor

    from fastvideo.rewards._common import quantize_uint8

    model_dir, processor_dir = tiny_hf_clip
    CLIPImageProcessor.from_pretrained(processor_dir).save_pretrained(model_dir)
    ckpt, cfg = tiny_hps
    mlp = str(_random_laion_mlp(tmp_path / "m.pth", 16))
    scorers = {
        "pickscore": build_reward("pickscore", "cpu", pickscore_model=str(model_dir),
                                  pickscore_processor=str(processor_dir)).components[0][2],
        "aesthetic-hf": build_reward("aesthetic", "cpu", aesthetic_checkpoint=mlp,
                                     aesthetic_clip_checkpoint=str(model_dir)).components[0][2],
        "clipscore": build_reward("clipscore", "cpu", clip_checkpoint=str(ckpt),
                                  clip_model=str(cfg)).components[0][2],
        "hpsv2": hps_fn.components[0][2],
    }
    meta = torch.empty(2, 3, 48, 64, device="meta")
    preprocess = {"pickscore": lambda x: scorers["pickscore"].transform(quantize_uint8(x)),
                  "aesthetic-hf": lambda x: scorers["aesthetic-hf"].transform(quantize_uint8(x)),
                  "clipscore": scorers["clipscore"].pixels, "hpsv2": scorers["hpsv2"].pixels}
    for name, fn in preprocess.items():
        assert fn(meta).device.type == "meta", name
    images = _smooth_images(2, 48, 64)
    for name, scorer in scorers.items():
        assert torch.isfinite(scorer(images, PROMPTS[:2])).all(), name
    assert no_host_copies == []


def test_every_reward_flag_is_declared_once_and_reaches_build_reward():
    """The reward flags a trainer hands to ``build_reward`` are derived from the rewards' own declarations (files,
    architecture flags, URL options, --reward_options): each is a keyword of ``build_reward`` and a RewardOptions flag,
    and every such keyword of ``build_reward`` is one of them (a new reward's flag cannot be half wired)."""
    import dataclasses
    import inspect

    from fastvideo.rewards import REWARD_PATH_FLAGS, RewardOptions

    keywords = set(inspect.signature(build_reward).parameters) - {"spec", "device", "batch_size"}
    assert set(REWARD_PATH_FLAGS) == keywords
    assert set(REWARD_PATH_FLAGS) <= {f.name for f in dataclasses.fields(RewardOptions)}
