"""The parallel layout of a saved checkpoint iteration, read from its files.

Tensor-parallel size tp and pipeline size pp from its `mp_rank_*` directories (checked
against its stored args), model chunks per pipeline rank from the first rank's payload
(`model` or `model0`, `model1`, ...), and which optimizer wrapper wrote its optimizer
state (megatron/checkpoint_reshard.py describes the three payloads). Comparing that with a
run's layout says whether a load must reshard (`needs_resharding`).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron.checkpoint_dirs import complete_layout, incomplete_checkpoint_message, model_file
from megatron.checkpointing import rank_dir_name, read_checkpoint_file

DISTRIB_FILENAME = "distrib_optim.pt"


@dataclass(frozen=True)
class Layout:
    """Parallel layout of a checkpoint or a run."""

    tp: int
    pp: int
    vpp: int = 1  # model chunks per pipeline rank
    optimizer: Optional[str] = None  # "fp32" | "mixed" | "distributed" | None (none saved)

    def describe(self) -> str:
        text = f"tp {self.tp}, pp {self.pp}"
        if self.vpp > 1:
            text += f", {self.vpp} virtual stages"
        return text + (f", {self.optimizer} optimizer" if self.optimizer else ", no optimizer")


def scan_layout(iter_dir: str, args: Optional[dict] = None) -> Tuple[int, int]:
    """(tp, pp) from the `mp_rank_*` directories of a saved iteration; SystemExit if there
    are none or some are missing (`checkpoint_dirs.complete_layout`: `args` the stored
    arguments, whose sizes it must hold)."""
    return complete_layout(iter_dir, args)


def optimizer_kind(opt_state, has_distrib_file: bool = False) -> Optional[str]:
    """Which wrapper wrote an `optimizer` payload (megatron/checkpoint_reshard.py lists
    them); None when absent."""
    if opt_state is None:
        return None
    if "state" in opt_state:
        return "fp32"
    inner = opt_state.get("optimizer", opt_state.get("optimizer_state_dict"))
    if isinstance(inner, dict) and "state" in inner:
        return "mixed"
    return "distributed" if has_distrib_file or isinstance(inner, dict) else None


def live_optimizer_kind(optimizer) -> str:
    """The payload kind a live Megatron optimizer wrapper reads and writes."""
    if hasattr(optimizer, "load_parameter_state"):
        return "distributed"
    return "mixed" if hasattr(optimizer, "fp32_from_float16_groups") else "fp32"


def load_shard(path: str):
    """weights_only load, memory-mapped (tensors are read when used) when the file allows;
    SystemExit naming the file when it cannot be read (truncated, damaged)."""
    return read_checkpoint_file(path, mmap=True)


def model_keys(state: dict) -> List[str]:
    """The keys of a payload's model chunks: "model", or "model0", "model1", ... in order."""
    if "model" in state:
        return ["model"]
    return sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))


def inspect_checkpoint(iter_dir: str) -> Tuple[Layout, str, dict]:
    """(the layout a saved iteration was written with, the path of its first rank's file,
    that file's payload memory-mapped: only its structure and plain data are read)."""
    tp, pp = scan_layout(iter_dir)
    first = os.path.join(iter_dir, rank_dir_name(0, 0, pp))
    path = model_file(first)
    if not os.path.isfile(path):
        raise SystemExit(incomplete_checkpoint_message(
            iter_dir, [os.path.relpath(path, iter_dir)],
            f"the directories say tp {tp} x pp {pp}"))
    state = load_shard(path)
    tp, pp = scan_layout(iter_dir, state.get("args"))  # the sizes it was saved with
    has_distrib = os.path.isfile(os.path.join(first, DISTRIB_FILENAME))
    layout = Layout(tp, pp, max(len(model_keys(state)), 1),
                    optimizer_kind(state.get("optimizer"), has_distrib))
    return layout, path, state


def read_layout(iter_dir: str) -> Layout:
    """The layout a saved iteration was written with (see `inspect_checkpoint`)."""
    return inspect_checkpoint(iter_dir)[0]


def needs_resharding(saved: Layout, run: Layout, with_optimizer: bool) -> bool:
    """True when tp, pp or the chunks per rank differ, or (when the optimizer state is to be
    loaded) the optimizer payload kind differs. A dp change alone needs nothing."""
    if (saved.tp, saved.pp, saved.vpp) != (run.tp, run.pp, run.vpp):
        return True
    return with_optimizer and saved.optimizer is not None and saved.optimizer != run.optimizer


__all__ = ["DISTRIB_FILENAME", "Layout", "inspect_checkpoint", "live_optimizer_kind",
           "load_shard", "model_keys", "needs_resharding", "optimizer_kind", "read_layout",
           "scan_layout"]
