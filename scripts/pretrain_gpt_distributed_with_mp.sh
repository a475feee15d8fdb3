#!/usr/bin/env bash
# Pretrain a GPT-2 medium sized model (345M parameters) with tensor parallelism (TP, with
# sequence parallelism) and pipeline parallelism (PP) on one node (torchrun); the remaining
# factor of the GPU count is data parallelism: dp = GPUS_PER_NODE * NNODES / (TP * PP).
# Edit the paths below (or set them in the environment); extra flags after the script name
# are passed through and override the ones here.
set -euo pipefail

# --- launch ----------------------------------------------------------------------------
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-2}                                # tensor-model-parallel size
PP=${PP:-2}                                # pipeline-model-parallel size

# --- paths (relative ones: from the repository root, where the script runs) ------------
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_345m_tp${TP}_pp${PP}}   # --save, --load
VOCAB_FILE=${VOCAB_FILE:-data/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-data/gpt2-merges.txt}
DATA_PATH=${DATA_PATH:-data/my-gpt2_text_document}           # prefix of the .bin/.idx pair,
                                                             # or a blend "w1 prefix1 w2 prefix2 ..."
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

# Megatron-LM requires it (here the overlap of tensor-parallel communication relies on it);
# neither python nor torchrun sets it, so this script does.
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --sequence-parallel
)
MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 1024
    --max-position-embeddings 1024
)
TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 64
    --lr 1.5e-4
    --min-lr 1.0e-5
    --lr-decay-style cosine
    --lr-warmup-fraction 0.01
    --train-iters 500000
    --lr-decay-iters 320000
    --weight-decay 0.01
    --clip-grad 1.0
    --bf16
)
read -ra DATA_PATH_WORDS <<<"$DATA_PATH"   # a blend: its words, as Megatron's $DATA_PATH
DATA_ARGS=(--data-path "${DATA_PATH_WORDS[@]}")
# data named after the script name replaces DATA_PATH (--mock-data and --data-path are
# exclusive; --data-path would win over --train-data-path)
for arg in "$@"; do
    case "$arg" in --mock-data|--data-path|--data-path=*|--train-data-path|--train-data-path=*)
        DATA_ARGS=() ;;
    esac
done
DATA_ARGS+=(
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --split 949,50,1
)
OUTPUT_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_DIR"
)

cd "$(dirname "$0")/.."
torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${PARALLEL_ARGS[@]}" "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" "$@"
