"""Parallel generation under torchrun: the layout check and this rank's share of the model.

    torchrun --nproc-per-node 2 tools/generate.py --load CKPT --tensor-model-parallel-size 2 ...
    torchrun --nproc-per-node 8 tools/run_text_generation_server.py --load CKPT \\
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 ...

With world size W = T x P > 1 (--tensor-model-parallel-size T, --pipeline-model-parallel-size
P; data-parallel replicas below) every rank builds its share of the model as training builds it for that layout -- the
1/T tensor-parallel shard of its pipeline stage's layers, one chunk per stage (no virtual
stages, no standalone embedding stage, no sequence parallelism; gloo on the CPU, NCCL with
one GPU per rank) -- and loads the checkpoint through the training loader
(megatron/trainer_checkpoint.py: a checkpoint saved with any tp x pp layout is resharded on
load; the optimizer and RNG states are not read). The model's shape comes from the
checkpoint's stored arguments, as in the one-process path (tools/generate.py load_model):
global rank 0 reads them (the tracker, rank 0's model file) before the process group
exists and the other ranks get them, or its error, through the launch's rendezvous store
(megatron/startup_store.py), which then makes the group.

The ranks then decode in lockstep, all with the same tokens. Within a stage the attention
and MLP modules all-reduce as in training and the logits are all-gathered over the
vocabulary (megatron/core/models/gpt/kv_cache.py `gather_vocab`). At P > 1 the stage is
wrapped as a PipelineGPT (megatron/core/models/gpt/pipeline_decode.py): the first stage
embeds the tokens, the hidden states pass from stage to stage, each stage caching its own
layers' keys and values, and the last stage's logits are broadcast over each pipeline group.
So every rank holds the same full-vocabulary logits and samples the same token from the
same per-prompt generator (beam search reorders every stage's cache alike; log-probabilities
come out the same on every rank): the answers equal the one-process ones (greedy and seeded
tokens identical, fp32 logits within 1e-5; tests/test_generate_pp.py). The CUDA-graph decode
step (--decode-cuda-graph) is one stage's whole forward, so at P > 1 the eager cached step
runs (`on` is refused, naming why).

A world size W = D x T x P holds D data-parallel replicas of that layout (ranks grouped as
in training: tensor-parallel ranks adjacent, then replicas, then stages), each loading the
whole model. The replicas never talk while decoding: generate.py gives each its block of
the prompts (`replica_block`) and gathers the answers on rank 0 (`Replicas`); the
server sends each request to an idle replica (tools/run_text_generation_server.py
`Dispatcher`).

Refused, naming the values and the fix: a world size that is not a multiple of T x P,
--num-layers-per-virtual-pipeline-stage at P > 1, and a P that does not divide the
checkpoint's layers.
"""
from __future__ import annotations

# A library module, not a command: run as a script, it says which command to use.
if __name__ == "__main__":
    raise SystemExit("tools/generate_tp.py is a library module (parallel text generation under "
                     "torchrun); run python tools/generate.py --help")

import contextlib
import dataclasses
import datetime
import sys
from typing import Any, Dict, Mapping, MutableMapping, Optional, Tuple

import torch


def launch_ranks(environ: Mapping[str, str]) -> Tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    def number(name: str, default: int) -> int:
        value = environ.get(name, "")
        try:
            return int(value) if value else default
        except ValueError:
            raise SystemExit(f"error: the environment's {name}={value!r} is not an integer "
                             "(torchrun sets it; start under torchrun or unset it)") from None

    return number("RANK", 0), number("WORLD_SIZE", 1), number("LOCAL_RANK", 0)


def check_generation_layout(prog: str, world_size: int, tp_size: int, pp_size: int,
                            vpp_layers: Optional[int] = None) -> None:
    """SystemExit naming the values and the fix unless the layout is one generation runs:
    world size a multiple of tensor-parallel size x pipeline-parallel size (the multiple:
    data-parallel replicas; 1 x 1 x 1 is the one-process path), one model chunk per pipeline stage (at pp > 1 `vpp_layers`, the
    --num-layers-per-virtual-pipeline-stage given, must be None; at pp 1 it has no effect)."""
    if tp_size < 1 or pp_size < 1:
        raise SystemExit(f"{prog}: error: --tensor-model-parallel-size {tp_size} and "
                         f"--pipeline-model-parallel-size {pp_size} must be >= 1")
    if vpp_layers is not None and pp_size > 1:
        raise SystemExit(
            f"{prog}: error: --num-layers-per-virtual-pipeline-stage {vpp_layers}: "
            f"generation runs one model chunk per pipeline stage (a token crosses the "
            f"stages once; interleaving only helps the training schedule). Leave the flag "
            f"out: a checkpoint saved with virtual stages is resharded on load")
    if world_size % (tp_size * pp_size):
        raise SystemExit(
            f"{prog}: error: world size {world_size} with --tensor-model-parallel-size "
            f"{tp_size} x --pipeline-model-parallel-size {pp_size} = {tp_size * pp_size}: "
            f"the world size must be a multiple of {tp_size * pp_size} (each further "
            f"{tp_size * pp_size} processes are one more data-parallel replica of the "
            f"model); run torchrun --nproc-per-node {tp_size * pp_size} (over all nodes), a "
            f"multiple of it, or sizes whose product divides {world_size}")


def replica_block(num_items: int, dp_rank: int, dp_size: int) -> range:
    """The indices of `num_items` items that data-parallel replica `dp_rank` of `dp_size`
    takes: contiguous blocks in order, the first num_items % dp_size replicas one item
    more (5 over 2: [0, 3) and [3, 5); 1 over 2: [0, 1) and nothing)."""
    base, extra = divmod(num_items, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (dp_rank < extra))


# The replicas' answers meet on rank 0 once every replica is done. A replica may finish its
# block far sooner than another (its rows end at the end-of-document token, the other's run
# to --max-new-tokens; a single --prompt leaves all but replica 0 idle), and the wait must
# not end at the process group's timeout (--distributed-timeout-minutes): the gather has a
# group of its own with this timeout. A replica that fails ends the job as ever (torchrun;
# a rank gone breaks the gather at once).
ANSWERS_WAIT = datetime.timedelta(days=7)


class Replicas:
    """This rank's place among the data-parallel replicas of a generation run: `index` of
    `count` (0 of 1 in one process or at dp 1), `rank` the global rank. Built by every rank
    at the same point (at dp > 1 it makes the gloo group over the world, timeout
    ANSWERS_WAIT, that `gather` uses: collective)."""

    def __init__(self, rt) -> None:
        self.rank = 0 if rt is None else rt.ps.rank
        self.index, self.count = (0, 1) if rt is None else (rt.ps.dp_rank, rt.ps.dp_size)
        # every rank of a replica holds the same answers: its first one sends them
        self.sends = rt is None or (rt.ps.tp_rank == 0 and rt.ps.pp_rank == 0)
        self.group = None
        if self.count > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo", timeout=ANSWERS_WAIT)
            # the pairs `gather` uses, connected while every rank is here: gloo connects a
            # pair at its first message (TORCH_GLOO_LAZY_INIT) and would wait up to
            # ANSWERS_WAIT for a replica that died meanwhile instead of failing at once
            dist.gather_object(None, [None] * dist.get_world_size() if self.rank == 0 else None,
                               dst=0, group=self.group)

    def block(self, num_items: int) -> range:
        """The indices of `num_items` prompts this replica generates (`replica_block`)."""
        return replica_block(num_items, self.index, self.count)

    def gather(self, answers: Dict[int, Any]) -> Dict[int, Any]:
        """The `answers` (prompt index -> answer) of every replica merged on global rank 0,
        {} on the other ranks; this rank's own at dp 1. A gather of Python objects over
        `group`: every rank waits here until the last replica is done."""
        if self.group is None:
            return dict(answers)
        import torch.distributed as dist

        parts = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dist.gather_object(dict(answers) if self.sends else {}, parts, dst=0,
                           group=self.group)
        merged: Dict[int, Any] = {}
        for part in parts or ():
            merged.update(part)
        return merged


def checked_launch(prog: str, environ: Mapping[str, str], tp_size: int, pp_size: int,
                   vpp_layers: Optional[int] = None,
                   device: Optional[str] = None) -> Tuple[int, int, int]:
    """`launch_ranks(environ)` once the layout is one generation runs
    (`check_generation_layout`) and, under torchrun, no --device is given. A mistake in
    these flags is printed by rank 0 alone (the others wait for it under a launcher), as
    pretrain_gpt.py prints a flag error: each rank printed it."""
    from megatron.arguments import exit_before_group

    rank, world_size, local_rank = launch_ranks(environ)
    try:
        check_generation_layout(prog, world_size, tp_size, pp_size, vpp_layers)
        if world_size > 1 and device is not None:
            raise SystemExit(f"{prog}: error: --device {device}: under torchrun each rank uses "
                             "cuda:LOCAL_RANK (the CPU without CUDA); leave --device out")
    except SystemExit as exc:
        if world_size == 1:
            raise
        message = SystemExit(str(exc.code).removeprefix(f"{prog}: "))
        raise exit_before_group(message, rank, world_size, environ, machine=False) from None
    return rank, world_size, local_rank


def _padded_vocab(saved: dict, tp_size: int) -> int:
    """The checkpoint's padded vocabulary, padded further when the tensor-parallel size
    does not divide it into --make-vocab-size-divisible-by multiples (the loader fills the
    extra rows with copies of the last; they are past the tokenizer's vocabulary, never
    sampled)."""
    padded = int(saved["padded_vocab_size"])
    multiple = int(saved.get("make_vocab_size_divisible_by") or 1) * tp_size
    return -(-padded // multiple) * multiple


def tp_config(saved: dict, load: str, rank: int, tp_size: int,
              dtype: Optional[torch.dtype], pp_size: int = 1, dp_size: int = 1):
    """The Config of tensor-parallel size `tp_size`, pipeline size `pp_size` and
    `dp_size` data-parallel replicas (one chunk per stage, no standalone embedding stage)
    for the checkpoint whose stored arguments are `saved`, to be loaded from `load`
    without optimizer or RNG.
    config.model has this layout's padded vocabulary; config.args keeps the checkpoint's
    (the ids a prompt may hold when there is no tokenizer)."""
    from megatron.checkpoint_reshard import config_from_args

    config = config_from_args(
        saved, tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        world_size=tp_size * pp_size * dp_size, data_parallel_size=dp_size,
        rank=rank, standalone_embedding_stage=False,
        padded_vocab_size=_padded_vocab(saved, tp_size), load=load, no_load_optim=True,
        no_load_rng=True, finetune=False, exit_on_missing_checkpoint=True,
        perform_initialization=False, async_save=False, save=None)
    config.args["padded_vocab_size"] = int(saved["padded_vocab_size"])
    if dtype is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(
            config.model, params_dtype=dtype, embedding_weights_in_fp32=False))
    return config


def _saved_args(load: str, iteration: Optional[int]) -> Tuple[dict, int]:
    """(the checkpoint's stored arguments, its iteration): the tracker's, which the training
    loader reads; SystemExit for another --iteration or a checkpoint without arguments."""
    from megatron.checkpoint_reshard import inspect_checkpoint, locate_iteration

    iter_dir, latest, _ = locate_iteration(load, note=lambda _: None)  # the loader restores it
    if iteration is not None and iteration != latest:
        raise SystemExit(f"error: --iteration {iteration}: under torchrun the "
                         f"training loader reads the tracker's iteration ({latest}) of "
                         f"{load}; leave --iteration out, or load iteration {iteration} in "
                         "one process (no torchrun)")
    args = inspect_checkpoint(iter_dir)[2].get("args")
    if not isinstance(args, dict):
        raise SystemExit(f"error: {iter_dir} has no 'args' dict: it was not written by "
                         "pretrain_gpt.py, so the model shape is unknown")
    return args, latest


# The wait for rank 0's read before the checkpoint's own --distributed-timeout-minutes is
# known: Megatron's default (10), a minute longer, as initialize_distributed's.
STARTUP_WAIT = datetime.timedelta(minutes=10, seconds=60)


def _shared_saved_args(job, load: str, iteration: Optional[int],
                       pp_size: int) -> Tuple[dict, int]:
    """`_saved_args` checked for `pp_size` stages, read by global rank 0 alone when the
    launch has a rendezvous store (`job`, a megatron.startup_store.JobStore): the other
    ranks get the arguments, or rank 0's error as an ArgumentsError of the same message,
    through the store -- one read of the tracker and the rank-0 model file per job, not
    one per rank. Without a store this process reads, and its SystemExit is its own, as
    is the one of a rank whose answer never came."""
    from megatron.arguments_common import ArgumentsError
    from megatron.startup_store import from_rank_0

    def read() -> Tuple[dict, int]:
        saved, latest = _saved_args(load, iteration)
        _check_stages(saved, pp_size)
        return saved, latest

    if job.connect(STARTUP_WAIT) is None:
        return read()

    def read_for_all() -> Tuple[dict, int]:
        try:
            return read()
        except SystemExit as exc:  # sent to every rank as the same error
            if not isinstance(exc.code, str):
                raise
            raise ArgumentsError(exc.code.removeprefix("error: ")) from None

    return from_rank_0(job, "generation_args", read_for_all, STARTUP_WAIT,
                       f"the checkpoint arguments under --load {load}")


def _check_stages(saved: dict, pp_size: int) -> None:
    """SystemExit when the checkpoint's layers do not split evenly over `pp_size` stages."""
    layers = int(saved.get("num_layers") or 0)
    if pp_size > 1 and (layers < pp_size or layers % pp_size):
        raise SystemExit(f"error: --pipeline-model-parallel-size {pp_size}: the checkpoint's "
                         f"{layers} layers do not split evenly over {pp_size} stages; use "
                         "a pipeline size that divides the number of layers")


def load_model_tp(load: str, tp_size: int, rank: int, local_rank: int,
                  environ: MutableMapping[str, str], iteration: Optional[int] = None,
                  dtype: Optional[torch.dtype] = None, pp_size: int = 1,
                  dp_size: int = 1):
    """(this rank's model share in eval mode, Config, iteration, Runtime) for
    tensor-parallel size `tp_size` x pipeline size `pp_size` x `dp_size` data-parallel
    replicas == the world size (each replica a whole copy of the model; `rt.ps.dp_rank`
    says which this rank is in): the GPTModel shard at pp 1, else this rank's stage
    wrapped as a PipelineGPT (megatron/core/models/gpt/pipeline_decode.py), which the
    decoding code calls as the whole model. Global rank 0 reads the checkpoint's stored
    arguments for every rank (`_shared_saved_args`); then initialises torch.distributed
    (gloo on the CPU, NCCL with CUDA; through the store that answer came in; a process
    group that already exists is used), builds the share as training does
    (`build_model(for_training=False)`) and loads --load's latest checkpoint through the
    training loader, resharded from any saved layout. Collective over the world. The
    loader's messages go to stderr (stdout stays the tool's)."""
    from megatron.arguments import exit_before_group
    from megatron.arguments_common import ArgumentsError
    from megatron.core.models.gpt.pipeline_decode import PipelineGPT
    from megatron.gemm_choice import activate_gemm_algorithms
    from megatron.initialize import initialize_entry_point, set_random_seed
    from megatron.startup_store import JobStore
    from megatron.trainer_checkpoint import load_trainer_checkpoint
    from megatron.training import Trainer, build_model
    from megatron.watchdog import build_watchdog

    world_size = tp_size * pp_size * dp_size
    job = JobStore(environ, rank, world_size)  # rank 0 reads for all before the group
    env = {**environ, "LOCAL_RANK": str(local_rank)}
    try:
        saved, iteration = _shared_saved_args(job, load, iteration, pp_size)
    except ArgumentsError as err:  # rank 0's, the same on every rank: rank 0 prints it
        raise exit_before_group(SystemExit(str(err)), rank, world_size, env,
                                machine=False) from None
    except SystemExit as exc:  # this process's own read: printed once per node
        raise exit_before_group(exc, rank, world_size, env, machine=True) from None
    config = tp_config(saved, load, rank, tp_size, dtype, pp_size, dp_size)
    with contextlib.redirect_stdout(sys.stderr):
        workspace = str(saved.get("cublas_workspace") or "none")
        rt = initialize_entry_point(config.parallel, workspace, rank, world_size, local_rank,
                                    environ, store=job.store)  # the store rank 0 answered in
        set_random_seed(config.training.seed, rt)
        # training seeds each stage apart (seed + 100 x pipeline rank); decoding draws alike
        # on every rank, so torch's global generator (a caller's generator=None) agrees too
        torch.manual_seed(config.training.seed)
        activate_gemm_algorithms(config, rt)
        tr = Trainer(config, rt, build_model(config, rt, for_training=False), optimizer=None,
                     scheduler=None)
        # ends this rank when the job has ended elsewhere (its store gone) or another
        # rank's watchdog fired; closed by megatron.rank_failure.process_group_closed
        build_watchdog(config.parallel.distributed_timeout_minutes * 60)
        load_trainer_checkpoint(tr)
    model = tr.model.module
    if pp_size > 1:
        model = PipelineGPT(model, rt.ps)
    model.eval()
    return model, config, iteration, rt


__all__ = ["Replicas", "check_generation_layout", "checked_launch", "launch_ranks",
           "load_model_tp", "replica_block", "tp_config"]
