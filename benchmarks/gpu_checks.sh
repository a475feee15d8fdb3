#!/usr/bin/env bash
# One device call for the CUDA-only checks: the tests that need a GPU (pinned-memory async
# save, CUDA memory accounting), a bf16 run through pretrain_gpt.py with --async-save
# (prints how long each save blocked training), gpt-1.3b with full recompute (peak
# memory and speed against the run without, benchmarks/RESULTS.md), and a run that cannot
# fit, for the out-of-memory report (megatron/oom_report.py: exit status 1, the report's
# first lines, the --record-memory-history snapshot it names), then the zero-shot
# evaluation, a --num-experts benchmark and the key/value-cache generation speed (dense
# at gpt-1.3b's shape; 8 experts at gpt2-124m's), generation at tp/pp layouts over NCCL
# (benchmarks/generate_layouts.py). pytest must be importable.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
python -m pytest -q -p no:cacheprovider -x tests/test_async_save.py tests/test_logging_utils.py \
    tests/test_memory_estimate.py tests/test_moe_grouped.py tests/test_static_decode.py \
    tests/test_step_graph.py tests/test_memory_history.py 2>&1 | tail -4
python -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
    --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8 --lr 6e-4 \
    --train-iters 60 --mock-data --tokenizer-type NullTokenizer --vocab-size 50257 \
    --log-interval 20 --eval-iters 0 --save "${CKPT:-/tmp/gpu_checks_ckpt}" --save-interval 20 --async-save \
    --bf16 2>&1 | tee "$OUT/async.log" | grep -E "iteration +(20|40|60)/|saved checkpoint|rror"
for extra in "" "--recompute-granularity full --recompute-method uniform"; do
  python tools/benchmark.py --preset ${PRESET:-gpt-1.3b} --steps ${STEPS:-10} --warmup 3 \
      ${extra:+-- $extra} 2>&1 | tee -a "$OUT/bench.log" | grep -E '^\{|rror' | tail -2
done
# gpt-1.3b's shape with 64 sequences of 2048 per micro-batch needs far more than one GPU.
python -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
    --max-position-embeddings 2048 --micro-batch-size 64 --global-batch-size 64 --lr 1e-4 \
    --train-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 50257 \
    --eval-iters 0 --bf16 --record-memory-history --memory-snapshot-path /tmp/oom_snap.pickle \
    > "$OUT/oom.log" 2>&1
echo "out-of-memory run: exit status $? (expected 1)"
grep -A12 "out of GPU memory" "$OUT/oom.log" | head -14
grep "memory snapshot" "$OUT/oom.log"; ls -l /tmp/oom_snap_oom_rank0.pickle
# Zero-shot evaluation (tasks/main.py) of the checkpoint the async-save run wrote: a
# WikiText-style file of NullTokenizer ids, bf16, through the forward-only schedule.
python -c "import random; random.seed(0); print(' '.join(str(random.randrange(50257)) for _ in range(20000)))" \
    > "$OUT/wikitext_ids.txt"
python -m torch.distributed.run --standalone --nproc-per-node 1 tasks/main.py --task WIKITEXT103 \
    --valid-data "$OUT/wikitext_ids.txt" --overlapping-eval 256 --num-layers 12 --hidden-size 768 \
    --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 \
    --tokenizer-type NullTokenizer --vocab-size 50257 --bf16 --load "${CKPT:-/tmp/gpu_checks_ckpt}" \
    --no-load-optim --no-load-rng 2>&1 | tee "$OUT/zeroshot.log" | grep -E "validation results|rror"
# Mixture of experts (--num-experts, eager switch MLP) at gpt2-124m's shape, and text
# generation with and without the key/value cache at gpt-1.3b's shape.
python benchmarks/moe_dispatch.py --device cuda --dtype bf16 2>&1 | tail -4
python tools/benchmark.py --preset gpt2-124m --steps 10 --warmup 3 -- --num-experts 8 2>&1 \
    | tee -a "$OUT/bench.log" | grep -E '^\{|rror' | tail -1
python benchmarks/kv_cache_speed.py --device cuda --dtype bf16 --layers 24 --hidden 2048 --heads 16 \
    --prompt 128 --new 256 2>&1 | tee "$OUT/kv_cache.log"
python benchmarks/kv_cache_speed.py --device cuda --dtype bf16 --layers 12 --hidden 768 --heads 12 \
    --experts 8 --prompt 128 --new 256 2>&1 | tee "$OUT/kv_cache_moe.log"
# Generation at tp2 / pp2 / tp2pp2 through NCCL with every rank on GPU 0, against one
# process (the CUDA-graph decode step under tensor parallelism included).
timeout 400 python benchmarks/generate_layouts.py --layouts tp2,pp2,tp2pp2 2>&1 | grep -E "same ids|DIFFERENT"
