#!/usr/bin/env bash
# GRPO post-training of FLUX.
#   bash scripts/finetune_flux_grpo.sh                 # toy-world demo: prompt following of the toy FLUX, CPU
#   DEMO=jpeg bash scripts/finetune_flux_grpo.sh       # the tiny FLUX made JPEG-compressible, CPU, a few minutes
#   DEMO=video bash scripts/finetune_flux_grpo.sh      # toy-world video demo: motion prompts of the toy Wan, CPU
#   DEMO=edit bash scripts/finetune_flux_grpo.sh       # toy edit world demo: the toy Kontext's edits, CPU
#   MODEL_PATH=/models/FLUX.1-dev HPS_CHECKPOINT=/models/HPS_v2.1_compressed.pt \
#     bash scripts/finetune_flux_grpo.sh [--flag value ...]   # DanceGRPO's 8-GPU FLUX recipe; any flag overridable
#   RECIPE=scripts/recipes/flow_grpo.yaml MODEL_PATH=... bash scripts/finetune_flux_grpo.sh   # another recipe
#   MODEL_PATH=/models/sd3.5-medium bash scripts/finetune_flux_grpo.sh   # another family: its default recipe
# Env: MODEL_PATH, DATA_DIR (data), DATA_JSON (embeddings manifest), OUTPUT_DIR, NPROC_PER_NODE, NNODES,
#      NODE_RANK, MASTER_ADDR, MASTER_PORT (one node without MASTER_PORT: torchrun --standalone on a free port;
#      multi-node: run this on every node with its NODE_RANK and the same MASTER_ADDR/MASTER_PORT; Slurm:
#      scripts/slurm_finetune_flux.sbatch), SHUTDOWN_TIMEOUT (900: seconds torchrun gives its workers after a
#      SIGTERM to finish the step and checkpoint, as TORCH_ELASTIC_SHUTDOWN_TIMEOUT),
#      PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True unless it or PYTORCH_ALLOC_CONF is set),
#      PYTHON (python), HPS_CHECKPOINT (real runs), DEMO (toyworld | jpeg | video | edit),
#      TOY_PRETRAIN (1: pretrain the toy FLUX / toy Wan from scratch instead of building it from the shipped weights),
#      EVAL_JSON (toy world: held-out embeddings manifest), RECIPE (with MODEL_PATH: the --config recipe, default
#      the model family's: FLUX.1 scripts/recipes/dancegrpo_hps.yaml; paths are relative to the repository root).
# Everything after the script name is passed to train_grpo_flux.py and wins over the defaults below
# (the demo or recipe values come as --config files under the command line: one that conflicts with a flag you
# append, e.g. --timestep_fraction with --sde_window_size, is dropped with a note). Flags are checked in one process
# (--check_only) before torchrun starts: a bad flag is one line naming the fix, exit status 2.
# Both modes pass --resume_from latest: re-running after a preemption continues from the newest checkpoint.
# --dry_run prints the batch arithmetic and the per-rank memory plan for NPROC_PER_NODE x NNODES ranks and exits
# (one process, no torchrun, no weights or embeddings needed; add --device cuda on a machine without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_training_common.sh  # env defaults, demo_data, real_data, launch

if [ -z "${MODEL_PATH:-}" ] && [ "$DEMO" = toyworld ]; then
  # Toy-world default: GRPO of the pretrained toy FLUX with the verifiable toyworld reward, held-out accuracy every 10
  # steps; the values, with their reasons: scripts/demos/toyworld.yaml + grpo_toyworld.yaml (flags you append win,
  # and a demo value that conflicts with one of them is dropped with a note).
  toy_data  # MODEL, DATA_JSON, EVAL_JSON, NPROC_PER_NODE, TOY_ARGS; built in DATA_DIR if absent
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo-toyworld}
  set -- "${TOY_ARGS[@]}" --config scripts/demos/grpo_toyworld.yaml --output_dir "$OUTPUT_DIR" \
    --resume_from latest "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
elif [ -z "${MODEL_PATH:-}" ] && [ "$DEMO" = video ]; then
  # DEMO=video: GRPO of the pretrained toy Wan on the motion prompts with the verifiable toyworld_motion_strict reward,
  # held-out accuracy every 20 steps; the values with their reasons: scripts/demos/toyworld_video.yaml +
  # grpo_toyworld_video.yaml (docs/video.md)
  toy_video_data  # MODEL, DATA_JSON, EVAL_JSON, NPROC_PER_NODE, TOY_ARGS; built in DATA_DIR if absent
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo-toyworld-video}
  set -- "${TOY_ARGS[@]}" --config scripts/demos/grpo_toyworld_video.yaml --output_dir "$OUTPUT_DIR" \
    --resume_from latest "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
elif [ -z "${MODEL_PATH:-}" ] && [ "$DEMO" = edit ]; then
  # DEMO=edit: GRPO of the pretrained toy Kontext on the toy edit world's training edits with the verifiable
  # toyworld_edit reward, held-out edits evaluated as it trains; the values with their reasons:
  # scripts/demos/toyworld_edit.yaml + grpo_toyworld_edit.yaml (docs/editing.md)
  toy_edit_data  # MODEL, DATA_JSON, EVAL_JSON, NPROC_PER_NODE, TOY_ARGS; built in DATA_DIR if absent
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo-toyworld-edit}
  set -- "${TOY_ARGS[@]}" --config scripts/demos/grpo_toyworld_edit.yaml --output_dir "$OUTPUT_DIR" \
    --resume_from latest "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
elif [ -z "${MODEL_PATH:-}" ]; then
  # DEMO=jpeg: the tiny FLUX folder and its embeddings (built if absent), GRPO on the CPU with a weight-free reward
  # (JPEG compressibility); the values: scripts/demos/grpo_jpeg.yaml.
  demo_data  # MODEL, DATA_JSON, NPROC_PER_NODE; builds the tiny model and embeddings if absent
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo-tiny}
  set -- --config scripts/demos/grpo_jpeg.yaml --pretrained_model_name_or_path "$MODEL" --data_json_path "$DATA_JSON" \
    --output_dir "$OUTPUT_DIR" --resume_from latest "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
else
  real_data  # DATA_JSON, NPROC_PER_NODE; the embeddings must exist (except for --dry_run)
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo-flux}
  HPS_ARGS=()
  if [ -n "${HPS_CHECKPOINT:-}" ]; then HPS_ARGS=(--hps_checkpoint "$HPS_CHECKPOINT"); fi
  # DanceGRPO's 8-GPU FLUX recipe, value by value with its sources: scripts/recipes/dancegrpo_hps.yaml (RECIPE=FILE
  # takes another recipe, e.g. scripts/recipes/flow_grpo.yaml; flags after the script name still win)
  RECIPE=$(family_recipe grpo)  # the model family's (FLUX.1: DanceGRPO's), or RECIPE
  set -- --config "$RECIPE" --pretrained_model_name_or_path "$MODEL_PATH" \
    --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" --resume_from latest "${HPS_ARGS[@]}" "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
fi

launch train_grpo_flux.py "$@"
