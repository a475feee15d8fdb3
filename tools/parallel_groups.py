"""Show which ranks talk to which for a parallel layout (no processes needed).

    python tools/parallel_groups.py --world-size 8 --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 [--expert-model-parallel-size 1] \
        [--dot groups.dot] [--png groups.png]

Prints one row per rank (its tensor/data/pipeline coordinates and the members of its
groups) and can write the communication groups as a Graphviz graph: one cluster per
pipeline stage, one node per rank, edges coloured by group kind. `--png` renders that
graph with Graphviz's `dot` when it is installed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.parallel_state import get_parallel_group_info  # noqa: E402

# group kind -> (column title, DOT edge colour, DOT edge style)
EDGE_STYLES = {
    "tp": ("tp group", "blue", "solid"),
    "dp": ("dp group", "darkgreen", "dashed"),
    "pp": ("pp group", "red", "solid"),
    "embedding": ("embedding group", "orange", "dotted"),
    "ep": ("ep group", "purple", "bold"),
}


def build_parser() -> argparse.ArgumentParser:
    """Flags use Megatron's names; --tp/--pp/--ep are short aliases."""
    from megatron.cli_suggest import SuggestingParser

    p = SuggestingParser(
        description="Print the rank layout and communication groups of a parallel layout."
    )
    p.add_argument("--world-size", type=int, required=True, help="number of processes")
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp_size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", "--ep", dest="ep_size", type=int, default=1)
    p.add_argument("--dot", metavar="FILE", help="write the groups as a Graphviz DOT file")
    p.add_argument("--png", metavar="FILE", help="render the graph to PNG with Graphviz `dot`")
    return p


def _fmt(ranks: List[int]) -> str:
    return "[" + ",".join(str(r) for r in ranks) + "]" if ranks else "-"


def format_table(info: List[Dict[str, object]], with_ep: bool = False) -> str:
    """One line per rank: rank | tp | dp | pp | tp group | dp group | pp group | embedding."""
    kinds = ["tp", "dp", "pp", "embedding"] + (["ep"] if with_ep else [])
    header = ["rank", "tp", "dp", "pp"] + [EDGE_STYLES[k][0] for k in kinds]
    rows = [
        [str(row["rank"]), str(row["tp"]), str(row["dp"]), str(row["pp"])]
        + [_fmt(row[f"{k}_ranks"]) for k in kinds]
        for row in info
    ]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(cells: List[str]) -> str:
        return " | ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()

    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def _unique_groups(info: List[Dict[str, object]], kind: str) -> List[List[int]]:
    seen, out = set(), []
    for row in info:
        g = tuple(row[f"{kind}_ranks"])
        if len(g) > 1 and g not in seen:
            seen.add(g)
            out.append(list(g))
    return out


def build_dot(info: List[Dict[str, object]], with_ep: bool = False) -> str:
    """Graphviz text: a cluster per pipeline stage, a node per rank, a chain of edges
    through the members of each tp / dp / pp / embedding (/ ep) group of size > 1."""
    sizes = {k: max(row[k] for row in info) + 1 for k in ("tp", "dp", "pp")}
    kinds = ["tp", "dp", "pp", "embedding"] + (["ep"] if with_ep else [])
    legend = ", ".join(f"{k}: {EDGE_STYLES[k][1]} {EDGE_STYLES[k][2]}" for k in kinds)
    out = [
        "graph parallel_groups {",
        f'  label="world {len(info)} = tp {sizes["tp"]} x dp {sizes["dp"]} x pp {sizes["pp"]}'
        f'\\n{legend}";',
        "  labelloc=t;",
        "  node [shape=box, fontname=Helvetica];",
    ]
    for stage in range(sizes["pp"]):
        out.append(f"  subgraph cluster_pp{stage} {{")
        out.append(f'    label="pipeline stage {stage}";')
        for row in info:
            if row["pp"] == stage:
                r = row["rank"]
                out.append(f'    r{r} [label="rank {r}\\ntp {row["tp"]} dp {row["dp"]}"];')
        out.append("  }")
    for kind in kinds:
        _, colour, style = EDGE_STYLES[kind]
        for group in _unique_groups(info, kind):
            for a, b in zip(group, group[1:]):
                out.append(f"  r{a} -- r{b} [color={colour}, style={style}, tooltip={kind}];")
    out.append("}")
    return "\n".join(out) + "\n"


def render_png(dot_text: str, png_path: str) -> Optional[str]:
    """Run `dot -Tpng`; return None on success or a message saying why it did not run."""
    exe = shutil.which("dot")
    if exe is None:
        return (
            f"error: Graphviz `dot` is not installed, so {png_path} was not written; install "
            "graphviz (e.g. `apt-get install graphviz`) or write the graph with --dot FILE "
            "and render it elsewhere with `dot -Tpng FILE -o out.png`"
        )
    proc = subprocess.run(
        [exe, "-Tpng", "-o", png_path], input=dot_text, text=True, capture_output=True
    )
    if proc.returncode != 0:
        return (f"error: `dot -Tpng -o {png_path}` failed (exit {proc.returncode}): "
                f"{proc.stderr.strip()}")
    return None


def write_graph(dot_text: str, dot_path: Optional[str], png_path: Optional[str]) -> int:
    """Write the DOT file and / or the PNG; 0, or 1 after saying on stderr which one could
    not be written and why."""
    if dot_path:
        try:
            with open(dot_path, "w") as f:
                f.write(dot_text)
        except OSError as exc:
            print(f"error: cannot write --dot {dot_path} ({exc.strerror or exc}); pass a "
                  "file in an existing, writable directory", file=sys.stderr)
            return 1
        print(f"wrote {dot_path}")
    if png_path:
        problem = render_png(dot_text, png_path)
        if problem:
            print(problem, file=sys.stderr)
            return 1
        print(f"wrote {png_path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the table; write --dot / --png when asked. Bad sizes exit 2; a graph file that
    cannot be written exits 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        info = get_parallel_group_info(args.world_size, args.tp_size, args.pp_size, args.ep_size)
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2
    with_ep = args.ep_size > 1
    print(format_table(info, with_ep))
    if with_ep:  # the grid computes them; no run builds them (Megatron-LM 23.05 has none)
        print(f"note: --expert-model-parallel-size {args.ep_size}: the ep groups are the rank "
              "arithmetic only; pretrain_gpt.py refuses expert model parallelism (with "
              "--num-experts every expert is split over the tp group like the dense MLP and "
              "replicated over the dp group, as in Megatron-LM 23.05)", file=sys.stderr)
    if args.dot or args.png:
        return write_graph(build_dot(info, with_ep), args.dot, args.png)
    return 0


if __name__ == "__main__":
    from tools.cli_exit import run

    run(main)
