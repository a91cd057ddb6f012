# Sourced by the launchers (scripts/_training_common.sh, scripts/preprocess_flux_embeddings.sh): torchrun's
# rendezvous flags. Not a launcher itself.
#   NNODES 1 and no MASTER_PORT: --standalone (torchrun starts its rendezvous on a free localhost port, so two
#     single-node runs on one machine, say a demo beside a test suite, never collide on a fixed port);
#   MASTER_PORT set, or NNODES > 1: --nnodes/--node_rank/--master_addr/--master_port (every node passes the same
#     MASTER_ADDR and MASTER_PORT; 29500 unless set).
# Sets the array TORCHRUN_RDZV.
rendezvous_args() {
  if [ "${NNODES:-1}" = 1 ] && [ -z "${MASTER_PORT:-}" ]; then
    TORCHRUN_RDZV=(--standalone --nnodes 1)
  else
    TORCHRUN_RDZV=(--nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --master_addr "${MASTER_ADDR:-127.0.0.1}"
                   --master_port "${MASTER_PORT:-29500}")
  fi
}
