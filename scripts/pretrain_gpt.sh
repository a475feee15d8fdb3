#!/usr/bin/env bash
# Pretrain a GPT-2 medium sized model (345M parameters) on ONE GPU (or the CPU).
# Edit the paths below (or set them in the environment); extra flags after the script name
# are passed through and override the ones here, e.g.
#   bash scripts/pretrain_gpt.sh --train-iters 100 --dry-run
set -euo pipefail

# --- paths (relative ones: from the repository root, where the script runs) ------------
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_345m}      # --save and --load
VOCAB_FILE=${VOCAB_FILE:-data/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-data/gpt2-merges.txt}
DATA_PATH=${DATA_PATH:-data/my-gpt2_text_document}           # prefix of the .bin/.idx pair,
                                                             # or a blend "w1 prefix1 w2 prefix2 ..."
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

# Megatron-LM requires it (here the overlap of tensor-parallel communication relies on it);
# neither python nor torchrun sets it, so this script does.
export CUDA_DEVICE_MAX_CONNECTIONS=1

MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 1024
    --max-position-embeddings 1024
)
TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 8
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
python pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
