"""Encode a prompt file into the model family's text embeddings on disk (FLUX.1: T5 prompt_embeds + CLIP pooled).

    torchrun --nproc_per_node N preprocess_embeddings.py --model_path DIR --prompt_file FILE --output_dir OUT
    torchrun --nproc_per_node N preprocess_embeddings.py --model_path KONTEXT --edit_file pairs.jsonl --output_dir OUT

An edit model (FLUX.1-Kontext) takes an --edit_file of (source image, instruction) pairs instead: the VAE is loaded
too and each source's latents are stored beside its instruction's embeddings (docs/editing.md).

Only the tokenizers and text encoders are loaded (never the transformer or VAE). Prompts are cut into
fixed-size shards of consecutive ids; shard k is encoded by rank k % N and written atomically, so any
number of ranks produces the same files and a re-run keeps the shards that are already finished.
Rank 0 writes OUT/manifest.json at the end. The format is documented in fastvideo/data.py.
"""
from __future__ import annotations

import argparse
import time

from fastvideo import distributed, errors
from fastvideo.config import FlagParser, add_config_flag, parse_with_config
from fastvideo.data import DEFAULT_SHARD_SIZE, DTYPES, open_prompt_store, write_prompt_store
from fastvideo.edits import parse_edit_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (every flag has its unit in the help)."""
    p = FlagParser(description=__doc__.split("\n\n")[0])
    add_config_flag(p)
    p.add_argument("--model_path", required=True,
                   help="diffusers model folder (needs the family's tokenizers and text encoders; FLUX.1: "
                        "text_encoder, text_encoder_2, tokenizer, tokenizer_2)")
    p.add_argument("--prompt_file", default=None, help="UTF-8 text file, one prompt per line, blank lines skipped "
                                                        "(text-to-image/video families)")
    p.add_argument("--edit_file", default=None,
                   help="JSON Lines file of edits for an edit family (flux-kontext), one object per line: "
                        "{\"image\": \"path/to/source.png\", \"prompt\": \"make the red circle blue\"}, image paths "
                        "relative to the file; instead of --prompt_file (docs/editing.md)")
    p.add_argument("--edit_size", default=None,
                   help="WIDTHxHEIGHT in pixels every --edit_file source is resized to (Lanczos, as the diffusers "
                        "edit pipelines); default: the sources' own size, which must then be one size")
    p.add_argument("--output_dir", required=True, help="directory for manifest.json and the safetensors shards")
    p.add_argument("--model_family", default="auto",
                   help="model family adapter: auto (from model_index.json) | flux1 | sd3 | qwen-image | flux2 | "
                        "package.module:Class (docs/model-families.md)")
    p.add_argument("--max_sequence_length", type=int, default=None,
                   help="text tokens per prompt, 1..the family's limit (longer prompts are truncated and counted); "
                        "default: the family's pipeline default (FLUX.1: 512 T5 tokens)")
    p.add_argument("--negative_prompt", default=None,
                   help="also store this prompt's embeddings, the unconditional branch of --cfg_scale > 1 in the "
                        "trainers and sample.py (e.g. --negative_prompt \"\"); default: the family pipeline's "
                        "negative prompt where that pipeline guides with CFG (SD3.5 \"\", Qwen-Image \" \", FLUX.2 "
                        "base \"\"), none where it does not (FLUX.1, distilled FLUX.2)")
    p.add_argument("--batch_size", type=int, default=8, help="prompts per text-encoder forward pass")
    p.add_argument("--shard_size", type=int, default=DEFAULT_SHARD_SIZE,
                   help="prompts per shard file (the unit of work per rank and of resume)")
    p.add_argument("--device", default=None, help="cuda, npu or cpu (default: the first available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="text-encoder compute and storage dtype (bf16 halves disk and memory for FLUX.1-dev)")
    args = parse_with_config(p, argv)
    if args.batch_size < 1:
        p.error(f"--batch_size must be >= 1, got {args.batch_size}")
    if (args.prompt_file is None) == (args.edit_file is None):
        p.error("pass exactly one of --prompt_file (prompts) and --edit_file (source image + instruction pairs)")
    if args.edit_size is not None and args.edit_file is None:
        p.error("--edit_size resizes --edit_file sources; pass --edit_file, or drop --edit_size")
    return args


def fill_family_text_defaults(args: argparse.Namespace) -> None:
    """Unset --max_sequence_length and --negative_prompt from the family's pipeline defaults: its text length, and
    its negative prompt where that pipeline guides with CFG (the trainers' default --cfg_scale then needs it)."""
    if args.max_sequence_length is not None and args.negative_prompt is not None:
        return
    from fastvideo import models

    defaults = models.resolve(args.model_family, args.model_path).sampler_defaults(args.model_path)
    if args.max_sequence_length is None:
        args.max_sequence_length = defaults.max_sequence_length
    if args.negative_prompt is None and defaults.cfg_scale > 1:
        args.negative_prompt = defaults.negative_prompt


def main(argv: list[str] | None = None) -> None:
    """Validate inputs, encode this rank's unfinished shards, then rank 0 writes the manifest."""
    with errors.exit_on_usage_error(), errors.checking():  # a bad flag or path: one line, exit status 2
        args = parse_args(argv)
        fill_family_text_defaults(args)
        writer = open_prompt_store(args.prompt_file, args.model_path, args.output_dir,  # every check, nothing loaded
                                   max_sequence_length=args.max_sequence_length, dtype=args.dtype,
                                   shard_size=args.shard_size, model_family=args.model_family,
                                   negative_prompt=args.negative_prompt, edit_file=args.edit_file,
                                   edit_size=parse_edit_size(args.edit_size))
    dist = distributed.init_distributed(args.device)
    start = time.perf_counter()
    done = write_prompt_store(writer, device=dist.device, batch_size=args.batch_size)
    if dist.is_main:
        manifest, spec = done["manifest"], writer.spec
        what = "prompts" if writer.sources is None else f"edits ({writer.sources.width}x{writer.sources.height} sources)"
        print(f"[preprocess] {manifest['num_prompts']} {what} in {len(manifest['shards'])} shards "
              f"(encoded {done['encoded']}, kept {done['kept']} finished) on {dist.world_size} rank(s) in "
              f"{time.perf_counter() - start:.1f}s; {manifest['num_truncated']} truncated (longer than "
              f"max_sequence_length={spec.max_sequence_length} or CLIP's 77 tokens); dtype {spec.dtype}; "
              + (f"negative prompt {spec.negative_prompt!r}; " if spec.negative_prompt is not None else "")
              + f"-> {writer.output_dir / 'manifest.json'}", flush=True)
    distributed.cleanup()


if __name__ == "__main__":
    main()
