r"""Zero-shot evaluation of a GPT checkpoint: WIKITEXT103 perplexity, LAMBADA accuracy.

    torchrun --nproc-per-node N tasks/main.py --task LAMBADA --valid-data lambada.jsonl \
        --strict-lambada <pretrain_gpt.py's model, tokenizer and layout flags> --load CKPT

The command line is Megatron-LM's (`examples/evaluate_zeroshot_gpt.sh`): pretrain_gpt.py's
flags (the same parser and validation) plus the tasks flags of `build_task_parser`. The
model is built for the run's tensor / pipeline / data-parallel layout, without gradient
buffers or optimizer, and loaded from --load (resharded when saved with another layout;
the optimizer and RNG states are never read). The micro-batches run through the training
code's forward-only pipeline schedule (`megatron.train_step.run_schedule`) with a metric
in place of the training loss:

* WIKITEXT103: the sum of the masked per-token cross entropy (fp32, vocabulary-parallel
  under TP) over the sliding windows of datasets.py;
* LAMBADA: the number of passages whose every target token is the argmax of the logits,
  the argmax taken over the whole (unpadded) vocabulary across the TP ranks.

Each data-parallel rank evaluates every dp-th sample (none twice: unlike Megatron-LM's
DistributedSampler, which repeats samples to even out the ranks); the sums are
all-reduced over the data-parallel group and the last rank prints Megatron's report.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.arguments_common import ArgumentsError
from megatron.logging_utils import print_rank_0, print_rank_last
from megatron.watchdog import build_watchdog, watching
from tasks.zeroshot_gpt.datasets import (
    Sample,
    build_lambada_data,
    build_wikitext_data,
)

TASKS = ("WIKITEXT103", "LAMBADA")
# Megatron-LM's tasks/main.py runs these with a BERT model (finetuning classifiers)
BERT_TASKS = ("RACE", "MNLI", "QQP", "ICT-ZEROSHOT-NQ", "RET-FINETUNE-NQ", "MSDP-PROMPT",
              "MSDP-EVAL-F1", "MSDP-EVAL-KF1", "ORQA")
# Megatron's tasks flags that only its finetuning tasks read
NO_EFFECT = {"epochs": "--epochs", "pretrained_checkpoint": "--pretrained-checkpoint",
             "keep_last": "--keep-last", "train_data": "--train-data"}


# --------------------------------------------------------------------------- the flags
class _TaskParser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse API
        raise ArgumentsError(message)


def build_task_parser() -> argparse.ArgumentParser:
    """Megatron-LM's tasks flags (tasks/main.py), beside pretrain_gpt.py's."""
    p = _TaskParser(add_help=False, allow_abbrev=False)
    g = p.add_argument_group("tasks", "zero-shot evaluation (tasks/main.py)")
    g.add_argument("--task", type=str, default=None, help="WIKITEXT103 or LAMBADA (required)")
    g.add_argument("--valid-data", nargs="*", default=None,
                   help="the file to evaluate: WikiText-103 text, or LAMBADA JSON lines")
    g.add_argument("--overlapping-eval", type=int, default=None,
                   help="WIKITEXT103: stride of the sliding windows, in tokens (default 32)")
    g.add_argument("--strict-lambada", action="store_true",
                   help="LAMBADA: the target is the whole last word, not the last token")
    g.add_argument("--epochs", type=int, default=None, help="no effect (finetuning tasks)")
    g.add_argument("--pretrained-checkpoint", type=str, default=None,
                   help="no effect (finetuning tasks); the checkpoint comes from --load")
    g.add_argument("--keep-last", action="store_true", help="no effect (finetuning tasks)")
    g.add_argument("--train-data", nargs="+", default=None,
                   help="no effect (finetuning tasks)")
    return p


def _print_help() -> None:
    from megatron.arguments import build_parser

    print(__doc__)
    print(build_task_parser().format_help())
    build_parser().print_help()


def check_task_args(ns: argparse.Namespace, warn=print) -> None:
    """ArgumentsError for a missing or unknown --task, or a --valid-data that names no file
    or several; a warning for each flag that means nothing to a zero-shot evaluation."""
    if ns.task is None:
        raise ArgumentsError(f"--task is required: {' or '.join(TASKS)}")
    if ns.task not in TASKS:
        if ns.task.upper() in BERT_TASKS:
            raise ArgumentsError(f"--task {ns.task} is one of Megatron-LM's BERT tasks; this "
                                 f"framework evaluates GPT models: --task "
                                 f"{' or --task '.join(TASKS)}")
        raise ArgumentsError(f"unknown --task {ns.task}; the supported tasks are "
                             f"{' and '.join(TASKS)} (upper case, as Megatron-LM spells them)")
    if not ns.valid_data:
        what = "WikiText-103 text file" if ns.task == "WIKITEXT103" else "LAMBADA JSON-lines file"
        raise ArgumentsError(f"--task {ns.task} needs --valid-data FILE (the {what})")
    if len(ns.valid_data) > 1:  # Megatron-LM asserts one file
        raise ArgumentsError(f"--valid-data names {len(ns.valid_data)} files "
                             f"({' '.join(ns.valid_data)}); --task {ns.task} reports on one "
                             "file: run tasks/main.py once per file")
    for dest, flag in NO_EFFECT.items():
        if getattr(ns, dest) not in (None, False):
            warn(f"WARNING: {flag} has no effect on a zero-shot evaluation")
    _check_task_specific(ns, warn)


def _check_task_specific(ns: argparse.Namespace, warn) -> None:
    """Warnings for a flag of the other task (no effect) and for an --overlapping-eval
    below 1 (taken as 1, as Megatron-LM does: one window per token, the slowest
    evaluation); fills --overlapping-eval's default, 32."""
    if ns.task == "WIKITEXT103" and ns.strict_lambada:
        warn("WARNING: --strict-lambada has no effect on --task WIKITEXT103 (it is LAMBADA's)")
    if ns.task == "LAMBADA" and ns.overlapping_eval is not None:
        warn("WARNING: --overlapping-eval has no effect on --task LAMBADA (it is "
             "WIKITEXT103's window stride)")
    if ns.overlapping_eval is None:
        ns.overlapping_eval = 32
    elif ns.overlapping_eval < 1 and ns.task == "WIKITEXT103":
        warn(f"WARNING: --overlapping-eval {ns.overlapping_eval} is taken as 1 (as Megatron-LM "
             "does): a window of --seq-length tokens per scored token, the slowest evaluation; "
             "Megatron-LM's default is 32, --seq-length gives windows without overlap")


def split_args(argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str]]:
    """(the tasks flags, the rest for pretrain_gpt.py's parser). The rest gets --skip-train
    when it sets no run length, and --lr 0 when it has no --lr: both are required by the
    training parser and mean nothing here."""
    ns, rest = build_task_parser().parse_known_args(list(argv))
    given = {a.split("=", 1)[0] for a in rest}
    if not given & {"--train-iters", "--train-samples", "--skip-train"}:
        rest.append("--skip-train")
    if "--lr" not in given:
        rest += ["--lr", "0"]
    return ns, rest


# ------------------------------------------------------------------------- the metrics
class LossSum:
    """WIKITEXT103: sum of the per-token cross entropy at the scored labels (fp32), the
    softmax taken over the first `vocab_limit` ids (the tokenizer's vocabulary) of the
    vocabulary-parallel logits, so the padding rows -- whose number depends on the tensor-
    parallel size, and which a resharded checkpoint fills with zeros -- never count."""

    needs_logits = True

    def __init__(self, tp_group, vocab_limit: int) -> None:
        self.tp_group, self.vocab_limit = tp_group, vocab_limit

    def __call__(self, logits_bsv: torch.Tensor, batch: dict) -> torch.Tensor:
        from megatron.core.tensor_parallel import mask_vocab_padding, vocab_parallel_cross_entropy

        logits = mask_vocab_padding(logits_bsv, self.tp_group, self.vocab_limit)
        loss_bs = vocab_parallel_cross_entropy(logits, batch["labels"], self.tp_group)
        return (loss_bs * batch["loss_mask"]).sum()


class CorrectCount:
    """LAMBADA: passages whose scored labels all equal the argmax of the logits over the
    first `vocab_limit` ids (the tokenizer's; never a padding row) of the whole vocabulary
    (vocabulary-parallel argmax over `tp_group`). Rows with no scored label (the filler of
    a last partial micro-batch) count as neither."""

    needs_logits = True

    def __init__(self, tp_group, vocab_limit: int) -> None:
        self.tp_group, self.vocab_limit = tp_group, vocab_limit

    def __call__(self, logits_bsv: torch.Tensor, batch: dict) -> torch.Tensor:
        from megatron.core.tensor_parallel import vocab_parallel_argmax

        predicted = vocab_parallel_argmax(logits_bsv, self.tp_group, self.vocab_limit)
        scored = batch["loss_mask"] > 0
        right = ((predicted == batch["labels"]) | ~scored).all(dim=-1) & scored.any(dim=-1)
        return right.sum().to(torch.float32)


# -------------------------------------------------------------------- the micro-batches
def micro_batch(rows: Sequence[Sample], micro_batch_size: int, seq_length: int,
                pad_id: int) -> dict:
    """{'text': [b, s+1] int64, 'loss_mask': [b, s] fp32} from up to `micro_batch_size`
    samples, filled up with unscored pad rows (the pipeline sends activations of one
    fixed shape, so a last partial micro-batch keeps the full size)."""
    filler = ([pad_id] * (seq_length + 1), [0] * seq_length)
    rows = list(rows) + [filler] * (micro_batch_size - len(rows))
    return {"text": torch.tensor([r[0] for r in rows], dtype=torch.long),
            "loss_mask": torch.tensor([r[1] for r in rows], dtype=torch.float32)}


def _runs(samples: Sequence[Sample], indices: Sequence[int], cfg, pad_id: int):
    """(first micro-batch number, micro-batches) per schedule run: `num_micro_batches`
    micro-batches each (--global-batch-size / (--micro-batch-size x dp)), the last run
    filled up with unscored ones. Made as they are needed."""
    mbs, seq, per_run = cfg.micro_batch_size, cfg.seq_length, cfg.num_micro_batches
    num_micro = -(-len(indices) // mbs)
    for first in range(0, num_micro, per_run):
        run = []
        for m in range(first, first + per_run):
            rows = [samples[i] for i in indices[m * mbs:(m + 1) * mbs]]
            run.append(micro_batch(rows, mbs, seq, pad_id))
        yield first, min(per_run, num_micro - first), run


@torch.no_grad()
def evaluate_metric(tr, samples: Sequence[Sample], metric, pad_id: int) -> float:
    """The metric summed over this data-parallel rank's share of `samples` (every dp-th),
    then over the data-parallel group (float64). Prints Megatron's '> working on
    iteration: N' every --log-interval micro-batches (rank 0)."""
    from megatron.train_step import run_schedule

    cfg, ps = tr.config, tr.rt.ps
    indices = range(ps.dp_rank, len(samples), ps.dp_size)
    total = torch.zeros((), dtype=torch.float64, device=tr.rt.device)
    tr.model.eval()
    for first, count, run in _runs(samples, indices, cfg.data, pad_id):
        for i in range(first, first + count):
            if i % cfg.logging.log_interval == 0:
                print_rank_0(f"> working on iteration: {i}")
        total += run_schedule(tr, iter(run), len(run), forward_only=True, metric=metric).double()
    if ps.dp_group is not None:
        with watching("evaluation sum all-reduce (data-parallel group)", ps.dp_group):
            dist.all_reduce(total, group=ps.dp_group)
    return float(total)


# ---------------------------------------------------------------------- the reports
def _block(text: str) -> str:
    dashes = "-" * (len(text) + 1)
    return "\n".join([dashes, text, dashes])


def wikitext_report(loss_sum: float, num_tokenized: int, num_original: int) -> Tuple[dict, str]:
    """Megatron's WIKITEXT103 numbers and its report block."""
    avg_loss = loss_sum / (num_tokenized - 1)
    ratio = (num_tokenized - 1) / (num_original - 1)
    res = {"avg_loss": avg_loss, "ppl": math.exp(min(20, avg_loss)),
           "adjusted_ppl": math.exp(min(20, avg_loss * ratio)), "token_ratio": ratio}
    text = (f" validation results on WIKITEXT103 | avg loss: {avg_loss:.4E} | "
            f"ppl: {res['ppl']:.4E} | adjusted ppl: {res['adjusted_ppl']:.4E} | "
            f"token ratio: {ratio} |")
    return res, _block(text)


def lambada_report(num_correct: float, num_examples: int) -> Tuple[dict, str]:
    """Megatron's LAMBADA numbers and its report block."""
    acc = num_correct / num_examples
    res = {"num_correct": num_correct, "num_examples": num_examples, "accuracy": acc}
    text = (f" validation results on LAMBADA | number correct: {num_correct:.4E} | "
            f"total examples: {float(num_examples):.4E} | avg accuracy: {acc:.4E}")
    return res, _block(text)


# --------------------------------------------------------------------------- the run
def build_data(task_ns, config, tokenizer, say=print) -> dict:
    """The samples (and WIKITEXT103's counts) before any process group exists, so a bad
    file stops every rank alike. --overlapping-eval above --seq-length would skip tokens:
    it is taken as --seq-length, with a warning. `say` prints the warnings and Megatron's
    lines on the data read (rank 0's printer under a launcher: no process group tells the
    ranks apart yet)."""
    path, seq = task_ns.valid_data[0], config.data.seq_length
    if task_ns.task == "LAMBADA":
        say(f"> building lambada dataset from {path} ...")
        samples = build_lambada_data(path, tokenizer, seq, task_ns.strict_lambada,
                                     _position_limit(config))
        say(f" > found {len(samples)} samples.")
        return {"samples": samples}
    stride = max(1, task_ns.overlapping_eval)
    if stride > seq:
        say(f"WARNING: --overlapping-eval {task_ns.overlapping_eval} is larger than "
            f"--seq-length {seq}: windows would skip tokens; using {seq} (windows "
            "without overlap)")
        stride = seq
    data = build_wikitext_data(path, tokenizer, seq, stride, warn=say)
    say(f" > number of original tokens: {data.num_original_tokens}, number of detokenized "
        f"tokens: {data.num_tokenized_tokens}")
    return {"samples": data.samples, "num_original": data.num_original_tokens,
            "num_tokenized": data.num_tokenized_tokens}


def _position_limit(config) -> Optional[int]:
    """--max-position-embeddings where it limits the sequence length (a learned position
    table), else None (rotary or no positions)."""
    model = config.model
    return model.max_position_embeddings if model.add_position_embedding else None


def check_load_dir(load: Optional[str]) -> None:
    """SystemExit when --load is given but names no checkpoint (no tracker file): training
    starts from random there, but an evaluation would report a random model's numbers as
    the checkpoint's (a mistyped path). Runs before any process group exists."""
    from megatron.checkpoint_dirs import (
        TRACKER_FILENAME,
        refuse_untracked_checkpoints,
        tracker_path,
    )

    if load is None or os.path.isfile(tracker_path(load)):
        return
    refuse_untracked_checkpoints(load)  # an iteration directory, or one without its tracker
    what = "does not exist" if not os.path.exists(load) else f"has no {TRACKER_FILENAME}"
    raise SystemExit(f"error: --load {load} {what}: there is no checkpoint to evaluate; pass "
                     "the directory pretrain_gpt.py's --save wrote (or drop --load to evaluate "
                     "a randomly initialised model)")


def build_evaluator(config, rt, eod: int):
    """A `megatron.training.Trainer` with this rank's model chunks in eval mode (no
    gradient buffers, no optimizer) and the weights of --load (its optimizer and RNG
    states are not read). Without --load the weights are the seeded initialisation, with
    a warning (Megatron-LM evaluates that too)."""
    from megatron.gemm_choice import activate_gemm_algorithms
    from megatron.trainer_checkpoint import load_trainer_checkpoint
    from megatron.training import Trainer, build_model

    activate_gemm_algorithms(config, rt)
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(
        config.checkpoint, no_load_optim=True, no_load_rng=True))
    tr = Trainer(config, rt, build_model(config, rt, for_training=False), optimizer=None,
                 scheduler=None, eod=eod)
    if config.checkpoint.load:
        load_trainer_checkpoint(tr)
    else:
        print_rank_0("WARNING: no --load: evaluating a randomly initialised model")
    tr.model.eval()
    return tr


def evaluate_task(task_ns, config, rt, tokenizer, data: dict) -> Dict[str, float]:
    """Build, load, evaluate; the last rank prints the report. Returns the numbers."""
    tr = build_evaluator(config, rt, tokenizer.eod)
    if task_ns.task == "LAMBADA":
        metric = CorrectCount(rt.ps.tp_group, tokenizer.vocab_size)
        correct = evaluate_metric(tr, data["samples"], metric, tokenizer.eod)
        res, block = lambada_report(correct, len(data["samples"]))
    else:
        metric = LossSum(rt.ps.tp_group, tokenizer.vocab_size)
        loss_sum = evaluate_metric(tr, data["samples"], metric, tokenizer.eod)
        res, block = wikitext_report(loss_sum, data["num_tokenized"], data["num_original"])
    print_rank_last(block)
    return res


def main(argv: Sequence[str], rank: int = 0, world_size: int = 1, local_rank: int = 0,
         environ=None) -> Optional[Dict[str, float]]:
    """tasks/main.py: parse -> check the tasks flags -> read the data -> initialise ->
    evaluate. Returns the numbers (every rank); None for --help / --dry-run (SystemExit 1
    when the dry run finds a problem). A process group made by the caller is used (and
    left for the caller to destroy); the one the call made is destroyed when it returns
    or every rank exits together, and left alive after another failure, where a rank may
    be gone (megatron.rank_failure.process_group_closed: a collective another rank broke
    is one line naming that rank). Callable more than once in one process: the variables
    it sets in `environ` and the warnings hooks come back as they were
    (megatron.entry_state.entry_point_changes_undone)."""
    from megatron.agreed_exit import silent_ranks_wait
    from megatron.entry_state import entry_point_changes_undone
    from megatron.rank_failure import process_group_closed

    environ = {} if environ is None else environ
    with process_group_closed("during the zero-shot evaluation", environ), \
            silent_ranks_wait(environ), entry_point_changes_undone(environ):
        return _main(argv, rank, world_size, local_rank, environ)


def _main(argv: Sequence[str], rank: int, world_size: int, local_rank: int,
          environ) -> Optional[Dict[str, float]]:
    """main, inside entry_point_changes_undone."""
    from megatron.arguments import (
        exit_before_group,
        format_args_dump,
        parse_and_validate,
        probe_args,
        program_name,
        wait_for_printing_rank,
    )
    from megatron.cli_suggest import option_strings
    from megatron.data_loading import build_tokenizer_for
    from megatron.initialize import initialize_entry_point, set_random_seed
    from megatron.startup_store import JobStore
    from pretrain_gpt import KeptTokenizer

    if "-h" in argv or "--help" in argv:
        _print_help()
        return None
    say = lambda m: rank == 0 and print(m, flush=True)  # rank 0 prints: no group yet
    try:
        task_ns, rest = split_args(argv)
        # a mistyped flag first: `--tsk` is why "--task is required"
        probe_args(rest, option_strings(build_task_parser()))
        check_task_args(task_ns, warn=say)
    except ArgumentsError as err:  # a mistake in the flags: rank 0 prints it
        if rank == 0:  # named as argparse names it, and Megatron-LM's tasks/main.py
            print(f"{program_name()}: {err}", file=sys.stderr)
        else:
            wait_for_printing_rank(world_size, environ)
        raise
    kept = KeptTokenizer()  # its files read once per rank
    job = JobStore(environ, rank, world_size)  # --use-checkpoint-args: rank 0 reads for all
    config = parse_and_validate(rest, world_size=world_size,
                                env={"RANK": str(rank), "LOCAL_RANK": str(local_rank)},
                                vocab_size_fn=kept, job_store=job)
    if config.args.get("dry_run"):
        from tasks.zeroshot_gpt.dry_run import node_dry_run

        status = node_dry_run(task_ns, config, job, local_rank)
        if status:
            raise SystemExit(status)
        return None
    try:  # files read before any process group: printed once per node, not once per rank
        check_load_dir(config.checkpoint.load)
        tokenizer = kept.tokenizer if kept.tokenizer is not None else build_tokenizer_for(config)
        data = build_data(task_ns, config, tokenizer, say)
    except SystemExit as exc:
        raise exit_before_group(exc, rank, world_size,
                                {**environ, "LOCAL_RANK": str(local_rank)}) from None
    rt = initialize_entry_point(config.parallel, config.args["cublas_workspace"], rank,
                                world_size, local_rank, environ, store=job.store)
    # a rank stuck (or gone) while the others wait in a watched collective: one report
    # naming it after --distributed-timeout-minutes, and every rank ends
    watchdog = build_watchdog(config.parallel.distributed_timeout_minutes * 60)
    watchdog.describe = lambda: "during the zero-shot evaluation"
    if rank == 0:
        print(format_args_dump({**config.args, **vars(task_ns)}), flush=True)
    set_random_seed(config.training.seed, rt, config.training.data_parallel_random_init)
    try:
        res = evaluate_task(task_ns, config, rt, tokenizer, data)
    finally:
        watchdog.close()
    print_rank_0("done :-)")
    return res
