"""`--gemm-algorithms`: which cuBLASLt algorithm tables the run's linear products use.

The tables shipped in megatron/gemm_tables were measured by tools/tune_gemms.py on one GPU
model with one cuBLASLt version each; megatron/core/tensor_parallel/gemm_algos.py routes
the products of the shapes a table holds through the measured algorithm. Used by every
entry point that builds a model (training, generation, zero-shot evaluation).
"""
from __future__ import annotations

import os

import torch

from megatron.config import Config
from megatron.initialize import Runtime
from megatron.logging_utils import print_rank_0

GEMM_TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemm_tables")


def activate_gemm_algorithms(config: Config, rt: Runtime) -> None:
    """`--gemm-algorithms`: auto (the default) -> the tables shipped in megatron/gemm_tables
    that were measured on this GPU model with this cuBLASLt version (none on the CPU or
    elsewhere: torch's products); FILE -> that table (one measured on another GPU model or
    cuBLASLt version is refused, naming both); none -> torch's products. A table a
    previous trainer of this process used is dropped first."""
    from megatron.core.tensor_parallel import gemm_algos

    choice = config.args.get("gemm_algorithms") or "none"
    gemm_algos.activate({}, rt.device)
    if choice == "none" or (choice == "auto" and rt.device.type != "cuda"):
        return
    device_name = torch.cuda.get_device_name(rt.device)
    if choice != "auto":
        table = gemm_algos.load_table(choice, device_name, gemm_algos.cublaslt().version)
        gemm_algos.activate(table, rt.device)
        print_rank_0(f"> --gemm-algorithms {choice}: {len(table)} product shapes use the "
                     "measured cuBLASLt algorithm")
        return
    try:
        version = gemm_algos.cublaslt().version
    except (OSError, RuntimeError, AttributeError) as e:  # no libcublasLt, or an old one
        print_rank_0(f"> --gemm-algorithms auto: cuBLASLt cannot be called here ({e}); "
                     "torch's products")
        return
    table, used = gemm_algos.shipped_tables(GEMM_TABLES, device_name, version)
    gemm_algos.activate(table, rt.device)
    if used:
        print_rank_0(f"> --gemm-algorithms auto: products of the {len(table)} shapes in "
                     f"{', '.join(os.path.basename(u) for u in used)} (measured on "
                     f"{device_name}) use the measured cuBLASLt algorithm, all others "
                     "torch's (--gemm-algorithms none: torch's for all)")
    else:
        print_rank_0(f"> --gemm-algorithms auto: no table shipped for {device_name} with "
                     f"cuBLASLt {version}; torch's products (measure your own: "
                     "python tools/tune_gemms.py --out FILE -- <your flags>)")


__all__ = ["GEMM_TABLES", "activate_gemm_algorithms"]
