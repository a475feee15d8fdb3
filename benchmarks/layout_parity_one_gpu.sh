#!/usr/bin/env bash
# Layout parity on one GPU: every rank on GPU 0, NCCL between them through loopback sockets
# (tools/layout_parity.py --one-gpu). Ranks time-slice the GPU, so each collective costs a
# few milliseconds: the TP part uses few micro-batches and layers. Results: RESULTS.md.
#   OUT=/some/dir bash benchmarks/layout_parity_one_gpu.sh [A|T8|B|C|D]...   (default: all,
#   ~24 min: name one or two parts per device call)
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
[ ${#parts[@]} -eq 0 ] && parts=(A T8 B C D)
for p in "${parts[@]}"; do
    # Each part fits one 600 s device call (times from the 2026-12-04 runs in RESULTS.md).
    case $p in
        A) part A 560 tp1,tp2,tp4,tp2+nosp "$A" ;;                        # ~3 min
        T8) part T8 560 tp1,tp8 "$A" ;;                                   # ~4.5 min
        B) part B 560 tp1,pp2,pp4,pp2vp2,pp4vp2 "$B" ;;                   # ~5 min
        C) part C 560 tp1,tp1+eager,dp2+overlap,dp2+distopt,dp8+overlap+distopt "$B" ;;  # ~3.5 min
        D) part D 560 tp1,tp2pp2dp2+overlap+distopt "$B" ;;               # ~4.5 min
        *) echo "unknown part $p (A, T8, B, C, D)" >&2; exit 2 ;;
    esac
done
