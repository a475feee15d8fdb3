"""What the CLI prints about a resolved configuration: the `--dry-run` report (grid, batch
split, analytic parameter counts, missing input files) and Megatron's arguments dump."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from megatron.config import Config, ModelConfig
from megatron.write_errors import write_probe_error


class ParamCount(NamedTuple):
    """`total`: unique parameters of the whole model (tied weights once).
    `per_stage[s]`: parameters on one tensor-parallel rank of pipeline stage s (a tied
    output layer on the last stage of a pipeline counts its own copy, as Megatron does)."""

    total: int
    per_stage: List[int]


def _layer_params(cfg: ModelConfig) -> tuple:
    """(sharded, replicated) parameter counts of one transformer layer. Sharded ones are
    split over tensor-parallel ranks: QKV and fc1 (column-parallel, weight and bias), proj
    and fc2 weights (row-parallel); the norms and the row-parallel biases are replicated.
    With --num-experts E the layer holds E MLPs and the router (h -> E, with bias,
    replicated)."""
    h, d = cfg.hidden_size, cfg.kv_channels
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    bias = 1 if cfg.add_bias_linear else 0
    norm = h if cfg.normalization == "RMSNorm" else 2 * h
    qkv_out = (heads + 2 * groups) * d
    fc1_out = cfg.ffn_hidden_size * (2 if cfg.swiglu else 1)
    mlps = cfg.num_experts or 1
    mlp = (fc1_out * h + bias * fc1_out  # dense_h_to_4h
           + cfg.ffn_hidden_size * h)  # dense_4h_to_h
    sharded = (qkv_out * h + bias * qkv_out  # query_key_value
               + heads * d * h  # dense (attention output projection)
               + mlps * mlp)
    replicated = 2 * norm + bias * h * (1 + mlps)  # norms, proj and fc2 biases
    if cfg.num_experts:
        replicated += cfg.num_experts * (h + 1)  # router
    return sharded, replicated


def count_parameters(cfg: ModelConfig, tp_size: int = 1, pp_size: int = 1,
                     standalone_embedding_stage: bool = False) -> ParamCount:
    """Analytic GPT parameter count: word embeddings (+ learned positions), per layer QKV
    (with grouped-query attention), projection, two norms and the MLP (3 matrices with
    SwiGLU), biases when add_bias_linear, final norm and an untied output layer. Per
    pipeline stage as the model places them (`stage_layout`): with
    `standalone_embedding_stage` stage 0 holds the embedding only; a last stage that does
    not hold the embedding keeps a copy of it for a tied output layer."""
    from megatron.core.models.gpt.stages import stage_layout

    h, vocab = cfg.hidden_size, cfg.padded_vocab_size
    sharded, replicated = _layer_params(cfg)
    final_norm = h if cfg.normalization == "RMSNorm" else 2 * h
    word = vocab * h
    pos = cfg.max_position_embeddings * h if cfg.add_position_embedding else 0
    untied = cfg.untie_embeddings_and_output_weights
    total = word + pos + cfg.num_layers * (sharded + replicated) + final_norm + (word if untied else 0)
    per_stage = []
    for stage in range(pp_size):
        specs = stage_layout(cfg.num_layers, pp_size, stage,
                             standalone_embedding_stage=standalone_embedding_stage)
        pre = any(s.pre_process for s in specs)
        n = sum(s.num_layers for s in specs) * (sharded // tp_size + replicated)
        if pre:
            n += word // tp_size + pos
        if any(s.post_process for s in specs):
            n += final_norm + (word // tp_size if untied or not pre else 0)
        per_stage.append(n)
    return ParamCount(total, per_stage)


def _data_prefixes(paths: Optional[Sequence[str]]) -> List[str]:
    """Prefixes of a Megatron data list: `p`, or `w1 p1 w2 p2 ...` (weights dropped), read
    by the dataset builder's parser; a list it rejects (validation reports it) as is."""
    from megatron.core.datasets.blended import parse_weighted_prefixes

    if not paths:
        return []
    try:
        return parse_weighted_prefixes(paths)[0]
    except ValueError:
        return list(paths)


def missing_data_files(args: Mapping[str, Any]) -> List[str]:
    """The `<prefix>.bin/.idx` files of every data path (`Config.args` as input) that do
    not exist, each with its flag and the fix when there is one ('x.bin' given, the
    --output-prefix, a .bin without its .idx); a relative one also resolved from the
    working directory (the launch scripts run from the repository root)."""
    from megatron.arguments_inputs import unexpanded_home
    from megatron.core.datasets.indexed_dataset import missing_dataset_hint

    missing = []
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        for prefix in _data_prefixes(args.get(flag)):
            absent = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if not absent:
                continue
            where = "" if os.path.isabs(prefix) else f"; looked for {os.path.abspath(prefix)}.*"
            where += unexpanded_home(prefix)
            hint = missing_dataset_hint(prefix).replace("; ", ": ", 1)
            missing.append(f"{' and '.join(absent)} (--{flag.replace('_', '-')}{hint}{where})")
    return missing


def find_missing_inputs(args: Mapping[str, Any]) -> List[str]:
    """Input files a run would need but that do not exist (`Config.args` as input):
    `<prefix>.bin/.idx` of every data path, tokenizer files (the run stops at the first at
    start-up; a dry run goes on with an assumed vocabulary), a missing --load directory
    when --exit-on-missing-checkpoint is set, and a run with no data source at all."""
    from megatron.arguments_inputs import absent_tokenizer_files

    missing = missing_data_files(args) + absent_tokenizer_files(args)
    load = args.get("load")
    if load and not os.path.isdir(load) and args.get("exit_on_missing_checkpoint"):
        missing.append(f"{load} (--load, with --exit-on-missing-checkpoint)")
    has_data = args.get("data_path") or args.get("train_data_path") or args.get("mock_data")
    if not has_data and not args.get("skip_train"):
        missing.append("no training data: pass --data-path PREFIX (or --mock-data)")
    return missing


def data_file_problems(config: Config) -> Tuple[List[str], List[str]]:
    """(problems, warnings): what the run's dataset builder would refuse in data files that
    exist -- an index that does not parse or does not match its `.bin` (a truncated copy,
    the `.idx` of another preprocessing), token ids outside the padded vocabulary (the
    run's bounded sample), a --split that leaves training no document or a blended dataset
    none in a split the run reads -- and the run's warning that it never evaluates (no
    validation document). Each prefix is opened memory-mapped, as the run opens it: no
    token is read beyond that sample, no index is built."""
    import warnings

    from megatron.arguments_inputs import vocab_assumed
    from megatron.core.datasets.gpt_dataset import check_splits
    from megatron.core.datasets.indexed_dataset import MMapIndexedDataset, check_token_ids
    from megatron.data_loading import split_sample_counts

    args, d = config.args, config.data
    vocab = None if vocab_assumed(args) else args.get("padded_vocab_size")
    problems, seen = [], set()
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        for prefix in _data_prefixes(args.get(flag)):
            if prefix in seen or not MMapIndexedDataset.exists(prefix):
                continue  # a missing file is reported by find_missing_inputs
            seen.add(prefix)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the run prints the builder's notes
                    dataset = MMapIndexedDataset(prefix)
                if vocab:
                    check_token_ids(dataset, vocab)
            except ValueError as e:
                problems.append(f"{e} (--{flag.replace('_', '-')})")
    prefixes = _data_prefixes(d.data_path) or _data_prefixes(d.train_data_path)
    if problems or d.mock_data or not all(MMapIndexedDataset.exists(p) for p in prefixes):
        return problems, []
    counts = split_sample_counts(config)
    try:
        check_splits(d.data_path, d.split, counts, d.train_data_path)
    except ValueError as e:
        return [str(e)], []
    warned = []
    t = config.training
    if d.data_path and t.eval_iters > 0 and (t.eval_interval or t.skip_train):
        from megatron.core.datasets.gpt_dataset import get_train_valid_test_split

        sizes = [len(MMapIndexedDataset(p).sizes) for p in _data_prefixes(d.data_path)]
        bounds = [get_train_valid_test_split(d.split, n) for n in sizes]
        if all(b[2] == b[1] for b in bounds):
            from megatron.data_loading import no_validation_reason

            has_test = any(b[3] > b[2] for b in bounds)
            warned.append(f"WARNING: {no_validation_reason(config, has_test)}")
    return problems, warned


def _fmt(n: int) -> str:
    return f"{n:,}"


def _samples(n) -> str:
    """A schedule length in samples: 3.5999999999999996 (0.3 x 12) prints as 3.6."""
    return str(round(n, 4)) if isinstance(n, float) else str(n)


def dry_run_report(config: Config, world_size: int) -> str:
    """Human-readable summary of a resolved configuration for `--dry-run`."""
    return _dry_run(config, world_size)[0]


def _dry_run(config: Config, world_size: int) -> tuple:
    """(the `--dry-run` report, whether the run would fail: missing inputs, data files
    the dataset builder refuses, or a checkpoint under --load that the run could not
    load)."""
    d, t, o = config.data, config.training, config.optimizer
    steps = f"{t.train_iters} iterations"
    if t.train_samples:
        steps += f" ({t.train_samples} samples)"
    training = (f"  training: {steps}, lr {o.lr} ({o.lr_decay_style}, warmup "
                f"{_samples(o.lr_warmup_steps)} / decay {_samples(o.lr_decay_steps)} samples)")
    if t.skip_train or t.train_iters is None:  # no schedule (without --train-iters a placeholder)
        training = "  training: none (--skip-train: evaluation only)"
    world, model = setup_lines(config, world_size)
    lines = [
        "dry run: configuration resolved, nothing launched",
        world,
        f"  batch: micro {d.micro_batch_size} x {d.num_micro_batches} micro-batches per step x "
        f"data {config.parallel.dp_size} = global {d.global_batch_size}; sequence length "
        f"{d.seq_length}",
        training,
    ] + model
    lines += memory_lines(config)
    missing = find_missing_inputs(config.args)
    lines += missing_input_lines(missing)
    bad_data, data_warnings = data_file_problems(config)
    if bad_data:
        lines += ["data the run would refuse:"] + [f"  {item}" for item in bad_data]
    lines += data_warnings
    bad_dirs, dir_warnings = output_dir_problems(config)
    if bad_dirs:
        lines += ["output directories the run would refuse:"] + [f"  {p}" for p in bad_dirs]
    lines += dir_warnings
    load_lines, load_fails = checkpoint_lines(config)
    return "\n".join(lines + load_lines), bool(missing or bad_data or bad_dirs) or load_fails


def unusable_dir(path: str) -> Optional[str]:
    """Why the directory `path` could not be created or written into by this user (an
    existing file, a file on the way to it, a parent without write permission, a
    read-only file system), or None. Leaves nothing behind: a temporary file is created
    and removed in `path` or its nearest existing parent; the run's start-up probe
    (`check_output_dir`) creates the directory and writes a file there."""
    top = os.path.abspath(path)
    if os.path.exists(top):
        if not os.path.isdir(top):
            return "it is an existing file, not a directory"
        return "this user cannot write into it" if write_probe_error(top) is not None else None
    parent = os.path.dirname(top)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a directory, so it cannot be created"
    if write_probe_error(parent) is not None:
        return f"this user cannot create it in {parent} (no write permission or read-only)"
    return None


def output_dir_problems(config: Config) -> Tuple[List[str], List[str]]:
    """(problems, warnings): --save and --tensorboard-dir, which the run probes at
    start-up and refuses when it cannot create or write them, and --data-cache-path,
    where the run builds the dataset index caches it does not find beside the data
    (`<data dir>/index-cache/`): refused when that directory is absent, since the caches
    must then be built there; only a warning when it exists (they may be in it)."""
    fix = "pass a directory that can be created and written to"
    problems, warned = [], []
    for flag, path in (("--save", config.checkpoint.save),
                       ("--tensorboard-dir", config.logging.tensorboard_dir)):
        why = unusable_dir(path) if path else None
        if why:
            problems.append(f"{flag} {path} cannot be used: {why}; {fix}")
    d = config.data
    why = unusable_dir(d.data_cache_path) if d.data_cache_path and not d.mock_data else None
    if why:
        text = (f"--data-cache-path {d.data_cache_path} cannot be used: {why}; the run stops "
                f"when it has to build a dataset index cache there; {fix}")
        prefixes = [p for flag in ("data_path", "train_data_path", "valid_data_path",
                                   "test_data_path") for p in _data_prefixes(config.args.get(flag))]
        beside = [os.path.join(os.path.dirname(p), "index-cache") for p in prefixes]
        if all(os.path.isdir(b) for b in beside):
            warned.append(f"WARNING: {text} (unless {', '.join(sorted(set(beside)))} holds "
                          "them all)")
        else:
            problems.append(text)
    return problems, warned


def setup_lines(config: Config, world_size: int) -> Tuple[str, List[str]]:
    """(the world-size line, the model and parameter-count lines) of a dry-run report."""
    from megatron.arguments_inputs import assumed_vocab_size, vocab_assumed

    m, p, o = config.model, config.parallel, config.optimizer
    counts = count_parameters(m, p.tp_size, p.pp_size, p.standalone_embedding_stage)
    dtype = "bf16" if o.bf16 else "fp16" if o.fp16 else "fp32"
    groups = f", {m.num_query_groups} query groups" if m.num_query_groups != m.num_attention_heads else ""
    per_rank = ", ".join(f"stage {s}: {_fmt(n)}" for s, n in enumerate(counts.per_stage))
    world = (f"  world size {world_size} = tensor {p.tp_size} x pipeline {p.pp_size} x data "
             f"{p.dp_size} (backend {config.args.get('distributed_backend')})")
    padded = "padded"
    if vocab_assumed(config.args):
        padded += (f" from an assumed {assumed_vocab_size(config.args)} tokens: the tokenizer "
                   "files are missing")
    return world, [
        f"  model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads"
        f"{groups}, ffn {m.ffn_hidden_size} ({_ACTIVATION_NAMES.get(m.activation, m.activation)}), "
        f"{m.normalization}, positions "
        f"{m.position_embedding_type}, vocab {m.padded_vocab_size} ({padded}), {dtype}"
        + (f", switch MLP of {m.num_experts} experts (top-1)" if m.num_experts else "")
        + "".join(f", {variant}" for variant in _model_variants(m)),
        f"  parameters: {_fmt(counts.total)} total; per rank ({per_rank})",
    ]


# the activation as the model line names it: "openai_gelu" is the config's name for the
# tanh form, which the default (the fused bias-GeLU, as Megatron's) computes too
_ACTIVATION_NAMES = {"openai_gelu": "GeLU, tanh form", "gelu": "GeLU, erf form",
                     "squared_relu": "squared ReLU", "swiglu": "SwiGLU"}


def _model_variants(m) -> List[str]:
    """The settings of `m` (a ModelConfig) that make it another model than the default GPT
    and that the model line names nowhere else: a ported configuration is checked there."""
    found = []
    if m.kv_channels != m.hidden_size // m.num_attention_heads:
        found.append(f"kv channels {m.kv_channels}")
    if m.use_rotary_position_embeddings and m.rotary_percent != 1.0:
        found.append(f"rotary percent {m.rotary_percent:g}")
    if m.use_rotary_position_embeddings and m.rotary_base != 10000.0:
        found.append(f"rotary base {m.rotary_base:g}")
    if m.layernorm_epsilon != 1e-5:
        found.append(f"layernorm epsilon {m.layernorm_epsilon:g}")
    flags = (
        (m.apply_layernorm_1p, "layernorm 1p"),
        (m.apply_residual_connection_post_layernorm, "residual after the layernorm"),
        (m.untie_embeddings_and_output_weights, "untied output weights"),
        (not m.add_bias_linear, "no linear biases"),
    )
    return found + [name for on, name in flags if on]


def missing_input_lines(missing: List[str]) -> List[str]:
    """The report's input-file lines: every missing one, or that all were found."""
    if not missing:
        return ["all input files found"]
    return ["missing inputs:"] + [f"  {item}" for item in missing]


def checkpoint_lines(config: Config, evaluation: bool = False) -> Tuple[List[str], bool]:
    """(what loading --load would do and every problem that would stop it, whether there
    is one), read from the tracker and the checkpoint's stored arguments and states, not
    its weights (megatron/checkpoint_preflight.py). `evaluation`: for an evaluation,
    which reads the weights alone (its caller refuses a --load without a checkpoint)."""
    load = config.checkpoint.load
    if not load:  # (before the import: it brings the optimizer and the GPU kernels' triton)
        return [], False
    from megatron.checkpoint_preflight import preflight_load

    if not os.path.isdir(load) and config.checkpoint.exit_on_missing_checkpoint:
        return [], False  # a missing input (above)
    if not os.path.exists(load):  # (a file is refused by the preflight, as by the run)
        return [f"checkpoint (--load {load}): the directory does not exist; training would "
                "start from scratch"], False
    found = preflight_load(config, evaluation)
    lines = [f"checkpoint (--load {load}):"] + [f"  {line}" for line in found.lines]
    if not found.problems:
        return lines, False
    lines.append(f"checkpoint problems ({len(found.problems)}; the real run stops at the "
                 "first):")
    for problem in found.problems:
        lines += [f"  {part}" for part in problem.splitlines()]
    what = "evaluation" if evaluation else "run"
    return lines + [f"the {what} would stop when it loads the checkpoint"], True


def _local_gpu_memory() -> Optional[int]:
    """Total memory of the local GPU in bytes, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def memory_lines(config: Config, evaluation: bool = False) -> List[str]:
    """The memory estimate of `megatron.memory_estimate` (a training step's, or with
    `evaluation` a forward-only evaluation's), checked against --gpu-memory-gb (default:
    the local GPU's memory; no check on a machine without CUDA)."""
    from megatron.memory_estimate import format_evaluation_memory_report, format_memory_report

    report = format_evaluation_memory_report if evaluation else format_memory_report
    gb = config.args.get("gpu_memory_gb")
    if gb is not None:
        return report(config, int(gb * 2**30), "--gpu-memory-gb")
    return report(config, _local_gpu_memory(), "the local GPU's memory")


def run_dry_run(config: Config, world_size: int, show: bool = True) -> int:
    """Print the dry-run report (unless not `show`: a launcher's other ranks make the same
    checks in silence); return the exit status (1 when inputs are missing or the
    checkpoint under --load would stop the run)."""
    text, failed = _dry_run(config, world_size)
    if show:
        print(text)
    return 1 if failed else 0


def format_args_dump(args: Dict[str, Any]) -> str:
    """Megatron's rank-0 arguments dump: header, `  name ..... value` lines (name padded with
    dots to 48 characters) sorted case-insensitively, footer."""
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(args, key=lambda k: k.lower()):
        lines.append(f"  {name} {'.' * (48 - len(name))} {args[name]}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
