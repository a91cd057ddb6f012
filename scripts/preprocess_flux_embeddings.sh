#!/usr/bin/env bash
# Precompute FLUX text embeddings for a prompt file (only the text encoders are loaded).
#   MODEL_PATH=/models/FLUX.1-dev PROMPT_FILE=prompts.txt DATA_DIR=data bash scripts/preprocess_flux_embeddings.sh [extra flags]
# Without MODEL_PATH it builds the tiny FLUX folder in $DATA_DIR/tiny-flux and encodes assets/prompts.txt.
# Env: MODEL_PATH, PROMPT_FILE (assets/prompts.txt), DATA_DIR (data), DATA_JSON (output manifest path),
#      NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (one node without it: a free port), PYTHON,
#      MAX_SEQUENCE_LENGTH (tiny default only: 64), PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True unless it or
#      PYTORCH_ALLOC_CONF is set). Extra args go to the script.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
DATA_DIR=${DATA_DIR:-data}
PROMPT_FILE=${PROMPT_FILE:-assets/prompts.txt}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-}  # unset on one node: torchrun --standalone picks a free port
. scripts/_torchrun.sh  # rendezvous_args
if [ -z "${MODEL_PATH:-}" ]; then
  MODEL_PATH=$DATA_DIR/tiny-flux
  if [ ! -f "$MODEL_PATH/model_index.json" ]; then
    "$PYTHON" -m fastvideo.tiny --preset tiny --out "$MODEL_PATH"
  fi
  DATA_JSON=${DATA_JSON:-$DATA_DIR/tiny-flux-embeddings/manifest.json}
  NPROC_PER_NODE=${NPROC_PER_NODE:-1}
  set -- --max_sequence_length "${MAX_SEQUENCE_LENGTH:-64}" "$@"
else
  DATA_JSON=${DATA_JSON:-$DATA_DIR/embeddings/manifest.json}
  NPROC_PER_NODE=${NPROC_PER_NODE:-8}
fi
OUT_DIR=$(dirname "$DATA_JSON")
if [ -z "${PYTORCH_ALLOC_CONF:-}" ]; then  # as the training launchers: kept when set (either name)
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
fi
rendezvous_args
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" -m torch.distributed.run "${TORCHRUN_RDZV[@]}" \
  --nproc_per_node "$NPROC_PER_NODE" preprocess_embeddings.py --model_path "$MODEL_PATH" --prompt_file "$PROMPT_FILE" --output_dir "$OUT_DIR" "$@"
