#!/usr/bin/env bash
# The default job: train a small GPT end to end on this machine (CPU or GPU), with
# tensor parallelism over 2 processes, tensorboard logs and a checkpoint.
# Outputs go under ${OUT_DIR:-runs/quickstart}. Runs in a few minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-runs/quickstart}
NPROC=${NPROC:-2}
TRAIN_ITERS=${TRAIN_ITERS:-300}
rm -rf "$OUT_DIR"
python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    --tensor-model-parallel-size 2 --sequence-parallel \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
    --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 8 --global-batch-size 16 \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
    --train-iters "$TRAIN_ITERS" --weight-decay 0.1 --clip-grad 1.0 \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 \
    --log-interval 20 --eval-interval 100 --eval-iters 5 \
    --save "$OUT_DIR/checkpoints" --save-interval 100 \
    --tensorboard-dir "$OUT_DIR/tensorboard" \
    --use-cpu-initialization --seed 1234 "$@"
echo
echo "tensorboard logs: $OUT_DIR/tensorboard   (tensorboard --logdir $OUT_DIR/tensorboard)"
echo "checkpoints:      $OUT_DIR/checkpoints   (latest: $(cat "$OUT_DIR/checkpoints/latest_checkpointed_iteration.txt"))"
