"""The parallel layout's rules (Megatron-LM 23.05 `validate_args`, the parts about tensor,
pipeline, virtual-pipeline and data-parallel sizes) and activation recomputation, for
`arguments_validate.validate_args`. Each runs before any process group exists; a message
names the values and the fix.
"""
from __future__ import annotations

import os
import sys
from typing import Mapping, Optional, Set

from megatron.arguments_common import ArgumentsError, note, spelled, typed_flag, warn
from megatron.arguments_ranges import warn_unread


def resolve_parallel(ns, world_size: int, origins: Optional[Mapping[str, str]] = None) -> None:
    """tp/pp clamped to the world size as Megatron does (with a warning), dp derived,
    then every divisibility rule of the grid (`origins`: the flags' aliases the user gave,
    as `validate_args` records them)."""
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    if world_size < 1 or tp < 1 or pp < 1:
        raise ArgumentsError(f"world size {world_size}, --tensor-model-parallel-size {tp} and "
                             f"--pipeline-model-parallel-size {pp} must all be >= 1")
    need = tp * pp  # the processes one model copy of the given sizes takes
    if tp > world_size:
        warn(f"--tensor-model-parallel-size {tp} is larger than the world size {world_size}; "
             f"using {world_size} (as Megatron-LM does){_launch_hint(need, world_size)}")
        tp = ns.tensor_model_parallel_size = world_size
        need = world_size  # one hint is enough
    if pp > world_size // tp:
        warn(f"--pipeline-model-parallel-size {pp} does not fit in world size {world_size} with "
             f"tensor-parallel size {tp}; using {world_size // tp} (as Megatron-LM does)"
             f"{_launch_hint(need, world_size)}")
        pp = ns.pipeline_model_parallel_size = world_size // tp
    if world_size % (tp * pp):
        raise ArgumentsError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} "
            "processes or change the parallel sizes")
    ns.world_size = world_size
    ns.data_parallel_size = world_size // (tp * pp)
    if ns.standalone_embedding_stage and pp < 2:
        raise ArgumentsError(f"--standalone-embedding-stage needs --pipeline-model-parallel-size "
                             f">= 2 (got {pp}): the first stage would hold no layers at all")
    ns.transformer_pipeline_model_parallel_size = pp - 1 if ns.standalone_embedding_stage else pp
    ns.virtual_pipeline_model_parallel_size = None
    note(f"using world size: {world_size}, data-parallel-size: {ns.data_parallel_size}, "
         f"tensor-model-parallel size: {tp}, pipeline-model-parallel size: {pp} ")
    _check_heads(ns.num_attention_heads, tp, pp, world_size)
    _check_layer_split(ns, origins)
    _check_seed_range(ns, pp)
    if ns.sequence_parallel and tp == 1:
        warn("--sequence-parallel needs --tensor-model-parallel-size > 1; disabled")
        ns.sequence_parallel = False
    if ns.sequence_parallel and ns.seq_length % tp:
        # each tensor-parallel rank holds seq_length / tp positions between the layers;
        # Megatron-LM 23.05 fails on an assertion at the first forward on every rank
        raise ArgumentsError(
            f"{spelled(ns, 'seq_length', origins)} is not divisible by "
            f"--tensor-model-parallel-size {tp}: --sequence-parallel splits each sequence over "
            f"the tensor-parallel ranks; use a {typed_flag('seq_length', origins)} that is a "
            f"multiple of {tp} "
            f"({nearby_multiples(ns.seq_length, tp)}) or drop --sequence-parallel")


def _check_heads(heads: int, tp: int, pp: int, world_size: int) -> None:
    """Each tensor-parallel rank holds heads / tp whole attention heads. The fix names the
    tp sizes that also divide the processes of a pipeline stage (a size that divides the
    heads only is refused next)."""
    if heads % tp == 0:
        return
    per_stage = world_size // pp
    fits = [t for t in range(1, per_stage + 1) if per_stage % t == 0 and heads % t == 0]
    room = (f"the world size {world_size}" if pp == 1 else f"world size {world_size} / "
            f"--pipeline-model-parallel-size {pp} = {per_stage}")
    raise ArgumentsError(
        f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size "
        f"{tp}; use --tensor-model-parallel-size {' or '.join(map(str, fits))} (dividing both "
        f"{heads} and {room}), or a --num-attention-heads that is a multiple of {tp}")


_MAX_SEED = 2**32 - 1  # numpy's seeds (np.random.seed, the datasets' RandomState)


def _check_seed_range(ns, pp: int) -> None:
    """Megatron-LM seeds each rank with seed + 100 * pp_rank (+ 10 * dp_rank with
    --data-parallel-random-init) for python, numpy and torch; numpy takes at most 2**32 - 1,
    else every rank stops with a ValueError traceback after the model is configured."""
    dp_part = 10 * (ns.data_parallel_size - 1) if ns.data_parallel_random_init else 0
    largest = ns.seed + 100 * (pp - 1) + dp_part
    if largest > _MAX_SEED:
        raise ArgumentsError(
            f"--seed {ns.seed} is too large: the last rank seeds numpy with {largest} (seed + "
            f"100 x pipeline rank{' + 10 x data-parallel rank' if dp_part else ''}), and numpy "
            f"takes at most {_MAX_SEED}; pass a --seed of at most {_MAX_SEED - largest + ns.seed}")


def nearby_multiples(value: int, step: int) -> str:
    """'e.g. 30 or 32': the multiples of `step` next to `value` (the lower one when > 0)."""
    low = value // step * step
    return f"e.g. {low} or {low + step}" if low else f"e.g. {step}"


def _launch_hint(need: int, world_size: int) -> str:
    """How to get the `need` processes that the given parallel sizes ask for (a script run
    with plain python, or a torchrun with too small --nproc-per-node, trains on as is)."""
    if need <= world_size:
        return ""
    alone = ", this run is a single one" if world_size == 1 else ""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "pretrain_gpt.py"
    return (f"; the given sizes need {need} processes (or a multiple){alone}: launch them, e.g. "
            f"torchrun --nproc-per-node {need} {prog} ...")


def _check_layer_split(ns, origins: Optional[Mapping[str, str]] = None) -> None:
    """Every stage that holds transformer layers gets the same number (Megatron-LM 23.05's
    rule); with --standalone-embedding-stage the first stage holds none."""
    stages, layers = ns.transformer_pipeline_model_parallel_size, ns.num_layers
    if layers % stages == 0:
        return
    pp = ns.pipeline_model_parallel_size
    where = (f"the {stages} pipeline stages that hold layers (--pipeline-model-parallel-size "
             f"{pp} less the first, which --standalone-embedding-stage keeps for the "
             "embedding)" if ns.standalone_embedding_stage
             else f"--pipeline-model-parallel-size {pp}")
    first = 1 if ns.standalone_embedding_stage else 0  # the stage without layers
    best = max(d for d in range(1, stages) if layers % d == 0) if stages > 1 else 1
    other = (f", or --pipeline-model-parallel-size {best + first}"
             if best + first > 1 else "")
    raise ArgumentsError(
        f"{spelled(ns, 'num_layers', origins)} is not divisible by {where}; every stage needs "
        f"the same number of layers: use {typed_flag('num_layers', origins)} "
        f"{nearby_multiples(layers, stages)}{other}")


def resolve_virtual_pipeline(ns, gbs_defaulted: bool = False) -> None:
    """Virtual stages for the interleaved schedule (Megatron: v = layers per stage // L),
    after the micro-batch count is known. Megatron asks for pp > 2; our schedule also runs
    pp == 2. --overlap-p2p-communication only matters with pp > 1. `gbs_defaulted`: the
    user gave no --global-batch-size (its default, micro batch x dp, is named as such)."""
    pp, per_vstage = ns.pipeline_model_parallel_size, ns.num_layers_per_virtual_pipeline_stage
    if ns.overlap_p2p_comm and pp == 1:
        warn("--overlap-p2p-communication has no effect without --pipeline-model-parallel-size > 1")
    if per_vstage is None:
        return
    if per_vstage < 1:
        raise ArgumentsError(f"--num-layers-per-virtual-pipeline-stage {per_vstage} must be >= 1 "
                             "(transformer layers in each virtual pipeline stage)")
    if pp < 2:
        raise ArgumentsError(f"--num-layers-per-virtual-pipeline-stage {per_vstage} needs "
                             f"--pipeline-model-parallel-size >= 2 (got {pp})")
    if ns.standalone_embedding_stage:
        raise ArgumentsError("--num-layers-per-virtual-pipeline-stage and "
                             "--standalone-embedding-stage cannot be combined; drop one")
    per_stage = ns.num_layers // pp
    if per_stage % per_vstage:
        raise ArgumentsError(_virtual_stage_misfit(ns.num_layers, pp, per_vstage))
    vpp = per_stage // per_vstage
    if vpp == 1:  # (1F1B takes any micro-batch count: the rule below is not for it)
        warn(f"--num-layers-per-virtual-pipeline-stage {per_vstage} equals the layers per "
             "pipeline stage: one virtual stage per rank, using the non-interleaved 1F1B "
             "schedule")
        return
    if ns.num_micro_batches % pp:
        mbs, dp, gbs = ns.micro_batch_size, ns.data_parallel_size, ns.global_batch_size
        given = (f"(default: --micro-batch-size {mbs} x data-parallel size {dp} = {gbs})"
                 if gbs_defaulted else str(gbs))
        fix = "pass a --global-batch-size" if gbs_defaulted else "use a global batch size"
        raise ArgumentsError(
            f"the interleaved schedule (--num-layers-per-virtual-pipeline-stage) needs the "
            f"number of micro-batches ({ns.num_micro_batches} = --global-batch-size {given} "
            f"/ (--micro-batch-size {mbs} x data-parallel size {dp})) to be a multiple of "
            f"--pipeline-model-parallel-size {pp}; {fix} that is a multiple of "
            f"{mbs * dp * pp}")
    ns.virtual_pipeline_model_parallel_size = vpp
    note(f"interleaved pipeline schedule: {vpp} virtual stages per pipeline rank")


def _virtual_stage_misfit(layers: int, pp: int, per_vstage: int) -> str:
    """The refusal of a virtual stage size that does not divide the layers of a pipeline
    stage, with the sizes that do (a divisor below the stage's layer count: the count
    itself is one virtual stage, no interleaving) and the --num-layers that fits the given
    size with two virtual stages per rank."""
    per_stage = layers // pp
    fits = [d for d in range(1, per_stage) if per_stage % d == 0]
    use = (f"use --num-layers-per-virtual-pipeline-stage {' or '.join(map(str, fits))}"
           if fits else f"a stage of {per_stage} layer{'s' if per_stage > 1 else ''} cannot be "
           "interleaved: drop --num-layers-per-virtual-pipeline-stage")
    return (f"--num-layers-per-virtual-pipeline-stage {per_vstage} must divide the "
            f"{per_stage} layer{'s' if per_stage > 1 else ''} of each pipeline stage "
            f"(--num-layers {layers} / --pipeline-model-parallel-size {pp}); {use}, or "
            f"use --num-layers {2 * per_vstage * pp} (two virtual stages of {per_vstage} "
            "per pipeline rank)")


def _check_recompute_num_layers(ns) -> None:
    """Megatron-LM's uniform method recomputes groups of --recompute-num-layers layers, and
    its loop over the groups never ends below 1 (here each layer is recomputed alone: the
    value is not read, but a script with it would hang there). Block recomputes the first N
    layers of each (virtual) stage: N <= 0 recomputes none, as in Megatron-LM: warned."""
    n, method = ns.recompute_num_layers, ns.recompute_method
    if method == "uniform" and n < 1:
        raise ArgumentsError(
            f"--recompute-num-layers {n} must be >= 1 with --recompute-method uniform (layers "
            f"per recomputed group; Megatron-LM's loop over the groups never ends with {n}); "
            "pass 1 or leave the flag out")
    if method == "block" and n < 1:
        warn(f"--recompute-granularity full --recompute-method block --recompute-num-layers {n} "
             "recomputes no layer (as in Megatron-LM); pass the number of layers of each "
             "pipeline stage to recompute, or drop the recompute flags")


def resolve_recompute(ns, explicit: Set[str]) -> None:
    """Megatron's recompute rules. --recompute-method / --recompute-num-layers without
    --recompute-granularity full recompute nothing (Megatron ignores them silently; a
    script that forgot the granularity would run out of memory believing it recomputes):
    warned."""
    if ns.recompute_activations:
        if ns.recompute_granularity not in (None, "selective"):
            warn(f"--recompute-activations overrides --recompute-granularity "
                 f"{ns.recompute_granularity} with selective (as Megatron-LM does)")
        ns.recompute_granularity = "selective"
    if ns.recompute_granularity == "selective" and ns.recompute_method is not None:
        if ns.recompute_activations:  # the user may have typed --recompute-granularity full
            raise ArgumentsError(
                f"--recompute-method {ns.recompute_method} only applies to "
                f"--recompute-granularity full, and --recompute-activations means "
                f"--recompute-granularity selective (the attention core only; it overrides "
                f"the flag, as in Megatron-LM): drop --recompute-method, or replace "
                f"--recompute-activations by --recompute-granularity full")
        raise ArgumentsError(f"--recompute-method {ns.recompute_method} only applies to "
                             "--recompute-granularity full")
    if ns.recompute_granularity == "full" and ns.recompute_method is None:
        raise ArgumentsError("--recompute-granularity full needs --recompute-method uniform "
                             "(every layer) or block (the first --recompute-num-layers layers)")
    if ns.recompute_granularity == "full":
        _check_recompute_num_layers(ns)
    if ns.recompute_granularity != "full":
        run = ("--recompute-granularity selective recomputes the attention core only"
               if ns.recompute_granularity == "selective" else
               "nothing is recomputed without --recompute-granularity")
        warn_unread(ns, explicit, ("recompute_method", "recompute_num_layers"),
                    f"{run}; add --recompute-granularity full to recompute whole layers")
    if ns.distribute_saved_activations:
        _check_distribute_saved_activations(ns)


def _check_distribute_saved_activations(ns) -> None:
    """Megatron's asserts, with what this run has instead; with sequence parallelism the
    layer inputs are split over the TP ranks already and the flag changes nothing (Megatron
    ignores it there in silence): warned."""
    have = []
    if ns.tensor_model_parallel_size == 1:
        have.append("--tensor-model-parallel-size 1")
    if ns.recompute_granularity != "full":
        have.append("--recompute-granularity selective (from --recompute-activations)"
                    if ns.recompute_activations else
                    f"--recompute-granularity {ns.recompute_granularity or '(not set)'}")
    if have:
        raise ArgumentsError(
            "--distribute-saved-activations needs --tensor-model-parallel-size > 1, "
            "--recompute-granularity full and --recompute-method uniform|block; this run "
            f"has {' and '.join(have)}: fix those, or drop --distribute-saved-activations")
    if ns.sequence_parallel:
        warn("--distribute-saved-activations has no effect with --sequence-parallel: each "
             "tensor-parallel rank keeps only its part of the recomputed layers' inputs "
             "already (Megatron-LM ignores it there too); drop one of the two flags")
