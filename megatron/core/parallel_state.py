"""The parallel grid as an object.

Rank layout (Megatron's order): tensor-parallel ranks are adjacent, then data-parallel,
then pipeline-parallel:

    rank = pp_rank * (tp_size * dp_size) + dp_rank * tp_size + tp_rank

`RankGrid` is pure arithmetic (no processes needed, unit-tested for many layouts).
`ParallelState` adds the torch.distributed process groups for one rank. With a world of
one and no initialised process group every group is `None`, and the communication
functions in `tensor_parallel.mappings` treat `None` as "nothing to communicate", so the
same model code runs as a plain single-process model.

A group of one rank is `None` in a larger world too (tp 1: no tensor-parallel group; pp 1:
no pipeline or embedding group): `dist.new_group` must be called by every rank for every
group, and with NCCL on a device-bound default group each call is a communicator split
over the whole world, so the world-size many one-rank groups of a data-parallel layout cost
O(world) world-wide collectives per rank at start-up (O(world^2) in all). The
expert-data-parallel groups are the data-parallel ones when ep is 1. The Megatron-style
`initialize_model_parallel` below still makes the one-rank groups: code ported from
Megatron passes its groups to torch.distributed, where `None` means the whole world.

Thin Megatron-style accessors (`initialize_model_parallel`, `get_tensor_model_parallel_rank`,
...) are at the bottom for people porting code; new code passes the object around.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch.distributed as dist

GROUP_KINDS = ("tp", "dp", "pp", "mp", "embedding", "position_embedding", "ep", "dp_modulo_ep")


@dataclass(frozen=True)
class RankGrid:
    """Pure rank arithmetic for a (world, tp, pp, ep) layout."""

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "ep_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size % (self.tp_size * self.pp_size) != 0:
            raise ValueError(
                f"world size ({self.world_size}) is not divisible by tensor-model-parallel size "
                f"({self.tp_size}) x pipeline-model-parallel size ({self.pp_size}); choose sizes "
                f"whose product divides the number of processes"
            )
        if self.dp_size % self.ep_size != 0:
            raise ValueError(
                f"data-parallel size ({self.dp_size}) is not divisible by expert-model-parallel "
                f"size ({self.ep_size}); choose one of "
                + ", ".join(str(n) for n in range(1, self.dp_size + 1) if self.dp_size % n == 0)
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    # --- coordinates -------------------------------------------------------------------
    def coords(self, rank: int) -> Dict[str, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return {
            "tp": rank % self.tp_size,
            "dp": (rank // self.tp_size) % self.dp_size,
            "pp": rank // (self.tp_size * self.dp_size),
        }

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return pp * self.tp_size * self.dp_size + dp * self.tp_size + tp

    # --- groups (each a list of lists of global ranks, covering the world) --------------
    def tp_groups(self) -> List[List[int]]:
        return [list(range(s, s + self.tp_size)) for s in range(0, self.world_size, self.tp_size)]

    def dp_groups(self) -> List[List[int]]:
        return [
            [self.rank_of(t, d, p) for d in range(self.dp_size)]
            for p in range(self.pp_size)
            for t in range(self.tp_size)
        ]

    def pp_groups(self) -> List[List[int]]:
        stride = self.world_size // self.pp_size
        return [list(range(s, self.world_size, stride)) for s in range(stride)]

    def mp_groups(self) -> List[List[int]]:
        """Model-parallel groups: all tp x pp ranks that hold one replica of the model."""
        return [
            sorted(self.rank_of(t, d, p) for p in range(self.pp_size) for t in range(self.tp_size))
            for d in range(self.dp_size)
        ]

    def embedding_groups(self) -> List[List[int]]:
        """First and last pipeline stage of each pipeline group (tied embeddings)."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def position_embedding_groups(self) -> List[List[int]]:
        return [[g[0]] for g in self.pp_groups()]

    def ep_groups(self) -> List[List[int]]:
        """Expert-parallel groups: consecutive blocks of ep_size inside each DP group."""
        return [
            g[i : i + self.ep_size] for g in self.dp_groups() for i in range(0, len(g), self.ep_size)
        ]

    def dp_modulo_ep_groups(self) -> List[List[int]]:
        """Ranks holding the same expert shard: stride ep_size inside each DP group."""
        return [g[i :: self.ep_size] for g in self.dp_groups() for i in range(self.ep_size)]

    def groups(self, kind: str) -> List[List[int]]:
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")
        return getattr(self, f"{kind}_groups")()

    def group_of(self, kind: str, rank: int) -> List[int]:
        for g in self.groups(kind):
            if rank in g:
                return g
        return []


@dataclass
class ParallelState:
    """One rank's view of the grid: its coordinates and its process groups.

    A group attribute is `None` when the world has one process, torch.distributed is
    not initialised, or the group has one rank; library code treats `None` as a group of
    size one.
    """

    grid: RankGrid
    rank: int = 0
    virtual_pp_size: Optional[int] = None
    sequence_parallel: bool = False
    _groups: Dict[str, object] = field(default_factory=dict, repr=False)
    # Which virtual pipeline chunk this rank is running now (Megatron's global of that
    # name): 0 after build when virtual_pp_size is set, else None. Set by ported code
    # through `set_virtual_pipeline_model_parallel_rank`.
    virtual_pp_rank: Optional[int] = None

    def __post_init__(self) -> None:
        if self.virtual_pp_size is not None and self.virtual_pp_rank is None:
            self.virtual_pp_rank = 0

    @classmethod
    def build(
        cls,
        world_size: int = 1,
        rank: int = 0,
        tp_size: int = 1,
        pp_size: int = 1,
        ep_size: int = 1,
        virtual_pp_size: Optional[int] = None,
        sequence_parallel: bool = False,
        create_groups: Optional[bool] = None,
        timeout=None,
        one_rank_groups: bool = False,
    ) -> "ParallelState":
        """Build the state; create torch process groups when distributed is initialised.

        Every rank must call this with the same sizes (group creation is collective).
        Groups of one rank are left `None` (a group of one: nothing to communicate)
        unless `one_rank_groups` (see the module docstring).
        """
        if sequence_parallel and tp_size == 1:
            raise ValueError("Sequence parallelism requires tensor parallelism")
        grid = RankGrid(world_size, tp_size, pp_size, ep_size)
        state = cls(grid, rank, virtual_pp_size, sequence_parallel)
        if create_groups is None:
            create_groups = dist.is_available() and dist.is_initialized() and world_size > 1
        if create_groups:
            state._create_groups(timeout, one_rank_groups)
        return state

    def _create_groups(self, timeout, one_rank_groups: bool = False) -> None:
        """One `dist.new_group` per group of more than one rank (every rank calls each:
        it is collective), or of any size with `one_rank_groups`. The expert-data-parallel
        groups of ep 1 are the data-parallel groups, reused."""
        kwargs = {"timeout": timeout} if timeout is not None else {}
        for kind in GROUP_KINDS:
            if kind == "dp_modulo_ep" and self.ep_size == 1:
                if "dp" in self._groups:
                    self._groups[kind] = self._groups["dp"]
                continue
            for ranks in self.grid.groups(kind):
                if len(ranks) == 1 and not one_rank_groups:
                    continue
                group = dist.new_group(ranks, **kwargs)  # collective: every rank calls it
                if self.rank in ranks:
                    self._groups[kind] = group

    # --- sizes and coordinates ----------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.grid.world_size

    @property
    def tp_size(self) -> int:
        return self.grid.tp_size

    @property
    def pp_size(self) -> int:
        return self.grid.pp_size

    @property
    def dp_size(self) -> int:
        return self.grid.dp_size

    @property
    def ep_size(self) -> int:
        return self.grid.ep_size

    @property
    def tp_rank(self) -> int:
        return self.grid.coords(self.rank)["tp"]

    @property
    def dp_rank(self) -> int:
        return self.grid.coords(self.rank)["dp"]

    @property
    def pp_rank(self) -> int:
        return self.grid.coords(self.rank)["pp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def ranks(self, kind: str) -> List[int]:
        """Global ranks of this rank's group of `kind`."""
        return self.grid.group_of(kind, self.rank)

    # --- process groups -----------------------------------------------------------------
    def group(self, kind: str):
        """This rank's process group of `kind` (None: no groups built, or not a member)."""
        if kind not in GROUP_KINDS:  # a typo would otherwise read as "nothing to reduce"
            raise ValueError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")
        return self._groups.get(kind)

    @property
    def tp_group(self):
        return self._groups.get("tp")

    @property
    def dp_group(self):
        return self._groups.get("dp")

    @property
    def pp_group(self):
        return self._groups.get("pp")

    @property
    def mp_group(self):
        return self._groups.get("mp")

    @property
    def embedding_group(self):
        return self._groups.get("embedding")

    @property
    def ep_group(self):
        return self._groups.get("ep")

    @property
    def pp_next_rank(self) -> int:
        g = self.ranks("pp")
        return g[(g.index(self.rank) + 1) % len(g)]

    @property
    def pp_prev_rank(self) -> int:
        g = self.ranks("pp")
        return g[(g.index(self.rank) - 1) % len(g)]

    def describe(self) -> Dict[str, object]:
        """This rank's coordinates and group members as plain data."""
        info: Dict[str, object] = {"rank": self.rank, **self.grid.coords(self.rank)}
        for kind in GROUP_KINDS:
            info[f"{kind}_ranks"] = self.ranks(kind)
        return info


def get_parallel_group_info(
    world_size: int, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1
) -> List[Dict[str, object]]:
    """Every rank's coordinates and groups as plain data (no processes needed)."""
    grid = RankGrid(world_size, tp_size, pp_size, ep_size)
    return [ParallelState(grid, r).describe() for r in range(world_size)]


# ---------------------------------------------------------------------------------------
# Megatron-style accessors for people porting code. They read one module-level state set
# by `initialize_model_parallel`; library code never uses them.
_STATE: Optional[ParallelState] = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_split_rank: Optional[int] = None,
    use_fp8: bool = False,
    *,
    expert_model_parallel_size: int = 1,
    sequence_parallel_enabled: bool = False,
) -> ParallelState:
    """Build the ParallelState for this process (torch.distributed must be initialised
    when the world has more than one process) and remember it for the accessors.

    The first five parameters are Megatron-LM 23.05's, in its order (its own initialize
    passes them positionally); `pipeline_model_parallel_split_rank` splits an
    encoder-decoder pipeline and `use_fp8` builds the FP8 amax-reduction groups, so only
    None and False are accepted here. The others are keyword-only. A second call without
    `destroy_model_parallel()` in between is an error (Megatron-LM asserts), not a second
    set of groups."""
    global _STATE
    if use_fp8:
        raise ValueError(
            "initialize_model_parallel(use_fp8=True): FP8 (Transformer Engine) training is "
            "not supported by this framework, so it has no amax-reduction groups; pass "
            "use_fp8=False (and drop --fp8-e4m3 / --fp8-hybrid)")
    if _STATE is not None:
        raise RuntimeError(
            f"initialize_model_parallel() was already called (tensor_model_parallel_size="
            f"{_STATE.tp_size}, pipeline_model_parallel_size={_STATE.pp_size}); call "
            "destroy_model_parallel() first to initialise again")
    _check_split_rank(pipeline_model_parallel_split_rank)
    if sequence_parallel_enabled and tensor_model_parallel_size == 1:
        raise ValueError("Sequence parallelism requires tensor parallelism")
    _check_virtual_size(virtual_pipeline_model_parallel_size, pipeline_model_parallel_size)
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized and tensor_model_parallel_size * pipeline_model_parallel_size > 1:
        raise ValueError(
            f"tensor_model_parallel_size={tensor_model_parallel_size} x "
            f"pipeline_model_parallel_size={pipeline_model_parallel_size} needs several "
            "processes, but torch.distributed is not initialised, so the world size (1) is this "
            "process alone: call torch.distributed.init_process_group() first (under torchrun)")
    world = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    _STATE = ParallelState.build(
        world, rank, tensor_model_parallel_size, pipeline_model_parallel_size,
        expert_model_parallel_size, virtual_pipeline_model_parallel_size,
        sequence_parallel_enabled, one_rank_groups=True,
    )
    return _STATE


def _check_split_rank(split: Optional[int]) -> None:
    if split is not None:
        raise ValueError(
            f"pipeline_model_parallel_split_rank={split} splits an encoder-decoder pipeline; "
            "the models here are decoder-only: pass None")


def _check_virtual_size(vpp: Optional[int], pp: int) -> None:
    """Virtual stages interleave the chunks of several pipeline ranks: with one stage there
    is nothing to interleave (and `is_pipeline_last_stage()` would be False on the only
    stage). Megatron-LM 23.05 wants pp > 2 here; the schedules here run pp == 2 too."""
    if vpp is None or vpp == 1:
        return
    if vpp < 1:
        raise ValueError(f"virtual_pipeline_model_parallel_size={vpp} must be >= 1, or None "
                         "for no interleaved schedule")
    if pp < 2:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size "
            f">= 2 (got {pp}): pass None (no interleaved schedule) or a larger pipeline size")


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("model parallel is not initialized; call initialize_model_parallel()")
    return _STATE


def destroy_model_parallel() -> None:
    """Forget the state, the global memory buffer and any value set by the
    `set_{tensor,pipeline}_model_parallel_{world_size,rank}` setters."""
    global _STATE, _MEMORY_BUFFER
    _STATE = None
    _MEMORY_BUFFER = None
    _OVERRIDES.clear()


def is_unitialized() -> bool:
    """Megatron-LM's (misspelt) name: True before `initialize_model_parallel`."""
    return _STATE is None


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def get_tensor_model_parallel_rank() -> int:
    value = _OVERRIDES.get("tp_rank")
    return get_parallel_state().tp_rank if value is None else value


def get_tensor_model_parallel_world_size() -> int:
    value = _OVERRIDES.get("tp_size")
    return get_parallel_state().tp_size if value is None else value


def get_tensor_model_parallel_group():
    return get_parallel_state().tp_group


def get_pipeline_model_parallel_rank() -> int:
    value = _OVERRIDES.get("pp_rank")
    return get_parallel_state().pp_rank if value is None else value


def get_pipeline_model_parallel_world_size() -> int:
    value = _OVERRIDES.get("pp_size")
    return get_parallel_state().pp_size if value is None else value


def get_pipeline_model_parallel_group():
    return get_parallel_state().pp_group


def get_data_parallel_rank() -> int:
    return get_parallel_state().dp_rank


def get_data_parallel_world_size() -> int:
    return get_parallel_state().dp_size


def get_data_parallel_group():
    return get_parallel_state().dp_group


def get_model_parallel_group():
    return get_parallel_state().mp_group


def get_embedding_group():
    """The group of the first and last pipeline stage (tied word embeddings). Raises on a
    rank outside it, where torch.distributed would read None as the whole world."""
    return _member_group("embedding", "is_rank_in_embedding_group()")


def get_position_embedding_group():
    """The group of the first pipeline stage (position embeddings); raises elsewhere."""
    return _member_group("position_embedding", "is_rank_in_position_embedding_group()")


def _member_group(kind: str, check: str):
    state = get_parallel_state()
    if state.world_size > 1 and state.group(kind) is None:
        pp = state.ranks("pp")
        members = sorted({pp[0], pp[-1]}) if kind == "embedding" else [pp[0]]
        raise RuntimeError(
            f"rank {state.rank} is not in the {kind.replace('_', ' ')} group (of its pipeline "
            f"group {pp} only ranks {members} are): only call get_{kind}_group() where "
            f"{check} is True")
    return state.group(kind)


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """True on the first and last pipeline stage (every rank when pp is 1). With a virtual
    size and not `ignore_virtual`: only while running the first chunk on the first stage,
    or the last chunk on the last stage."""
    state = get_parallel_state()
    ranks = state.ranks("embedding")
    if state.rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if state.rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False)
    if state.rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """True on the first pipeline stage."""
    state = get_parallel_state()
    return state.rank in state.ranks("position_embedding")


def get_pipeline_model_parallel_split_rank() -> Optional[int]:
    """Always None: no encoder-decoder split (see `initialize_model_parallel`)."""
    return None


def set_pipeline_model_parallel_split_rank(rank: Optional[int]) -> None:
    _check_split_rank(rank)


# Without a split every stage is before it, after it and (Megatron's `before_split(rank)
# and after_split(rank + 1)`) at it: Megatron's answers when the split rank is None.
def is_pipeline_stage_before_split(rank: Optional[int] = None) -> bool:
    return True


def is_pipeline_stage_after_split(rank: Optional[int] = None) -> bool:
    return True


def is_pipeline_stage_at_split() -> bool:
    return True


# Values set by `set_{tensor,pipeline}_model_parallel_{world_size,rank}`: read before the
# state, and usable without it (Megatron's checkpoint tools build one rank's model this way).
_OVERRIDES: Dict[str, Optional[int]] = {}


def _set_override(key: str, name: str, value: Optional[int]) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < (1 if key.endswith("size") else 0)):
        raise ValueError(f"{name}({value!r}): expected an int >= "
                         f"{1 if key.endswith('size') else 0}, or None to unset")
    _OVERRIDES[key] = value


def set_tensor_model_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("tp_size", "set_tensor_model_parallel_world_size", world_size)


def set_tensor_model_parallel_rank(rank: Optional[int]) -> None:
    _set_override("tp_rank", "set_tensor_model_parallel_rank", rank)


def set_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    _set_override("pp_size", "set_pipeline_model_parallel_world_size", world_size)


def set_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    _set_override("pp_rank", "set_pipeline_model_parallel_rank", rank)


_MEMORY_BUFFER = None


def get_global_memory_buffer():
    """Megatron's GlobalMemoryBuffer: `get_tensor(shape, dtype, name)` hands out a view of
    one reused tensor per (name, dtype). Made at the first call after initialisation."""
    global _MEMORY_BUFFER
    get_parallel_state()  # raises before initialisation, as Megatron's assertion
    if _MEMORY_BUFFER is None:
        from megatron.core.utils import GlobalMemoryBuffer

        _MEMORY_BUFFER = GlobalMemoryBuffer()
    return _MEMORY_BUFFER


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this process's tensor-parallel group (the source
    of broadcasts over that group)."""
    return get_parallel_state().ranks("tp")[0]


def get_data_parallel_src_rank() -> int:
    """Global rank of the first rank of this process's data-parallel group."""
    return get_parallel_state().ranks("dp")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of this process's pipeline group."""
    return get_parallel_state().ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of this process's pipeline group."""
    return get_parallel_state().ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage; the last stage's next is the first (wraps around)."""
    return get_parallel_state().pp_next_rank


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage; the first stage's previous is the last (wraps)."""
    return get_parallel_state().pp_prev_rank


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    """The virtual pipeline chunk this rank runs now: 0 after initialisation with a
    virtual size, None without one."""
    return get_parallel_state().virtual_pp_rank


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    """Set the virtual pipeline chunk this rank runs now (read by `is_pipeline_*_stage`)."""
    state = get_parallel_state()
    size = state.virtual_pp_size
    if size is not None and rank is not None and not 0 <= rank < size:
        raise ValueError(
            f"virtual pipeline rank {rank} is outside 0..{size - 1} "
            f"(virtual_pipeline_model_parallel_size={size})")
    state.virtual_pp_rank = rank


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    """Virtual pipeline chunks per rank (None: no interleaved schedule)."""
    return get_parallel_state().virtual_pp_size


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on the first pipeline stage; with a virtual size, only while running chunk 0
    unless `ignore_virtual`."""
    size, vrank = _virtual()
    if not ignore_virtual and size is not None and vrank != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the last pipeline stage; with a virtual size, only while running the last
    chunk unless `ignore_virtual`."""
    size, vrank = _virtual()
    if not ignore_virtual and size is not None and vrank != size - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def _virtual():
    """(virtual size, virtual rank); (None, None) before initialisation, where the pipeline
    setters alone may describe the stage."""
    return (None, None) if _STATE is None else (_STATE.virtual_pp_size, _STATE.virtual_pp_rank)
