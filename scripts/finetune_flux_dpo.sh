#!/usr/bin/env bash
# Diffusion-DPO post-training of FLUX, online (sample -> score -> best-vs-worst pairs) or offline (a pair file).
#   bash scripts/finetune_flux_dpo.sh                  # toy-world demo: online DPO for prompt following, CPU
#   DEMO=jpeg bash scripts/finetune_flux_dpo.sh        # the tiny FLUX made JPEG-compressible, online DPO, ~3 minutes
#   PREFERENCE_FILE=demo bash scripts/finetune_flux_dpo.sh   # demo, offline: pairs made from the tiny model's samples
#                                                            # (JPEG reward, tiny FLUX)
#   MODEL_PATH=/models/FLUX.1-dev HPS_CHECKPOINT=/models/HPS_v2.1_compressed.pt \
#     bash scripts/finetune_flux_dpo.sh [--flag value ...]   # online FLUX.1-dev recipe (8 GPUs); any flag overridable
#   MODEL_PATH=... PREFERENCE_FILE=/data/pairs.jsonl bash scripts/finetune_flux_dpo.sh   # offline FLUX.1-dev
# Env: MODEL_PATH, DATA_DIR (data), DATA_JSON (embeddings manifest), OUTPUT_DIR, NPROC_PER_NODE, NNODES,
#      NODE_RANK, MASTER_ADDR, MASTER_PORT (one node without MASTER_PORT: torchrun --standalone on a free port;
#      multi-node: run this on every node with its NODE_RANK and the same MASTER_ADDR/MASTER_PORT; Slurm:
#      scripts/slurm_finetune_flux.sbatch), SHUTDOWN_TIMEOUT (900: seconds torchrun gives its workers after a
#      SIGTERM to finish the step and checkpoint, as TORCH_ELASTIC_SHUTDOWN_TIMEOUT),
#      PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True unless it or PYTORCH_ALLOC_CONF is set),
#      PYTHON (python), HPS_CHECKPOINT (online real runs), PREFERENCE_FILE, RECIPE (with MODEL_PATH: the --config
#      recipe, default scripts/recipes/dpo.yaml or dpo_offline.yaml; relative to the repo root),
#      DEMO (toyworld | jpeg), TOY_PRETRAIN (1: pretrain the toy FLUX from scratch), EVAL_JSON (held-out manifest).
# Everything after the script name is passed to train_dpo.py and wins over the defaults below
# (the demo or recipe values come as --config files under the command line: one that conflicts with a flag you
# append, e.g. --timestep_fraction with --sde_window_size, is dropped with a note). Flags are checked in one process
# (--check_only) before torchrun starts: a bad flag is one line naming the fix, exit status 2.
# Both modes pass --resume_from latest: re-running after a preemption continues from the newest checkpoint.
# --dry_run prints the batch arithmetic and the per-rank memory plan for NPROC_PER_NODE x NNODES ranks and exits
# (one process, no torchrun, no weights or embeddings needed; add --device cuda on a machine without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
PREFERENCE_FILE=${PREFERENCE_FILE:-}
. scripts/_training_common.sh  # env defaults, demo_data, real_data, launch
grpo_only_demo finetune_flux_dpo.sh

if [ -z "${MODEL_PATH:-}" ] && [ "$DEMO" = toyworld ] && [ -z "$PREFERENCE_FILE" ]; then
  # Toy-world default: online DPO of the pretrained toy FLUX (best vs worst of each prompt's samples under the
  # verifiable toyworld reward), held-out accuracy every 15 steps; the values: scripts/demos/toyworld.yaml +
  # dpo_toyworld.yaml (flags you append win).
  toy_data  # MODEL, DATA_JSON, EVAL_JSON, NPROC_PER_NODE, TOY_ARGS; built in DATA_DIR if absent
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/dpo-toyworld}
  set -- "${TOY_ARGS[@]}" --config scripts/demos/dpo_toyworld.yaml --output_dir "$OUTPUT_DIR" \
    --resume_from latest "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
elif [ -z "${MODEL_PATH:-}" ]; then
  # DEMO=jpeg (and PREFERENCE_FILE=demo): the tiny FLUX folder and its embeddings (built if absent), DPO on the CPU
  # with a weight-free reward (JPEG compressibility); the values: scripts/demos/dpo_jpeg.yaml (offline:
  # dpo_jpeg_offline.yaml).
  demo_data  # MODEL, DATA_JSON, NPROC_PER_NODE; builds the tiny model and embeddings if absent
  if [ -n "$PREFERENCE_FILE" ]; then
    if [ "$PREFERENCE_FILE" = demo ]; then  # the best and worst of 4 samples per prompt, scored by the demo reward
      PREFERENCE_FILE=$DATA_DIR/tiny-flux-pairs/pairs.jsonl
      if [ ! -f "$PREFERENCE_FILE" ]; then
        "$PYTHON" -m fastvideo.preference --model_path "$MODEL" --data_json_path "$DATA_JSON" \
          --output_dir "$(dirname "$PREFERENCE_FILE")" --num_pairs 64 --num_generations 4 --h 64 --w 64 \
          --sampling_steps 8 --reward jpeg_compressibility:1.0 --seed 0 --device cpu
      fi
    fi
    OUTPUT_DIR=${OUTPUT_DIR:-outputs/dpo-tiny-offline}
    set -- --config scripts/demos/dpo_jpeg_offline.yaml --pretrained_model_name_or_path "$MODEL" \
      --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" --preference_file "$PREFERENCE_FILE" \
      --resume_from latest "$@"
  else
    OUTPUT_DIR=${OUTPUT_DIR:-outputs/dpo-tiny}
    set -- --config scripts/demos/dpo_jpeg.yaml --pretrained_model_name_or_path "$MODEL" --data_json_path "$DATA_JSON" \
      --output_dir "$OUTPUT_DIR" --resume_from latest "$@"
  fi
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
else
  real_data  # DATA_JSON, NPROC_PER_NODE; the embeddings must exist (except for --dry_run)
  # verl-omni's online DPO values with FLUX.1-dev's settings, each with its source: scripts/recipes/dpo.yaml
  # (offline: scripts/recipes/dpo_offline.yaml, the same without the sampling flags; RECIPE=FILE takes another
  # recipe; flags after the script name still win)
  if [ -z "$PREFERENCE_FILE" ]; then
    OUTPUT_DIR=${OUTPUT_DIR:-outputs/dpo-flux}
    HPS_ARGS=()
    if [ -n "${HPS_CHECKPOINT:-}" ]; then HPS_ARGS=(--hps_checkpoint "$HPS_CHECKPOINT"); fi
    RECIPE=$(family_recipe dpo)  # the model family's (FLUX.1: dpo.yaml), or RECIPE
    set -- --config "$RECIPE" --pretrained_model_name_or_path "$MODEL_PATH" \
      --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" --resume_from latest "${HPS_ARGS[@]}" "$@"
  else
    OUTPUT_DIR=${OUTPUT_DIR:-outputs/dpo-flux-offline}
    RECIPE=$(family_recipe dpo_offline)  # the model family's (FLUX.1: dpo_offline.yaml), or RECIPE
    set -- --config "$RECIPE" --pretrained_model_name_or_path "$MODEL_PATH" \
      --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" --preference_file "$PREFERENCE_FILE" \
      --resume_from latest "$@"
  fi
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
fi

launch train_dpo.py "$@"
