"""A run's datasets and what is checked about them: the tokenizer, mock or Megatron
.bin/.idx data split into train/valid/test, the `cyclic` sampler, the sample counts asked
of each split and the data checks said before training (missing files, a validation or
train set too small for a resumed run, a split without validation documents, data
without end-of-document tokens).

The iterators that read the datasets (reader thread, DataLoader workers, pinned memory,
worker failures) and `get_batch` are in `megatron.data_iterators`.

Sample counts follow Megatron: train = train_iters * global batch; valid =
(train_iters // eval_interval + 1) * eval_iters * global batch; test = eval_iters * global
batch (one draw, at the end). With --eval-interval 0 (this project's: no evaluation) a
training run asks nothing of valid and test, and builds neither (`unread_splits`).
"""
from __future__ import annotations

import os
import warnings
from typing import Dict, Iterator, List, Optional

import numpy as np
import torch
import torch.distributed as dist

import megatron.core.datasets
from megatron.config import Config
from megatron.core.datasets.mock import MockGPTDataset
from megatron.logging_utils import print_rank_0

SPLITS = ("train", "valid", "test")
# warnings raised by files under here are the dataset builder's own
_DATASETS_DIR = os.path.dirname(megatron.core.datasets.__file__)


def build_tokenizer_for(config: Config):
    """The run's tokenizer (None for mock data without a tokenizer type)."""
    d = config.data
    if d.tokenizer_type is None:
        return None
    from megatron.tokenizer import build_tokenizer

    return build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                           tokenizer_model=d.tokenizer_model, vocab_size=d.vocab_size,
                           vocab_extra_ids=d.vocab_extra_ids)


def split_sample_counts(config: Config) -> List[int]:
    """[train, valid, test] samples asked of the dataset builder (the module docstring's
    rule), in batches of the final --global-batch-size also during a ramp-up."""
    t, d = config.training, config.data
    gbs = d.target_global_batch_size or d.global_batch_size
    train = (t.train_samples or t.train_iters * gbs) if not t.skip_train else 0
    if unread_splits(config):
        return [train, 0, 0]
    evals = ((t.train_iters or 0) // t.eval_interval + 1) * t.eval_iters * gbs if t.eval_interval else t.eval_iters * gbs
    return [train, evals, t.eval_iters * gbs]


def unread_splits(config: Config) -> tuple:
    """The splits this run never reads, so never builds: valid and test when
    --eval-interval 0 turns every evaluation off, the final one too (a --skip-train run
    evaluates whatever the interval). Their index files would cost time and disk, and an
    iterator of a set (mock data's too) its loader's thread or worker processes."""
    t = config.training
    return ("valid", "test") if t.eval_interval == 0 and not t.skip_train else ()


def validation_shortfall(config: Config, iteration: int, consumed: int,
                         num_samples: int) -> Optional[str]:
    """Why the validation set cannot serve the evaluations left to a run starting at
    `iteration` with `consumed` validation samples behind it (None when it can).

    Each evaluation reads the next --eval-iters global batches (the `single` loader does
    not wrap). The set is sized from the current --train-iters, --eval-interval and
    --eval-iters, while `consumed` comes from the checkpoint: a run resumed with fewer
    --eval-iters or a longer --eval-interval than it was trained with can find the set
    used up, which Megatron-LM reports as a bare StopIteration at that evaluation, possibly
    hours in. Said before training instead. The `cyclic` loader starts another epoch
    instead of running out: nothing to say there."""
    t, d = config.training, config.data
    if t.eval_iters <= 0 or d.dataloader_type == "cyclic":
        return None
    per_draw = t.eval_iters * (d.target_global_batch_size or d.global_batch_size)
    in_loop = 0
    if t.eval_interval and not t.skip_train:
        in_loop = max(0, (t.train_iters or 0) // t.eval_interval - iteration // t.eval_interval)
    draws = in_loop + (1 if t.skip_train or t.eval_interval else 0)  # + the final one
    if consumed + draws * per_draw <= num_samples:
        return None
    fits = max(0, num_samples - consumed) // per_draw
    where = (f"the evaluation at iteration {(iteration // t.eval_interval + fits + 1) * t.eval_interval}"
             if fits < in_loop else "the final evaluation")
    return (f"the validation set has {num_samples} samples and {consumed} are already consumed "
            f"(consumed_valid_samples at iteration {iteration}); the {draws} evaluation(s) left "
            f"read {per_draw} samples each (--eval-iters {t.eval_iters} x global batch "
            f"{per_draw // t.eval_iters}), {draws * per_draw} in all, so {where} would run out "
            "of data. The set is sized from --train-iters, --eval-interval and --eval-iters as "
            "given now: resume with the --eval-interval and --eval-iters the checkpoint was "
            "trained with, or pass --eval-iters 0 to train without validation")


def train_shortfall(config: Config, iteration: int, consumed: int,
                    num_samples: int) -> Optional[str]:
    """Why the train set cannot serve the iterations left to a run starting at `iteration`
    with `consumed` training samples behind it (None when it can).

    The set is sized from --train-iters x --global-batch-size (or --train-samples) as given
    now, while `consumed` comes from the checkpoint: an iteration-based run resumed at a
    smaller --global-batch-size than it was trained with asks its data for fewer samples
    than it has read already plus the steps left (a blend holds barely more than it asks).
    Megatron-LM stops on an assertion when nothing is left, else with a bare StopIteration
    at the step that runs out, possibly hours in. Said before training instead. With
    --rampup-batch-size each step takes the ramp's size of its consumed count. The `cyclic`
    loader starts another epoch instead of running out."""
    from megatron.microbatches import current_global_batch_size

    t, d = config.training, config.data
    if t.skip_train or d.dataloader_type == "cyclic" or iteration >= (t.train_iters or 0):
        return None
    gbs = d.target_global_batch_size or d.global_batch_size
    rampup = tuple(d.rampup_batch_size) if d.rampup_batch_size else None
    end, it = consumed, iteration
    while it < t.train_iters:
        step = current_global_batch_size(end, rampup, gbs) if rampup else gbs
        if step == gbs:  # the same size from here on: the rest in one sum
            if end + (t.train_iters - it) * gbs <= num_samples:
                return None
            it += max(num_samples - end, 0) // gbs
            break
        if end + step > num_samples:
            break
        end, it = end + step, it + 1
    else:
        return None
    return _shortfall_message(config, iteration, consumed, num_samples, it + 1, gbs)


def _shortfall_message(config: Config, iteration: int, consumed: int, num_samples: int,
                       runs_out_at: int, gbs: int) -> str:
    """`train_shortfall`'s text. Consumed samples at iteration 0 come from a release
    checkpoint (Megatron-LM keeps its count, unless --finetune): the set is sized for the
    steps alone, so the fix is --finetune (read from sample 0) or the cyclic loader, not
    another batch size."""
    t = config.training
    release = iteration == 0 and consumed > 0
    if release:
        why = ("the consumed_train_samples of a checkpoint loaded at iteration 0, a release "
               "checkpoint: Megatron-LM keeps them")
    else:
        why = (f"consumed_train_samples at iteration {iteration}, "
               f"{consumed / max(iteration, 1):g} a step")
    text = (f"the train set has {num_samples} samples and {consumed} are already consumed "
            f"({why}); the {t.train_iters - iteration} iteration(s) left to --train-iters "
            f"{t.train_iters} at global batch size {gbs} would run out of data at iteration "
            f"{runs_out_at}. The set is sized from --train-iters x --global-batch-size (or "
            "--train-samples) as given now")
    if release:
        return (f"{text}, without the samples consumed before: pass --finetune to read the "
                "train data from sample 0, or --dataloader-type cyclic to start another "
                "epoch where it runs out")
    return (f"{text}, and the checkpoint read more a step: resume with the "
            "--global-batch-size the checkpoint was trained with, or, where a "
            "--nan-loss-policy rollback skipped batches (counted as read), with a larger "
            "--train-iters (or --train-samples)")


def check_data_files(config: Config, group=None) -> None:
    """Every `.bin/.idx` of the data paths exists, checked by every rank before the model
    is built (the dataset builder meets a missing one only after the model, optimizer and
    checkpoint load): one report naming each missing file, printed by rank 0 (the ranks
    agree over `group`). Collective when distributed."""
    from megatron.agreed_exit import agree
    from megatron.arguments_report import missing_data_files

    missing = [] if config.data.mock_data else missing_data_files(config.args)
    error = None
    if missing:
        error = f"error: data files not found: {'; '.join(missing)}"
    agree(error, group)


def build_datasets(config: Config, rank: int, vocab_size: int,
                   group=None, tokenizer_vocab_size: Optional[int] = None) -> Dict[str, object]:
    """split -> dataset (or None). Collective when distributed: global rank 0 builds the
    index caches while the others wait, then everyone loads them. Token ids are checked
    (a bounded sample) against the padded vocabulary: rank 0 reads the sample of each
    `.bin` and broadcasts the id ranges over `group`, every rank judges them; blend ratios are printed on rank 0;
    a run that trains needs train documents; sampled ids past `tokenizer_vocab_size` (the
    run's tokenizer's, unpadded) are warned. Any data problem ends the run on every rank
    together (`agreed_data_error` over `group`, the run's control group), printed once:
    `error: could not build the datasets: ...`."""
    d = config.data
    if d.mock_data:  # the tokenizer's ids (not the padding rows, which depend on the layout)
        size = tokenizer_vocab_size if tokenizer_vocab_size and not d.vocab_size else vocab_size
        unread = unread_splits(config)
        return {s: None if s in unread else
                MockGPTDataset(size, d.seq_length, d.seed, split_index=i, **sized)
                for i, (s, sized) in enumerate(zip(SPLITS, _mock_sizes(config)))}
    from megatron.agreed_exit import from_rank_0
    from megatron.core.datasets.gpt_dataset import build_train_valid_test_datasets
    from megatron.core.datasets.index_cache import MissingIndexCacheError

    counts = split_sample_counts(config)
    print_rank_0("> building train, validation, and test datasets ...")  # Megatron-LM's lines
    print_rank_0(" > datasets target sizes (minimum size):")
    for name, n in zip(("train", "validation", "test"), counts):
        print_rank_0(f"    {name + ':':<11} {n}")
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    wait = _index_build_wait(config, rank)
    barrier = wait.barrier if wait is not None else None
    share = None if barrier is None else (lambda value: from_rank_0(value, group))
    datasets, error = None, None
    if wait is not None and rank == 0:
        wait.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            datasets = build_train_valid_test_datasets(
                d.data_path, d.split, counts, d.seq_length, d.seed, d.data_cache_path,
                d.train_data_path, d.valid_data_path, d.test_data_path,
                is_builder_rank=rank == 0, barrier=barrier,
                vocab_size=config.model.padded_vocab_size, log=print_rank_0,
                tokenizer_vocab_size=tokenizer_vocab_size,
                barrier_timeout_s=60.0 * config.parallel.distributed_timeout_minutes,
                share=share, skip_splits=unread_splits(config))
    except (ValueError, OSError) as e:  # OSError: also an unreadable .bin/.idx
        error = (isinstance(e, MissingIndexCacheError), str(e))
    finally:
        if wait is not None:
            wait.stop()
    agreed_data_error(error, group)
    _report_warnings(caught)
    print_rank_0("> finished creating GPT datasets ...")
    return dict(zip(SPLITS, datasets))


def _mock_sizes(config: Config) -> List[dict]:
    """MockGPTDataset's size argument of each split: its default (2**40 samples) for the
    `single` loader; for `cyclic`, which permutes each epoch of the set, the samples the
    run asks of the split (at least one micro-batch per data-parallel rank), as a real
    set's index holds them: a permutation of 2**40 samples (8 TiB) ended the run in an
    out-of-memory report that advised more tensor or pipeline parallelism."""
    if config.data.dataloader_type != "cyclic":
        return [{} for _ in SPLITS]
    least = config.data.micro_batch_size * config.parallel.dp_size
    return [{"num_samples": max(n, least)} for n in split_sample_counts(config)]


def _index_build_wait(config: Config, rank: int):
    """The wait of the other ranks for global rank 0's index build (`IndexBuildWait`: not
    bounded by the collective timeout while rank 0's heartbeat comes), None without a
    process group of several ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from megatron.index_build_wait import IndexBuildWait

    store = dist.distributed_c10d._get_default_store()
    return IndexBuildWait(store, rank, 60.0 * config.parallel.distributed_timeout_minutes,
                          _watched_barrier)


def _watched_barrier() -> None:
    """The world barrier after global rank 0 built the index files (watched)."""
    from megatron.watchdog import watching

    with watching("barrier after the dataset index build"):
        dist.barrier()


def agreed_data_error(error: Optional[tuple], group=None) -> None:
    """Raise on every rank when any rank could not build its datasets (`error`: this rank's
    (waiting-for-the-builder?, message), or None), with one report that rank 0 prints. A
    rank that failed alone would otherwise leave the others waiting in their next
    collective until the timeout, and each failing rank printed its own copy. A rank that
    found no index files only waited for the builder (global rank 0): when the builder
    failed, its error is the one reported. Collective over `group` (all ranks)."""
    from megatron.agreed_exit import agree, agreed_report, exit_on_every_rank

    errors = agree(None, group, error)
    if not any(errors):
        return
    builder_failed = errors[0] is not None
    report = agreed_report([
        None if e is None or (e[0] and builder_failed)
        else f"error: could not build the datasets: {e[1]}" for e in errors])
    raise exit_on_every_rank(report, group)


def no_validation_reason(config: Config, has_test: bool = False) -> str:
    """Why a run asked to evaluate (--eval-iters > 0) has no validation set, and the fix:
    Megatron skips every evaluation then without a word. `has_test`: there is a test set,
    still evaluated at the end."""
    d = config.data
    if has_test:
        never = ("so this run computes no validation loss (only the test set is evaluated, "
                 "at the end)")
        off = "--eval-iters 0 to train without evaluation"
    else:
        never, off = "so this run never evaluates", "--eval-iters 0 to train without validation"
    if d.data_path:
        return (f"--split {d.split!r} leaves the validation split no documents of "
                f"--data-path, {never}; {validation_split_fix(d.data_path, d.split)}"
                f", or pass {off}")
    return f"no --valid-data-path, {never}; pass --valid-data-path, or {off}"


EOD_SAMPLE_DOCS = 64  # documents whose last token `missing_eod_warning` reads, per prefix


def _documents_end_with(prefix: str, eod: int) -> bool:
    """Whether any of up to EOD_SAMPLE_DOCS documents of `prefix`, spread over the file,
    ends with `eod` (a document's last token is the last of its last sequence: with
    --split-sentences a document holds several). An empty file or document counts as
    ending with it (nothing to say)."""
    from megatron.core.datasets.indexed_dataset import MMapIndexedDataset

    data = MMapIndexedDataset(prefix)
    ends = np.asarray(data.doc_idx[1:], dtype=np.int64) - 1  # each document's last sequence
    ends = ends[ends >= 0]
    if len(ends) == 0:
        return True
    picks = np.unique(np.linspace(0, len(ends) - 1, min(EOD_SAMPLE_DOCS, len(ends))).astype(int))
    for last in ends[picks]:
        size = int(data.sizes[last])
        if size == 0 or int(data.get(int(last), size - 1, 1)[0]) == eod:
            return True
    return False


def missing_eod_warning(config: Config, eod: Optional[int]) -> Optional[str]:
    """A WARNING line when --eod-mask-loss, --reset-position-ids or --reset-attention-mask
    is given and none of the sampled documents of a data file ends with the tokenizer's
    end-of-document id `eod`: the data was preprocessed without --append-eod, so the
    flags act on nothing (as in Megatron-LM, which says nothing). Reads the last token of
    up to EOD_SAMPLE_DOCS documents per file (rank 0 calls it; --mock-data is skipped)."""
    from megatron.arguments_common import flag_for_dest
    from megatron.arguments_inputs import EOD_FLAGS
    from megatron.core.datasets.blended import parse_weighted_prefixes

    d = config.data
    flags = [flag_for_dest(dest) for dest in EOD_FLAGS if getattr(d, dest)]
    if not flags or eod is None or d.mock_data:
        return None
    prefixes = []
    for paths in (d.data_path, d.train_data_path, d.valid_data_path, d.test_data_path):
        for prefix in (parse_weighted_prefixes(paths)[0] if paths else []):
            if prefix not in prefixes:
                prefixes.append(prefix)
    without = [p for p in prefixes if not _documents_end_with(p, eod)]
    if not without:
        return None
    one = len(flags) == 1
    return (f"WARNING: {' and '.join(flags)} {'acts' if one else 'act'} at the "
            f"end-of-document token (id {eod}), and no sampled document of "
            f"{', '.join(without)} ends with it: the data was likely preprocessed without "
            f"--append-eod, so {'it changes' if one else 'they change'} nothing. Preprocess "
            f"with tools/preprocess_data.py --append-eod, or drop {'it' if one else 'them'}")


def validation_split_fix(data_path, split: Optional[str] = None) -> str:
    """The fix for a --data-path whose --split gives validation no document, from the
    document count of its smallest dataset n: `--split n-1,1,0` gives each dataset at least
    one; a `split` with a test share keeps its train and test numbers and gets the smallest
    validation number that gives each dataset a document (`--split n-1,1,0` would drop the
    test set); a dataset of one document cannot be split, so validation needs its own files."""
    from megatron.core.datasets.blended import parse_weighted_prefixes
    from megatron.core.datasets.indexed_dataset import MMapIndexedDataset

    try:
        counts = {p: len(MMapIndexedDataset(p).sizes)
                  for p in parse_weighted_prefixes(data_path)[0]}
    except ValueError:
        counts = {}
    if not counts:
        return "give the second --split number a share of at least one document"
    prefix, fewest = min(counts.items(), key=lambda item: item[1])
    if fewest >= 2:
        return (f"give the second --split number a share of at least one document: with "
                f"{fewest} documents in {prefix}, e.g. --split "
                f"{_split_with_validation(split, fewest)}")
    return (f"{prefix} holds one document, which --split cannot share between training and "
            "validation: preprocess more documents, or give validation its own files with "
            "--train-data-path and --valid-data-path instead of --data-path")


def _split_with_validation(split: Optional[str], size: int) -> str:
    """A --split giving validation at least one of `size` documents: `split`'s train and
    test numbers with the smallest validation number that does so (`split_with_documents`),
    test keeping a document where `split` gave it one here (a test share too small for
    these documents is kept: it gives larger datasets of a blend theirs); `size-1,1,0`
    when `split` has no test number (or no such number fits)."""
    from megatron.core.datasets.splits import get_train_valid_test_split, split_with_documents

    fallback = f"{size - 1},1,0"
    try:
        bounds = get_train_valid_test_split(split, size) if split else None
        numbers = [float(x) for x in split.replace("/", ",").split(",")][:3] if split else []
    except ValueError:
        return fallback
    if bounds is None or len(numbers) < 3 or numbers[2] <= 0:
        return fallback
    fix = split_with_documents(split, [size], valid=True, test=bounds[3] > bounds[2])
    return fix or fallback


def _report_warnings(caught: List[warnings.WarningMessage]) -> None:
    """The dataset builder's own warnings (every rank sees the same files) as one
    `WARNING: ...` line on rank 0, not one `path:line: UserWarning` per rank; others
    are shown as Python would have shown them."""
    for w in caught:
        if w.filename.startswith(_DATASETS_DIR):
            print_rank_0(f"WARNING: {w.message}")
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


class CyclicSampler:
    """Megatron's `cyclic` loader: each epoch a permutation seeded by the epoch number;
    resumes at `consumed_samples`. Sharded (the default), each data-parallel rank permutes
    its own bucket of consecutive samples; with `data_sharding=False` (--no-data-sharding)
    one permutation of the whole dataset is dealt to the ranks in turn (rank r takes
    positions r, r + dp, ...), so every rank can see any sample. An epoch is
    `bucket` samples per rank either way, every rank the same number of micro-batches."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, data_sharding: bool = True):
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.sharded = data_sharding
        self.bucket = (total_samples // (micro_batch_size * dp_size)) * micro_batch_size
        if self.bucket == 0:
            raise ValueError(f"dataset of {total_samples} samples is smaller than one global "
                             f"micro-batch ({micro_batch_size} x {dp_size})")

    def _epoch_order(self, epoch: int, done: int) -> List[int]:
        """This rank's samples of `epoch` after the `done` samples (all ranks) read of it."""
        g = torch.Generator().manual_seed(epoch)
        if self.sharded:
            perm = torch.randperm(self.bucket, generator=g).tolist()
            start = self.dp_rank * self.bucket
            return [start + j for j in perm[done // self.dp_size:]]
        perm = torch.randperm((self.total // self.mbs) * self.mbs, generator=g).tolist()
        mine = perm[done:][self.dp_rank::self.dp_size]
        return mine[:self.bucket - done // self.dp_size]

    def __iter__(self) -> Iterator[List[int]]:
        epoch, done = divmod(self.consumed, self.bucket * self.dp_size)
        while True:
            order = self._epoch_order(epoch, done)
            for i in range(0, len(order) - self.mbs + 1, self.mbs):
                yield order[i:i + self.mbs]
            epoch, done = epoch + 1, 0
