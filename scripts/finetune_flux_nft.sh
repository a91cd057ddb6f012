#!/usr/bin/env bash
# DiffusionNFT post-training of FLUX (train_nft.py): old-policy ODE rollouts -> reward -> forward-process NFT loss.
#   bash scripts/finetune_flux_nft.sh                  # toy-world demo: prompt following of the toy FLUX, CPU
#   DEMO=jpeg bash scripts/finetune_flux_nft.sh        # the tiny FLUX made JPEG-compressible, CPU, a few minutes
#   MODEL_PATH=/models/FLUX.1-dev HPS_CHECKPOINT=/models/HPS_v2.1_compressed.pt \
#     bash scripts/finetune_flux_nft.sh [--flag value ...]   # FLUX.1-dev recipe (8 GPUs); any flag overridable
# Env: MODEL_PATH, DATA_DIR (data), DATA_JSON (embeddings manifest), OUTPUT_DIR, NPROC_PER_NODE, NNODES,
#      NODE_RANK, MASTER_ADDR, MASTER_PORT (one node without MASTER_PORT: torchrun --standalone on a free port;
#      multi-node: run this on every node with its NODE_RANK and the same MASTER_ADDR/MASTER_PORT; Slurm:
#      scripts/slurm_finetune_flux.sbatch), SHUTDOWN_TIMEOUT (900: seconds torchrun gives its workers after a
#      SIGTERM to finish the step and checkpoint, as TORCH_ELASTIC_SHUTDOWN_TIMEOUT),
#      PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True unless it or PYTORCH_ALLOC_CONF is set),
#      PYTHON (python), HPS_CHECKPOINT (real runs), DEMO (toyworld | jpeg),
#      TOY_PRETRAIN (1: pretrain the toy FLUX from scratch), EVAL_JSON (toy world: held-out embeddings manifest),
#      RECIPE (with MODEL_PATH: the --config recipe, default scripts/recipes/nft.yaml; relative to the repo root).
# Everything after the script name is passed to train_nft.py and wins over the defaults below
# (the demo or recipe values come as --config files under the command line: one that conflicts with a flag you
# append, e.g. --timestep_fraction with --sde_window_size, is dropped with a note). Flags are checked in one process
# (--check_only) before torchrun starts: a bad flag is one line naming the fix, exit status 2.
# --resume_from latest is passed: re-running after a preemption continues from the newest checkpoint.
# --dry_run prints the batch arithmetic and the per-rank memory plan for NPROC_PER_NODE x NNODES ranks and exits
# (one process, no torchrun, no weights or embeddings needed; add --device cuda on a machine without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_training_common.sh  # env defaults, demo_data, real_data, launch
grpo_only_demo finetune_flux_nft.sh

if [ -z "${MODEL_PATH:-}" ] && [ "$DEMO" = toyworld ]; then
  # Toy-world default: DiffusionNFT of the pretrained toy FLUX on the verifiable toyworld strict check, held-out
  # accuracy every 30 steps; the values: scripts/demos/toyworld.yaml + nft_toyworld.yaml (flags you append win).
  toy_data  # MODEL, DATA_JSON, EVAL_JSON, NPROC_PER_NODE, TOY_ARGS; built in DATA_DIR if absent
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/nft-toyworld}
  set -- "${TOY_ARGS[@]}" --config scripts/demos/nft_toyworld.yaml --output_dir "$OUTPUT_DIR" \
    --resume_from latest "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
elif [ -z "${MODEL_PATH:-}" ]; then
  # DEMO=jpeg: the tiny FLUX folder and its embeddings (built if absent), a full fine-tune on the CPU with a
  # weight-free reward (JPEG compressibility); the values: scripts/demos/nft_jpeg.yaml.
  demo_data  # MODEL, DATA_JSON, NPROC_PER_NODE; builds the tiny model and embeddings if absent
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/nft-tiny}
  set -- --config scripts/demos/nft_jpeg.yaml --pretrained_model_name_or_path "$MODEL" --data_json_path "$DATA_JSON" \
    --output_dir "$OUTPUT_DIR" --resume_from latest "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
else
  real_data  # DATA_JSON, NPROC_PER_NODE; the embeddings must exist (except for --dry_run)
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/nft-flux}
  HPS_ARGS=()
  if [ -n "${HPS_CHECKPOINT:-}" ]; then HPS_ARGS=(--hps_checkpoint "$HPS_CHECKPOINT"); fi
  # DiffusionNFT's values (its published code trains SD3.5-M) with FLUX.1-dev's sampling, each with its source:
  # scripts/recipes/nft.yaml (RECIPE=FILE takes another; flags after the script name still win)
  RECIPE=$(family_recipe nft)  # the model family's (FLUX.1: nft.yaml), or RECIPE
  set -- --config "$RECIPE" --pretrained_model_name_or_path "$MODEL_PATH" \
    --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" --resume_from latest "${HPS_ARGS[@]}" "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
fi

launch train_nft.py "$@"
