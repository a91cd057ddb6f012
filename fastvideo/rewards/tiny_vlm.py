"""Build a tiny real Qwen2-VL folder: the local stand-in for a VLM judge (e.g. Qwen2.5-VL-7B-Instruct under vLLM).

The folder is what ``Qwen/Qwen2-VL-2B-Instruct`` looks like on disk, only small (~0.4M parameters, < 2 MB):
``config.json`` + ``model.safetensors`` (``Qwen2VLForConditionalGeneration``, 2 text layers 32 wide, a 2-block vision
tower with Qwen2-VL's 14-pixel patches and 2x2 merge), ``generation_config.json``, and a real ``Qwen2VLProcessor``
(``Qwen2VLImageProcessor`` limited to 112x112 pixels, i.e. at most 16 image tokens; a small byte-level BPE tokenizer
built offline like FLUX.2's tiny ones, with Qwen's chat specials and Qwen2-VL-Instruct's own chat template, which places
``<|vision_start|><|image_pad|><|vision_end|>`` per image). Stock ``AutoProcessor`` / ``AutoModelForImageTextToText``
load it with ``local_files_only=True``; nothing is downloaded.

Weights are random but seeded (same seed => same files). Deterministic edits make it a usable *judge* stand-in: hidden
dimension 0 is a constant feature (every embedding holds ``CONSTANT`` there and no layer writes to it), from which the
lm_head gives the judge words (``Yes``/``No`` in their spellings, with and without a leading space) and the digits a
logit prior, the other tokens' rows scaled down; so these 20 tokens rank above the rest of the vocabulary (by nats, on
every input tried), i.e. fill the top-20 a yes/no judge reads, while their relative probabilities still move with the
image and the text, and a rating question gets digits. A random model knows nothing, so its answers are not
judgements: the folder exists to exercise the real path (HTTP, image encoding, chat template, generation, logprobs,
parsing) on a CPU.

CLI: ``python -m fastvideo.rewards.tiny_vlm OUT [--seed N]``; serve it with
``python -m fastvideo.rewards.serve --chat_model OUT --port 8000`` (or ``python -m fastvideo.rewards.chat_server
--model OUT``).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from fastvideo.models.flux2_presets import _byte_bpe
from fastvideo.seeding import derive_seed
from fastvideo.tiny import write_atomically

INFO_FILE = "tiny_vlm.json"  # what the folder is: seed, sizes, the prior
# Qwen2-VL-2B-Instruct's tokenizer_config.json chat template (a default system turn; one vision block per image part).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2-VL's special tokens, in the order of their ids there (151643...); here they follow the BPE vocabulary.
QWEN2_VL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                     "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# Words made single tokens so that a yes/no judge's first token can be read (with and without a leading space).
JUDGE_WORDS = ("Yes", "yes", "YES", "No", "no", "NO", " Yes", " yes", " No", " no")
DIGITS = tuple("0123456789")  # with JUDGE_WORDS, 20 prior tokens: exactly what top_logprobs=20 shows
# Sizes: text 32 wide (2 heads of 16: mrope sections 2+3+3 = 16/2), vision 32 wide, 112x112 pixels at most.
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=4096)
VISION = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2)
MROPE_SECTION = [2, 3, 3]
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112
INIT_STD = 0.3  # larger than Qwen's 0.02 so that the image and the words move the logits
CONSTANT = 4.0  # value of hidden dimension 0 at every position (the prior's carrier)
PRIOR_WEIGHT = 18.0  # lm_head weight of the judge words on dimension 0: their logits rise by ~8-18
DIGIT_WEIGHT = 20.0  # the digits' (a bit more, so that a rating question gets digits)
CROWD_SCALE = 0.5  # the other tokens' lm_head rows are scaled by this (a flatter crowd below the prior tokens)


def _tokenizer(merges: int = 3000, word_starts: int = 1000):
    """A small byte-level BPE in Qwen2's layout (FLUX.2's tiny builder, ``fastvideo.models.flux2_presets._byte_bpe``) with
    every ``JUDGE_WORDS`` entry one token and Qwen2-VL's specials after the vocabulary."""
    from transformers import AddedToken, Qwen2TokenizerFast  # heavy

    vocab, pairs = _byte_bpe(merges, word_starts)
    for word in JUDGE_WORDS:  # merge the pieces it splits into, after every existing merge (so they apply last)
        pieces = Qwen2TokenizerFast(vocab=vocab, merges=pairs).tokenize(word)
        while len(pieces) > 1:
            if pieces[0] + pieces[1] not in vocab:
                vocab[pieces[0] + pieces[1]] = len(vocab)
                pairs.append((pieces[0], pieces[1]))
            pieces = [pieces[0] + pieces[1], *pieces[2:]]
    tok = Qwen2TokenizerFast(vocab=vocab, merges=pairs, model_max_length=32768, pad_token="<|endoftext|>",
                             eos_token="<|im_end|>", unk_token=None, bos_token=None)
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN2_VL_SPECIALS], special_tokens=True)
    assert all(len(tok.tokenize(w)) == 1 for w in JUDGE_WORDS), [tok.tokenize(w) for w in JUDGE_WORDS]
    return tok


def save_processor(out_dir: str | os.PathLike) -> Path:
    """Write the tiny ``Qwen2VLProcessor`` (image/video processors, tokenizer, chat template) to ``out_dir``."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor  # heavy

    pixels = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=_tokenizer(),
                                 video_processor=Qwen2VLVideoProcessor(**pixels), chat_template=QWEN2_VL_CHAT_TEMPLATE)
    processor.save_pretrained(Path(out_dir))
    return Path(out_dir)


def _judge_prior(model: torch.nn.Module, word_ids: list[int], digit_ids: list[int]) -> None:
    """Make hidden dimension 0 a constant feature from which the lm_head reads a logit prior for the judge words and
    the digits (the other tokens' rows are scaled down)."""
    lm = model.model.language_model
    with torch.no_grad():
        lm.embed_tokens.weight[:, 0] = CONSTANT
        for layer in lm.layers:  # nothing writes to dimension 0, so it stays CONSTANT at every text position
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        merger = model.model.visual.merger.mlp[-1]  # image tokens too
        merger.weight[0] = 0.0
        merger.bias[0] = CONSTANT
        head = model.lm_head.weight
        crowd = torch.ones(head.shape[0], dtype=torch.bool)
        crowd[word_ids + digit_ids] = False
        head[crowd] *= CROWD_SCALE
        head[:, 0] = 0.0
        head[word_ids, 0] = PRIOR_WEIGHT
        head[digit_ids, 0] = DIGIT_WEIGHT


def _write_folder(tmp: Path, seed: int) -> None:
    """Save the seeded tiny Qwen2-VL (model, generation config, processor, info) into ``tmp``."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration  # heavy

    save_processor(tmp)
    tok = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
    special = {s: tok.convert_tokens_to_ids(s) for s in QWEN2_VL_SPECIALS}
    pad, eos = special["<|endoftext|>"], special["<|im_end|>"]
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), **TEXT, initializer_range=INIT_STD, bos_token_id=pad, eos_token_id=eos,
                         pad_token_id=pad,
                         rope_parameters={"rope_type": "default", "mrope_section": MROPE_SECTION, "rope_theta": 1e6}),
        vision_config=dict(VISION, initializer_range=INIT_STD),
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"])
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(derive_seed(seed, "tiny-vlm"))
        model = Qwen2VLForConditionalGeneration(config).eval()
    single = [tok.tokenize(w)[0] for w in (*JUDGE_WORDS, *DIGITS)]  # each one token (checked in _tokenizer)
    ids = tok.convert_tokens_to_ids(single)
    _judge_prior(model, ids[:len(JUDGE_WORDS)], ids[len(JUDGE_WORDS):])
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(tmp)
    info = {"kind": "tiny Qwen2-VL judge stand-in (random weights)", "seed": seed, "text": TEXT, "vision": VISION,
            "pixels": [MIN_PIXELS, MAX_PIXELS], "judge_words": list(JUDGE_WORDS), "digits": list(DIGITS),
            "prior_weights": [PRIOR_WEIGHT, DIGIT_WEIGHT], "constant": CONSTANT, "crowd_scale": CROWD_SCALE,
            "parameters": sum(p.numel() for p in model.parameters())}
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def build_tiny_vlm(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the seeded tiny Qwen2-VL folder to ``out_dir`` (atomically; FileExistsError if it is non-empty)."""
    return write_atomically(out_dir, lambda tmp: _write_folder(tmp, seed))


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: build a tiny Qwen2-VL folder."""
    parser = argparse.ArgumentParser(description="Build a tiny, randomly initialised (seeded) Qwen2-VL folder that "
                                                 "stands in for a VLM judge; serve it with `python -m "
                                                 "fastvideo.rewards.serve --chat_model OUT`")
    parser.add_argument("out", help="output folder (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (same seed => same files)")
    args = parser.parse_args(argv)
    print(f"wrote {build_tiny_vlm(args.out, seed=args.seed)}")


if __name__ == "__main__":
    main()
