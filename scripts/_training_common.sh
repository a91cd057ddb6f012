# Sourced by the training launchers (finetune_flux_{grpo,dpo,nft}.sh): env defaults, the embedded demo's data, the
# check for real embeddings, and the launch itself (torchrun, or one process for --dry_run). Not a launcher itself.
PYTHON=${PYTHON:-python}
DATA_DIR=${DATA_DIR:-data}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
DRY_RUN=0
for arg in "$@"; do if [ "$arg" = "--dry_run" ]; then DRY_RUN=1; fi; done

# The embedded default (no MODEL_PATH): the tiny FLUX folder and its embeddings, built in DATA_DIR if absent.
demo_data() {
  MODEL=$DATA_DIR/tiny-flux
  DATA_JSON=${DATA_JSON:-$DATA_DIR/tiny-flux-embeddings/manifest.json}
  NPROC_PER_NODE=${NPROC_PER_NODE:-1}
  if [ ! -f "$DATA_JSON" ]; then
    DATA_DIR=$DATA_DIR DATA_JSON=$DATA_JSON NPROC_PER_NODE=1 MASTER_PORT=$((MASTER_PORT + 1)) \
      bash scripts/preprocess_flux_embeddings.sh
  fi
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

# launch TRAINER.py ARGS...: --dry_run plans for NPROC_PER_NODE x NNODES ranks in one process; else torchrun.
launch() {
  local script=$1
  shift
  if [ "$DRY_RUN" = 1 ]; then
    exec "$PYTHON" "$script" --dry_run_world_size "$((NPROC_PER_NODE * NNODES))" "$@"
  fi
  "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$script" "$@"
}
