# Sourced by the training launchers (finetune_flux_{grpo,dpo,nft}.sh): env defaults, the embedded demos' data, the
# check for real embeddings, and the launch itself (torchrun, or one process for --dry_run). Not a launcher itself.
PYTHON=${PYTHON:-python}
DATA_DIR=${DATA_DIR:-data}
# without MODEL_PATH: toyworld (prompt following on the toy world) | jpeg (tiny FLUX, JPEG size) | video (motion
# prompts on the toy world in time, GRPO only) | edit (the toy edit world, GRPO only)
DEMO=${DEMO:-toyworld}
case "$DEMO" in
  toyworld|jpeg|video|edit) ;;
  *) echo "DEMO=$DEMO: choose DEMO=toyworld (default), DEMO=jpeg, DEMO=video or DEMO=edit (GRPO)" >&2; exit 1 ;;
esac
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-}  # unset on one node: torchrun --standalone picks a free port (scripts/_torchrun.sh)
. scripts/_torchrun.sh  # rendezvous_args
DRY_RUN=0
for arg in "$@"; do if [ "$arg" = "--dry_run" ]; then DRY_RUN=1; fi; done

# The embedded default (no MODEL_PATH): the tiny FLUX folder and its embeddings, built in DATA_DIR if absent.
demo_data() {
  MODEL=$DATA_DIR/tiny-flux
  DATA_JSON=${DATA_JSON:-$DATA_DIR/tiny-flux-embeddings/manifest.json}
  NPROC_PER_NODE=${NPROC_PER_NODE:-1}
  if [ ! -f "$DATA_JSON" ]; then
    DATA_DIR=$DATA_DIR DATA_JSON=$DATA_JSON NPROC_PER_NODE=1 NNODES=1 MASTER_PORT= \
      bash scripts/preprocess_flux_embeddings.sh
  fi
}

# The toy-world default (no MODEL_PATH): the pretrained toy FLUX (from the shipped weights; TOY_PRETRAIN=1 trains it
# from scratch, ~20 min), its train / held-out prompt files and their embeddings, each built in DATA_DIR if absent.
# Sets MODEL, DATA_JSON (train prompts), EVAL_JSON (held-out prompts), NPROC_PER_NODE and TOY_ARGS (the flags every
# toy-world demo shares: scripts/demos/toyworld.yaml, the model and the train / held-out prompts).
toy_data() {
  MODEL=$DATA_DIR/toy-flux
  NPROC_PER_NODE=${NPROC_PER_NODE:-1}
  if [ ! -f "$MODEL/model_index.json" ]; then
    if [ "${TOY_PRETRAIN:-0}" = 1 ]; then
      "$PYTHON" -m fastvideo.toyworld pretrain --out "$MODEL"
    else
      "$PYTHON" -m fastvideo.toyworld build --out "$MODEL"
    fi
  fi
  local prompts=$DATA_DIR/toyworld-prompts split
  if [ ! -f "$prompts/heldout.txt" ]; then
    "$PYTHON" -m fastvideo.toyworld prompts --out "$prompts"
  fi
  for split in train heldout; do
    if [ ! -f "$DATA_DIR/toyworld-$split/manifest.json" ]; then
      MODEL_PATH=$MODEL PROMPT_FILE=$prompts/$split.txt DATA_JSON=$DATA_DIR/toyworld-$split/manifest.json \
        NPROC_PER_NODE=1 NNODES=1 MASTER_PORT= bash scripts/preprocess_flux_embeddings.sh \
        --max_sequence_length 16
    fi
  done
  DATA_JSON=${DATA_JSON:-$DATA_DIR/toyworld-train/manifest.json}
  EVAL_JSON=${EVAL_JSON:-$DATA_DIR/toyworld-heldout/manifest.json}
  TOY_ARGS=(--config scripts/demos/toyworld.yaml --pretrained_model_name_or_path "$MODEL" --data_json_path "$DATA_JSON"
            --eval_prompts "$EVAL_JSON")
}

# The toy world in time (DEMO=video, no MODEL_PATH): the pretrained toy Wan (from the shipped weights; TOY_PRETRAIN=1
# trains it from scratch), the motion prompts' train / held-out files and their embeddings, each built in DATA_DIR if
# absent. Sets MODEL, DATA_JSON, EVAL_JSON, NPROC_PER_NODE and TOY_ARGS (scripts/demos/toyworld_video.yaml, the model
# and the prompts).
toy_video_data() {
  MODEL=$DATA_DIR/toy-wan
  NPROC_PER_NODE=${NPROC_PER_NODE:-1}
  if [ ! -f "$MODEL/model_index.json" ]; then
    if [ "${TOY_PRETRAIN:-0}" = 1 ]; then
      "$PYTHON" -m fastvideo.toyworld pretrain-video --out "$MODEL"
    else
      "$PYTHON" -m fastvideo.toyworld build-video --out "$MODEL"
    fi
  fi
  local prompts=$DATA_DIR/toyworld-motion-prompts split
  if [ ! -f "$prompts/motion_heldout.txt" ]; then
    "$PYTHON" -m fastvideo.toyworld motion-prompts --out "$prompts"
  fi
  for split in train heldout; do
    if [ ! -f "$DATA_DIR/toyworld-motion-$split/manifest.json" ]; then
      MODEL_PATH=$MODEL PROMPT_FILE=$prompts/motion_$split.txt \
        DATA_JSON=$DATA_DIR/toyworld-motion-$split/manifest.json NPROC_PER_NODE=1 NNODES=1 MASTER_PORT= \
        bash scripts/preprocess_flux_embeddings.sh --max_sequence_length 16
    fi
  done
  DATA_JSON=${DATA_JSON:-$DATA_DIR/toyworld-motion-train/manifest.json}
  EVAL_JSON=${EVAL_JSON:-$DATA_DIR/toyworld-motion-heldout/manifest.json}
  TOY_ARGS=(--config scripts/demos/toyworld_video.yaml --pretrained_model_name_or_path "$MODEL"
            --data_json_path "$DATA_JSON" --eval_prompts "$EVAL_JSON")
}

# The toy edit world (DEMO=edit, no MODEL_PATH): the pretrained toy Kontext (from the shipped weights; TOY_PRETRAIN=1
# fine-tunes it from the toy FLUX), the edit files of the train / held-out (edit, object) combinations and their
# embeddings, each built in DATA_DIR if absent. Sets MODEL, DATA_JSON, EVAL_JSON, NPROC_PER_NODE and TOY_ARGS
# (scripts/demos/toyworld_edit.yaml, the model and the edits).
toy_edit_data() {
  MODEL=$DATA_DIR/toy-kontext
  NPROC_PER_NODE=${NPROC_PER_NODE:-1}
  if [ ! -f "$MODEL/model_index.json" ]; then
    if [ "${TOY_PRETRAIN:-0}" = 1 ]; then
      "$PYTHON" -m fastvideo.toyworld pretrain-edit --out "$MODEL"
    else
      "$PYTHON" -m fastvideo.toyworld build-edit --out "$MODEL"
    fi
  fi
  local edits=$DATA_DIR/toyworld-edits
  if [ ! -f "$edits/heldout.jsonl" ]; then
    "$PYTHON" -m fastvideo.toyworld edits --out "$edits" --train 1024 --heldout 128
  fi
  for split in train heldout; do
    if [ ! -f "$DATA_DIR/toyworld-edit-$split/manifest.json" ]; then
      OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" preprocess_embeddings.py --model_path "$MODEL" \
        --edit_file "$edits/$split.jsonl" --output_dir "$DATA_DIR/toyworld-edit-$split" --max_sequence_length 16 \
        --device cpu
    fi
  done
  DATA_JSON=${DATA_JSON:-$DATA_DIR/toyworld-edit-train/manifest.json}
  EVAL_JSON=${EVAL_JSON:-$DATA_DIR/toyworld-edit-heldout/manifest.json}
  TOY_ARGS=(--config scripts/demos/toyworld_edit.yaml --pretrained_model_name_or_path "$MODEL"
            --data_json_path "$DATA_JSON" --eval_prompts "$EVAL_JSON")
}

# GRPO-only demos stop here in the other launchers (call with the launcher's name).
grpo_only_demo() {
  if [ -z "${MODEL_PATH:-}" ] && { [ "$DEMO" = video ] || [ "$DEMO" = edit ]; }; then
    echo "DEMO=$DEMO is a GRPO demo: run DEMO=$DEMO bash scripts/finetune_flux_grpo.sh ($1 has no $DEMO demo)" >&2
    exit 1
  fi
}

# family_recipe TRAINER (grpo | dpo | dpo_offline | nft): the default recipe of MODEL_PATH's model family (FLUX.1:
# dancegrpo_hps.yaml, dpo.yaml, dpo_offline.yaml, nft.yaml; SD3.5, Qwen-Image, FLUX.2: theirs, docs/model-families.md);
# RECIPE set wins. A folder no family serves, or a family without a recipe for TRAINER, stops here naming the fix.
family_recipe() {
  if [ -n "${RECIPE:-}" ]; then echo "$RECIPE"; return; fi
  "$PYTHON" -m fastvideo.models recipe "$1" "$MODEL_PATH"
}

# A real model (MODEL_PATH): its embeddings must exist (a plan does not need them).
real_data() {
  DATA_JSON=${DATA_JSON:-$DATA_DIR/embeddings/manifest.json}
  NPROC_PER_NODE=${NPROC_PER_NODE:-8}
  if [ ! -f "$DATA_JSON" ] && [ "$DRY_RUN" = 0 ]; then
    echo "no embeddings at $DATA_JSON: run MODEL_PATH=$MODEL_PATH PROMPT_FILE=... bash scripts/preprocess_flux_embeddings.sh first" >&2
    exit 1
  fi
}

# launch TRAINER.py ARGS...: --dry_run plans for NPROC_PER_NODE x NNODES ranks in one process; else the flags and
# inputs are checked first in one process (--check_only: a bad flag is one line naming the fix and exit status 2,
# before torchrun starts), then torchrun (this node's agent; rendezvous_args: --standalone on a free port for one node
# without MASTER_PORT, else NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT). torchrun replaces the shell (exec), so a
# SIGTERM (Slurm, kill) reaches it rather than ending a bash that would leave it behind; it forwards the signal to its
# workers, which finish the current step, checkpoint and exit 0, and SIGKILLs them only after
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (SHUTDOWN_TIMEOUT, default 900; torchrun's own default, 30 s, is too short
# for a FLUX step and a checkpoint). PYTORCH_CUDA_ALLOC_CONF defaults to expandable_segments:True (CUDA's caching
# allocator grows segments in place instead of leaving fragments of fixed-size ones: less memory lost between the
# rollout, decode and update phases); a value you set, or a PYTORCH_ALLOC_CONF (torch's newer name), is left as it is.
launch() {
  local script=$1
  shift
  if [ "$DRY_RUN" = 1 ]; then
    exec "$PYTHON" "$script" --dry_run_world_size "$((NPROC_PER_NODE * NNODES))" "$@"
  fi
  "$PYTHON" "$script" --check_only --dry_run_world_size "$((NPROC_PER_NODE * NNODES))" "$@" || exit $?
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-900}
  if [ -z "${PYTORCH_ALLOC_CONF:-}" ]; then
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  fi
  rendezvous_args
  exec "$PYTHON" -m torch.distributed.run "${TORCHRUN_RDZV[@]}" --nproc_per_node "$NPROC_PER_NODE" "$script" "$@"
}
