"""Random-number streams for tensor parallelism, and activation recompute.

Two streams, as in Megatron:

* the default torch generator, seeded with `seed` on every TP rank: dropout OUTSIDE the
  tensor-parallel region (hidden dropout on the full [s, b, h] residual stream) must
  give the same mask on every TP rank, because those ranks hold copies of one tensor;
* the "model-parallel-rng" stream of an `RNGStatesTracker`, seeded with
  `seed + 2718 + tp_rank`: dropout INSIDE the TP region (attention probabilities, each
  rank holding different heads) and the init of sharded weights run under
  `tracker.fork()` so that ranks draw different numbers.

A tracker drives one device's generator: CPU (`torch.get_rng_state`) or the current
CUDA device (`torch.cuda.get_rng_state`), chosen when it is built; use the device the
activations live on, or dropout would draw from the other generator. Its states are
ByteTensors keyed by name, the format Megatron checkpoints store as
`rng_tracker_states`.

`checkpoint(function, *args)` recomputes `function` in backward and replays the CPU,
CUDA and tracker streams, so recomputed dropout masks equal the original ones.
`checkpoint_distributed_input` does the same keeping only 1/tp of the input on each
tensor-parallel rank until backward.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch
import torch.utils.checkpoint

from .. import parallel_state

# torch >= 2.13 renamed the single-tensor all-gather (the old name warns FutureWarning).
_all_gather_single = (getattr(torch.distributed, "all_gather_single", None)
                      or torch.distributed.all_gather_into_tensor)

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offset between the default seed and the tensor-parallel seed (Megatron's constant).
TP_SEED_OFFSET = 2718


def _resolve_device(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"RNGStatesTracker supports device 'cpu' or 'cuda', got {device!r}")
    return kind


def _get_rng_state(device: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def _set_rng_state(device: str, state: torch.Tensor) -> None:
    if device == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(device: str, seed: int) -> None:
    if device == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states for one device; `fork(name)` runs code on one of them.

    `device` is "cpu", "cuda" or None (CUDA when available, else CPU).
    """

    def __init__(self, device=None) -> None:
        self.device = _resolve_device(device)
        self.states: Dict[str, torch.Tensor] = {}
        self.seeds: set = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states = {}
        self.seeds = set()

    def has(self, name: str) -> bool:
        return name in self.states

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` seeded with `seed`; the current generator state is kept."""
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already used by another RNG stream; pick another")
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists; call reset() first")
        self.seeds.add(seed)
        original = _get_rng_state(self.device)
        _manual_seed(self.device, seed)
        self.states[name] = _get_rng_state(self.device)
        _set_rng_state(self.device, original)

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the name -> generator-state mapping."""
        return dict(self.states)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace every stream's state (seeds are not checked)."""
        self.states = dict(states)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Same as get_states(): {name: ByteTensor}, loadable with weights_only=True."""
        return self.get_states()

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        self.set_states(state_dict)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on stream `name`, then put the default generator back.

        The stream advances: the next fork continues where this one stopped.
        """
        if name not in self.states:
            raise ValueError(
                f"RNG stream {name!r} is not set up; call model_parallel_seed(seed, tp_rank, "
                f"tracker) (or tracker.add) first"
            )
        original = _get_rng_state(self.device)
        _set_rng_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_rng_state(self.device)
            _set_rng_state(self.device, original)


_DEFAULT_TRACKER: Optional[RNGStatesTracker] = None


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide default tracker (built on first use with the default device).

    Library code takes a tracker argument and falls back to this one when given None;
    `get_cuda_rng_tracker` is the same function under Megatron's name.
    """
    global _DEFAULT_TRACKER
    if _DEFAULT_TRACKER is None:
        _DEFAULT_TRACKER = RNGStatesTracker()
    return _DEFAULT_TRACKER


def set_rng_tracker(tracker: RNGStatesTracker) -> None:
    """Replace the process-wide default tracker (e.g. with a CPU one on a GPU host)."""
    global _DEFAULT_TRACKER
    _DEFAULT_TRACKER = tracker


get_cuda_rng_tracker = get_rng_tracker


def model_parallel_seed(
    seed: int, tp_rank: int, tracker: Optional[RNGStatesTracker] = None
) -> RNGStatesTracker:
    """Seed both streams the Megatron way and return the tracker.

    Default generator(s) (CPU and every CUDA device): `seed`, identical on TP ranks.
    Tracker stream "model-parallel-rng": `seed + 2718 + tp_rank`, different per TP rank.
    The tracker is reset first. `seed` already carries any per-pipeline-stage offset.
    """
    tracker = get_rng_tracker() if tracker is None else tracker
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp_rank)
    return tracker


def model_parallel_cuda_manual_seed(seed: int) -> RNGStatesTracker:
    """Megatron's name, for ported code: seed the default tracker from the remembered
    parallel state (`parallel_state.initialize_model_parallel` first).

    The tracker's device default generator (CPU or the current CUDA device, the one
    Megatron seeds) gets `seed`, the same on every TP rank; the tracker is reset and its
    "model-parallel-rng" stream gets `seed + 2718 + tp_rank`. Works on a CPU tracker too.
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker = get_rng_tracker()
    tracker.reset()
    _manual_seed(tracker.device, seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp_rank)
    return tracker


class _ReplayTrackerStates:
    """Recompute context: run on the tracker states saved at forward time, then restore."""

    def __init__(self, tracker: RNGStatesTracker, states: Dict[str, torch.Tensor]) -> None:
        self.tracker = tracker
        self.forward_states = states
        self.saved: Optional[Dict[str, torch.Tensor]] = None

    def __enter__(self):
        self.saved = self.tracker.get_states()
        self.tracker.set_states(self.forward_states)
        return self

    def __exit__(self, *exc) -> bool:
        self.tracker.set_states(self.saved)
        return False


def checkpoint(function, *args, tracker: Optional[RNGStatesTracker] = None):
    """Activation recompute: run `function(*args)` without keeping its activations.

    In backward the function is run again under the generator states it saw in forward:
    torch restores the CPU and CUDA default generators (preserve_rng_state=True) and this
    wrapper restores the tracker's streams, so dropout inside and outside `fork()` draws
    the same masks. Any collectives inside `function` run again during backward, in the
    same order on every rank. Uses torch's non-reentrant checkpoint, so parameters get
    grads even when no input requires grad.

    Megatron's form `checkpoint(function, distribute_saved_activations, *args)` (a bool
    after the function) is accepted for ported code: False is dropped; True is refused
    (it needs the tensor-parallel group: use `checkpoint_distributed_input`).
    """
    if args and isinstance(args[0], bool):
        if args[0]:
            raise ValueError(
                "checkpoint(function, True, *args) is Megatron's distribute_saved_activations "
                "form, which needs the tensor-parallel group: call checkpoint_distributed_input("
                "function, x, *rest, group=tp_group) instead")
        args = args[1:]
    tracker = get_rng_tracker() if tracker is None else tracker
    if torch.compiler.is_compiling():
        # Inside a compiled region (selective recompute in a compiled layer) torch.compile
        # traces the checkpoint itself and replays random ops from its own seeds; a
        # context_fn is not supported there. `function` must not fork the tracker: a
        # generator state set inside the traced checkpoint is not replayed, and the
        # recompute draws other dropout masks. Fork around the checkpoint instead. Nor may
        # it hold a fused CUDA attention kernel with dropout, whose own RNG is not replayed
        # (ParallelAttention._recompute_core).
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    def context_fn():
        # Called once, at forward time: remember the tracker streams as they are now.
        return contextlib.nullcontext(), _ReplayTrackerStates(tracker, tracker.get_states())

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn
    )


def _my_slice(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/tp of `x` flattened (zero-padded to a multiple of tp), as a copy."""
    tp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    flat = x.detach().reshape(-1)
    n = -(-flat.numel() // tp)
    piece = flat[rank * n:(rank + 1) * n]
    if piece.numel() < n:
        piece = torch.cat([piece, piece.new_zeros(n - piece.numel())])
    return piece.clone()


def _gather_slices(piece: torch.Tensor, group, shape: torch.Size) -> torch.Tensor:
    """Inverse of `_my_slice`: all-gather the slices over the group into a tensor of `shape`."""
    tp = torch.distributed.get_world_size(group)
    full = piece.new_empty(piece.numel() * tp)
    _all_gather_single(full, piece, group=group)
    return full[:shape.numel()].view(shape)


class _RngSnapshot:
    """The CPU, CUDA (when `device` is CUDA) and tracker generator states at one moment."""

    def __init__(self, device: torch.device, tracker: Optional[RNGStatesTracker]) -> None:
        self.device, self.tracker = device, tracker
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.streams = tracker.get_states() if tracker is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        if self.streams is not None:
            self.tracker.set_states(self.streams)


class _DistributedInputCheckpoint(torch.autograd.Function):
    """Full recompute keeping 1/tp of the input per tensor-parallel rank.

    forward: runs `run(x, *rest)` without building a graph and saves only this rank's slice
    of `x` (the input is replicated over the TP group). backward: all-gather of the slices
    over the TP group to rebuild `x`, the forward run again under the saved generator
    states, then backward through it (collectives inside `run` run again, in order)."""

    @staticmethod
    def forward(ctx, run, tracker, group, x, *rest):
        ctx.run, ctx.group, ctx.rest, ctx.shape = run, group, rest, x.shape
        ctx.rng = _RngSnapshot(x.device, tracker)
        with torch.no_grad():
            out = run(x, *rest)
        ctx.save_for_backward(_my_slice(x, group))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (piece,) = ctx.saved_tensors
        x = _gather_slices(piece, ctx.group, ctx.shape).requires_grad_()
        now = _RngSnapshot(x.device, ctx.rng.tracker)
        ctx.rng.restore()
        try:
            with torch.enable_grad():
                out = ctx.run(x, *ctx.rest)
        finally:
            now.restore()
        torch.autograd.backward(out, grad_out)
        return (None, None, None, x.grad) + (None,) * len(ctx.rest)


def checkpoint_distributed_input(function, x: torch.Tensor, *rest, group,
                                 tracker: Optional[RNGStatesTracker] = None):
    """`checkpoint(function, x, *rest)` that keeps only 1/tp of `x` on each rank of the
    tensor-parallel `group` until backward (Megatron's --distribute-saved-activations).

    `x` must be the same on every rank of `group` (no sequence parallelism) and the only
    input that needs a gradient; the other arguments are kept as they are. Collectives:
    none in forward besides those of `function`; backward all-gathers the input over
    `group`, then reruns `function` (its collectives again). Falls back to `checkpoint`
    when `x` needs no gradient or the group has one rank."""
    tracker = get_rng_tracker() if tracker is None else tracker
    if (group is None or torch.distributed.get_world_size(group) == 1 or not x.requires_grad
            or not torch.is_grad_enabled()):
        return checkpoint(function, x, *rest, tracker=tracker)
    return _DistributedInputCheckpoint.apply(function, tracker, group, x, *rest)
