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
#      NODE_RANK, MASTER_ADDR, MASTER_PORT (multi-node: run this on every node with its NODE_RANK; Slurm:
#      scripts/slurm_finetune_flux.sbatch), SHUTDOWN_TIMEOUT (900: seconds torchrun gives its workers after a
#      SIGTERM to finish the step and checkpoint, as TORCH_ELASTIC_SHUTDOWN_TIMEOUT),
#      PYTHON (python), HPS_CHECKPOINT (online real runs), PREFERENCE_FILE,
#      DEMO (toyworld | jpeg), TOY_PRETRAIN (1: pretrain the toy FLUX from scratch), EVAL_JSON (held-out manifest).
# Everything after the script name is passed to train_dpo.py and wins over the defaults below.
# Both modes pass --resume_from latest: re-running after a preemption continues from the newest checkpoint.
# --dry_run prints the batch arithmetic and the per-rank memory plan for NPROC_PER_NODE x NNODES ranks and exits
# (one process, no torchrun, no weights or embeddings needed; add --device cuda on a machine without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
PREFERENCE_FILE=${PREFERENCE_FILE:-}
. scripts/_training_common.sh  # env defaults, demo_data, real_data, launch

if [ -z "${MODEL_PATH:-}" ] && [ "$DEMO" = toyworld ] && [ -z "$PREFERENCE_FILE" ]; then
  # Toy-world default: online DPO of the pretrained toy FLUX (full fine-tune; best vs worst of each prompt's samples
  # under the verifiable toyworld reward); held-out accuracy every 15 steps (eval_* metrics, samples/eval-step-*.png).
  toy_data  # MODEL, DATA_JSON, EVAL_JSON, NPROC_PER_NODE, TOY_ARGS; built in DATA_DIR if absent
  OUTPUT_DIR=${OUTPUT_DIR:-outputs/dpo-toyworld}
  set -- "${TOY_ARGS[@]}" --output_dir "$OUTPUT_DIR" --sampler sde --sde_type flow_sde --eta 0.7 \
    --num_generations 8 --prompts_per_step 8 --rollout_batch_size 64 --train_batch_size 8 --beta_dpo 200 \
    --learning_rate 1e-4 --max_grad_norm 1.0 --max_train_steps 150 --eval_every 15 --sample_every 50 \
    --checkpointing_steps 75 --checkpoints_total_limit 1 --seed 0 --resume_from latest "$@"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
elif [ -z "${MODEL_PATH:-}" ]; then
  # DEMO=jpeg (and PREFERENCE_FILE=demo): the tiny FLUX folder and its embeddings (built if absent), DPO on the CPU
  # with a weight-free reward (JPEG compressibility). Settings chosen by measurement over seeds against an lr-0
  # control (README).
  demo_data  # MODEL, DATA_JSON, NPROC_PER_NODE; builds the tiny model and embeddings if absent
  COMMON=(--pretrained_model_name_or_path "$MODEL" --data_json_path "$DATA_JSON" --device cpu --h 64 --w 64
          --sampling_steps 8 --beta_dpo 200 --learning_rate 3e-4 --max_grad_norm 1.0 --seed 0)
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
    # 64 pairs, 25 passes over them: a lower lr than online (3e-4 drives both errors far from the reference)
    set -- "${COMMON[@]}" --output_dir "$OUTPUT_DIR" --preference_file "$PREFERENCE_FILE" --prompts_per_step 8 \
      --learning_rate 3e-5 --train_batch_size 8 --max_train_steps 200 --sample_every 50 --checkpointing_steps 100 \
      --checkpoints_total_limit 1 --resume_from latest "$@"
  else
    OUTPUT_DIR=${OUTPUT_DIR:-outputs/dpo-tiny}
    # the SDE sampler (flow_sde, eta 0.7, as the GRPO demo) spreads a group's rewards more than ODE: -8.6% vs -6.1%
    # JPEG size over 3 seeds (README)
    set -- "${COMMON[@]}" --output_dir "$OUTPUT_DIR" --sampler sde --sde_type flow_sde --eta 0.7 \
      --num_generations 8 --prompts_per_step 4 \
      --rollout_batch_size 32 --train_batch_size 4 --reward jpeg_compressibility:1.0 --max_train_steps 600 \
      --sample_every 100 --checkpointing_steps 300 --checkpoints_total_limit 1 --resume_from latest "$@"
  fi
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
else
  real_data  # DATA_JSON, NPROC_PER_NODE; the embeddings must exist (except for --dry_run)
  WORLD=$((NPROC_PER_NODE * NNODES))
  # No public online-DPO recipe for FLUX.1-dev exists; this one takes verl-omni's online DPO recipe (verl-omni
  # examples/dpo_trainer/qwen_image/run_qwen_image_online_dpo_lora_v1.sh and its trainer config defaults
  # verl_omni/trainer/config/*.yaml) value by value, with FLUX.1-dev's own settings from Flow-GRPO's FLUX config
  # (flow_grpo config/grpo.py:pickscore_flux); "ours" marks our choices.
  RECIPE=(
    --h 512 --w 512                        # Flow-GRPO pickscore_flux resolution 512 (verl-omni default 512 too)
    --guidance_scale 3.5                   # Flow-GRPO pickscore_flux guidance 3.5 (FLUX.1-dev distilled guidance)
    --sampling_steps 28                    # ours: FluxPipeline's default 28 ODE steps (verl-omni: 35 for Qwen-Image)
    --beta_dpo 2000                        # verl-omni config default dpo_beta 2000.0 (its Qwen-Image script: 100;
                                           #   Diffusion-DPO SD1.5: 5000)
    --lora_rank 64 --lora_alpha 128        # verl-omni model.lora_rank 64, model.lora_alpha 128
    --learning_rate 3e-4                   # verl-omni optim.lr 3e-4 (Flow-GRPO DPO: 3e-4 as well)
    --lr_scheduler constant                # verl-omni: constant, no warm-up
    --weight_decay 1e-4                    # verl-omni optim.weight_decay 1e-4
    --max_grad_norm 1.0                    # verl-omni clip_grad 1.0
    --max_train_steps 300                  # verl-omni trainer.total_training_steps 300
    --mixed_precision bf16                 # verl-omni fsdp model_dtype bfloat16 (ours: fp32 master weights)
    --gradient_checkpointing               # verl-omni enable_gradient_checkpointing true
    --seed 42                              # ours (as the GRPO recipe)
    --checkpointing_steps 40               # ours (as the GRPO recipe)
    --sample_every 10                      # ours only: sample grids
    --rollout_batch_size 8                 # ours only: samples per rollout forward (speed, not maths)
  )
  if [ -z "$PREFERENCE_FILE" ]; then
    OUTPUT_DIR=${OUTPUT_DIR:-outputs/dpo-flux}
    HPS_ARGS=()
    if [ -n "${HPS_CHECKPOINT:-}" ]; then HPS_ARGS=(--hps_checkpoint "$HPS_CHECKPOINT"); fi
    RECIPE+=(
      --sampler ode                        # verl-omni: deterministic FlowMatchEuler rollout (Flow-GRPO samples SDE)
      --num_generations 16                 # verl-omni actor_rollout_ref.rollout.n 16 (best vs worst per prompt)
      --prompts_per_step 32                # verl-omni data.train_batch_size 32 prompts -> 32 pairs per step
      --train_batch_size 4                 # verl-omni ppo_micro_batch_size_per_gpu 8 images = 4 pairs
      --min_reward_gap 0                   # ours: only equal-reward pairs are skipped (verl-omni keeps every pair)
      --ref_update_interval 0              # verl-omni: frozen reference (Flow-GRPO suggests 40 for online DPO)
      --reward hpsv2:1.0                   # ours: DanceGRPO's FLUX reward, as our GRPO recipe (verl-omni: an OCR
                                           #   GenRM; Flow-GRPO DPO: PickScore)
    )
    set -- --pretrained_model_name_or_path "$MODEL_PATH" --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" \
      "${RECIPE[@]}" --resume_from latest "${HPS_ARGS[@]}" "$@"
  else
    OUTPUT_DIR=${OUTPUT_DIR:-outputs/dpo-flux-offline}
    # offline: --prompts_per_step is pairs per step; Diffusion-DPO trained on 2048 pairs per step (SD1.5)
    set -- --pretrained_model_name_or_path "$MODEL_PATH" --data_json_path "$DATA_JSON" --output_dir "$OUTPUT_DIR" \
      "${RECIPE[@]}" --preference_file "$PREFERENCE_FILE" --prompts_per_step $((8 * WORLD)) --train_batch_size 4 \
      --resume_from latest "$@"
  fi
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
fi

launch train_dpo.py "$@"
