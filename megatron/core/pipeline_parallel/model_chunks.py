"""The model chunks of one pipeline rank as one module.

A rank holds one chunk, or `vpp` chunks with virtual pipeline stages (chunk c is virtual
stage c * pp + pp_rank). Each chunk is usually wrapped in DistributedDataParallel.
`ModelChunks` is an `nn.ModuleList` of them, so `.train()`, `.eval()`, `.parameters()`
cover every chunk, and it forwards the grad-buffer calls to each chunk.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterable, List

from torch import nn


def unwrap(chunk: nn.Module) -> nn.Module:
    """The model inside a wrapper with `.module` (DistributedDataParallel), else itself."""
    return getattr(chunk, "module", chunk)


class ModelChunks(nn.ModuleList):
    """This rank's model chunks, in virtual-stage order."""

    def __init__(self, chunks: Iterable[nn.Module]) -> None:
        super().__init__(chunks)
        if len(self) == 0:
            raise ValueError("a pipeline rank needs at least one model chunk")

    @property
    def module(self) -> nn.Module:
        """The unwrapped model when there is one chunk (the pp=1 and 1F1B case).

        RuntimeError (not AttributeError, which nn.Module would turn into "no attribute
        'module'") with virtual-pipeline chunks."""
        if len(self) != 1:
            raise RuntimeError(f"this rank holds {len(self)} virtual-pipeline chunks; use "
                                 "unwrapped() or index the chunks")
        return unwrap(self[0])

    def unwrapped(self) -> List[nn.Module]:
        """The models inside the wrappers, one per chunk."""
        return [unwrap(c) for c in self]

    def zero_grad_buffer(self) -> None:
        for c in self:
            c.zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        """Finish every chunk's data-parallel gradient reduction (see DDP)."""
        for c in self:
            c.finish_grad_sync()

    @contextmanager
    def no_sync(self):
        """Every chunk's no_sync() at once."""
        with ExitStack() as stack:
            for c in self:
                stack.enter_context(c.no_sync())
            yield
