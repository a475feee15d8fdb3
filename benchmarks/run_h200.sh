#!/usr/bin/env bash
# One device call: the issue-2 small training in bf16 through pretrain_gpt.py, then the
# benchmark presets. Prints a short table at the end; full logs under $OUT (if set).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
SMALL=${SMALL:-1}
if [ "$SMALL" = 1 ]; then
  python -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --max-position-embeddings 128 --micro-batch-size 8 --global-batch-size 16 --lr 1e-3 \
    --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 --train-iters 300 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --log-interval 50 \
    --eval-interval 100 --eval-iters 5 --save "$OUT/ckpt" --save-interval 300 \
    --tensorboard-dir "$OUT/tb" --bf16 --use-cpu-initialization 2>&1 | tee "$OUT/small.log" | grep -E "iteration +(50|300)/|validation loss at iteration 300 on|error|Error" 
fi
for spec in ${PRESETS:-"gpt2-124m" "gpt-1.3b" "llama-1b"}; do
  python tools/benchmark.py --preset $spec --steps ${STEPS:-20} ${EXTRA:+-- $EXTRA} 2>&1 | tee "$OUT/bench_${spec}.log" | grep -E '^\{|Error|error' | tail -3
done
