#!/usr/bin/env bash
# Layout parity on one GPU: every rank on GPU 0, NCCL between them through loopback sockets
# (tools/layout_parity.py --one-gpu). Ranks time-slice the GPU, so each collective costs a
# few milliseconds: the TP part uses few micro-batches and layers. Results: RESULTS.md.
#   OUT=/some/dir bash benchmarks/layout_parity_one_gpu.sh [A|B|C]...   (default: A B C)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/layout_parity}
mkdir -p "$OUT"
M="--hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128
   --mock-data --tokenizer-type NullTokenizer --vocab-size 4095 --hidden-dropout 0
   --attention-dropout 0 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine
   --lr-warmup-fraction 0.1 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --eval-iters 0 --bf16"
A="--num-layers 4 --micro-batch-size 4 --global-batch-size 8 --no-compile"  # TP: 2 micro-batches
B="--num-layers 8 --micro-batch-size 1 --global-batch-size 8"              # PP and DP: 8
part() {  # name, seconds, layouts, model flags
    timeout "$2" python tools/layout_parity.py --one-gpu --iters 50 --out-dir "/tmp/lp$1" \
        --layouts "$3" -- $M $4 > "$OUT/table$1.txt" 2> "$OUT/err$1.txt"
    echo "part $1: exit $?"
    cat "$OUT/table$1.txt"
    grep -h "failed" "$OUT/err$1.txt" | head -5
    (cd "/tmp/lp$1" && tar czf "$OUT/logs$1.tgz" $(find . -name '*.log'))
}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(A B C)
for p in "${parts[@]}"; do
    case $p in
        A) part A 230 tp1,tp2,tp4,tp8,tp2+nosp "$A" ;;
        B) part B 300 tp1,pp2,pp4,pp2vp2,pp4vp2 "$B" ;;
        C) part C 300 tp1,tp1+eager,dp2+overlap,dp2+distopt,dp8+overlap+distopt,pp4vp2,tp2pp2dp2+overlap+distopt "$B" ;;
    esac
done
