#!/usr/bin/env bash
# GRPO post-training of FLUX.
#   bash scripts/finetune_flux_grpo.sh                 # toy-world demo: prompt following of the toy FLUX, CPU
#   DEMO=jpeg bash scripts/finetune_flux_grpo.sh       # the tiny FLUX made JPEG-compressible, CPU, a few minutes
#   MODEL_PATH=/models/FLUX.1-dev HPS_CHECKPOINT=/models/HPS_v2.1_compressed.pt \
#     bash scripts/finetune_flux_grpo.sh [--flag value ...]   # DanceGRPO's 8-GPU FLUX recipe; any flag overridable
#   RECIPE=scripts/recipes/flow_grpo.yaml MODEL_PATH=... bash scripts/finetune_flux_grpo.sh   # another recipe
# Env: MODEL_PATH, DATA_DIR (data), DATA_JSON (embeddings manifest), OUTPUT_DIR, NPROC_PER_NODE, NNODES,
#      NODE_RANK, MASTER_ADDR, MASTER_PORT (multi-node: run this on every node with its NODE_RANK; Slurm:
#      scripts/slurm_finetune_flux.sbatch), SHUTDOWN_TIMEOUT (900: seconds torchrun gives its workers after a
#      SIGTERM to finish the step and checkpoint, as TORCH_ELASTIC_SHUTDOWN_TIMEOUT),
#      PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True unless it or PYTORCH_ALLOC_CONF is set),
#      PYTHON (python), HPS_CHECKPOINT (real runs), DEMO (toyworld | jpeg),
#      TOY_PRETRAIN (1: pretrain the toy FLUX from scratch instead of building it from the shipped weights),
#      EVAL_JSON (toy world: held-out embeddings manifest), RECIPE (with MODEL_PATH: the --config recipe, default
#      scripts/recipes/dancegrpo_hps.yaml; paths are relative to the repository root).
# Everything after the script name is passed to train_grpo_flux.py and wins over the defaults below.
# Both modes pass --resume_from latest: re-running after a preemption continues from the newest checkpoint.
# --dry_run prints the batch arithmetic and the per-rank memory plan for NPROC_PER_NODE x NNODES ranks and exits
# (one process, no torchrun, no weights or embeddings needed; add --device cuda on a machine without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_training_common.sh  # env defaults, demo_data, real_data, launch

if [ -z "${MODEL_PATH:-}" ] && [ "$DEMO" = toyworld ]; then
  # Toy-world default: GRPO of the pretrained toy FLUX (full fine-tune) on the training prompts with the verifiable
  # toyworld reward; held-out prompt-following accuracy is evaluated every 10 steps (eval_* metrics, before/after
  # grids in OUTPUT_DIR/samples/eval-step-*.png). lr: the study's tuned value (benchmarks/algorithms.py); the rest
  # by one-seed runs against the step-0 evaluation, which is the lr-0 control's at every step (README, "Toy world").
  toy_data  # MODEL, DATA_JSON, EVAL_JSON, NPROC_PER_NODE, TOY_ARGS; built in DATA_DIR if absent
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo-toyworld}
  # --init_same_noise: a group shares its initial noise, so reward differences come from the SDE steps the loss
  # credits (the layout is mostly set by the initial noise, which no log-prob covers); without it 60 steps gained
  # nothing (README, "Toy world").
  set -- "${TOY_ARGS[@]}" --output_dir "$OUTPUT_DIR" --sde_type flow_sde --eta 1.0 --init_same_noise \
    --num_generations 8 --prompts_per_step 8 --rollout_batch_size 64 --train_batch_size 16 \
    --timestep_fraction 1.0 --clip_range 1e-3 --adv_clip_max 5 --learning_rate 1e-4 --lr_warmup_steps 0 \
    --max_grad_norm 1.0 --max_train_steps 60 --eval_every 10 --sample_every 20 --checkpointing_steps 30 \
    --checkpoints_total_limit 1 --seed 0 --resume_from latest "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
elif [ -z "${MODEL_PATH:-}" ]; then
  # DEMO=jpeg: the tiny FLUX folder and its embeddings (built if absent), GRPO on the CPU
  # with a weight-free reward (JPEG compressibility).
  demo_data  # MODEL, DATA_JSON, NPROC_PER_NODE; builds the tiny model and embeddings if absent
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo-tiny}
  set -- --pretrained_model_name_or_path "$MODEL" --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" \
    --device cpu --h 64 --w 64 --sampling_steps 8 --sde_type flow_sde --eta 0.7 \
    --num_generations 8 --prompts_per_step 4 --rollout_batch_size 32 --train_batch_size 32 \
    --timestep_fraction 0.6 --clip_range 1e-4 --adv_clip_max 5 --global_std \
    --learning_rate 1e-3 --lr_warmup_steps 0 --max_grad_norm 1.0 --max_train_steps 250 \
    --reward jpeg_compressibility:1.0 --sample_every 50 --checkpointing_steps 125 --checkpoints_total_limit 1 \
    --seed 0 --resume_from latest "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
else
  real_data  # DATA_JSON, NPROC_PER_NODE; the embeddings must exist (except for --dry_run)
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo-flux}
  HPS_ARGS=()
  if [ -n "${HPS_CHECKPOINT:-}" ]; then HPS_ARGS=(--hps_checkpoint "$HPS_CHECKPOINT"); fi
  # DanceGRPO's 8-GPU FLUX recipe, value by value with its sources: scripts/recipes/dancegrpo_hps.yaml (RECIPE=FILE
  # takes another recipe, e.g. scripts/recipes/flow_grpo.yaml; flags after the script name still win)
  set -- --config "${RECIPE:-scripts/recipes/dancegrpo_hps.yaml}" --pretrained_model_name_or_path "$MODEL_PATH" \
    --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" --resume_from latest "${HPS_ARGS[@]}" "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
fi

launch train_grpo_flux.py "$@"
