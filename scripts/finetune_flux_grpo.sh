#!/usr/bin/env bash
# GRPO post-training of FLUX.
#   bash scripts/finetune_flux_grpo.sh                 # embedded demo: tiny FLUX on the CPU, a few minutes
#   MODEL_PATH=/models/FLUX.1-dev HPS_CHECKPOINT=/models/HPS_v2.1_compressed.pt \
#     bash scripts/finetune_flux_grpo.sh [--flag value ...]   # DanceGRPO's FLUX recipe; any flag overridable
# Env: MODEL_PATH, DATA_DIR (data), DATA_JSON (embeddings manifest), OUTPUT_DIR, NPROC_PER_NODE, NNODES,
#      NODE_RANK, MASTER_ADDR, MASTER_PORT, PYTHON (python), HPS_CHECKPOINT (real runs).
# Everything after the script name is passed to train_grpo_flux.py and wins over the defaults below.
# Both modes pass --resume_from latest: re-running after a preemption continues from the newest checkpoint.
# --dry_run prints the batch arithmetic and the per-rank memory plan for NPROC_PER_NODE x NNODES ranks and exits
# (one process, no torchrun, no weights or embeddings needed; add --device cuda on a machine without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
DATA_DIR=${DATA_DIR:-data}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
DRY_RUN=0
for arg in "$@"; do if [ "$arg" = "--dry_run" ]; then DRY_RUN=1; fi; done

if [ -z "${MODEL_PATH:-}" ]; then
  # Embedded default: build the tiny FLUX folder and its embeddings if absent, then GRPO on the CPU
  # with a weight-free reward (JPEG compressibility).
  MODEL=$DATA_DIR/tiny-flux
  DATA_JSON=${DATA_JSON:-$DATA_DIR/tiny-flux-embeddings/manifest.json}
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo-tiny}
  NPROC_PER_NODE=${NPROC_PER_NODE:-1}
  if [ ! -f "$DATA_JSON" ]; then
    DATA_DIR=$DATA_DIR DATA_JSON=$DATA_JSON NPROC_PER_NODE=1 MASTER_PORT=$((MASTER_PORT + 1)) \
      bash scripts/preprocess_flux_embeddings.sh
  fi
  set -- --pretrained_model_name_or_path "$MODEL" --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" \
    --device cpu --h 64 --w 64 --sampling_steps 8 --sde_type flow_sde --eta 0.7 \
    --num_generations 8 --prompts_per_step 4 --rollout_batch_size 32 --train_batch_size 32 \
    --timestep_fraction 0.6 --clip_range 1e-4 --adv_clip_max 5 --global_std \
    --learning_rate 1e-3 --lr_warmup_steps 0 --max_grad_norm 1.0 --max_train_steps 250 \
    --reward jpeg_compressibility:1.0 --sample_every 50 --checkpointing_steps 125 --checkpoints_total_limit 1 \
    --seed 0 --resume_from latest "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
else
  DATA_JSON=${DATA_JSON:-$DATA_DIR/embeddings/manifest.json}
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo-flux}
  NPROC_PER_NODE=${NPROC_PER_NODE:-8}
  if [ ! -f "$DATA_JSON" ] && [ "$DRY_RUN" = 0 ]; then
    echo "no embeddings at $DATA_JSON: run MODEL_PATH=$MODEL_PATH PROMPT_FILE=... bash scripts/preprocess_flux_embeddings.sh first" >&2
    exit 1
  fi
  HPS_ARGS=()
  if [ -n "${HPS_CHECKPOINT:-}" ]; then HPS_ARGS=(--hps_checkpoint "$HPS_CHECKPOINT"); fi
  # DanceGRPO's FLUX recipe: 720^2, 16 steps, dance_sde eta 0.3, shift 3, 12 generations,
  # timestep_fraction 0.6, clip 1e-4, adv clip 5, lr 1e-5, HPS v2.1, gradient checkpointing, full shard.
  set -- --pretrained_model_name_or_path "$MODEL_PATH" --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" \
    --h 720 --w 720 --sampling_steps 16 --sde_type dance_sde --eta 0.3 --shift 3 --guidance_scale 3.5 \
    --num_generations 12 --prompts_per_step "$((NPROC_PER_NODE * NNODES))" --rollout_batch_size 4 \
    --train_batch_size 2 --gradient_accumulation_steps 0 --timestep_fraction 0.6 --clip_range 1e-4 \
    --adv_clip_max 5 --learning_rate 1e-5 --weight_decay 1e-4 --max_grad_norm 1.0 --max_train_steps 300 \
    --reward hpsv2:1.0 --gradient_checkpointing --fsdp_sharding_strategy full --mixed_precision bf16 \
    --checkpointing_steps 50 --sample_every 10 --use_ema --ema_decay 0.995 --seed 42 --resume_from latest "${HPS_ARGS[@]}" "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
fi

if [ "$DRY_RUN" = 1 ]; then
  exec "$PYTHON" train_grpo_flux.py --dry_run_world_size "$((NPROC_PER_NODE * NNODES))" "$@"
fi
"$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" train_grpo_flux.py "$@"
