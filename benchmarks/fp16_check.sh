#!/usr/bin/env bash
# fp16 against bf16 on one GPU, through pretrain_gpt.py on real text: a gpt2-124m-shaped
# model with Megatron-LM's default linear layers (biases, fused bias-GeLU) trained on the
# quickstart's corpus (build it first: scripts/quickstart.sh, or its two data commands),
# once per precision, same seed; prints the loss, loss-scale and skipped-iteration columns
# and the validation loss. Then the benchmark step of each of $PRESETS in bf16 and fp16.
#   DATA=runs/quickstart/data ITERS=400 bash benchmarks/fp16_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-runs/quickstart/data}
ITERS=${ITERS:-400}
OUT=${OUT:-/tmp/fp16_check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
for prec in bf16 fp16; do
  echo "== $prec"
  python -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py \
      --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
      --max-position-embeddings 1024 --micro-batch-size 16 --global-batch-size 16 \
      --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 50 \
      --train-iters "$ITERS" --weight-decay 0.1 --clip-grad 1.0 \
      --hidden-dropout 0 --attention-dropout 0 \
      --data-path "$DATA/stdlib_text_document" --split 98,2,0 \
      --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/spm.model" \
      --data-cache-path "$OUT/index-cache-$prec" --log-interval 50 \
      --eval-interval "$ITERS" --eval-iters 10 --seed 1234 --$prec 2>&1 \
    | tee "$OUT/train-$prec.log" \
    | grep -E "iteration +[0-9]+/|validation loss|rror|Traceback" \
    | sed -E 's/consumed samples.*elapsed time per iteration \(ms\)/ms/; s/learning rate[^|]*\|//; s/global batch size[^|]*\|//; s/number of nan iterations[^|]*\|//'
done
for preset in ${PRESETS:-gpt-1.3b gpt2-124m}; do
  for prec in bf16 fp16; do
    python tools/benchmark.py --preset "$preset" --steps 20 --warmup 5 -- --$prec \
        --initial-loss-scale 65536 2>&1 | tee -a "$OUT/bench.log" | grep -E '^\{|rror' | tail -2
  done
done
