"""Optimizer-state memory per data-parallel rank: the distributed optimizer
(--use-distributed-optimizer) against the unsharded mixed-precision optimizer.

For each dp in --dp (default 1 2 4 8) this starts dp gloo processes on the CPU, builds the
same GPT with bf16 parameters (fp32 main parameters + Adam: Megatron's usual setup), runs
one training step so that Adam's state exists, and measures on every rank from the live
objects:

  main+state  bytes of the fp32 main parameters that are copies (not the model's own
              tensors) plus every optimizer state tensor (exp_avg, exp_avg_sq, step)
  grad buffer bytes of the DDP fp32 gradient buffers (the same for both optimizers)

Expected: about 12 bytes per parameter unsharded (4 main + 4 exp_avg + 4 exp_avg_sq) and
about 12 / dp with the distributed optimizer; the grad buffer stays at 4 bytes per
parameter (plus the distributed optimizer's padding to a multiple of dp).

    python benchmarks/optimizer_memory.py [--hidden-size 256] [--num-layers 4] [--dp 1 2 4 8]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.config import ModelConfig, OptimizerConfig, ParallelConfig  # noqa: E402
from megatron.core.distributed import DistributedDataParallel  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import build_optimizer  # noqa: E402
from megatron.core.parallel_state import ParallelState  # noqa: E402

SEQ, VOCAB = 64, 1024


def _storages_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages behind `tensors`, leaving out `exclude`'s storages."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure(rank: int, world: int, distributed: bool, hidden: int, layers: int) -> dict:
    """One rank: build, take one step, return the byte counts (see the module doc)."""
    ps = ParallelState.build(world, rank)
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=8,
                      padded_vocab_size=VOCAB, seq_length=SEQ, max_position_embeddings=SEQ,
                      hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                      params_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = GPTModel(cfg, device="cpu")
    ddp = DistributedDataParallel(model, ps, ParallelConfig(
        dp_size=world, world_size=world, accumulate_allreduce_grads_in_fp32=True,
        use_distributed_optimizer=distributed))
    opt = build_optimizer(OptimizerConfig(bf16=True, lr=1e-4), [ddp], ps)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    ddp.zero_grad_buffer()
    ddp(tokens[:, :-1], labels=tokens[:, 1:]).float().mean().backward()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok
    model_params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "kind": type(opt).__name__,
        "params": sum(p.numel() for p in model_params),
        "main": _storages_bytes(opt.get_parameters(), exclude=model_params),
        "state": _storages_bytes(state),
        "grad_buffer": sum(b.data.nbytes for b in ddp.grad_buffers.values()),
    }


def _entry(rank, world, port, outdir, args):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(measure(rank, world, *args), os.path.join(outdir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run(world: int, distributed: bool, hidden: int, layers: int) -> list:
    """`measure` on `world` gloo processes; the list of per-rank results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_entry, args=(world, port, outdir, (distributed, hidden, layers)),
                           nprocs=world, join=True, start_method="fork")
        return [torch.load(os.path.join(outdir, f"{r}.pt")) for r in range(world)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    header = (f"{'dp':>3} {'optimizer':<24} {'main+state MB/rank':>19} {'bytes/param':>12} "
              f"{'grad buffer MB/rank':>20}")
    rows = []
    for dp in args.dp:
        for distributed in (False, True):
            results = run(dp, distributed, args.hidden_size, args.num_layers)
            worst = max(results, key=lambda r: r["main"] + r["state"])
            total = worst["main"] + worst["state"]
            rows.append(f"{dp:>3} {worst['kind']:<24} {total / 2**20:>19.2f} "
                        f"{total / worst['params']:>12.2f} "
                        f"{max(r['grad_buffer'] for r in results) / 2**20:>20.2f}")
    n = results[0]["params"]
    print(f"GPT: {args.num_layers} layers, hidden {args.hidden_size}, vocab {VOCAB}, "
          f"{n:,} parameters (bf16), Adam; largest rank shown")
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
