#!/usr/bin/env bash
# The default job: train a small GPT end to end on real text this machine already has
# (the Python standard library's sources), with no download:
#   1. build a JSONL corpus and train a SentencePiece BPE tokenizer on it,
#   2. preprocess it into Megatron's .bin/.idx format,
#   3. train with tensor parallelism over 2 processes (CPU/gloo or GPUs/NCCL; one GPU:
#      one process), with validation perplexity, tensorboard logs and checkpoints.
# Outputs go under ${OUT_DIR:-runs/quickstart}; NPROC (2) and TRAIN_ITERS (300) may be set
# too, and extra flags go to pretrain_gpt.py. About 4 minutes on 2 idle CPU cores. Every run
# starts afresh: it deletes the checkpoints/ and tensorboard/ of the previous run under
# OUT_DIR (saying so; the corpus and tokenizer in data/ are kept and reused), except a
# `--dry-run`, which deletes nothing and trains nothing: it builds data/ when missing (the
# check reads the dataset and tokenizer), then prints what the run would do.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-runs/quickstart}
NPROC=${NPROC:-2}
TRAIN_ITERS=${TRAIN_ITERS:-300}
# 20 warmup iterations; a tenth of a shorter run (the warmup must end before the decay does)
WARMUP_ITERS=$(( TRAIN_ITERS / 10 < 20 ? TRAIN_ITERS / 10 : 20 ))
DATA=$OUT_DIR/data
DRY_RUN=0
for flag in "$@"; do [ "$flag" = "--dry-run" ] && DRY_RUN=1; done
[ "$DRY_RUN" = 1 ] || for previous in "$OUT_DIR/checkpoints" "$OUT_DIR/tensorboard"; do
  if [ -e "$previous" ]; then
    echo "note: deleting the previous run's $previous (a quickstart starts afresh; use" \
         "another OUT_DIR to keep it)"
    rm -rf "$previous"
  fi
done
mkdir -p "$DATA"
if [ ! -f "$DATA/stdlib_text_document.idx" ]; then
  python tools/make_corpus.py --output "$DATA/corpus.jsonl" --max-mb 6 \
      --tokenizer-prefix "$DATA/spm" --vocab-size 4096
  python tools/preprocess_data.py --input "$DATA/corpus.jsonl" --output-prefix "$DATA/stdlib" \
      --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/spm.model" \
      --append-eod --workers 2
fi
# NCCL needs a GPU per process: with fewer GPUs than processes, use as many as there are
# (one GPU: tensor parallel size 1); without GPUs the processes share the CPU (gloo).
GPUS=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$GPUS" -gt 0 ] && [ "$GPUS" -lt "$NPROC" ]; then
  echo "note: $GPUS GPU(s) for $NPROC processes: training with $GPUS (NPROC=$GPUS)"
  NPROC=$GPUS
fi
TP_FLAGS="--tensor-model-parallel-size $NPROC"
[ "$NPROC" -gt 1 ] && TP_FLAGS="$TP_FLAGS --sequence-parallel"
python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    $TP_FLAGS \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
    --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 8 --global-batch-size 16 \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS" \
    --train-iters "$TRAIN_ITERS" --weight-decay 0.1 --clip-grad 1.0 \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path "$DATA/stdlib_text_document" --split 98,2,0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/spm.model" \
    --data-cache-path "$DATA/index-cache" --num-workers 0 \
    --log-interval 20 --eval-interval 100 --eval-iters 5 \
    --save "$OUT_DIR/checkpoints" --save-interval 100 \
    --tensorboard-dir "$OUT_DIR/tensorboard" \
    --use-cpu-initialization --seed 1234 "$@"
[ "$DRY_RUN" = 1 ] && exit 0
echo
echo "tensorboard logs: $OUT_DIR/tensorboard   (tensorboard --logdir $OUT_DIR/tensorboard)"
echo "checkpoints:      $OUT_DIR/checkpoints   (latest: $(cat "$OUT_DIR/checkpoints/latest_checkpointed_iteration.txt"))"
