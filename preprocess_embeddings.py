"""Encode a prompt file into FLUX text embeddings on disk (T5 prompt_embeds + CLIP pooled).

    torchrun --nproc_per_node N preprocess_embeddings.py --model_path DIR --prompt_file FILE --output_dir OUT

Only the tokenizers and text encoders are loaded (never the transformer or VAE). Prompts are cut into
fixed-size shards of consecutive ids; shard k is encoded by rank k % N and written atomically, so any
number of ranks produces the same files and a re-run keeps the shards that are already finished.
Rank 0 writes OUT/manifest.json at the end. The format is documented in fastvideo/data.py.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from fastvideo import distributed
from fastvideo.data import DEFAULT_SHARD_SIZE, DTYPES, EmbeddingWriter, StoreSpec, read_prompt_file
from fastvideo.weights import check_weight_files


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (every flag has its unit in the help)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_path", required=True,
                   help="diffusers FLUX folder (needs text_encoder, text_encoder_2, tokenizer, tokenizer_2)")
    p.add_argument("--prompt_file", required=True, help="UTF-8 text file, one prompt per line, blank lines skipped")
    p.add_argument("--output_dir", required=True, help="directory for manifest.json and the safetensors shards")
    p.add_argument("--max_sequence_length", type=int, default=512,
                   help="T5 tokens per prompt, 1..512 (longer prompts are truncated and counted); 512 for FLUX.1-dev")
    p.add_argument("--batch_size", type=int, default=8, help="prompts per text-encoder forward pass")
    p.add_argument("--shard_size", type=int, default=DEFAULT_SHARD_SIZE,
                   help="prompts per shard file (the unit of work per rank and of resume)")
    p.add_argument("--device", default=None, help="cuda, npu or cpu (default: the first available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="text-encoder compute and storage dtype (bf16 halves disk and memory for FLUX.1-dev)")
    args = p.parse_args(argv)
    if not 1 <= args.max_sequence_length <= 512:
        p.error(f"--max_sequence_length must be in [1, 512] (FLUX's T5 limit), got {args.max_sequence_length}")
    if args.batch_size < 1:
        p.error(f"--batch_size must be >= 1, got {args.batch_size}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Validate inputs, encode this rank's unfinished shards, then rank 0 writes the manifest."""
    from fastvideo.flux import (TEXT_COMPONENTS, check_model_folder, encode_prompts, encoders_fingerprint,
                                load_text_encoders)

    args = parse_args(argv)
    # --- validate everything before any expensive work ---
    prompts = read_prompt_file(args.prompt_file)
    model_path = check_model_folder(args.model_path, TEXT_COMPONENTS).resolve()
    for component in ("text_encoder", "text_encoder_2"):  # headers only: a corrupt file fails here, not mid-load
        check_weight_files(model_path / component)
    spec = StoreSpec(model_path=str(model_path), encoders_fingerprint=encoders_fingerprint(model_path),
                     max_sequence_length=args.max_sequence_length, dtype=args.dtype, shard_size=args.shard_size)
    writer = EmbeddingWriter(Path(args.output_dir), prompts, spec, prompt_file=str(Path(args.prompt_file).resolve()))
    writer.check_existing()

    dist = distributed.init_distributed(args.device)
    start = time.perf_counter()
    mine = writer.shards_for_rank(dist.rank, dist.world_size)
    todo = [s for s in mine if not writer.is_complete(s)]

    # --- encode this rank's unfinished shards ---
    if todo:
        encoders = load_text_encoders(model_path, dtype=DTYPES[args.dtype], device=dist.device)
        for shard in todo:
            texts = writer.prompts_of(shard)
            embeds, pooled, truncated = [], [], []
            for i in range(0, len(texts), args.batch_size):
                with torch.no_grad():
                    e, p, t = encode_prompts(encoders, texts[i:i + args.batch_size],
                                             max_sequence_length=args.max_sequence_length)
                embeds.append(e.cpu())  # (b, T, D)
                pooled.append(p.cpu())  # (b, Dp)
                truncated.extend(bool(x) for x in t)
            writer.write_shard(shard, torch.cat(embeds), torch.cat(pooled), truncated)

    # --- rank 0 checks every shard and writes the manifest ---
    counts = distributed.all_gather_object((len(todo), len(mine) - len(todo)))
    distributed.barrier()
    if dist.is_main:
        manifest = writer.finalize()
        encoded, kept = sum(c[0] for c in counts), sum(c[1] for c in counts)
        print(f"[preprocess] {manifest['num_prompts']} prompts in {len(manifest['shards'])} shards "
              f"(encoded {encoded}, kept {kept} finished) on {dist.world_size} rank(s) in "
              f"{time.perf_counter() - start:.1f}s; {manifest['num_truncated']} truncated (T5 > "
              f"max_sequence_length={spec.max_sequence_length} or CLIP > 77 tokens); dtype {spec.dtype}; "
              f"-> {writer.output_dir / 'manifest.json'}", flush=True)
    distributed.cleanup()


if __name__ == "__main__":
    main()
