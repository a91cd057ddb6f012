#!/usr/bin/env bash
# GRPO post-training of FLUX.
#   bash scripts/finetune_flux_grpo.sh                 # toy-world demo: prompt following of the toy FLUX, CPU
#   DEMO=jpeg bash scripts/finetune_flux_grpo.sh       # the tiny FLUX made JPEG-compressible, CPU, a few minutes
#   MODEL_PATH=/models/FLUX.1-dev HPS_CHECKPOINT=/models/HPS_v2.1_compressed.pt \
#     bash scripts/finetune_flux_grpo.sh [--flag value ...]   # DanceGRPO's 8-GPU FLUX recipe; any flag overridable
# Env: MODEL_PATH, DATA_DIR (data), DATA_JSON (embeddings manifest), OUTPUT_DIR, NPROC_PER_NODE, NNODES,
#      NODE_RANK, MASTER_ADDR, MASTER_PORT (multi-node: run this on every node with its NODE_RANK; Slurm:
#      scripts/slurm_finetune_flux.sbatch), SHUTDOWN_TIMEOUT (900: seconds torchrun gives its workers after a
#      SIGTERM to finish the step and checkpoint, as TORCH_ELASTIC_SHUTDOWN_TIMEOUT),
#      PYTHON (python), HPS_CHECKPOINT (real runs), DEMO (toyworld | jpeg),
#      TOY_PRETRAIN (1: pretrain the toy FLUX from scratch instead of building it from the shipped weights),
#      EVAL_JSON (toy world: held-out embeddings manifest).
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
  WORLD=$((NPROC_PER_NODE * NNODES))
  # DanceGRPO's FLUX recipe, value by value from its 8-GPU script (DanceGRPO scripts/finetune/
  # finetune_flux_grpo_8gpus.sh, trainer fastvideo/train_grpo_flux.py); "ours" marks deliberate differences.
  RECIPE=(
    --h 720 --w 720                        # --h 720 --w 720
    --sampling_steps 16                    # --sampling_steps 16
    --sde_type dance_sde --eta 0.3         # flux_step, --eta 0.3
    --shift 3                              # --shift 3
    --guidance_scale 3.5                   # trainer hard-codes guidance 3.5 (--cfg 0.0: no real CFG)
    --decode_x0                            # trainer decodes and scores the last pred_original (x0_hat)
    --init_same_noise                      # --init_same_noise (ours: shared within a prompt group only; theirs: by
                                           #   every sample of a rank, i.e. also across its 2 prompts)
    --num_generations 12                   # --num_generations 12 (--use_group)
    --prompts_per_step $((2 * WORLD))      # --train_batch_size 2: two prompts per GPU per step
    --train_batch_size 2                   # ours: 2 samples per replay forward (theirs replays 1 at a time; the loss
    --gradient_accumulation_steps 6        #   is the same mean): 6 x 2 = 12 samples per optimizer step, as their
                                           #   --gradient_accumulation_steps 12 -> 2 optimizer steps per rollout
    --timestep_fraction 0.6                # --timestep_fraction 0.6 (int(15 x 0.6) = 9 of the non-final steps)
    --clip_range 1e-4 --adv_clip_max 5     # --clip_range 1e-4 --adv_clip_max 5.0
    --adv_eps 1e-8                         # trainer: (r - group mean) / (unbiased group std + 1e-8)
    --learning_rate 1e-5 --lr_warmup_steps 0 --lr_scheduler constant_with_warmup   # same (scheduler: default)
    --weight_decay 1e-4                    # --weight_decay 0.0001
    --max_grad_norm 0.01                   # --max_grad_norm 0.01 (their 16-GPU script: 1.0)
    --use_ema --ema_decay 0.995            # --use_ema --ema_decay 0.995 (ours: EMA warm-up on; theirs is a constant
                                           #   decay, which keeps ~22% of the base weights after 300 updates;
                                           #   --no-ema_warmup reproduces it)
    --max_train_steps 300                  # --max_train_steps 300
    --checkpointing_steps 40               # --checkpointing_steps 40
    --seed 42                              # --seed 42
    --reward hpsv2:1.0                     # --use_hpsv2 (HPS v2.1 checkpoint: HPS_CHECKPOINT)
    --mixed_precision bf16                 # --mixed_precision bf16 (fp32 master weights)
    --gradient_checkpointing               # --gradient_checkpointing
    --fsdp_sharding_strategy full          # trainer default FULL_SHARD
    --rollout_batch_size 4                 # ours only: samples per rollout forward (speed, not maths)
    --sample_every 10                      # ours only: sample grids
  )
  set -- --pretrained_model_name_or_path "$MODEL_PATH" --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" \
    "${RECIPE[@]}" --resume_from latest "${HPS_ARGS[@]}" "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
fi

launch train_grpo_flux.py "$@"
