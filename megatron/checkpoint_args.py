"""Warnings when a run resumes from a checkpoint whose arguments differ from its own in ways
that change no weight's shape but what it trains on or how: --seq-length, the tokenizer, the
data order (seed, split, blend, loader), --norm-epsilon, and the train / valid sample order
at the data build. Each is a WARNING text or None; the model arguments that must match are
checked in megatron/checkpoint_model_args.py.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from megatron.checkpoint_model_args import _ABSENT, _plain, _position_type


def seq_length_warning(saved: Optional[Dict], run: Dict, where: str) -> Optional[str]:
    """One WARNING line when this run's --seq-length differs from the one the checkpoint in
    `where` was saved with, else None. Megatron-LM accepts the change silently, and going on
    at a new length is legitimate (its learned position table has --max-position-embeddings
    rows, checked above), but a mistyped value should not go unseen. With learned positions
    a longer sequence uses rows the saving run did not train. A --data-path is read in
    another order then (the index is built for the sample length)."""
    if not isinstance(saved, dict):
        return None
    before, now = _plain(saved, "seq_length"), _plain(run, "seq_length")
    if before is _ABSENT or now is _ABSENT or before == now:
        return None
    text = f"WARNING: --seq-length {now} differs from the checkpoint's {before} ({where})"
    positions = _position_type(run)
    if positions in ("learned_absolute", "rope+learned") and now > before:
        text += (f"; learned position embeddings {before}..{now - 1} were not trained by the "
                 "run that saved it")
    elif positions == "rope":
        text += "; rotary positions have no trained table to outgrow"
    if run.get("data_path") and not run.get("finetune") and not run.get("mock_data"):
        text += ("; the --data-path documents are cut into samples of the new length and "
                 "shuffled anew, so of the text consumed so far some comes again and some "
                 "never (as in Megatron-LM)")
    elif run.get("mock_data") and not run.get("finetune"):
        text += "; --mock-data draws other samples at another length"
    return text + (f"; continuing at the new length is allowed, if it was mistyped rerun with "
                   f"--seq-length {before}")


def _split_shares(split) -> Optional[List[float]]:
    """--split as normalised train/valid/test shares ('969, 30, 1' == '969,30,1'), or None
    when it does not parse."""
    try:
        numbers = [float(x) for x in str(split).replace("/", ",").split(",")][:3]
    except ValueError:
        return None
    numbers += [0.0] * (3 - len(numbers))
    total = sum(numbers)
    return [x / total for x in numbers] if total > 0 else None


def _blend(data_path) -> object:
    """--data-path as (normalised path, weight) pairs, so '1 a 1 b' == '0.5 a 0.5 b'; the
    list as given when it does not parse."""
    from megatron.core.datasets.blended import parse_weighted_prefixes

    try:
        prefixes, weights = parse_weighted_prefixes(list(data_path))
    except (TypeError, ValueError):
        return data_path
    return [(os.path.normpath(p), round(w, 9)) for p, w in zip(prefixes, weights)]


def tokenizer_warning(saved: Optional[Dict], run: Dict, where: str,
                      evaluation: bool = False) -> Optional[str]:
    """One WARNING line when this run's tokenizer is likely not the one the checkpoint in
    `where` was trained with although its vocabulary pads to the same rows (Megatron-LM
    compares the tokenizer only with a --vocab-file, and never its files): another
    --tokenizer-type, or a tokenizer file whose contents differ from the file at the path
    the checkpoint records, where that still exists. Else None. `evaluation`: the run
    only evaluates or generates (the line says what that means for its numbers)."""
    from megatron.tokenizer.tokenizer import checkpoint_tokenizer_overrides

    if not isinstance(saved, dict) or run.get("finetune"):
        return None
    notes = checkpoint_tokenizer_overrides(saved, run, advice=False)
    if not notes:
        return None
    if evaluation:
        effect, fix = ("the model reads other token ids than it learned, so its scores and "
                       "text mean little (Megatron-LM does not check): evaluate", "")
    else:
        effect, fix = ("training goes on with other token ids than the model learned "
                       "(Megatron-LM does not check): resume", " unless the change is deliberate")
    return (f"WARNING: this run's tokenizer is likely not the one the checkpoint in {where} "
            f"was trained with: {'; '.join(notes)}; {effect} with the checkpoint's tokenizer "
            f"flags{fix}")


def data_order_warning(saved: Optional[Dict], run: Dict, where: str) -> Optional[str]:
    """One WARNING line when a resume reads its data in another order than the run that
    saved `where`: another --seed reshuffles the samples of a --data-path or
    --train-data-path (the consumed count then points into a different order: some samples
    come again, others never), another --split moves documents between the train,
    validation and test ranges (the validation loss may then be measured on trained-on
    documents). Megatron-LM resumes silently; going on may be meant, so it is not an error.
    Another --data-path (other files or weights) is read from the consumed count on as
    well, as in Megatron-LM; another --dataloader-type, or the cyclic loader at another
    data-parallel size, reads another order (`_loader_order_change`). --mock-data: see
    `_mock_data_warning`. None for --finetune or no change. --skip-train reads no training data (and the validation and test sets from
    their start): only the --split change, which can put trained-on documents in the
    evaluated ranges, is said."""
    if not isinstance(saved, dict) or run.get("finetune"):
        return None
    if run.get("mock_data"):
        return _mock_data_warning(saved, run, where)
    if not (run.get("data_path") or run.get("train_data_path")):
        return None
    if _plain(saved, "mock_data") is True or \
            not (_plain(saved, "data_path") or _plain(saved, "train_data_path")):
        return None
    trains = not run.get("skip_train")
    found = [_seed_change(saved, run)] if trains else []
    if run.get("data_path"):  # --split and the blend are read only with --data-path
        found += [_split_change(saved, run), _blend_change(saved, run) if trains else None]
    found += [_loader_order_change(saved, run)] if trains else []
    found = [item for item in found if item is not None]
    if not found:
        return None
    return (f"WARNING: {' and '.join(c for c, _ in found)} ({where}): "
            f"{'; '.join(e for _, e in found)}; continuing is allowed, to resume the saved "
            "order rerun with the checkpoint's values")


def _consumed_text(saved: Dict, before: str, after: str, unknown: str) -> str:
    consumed = _plain(saved, "consumed_train_samples")
    return unknown if consumed is _ABSENT else f"{before}{consumed}{after}"


def _seed_change(saved: Dict, run: Dict) -> Optional[Tuple[str, str]]:
    """(change, effect) of another --seed, which shuffles a real dataset's samples."""
    before, now = _plain(saved, "seed"), _plain(run, "seed")
    if before is _ABSENT or now is _ABSENT or before == now:
        return None
    done = _consumed_text(saved, " of the ", " consumed so far", "")
    return (f"--seed {now} differs from the checkpoint's {before}",
            f"the samples are shuffled in another order, so some{done} will come again and "
            "others never")


def _split_change(saved: Dict, run: Dict) -> Optional[Tuple[str, str]]:
    before, now = _plain(saved, "split"), _plain(run, "split")
    if before is _ABSENT or now is _ABSENT or _split_shares(before) == _split_shares(now):
        return None
    return (f"--split '{now}' differs from the checkpoint's '{before}'",
            "documents move between the train, validation and test ranges (the validation "
            "loss may be measured on documents already trained on)")


def _blend_change(saved: Dict, run: Dict) -> Optional[Tuple[str, str]]:
    before, now = _plain(saved, "data_path"), _plain(run, "data_path")
    if _blend(before) == _blend(now):
        return None
    start = _consumed_text(saved, "sample ", "", "the count consumed so far")
    return (f"--data-path {' '.join(map(str, now))} differs from the checkpoint's "
            f"{' '.join(map(str, before))}",
            f"the new data is read from its {start} on, so samples of a dataset added or "
            "weighted up are skipped and of one weighted down some come again (if the files "
            "only moved, nothing changes)")


def _cyclic_epoch(args: Dict):
    """The samples of a --mock-data train set under the cyclic loader (`_mock_sizes`: the
    train request, at least one micro-batch per data-parallel rank); None when unknown."""
    request = _saved_train_request(args)
    least = [_plain(args, k) for k in ("micro_batch_size", "data_parallel_size")]
    if request is None or not all(isinstance(v, int) for v in least):
        return None
    return max(request, least[0] * least[1])


def _mock_data_warning(saved: Dict, run: Dict, where: str) -> Optional[str]:
    """The WARNING line of a --mock-data resume whose samples from the consumed count on
    differ from those the saving run would have read: sample i is drawn from (--seed, i),
    the cyclic loader permutes epochs of as many samples as the run asks of its train set,
    and another loader or data-parallel size reads them in another order, as it reads a
    real set (`_loader_order_change`). (Another --seq-length or tokenizer has its own
    warning, another --vocab-size is refused.) None when the checkpoint was not a
    --mock-data run, or with --skip-train."""
    if _plain(saved, "mock_data") is not True or run.get("skip_train"):
        return None
    changes, effects = [], []
    before, now = _plain(saved, "seed"), _plain(run, "seed")
    if _ABSENT not in (before, now) and before != now:
        changes.append(f"--seed {now} differs from the checkpoint's {before}")
    loader = _loader_order_change(saved, run)  # the samplers treat mock sets as real ones
    if loader is not None:
        changes.append(loader[0])
        effects.append(f"{loader[1]}; ")
    if run.get("dataloader_type") == "cyclic" == _plain(saved, "dataloader_type"):
        then, asked = _cyclic_epoch(saved), _cyclic_epoch(run)
        if None not in (then, asked) and then != asked:
            changes.append(f"the cyclic loader's epoch of {asked} train samples differs from "
                           f"the checkpoint's {then} (--train-iters x --global-batch-size, or "
                           "--train-samples)")
    if not changes:
        return None
    return (f"WARNING: {' and '.join(changes)} ({where}): {''.join(effects)}--mock-data "
            "gives other samples from here on than the run that saved the checkpoint would "
            "have read (Megatron-LM does not check); continuing is allowed, to resume them "
            "rerun with the checkpoint's values")


def norm_epsilon_warning(saved: Optional[Dict], run: Dict, where: str) -> Optional[str]:
    """One WARNING line when this run's --layernorm-epsilon differs from the one the
    checkpoint in `where` was saved with (its LayerNorm or RMSNorm weights were trained
    with that value), else None. Megatron-LM does not check; changing it can be meant, so
    it is no error. Said with --finetune too: a converted checkpoint (1e-6) fine-tuned
    without the flag gets the default 1e-5 unseen."""
    if not isinstance(saved, dict):
        return None
    before, now = _plain(saved, "layernorm_epsilon"), _plain(run, "layernorm_epsilon")
    if before is _ABSENT or now is _ABSENT or before is None or now is None or before == now:
        return None
    return (f"WARNING: --layernorm-epsilon {now:g} differs from the checkpoint's {before:g} "
            f"({where}), which its norms were trained with (Megatron-LM does not check); "
            f"continuing is allowed, to keep the checkpoint's value pass --layernorm-epsilon "
            f"{before:g}, or leave the flag out and pass --use-checkpoint-args")


def _loader_order_change(saved: Dict, run: Dict) -> Optional[Tuple[str, str]]:
    """(change, effect) when the training loader's order differs from the saving run's:
    another --dataloader-type, or the sharded `cyclic` loader at another data-parallel size
    (each data-parallel rank permutes its own bucket of the set, so the epoch's order
    depends on that size). The consumed count then points into another order: Megatron-LM
    resumes silently."""
    type_before = _plain(saved, "dataloader_type")
    type_now = _plain(run, "dataloader_type")
    if type_before is _ABSENT or type_now is _ABSENT:
        return None
    type_before, type_now = type_before or "single", type_now or "single"
    done = _consumed_text(saved, " of the ", " consumed so far", "")
    effect = f"so some{done} will come again and others never"
    if type_before != type_now:
        return (f"--dataloader-type {type_now} differs from the checkpoint's {type_before}",
                f"the training samples are read in another order, {effect}")
    dp_before, dp_now = _plain(saved, "data_parallel_size"), _plain(run, "data_parallel_size")
    if (type_now != "cyclic" or _plain(run, "data_sharding") is False
            or _plain(saved, "data_sharding") is False
            or dp_before in (_ABSENT, None) or dp_now in (_ABSENT, None)
            or dp_before == dp_now):
        return None
    return (f"the data-parallel size {dp_now} differs from the checkpoint's {dp_before} "
            "under --dataloader-type cyclic (each data-parallel rank permutes its own share "
            "of the set)", f"the epoch in progress is read in another order, {effect}")


def _saved_train_request(saved: Dict) -> Optional[int]:
    """The training samples the saving run asked of its data (Megatron's rule:
    --train-samples, else --train-iters x --global-batch-size); None when unknown."""
    samples = _plain(saved, "train_samples")
    if samples not in (_ABSENT, None, 0):
        return int(samples)
    iters, gbs = _plain(saved, "train_iters"), _plain(saved, "global_batch_size")
    if iters in (_ABSENT, None) or gbs in (_ABSENT, None):
        return None
    return int(iters) * int(gbs)


def _layout_text(layout) -> str:
    epochs, apart = layout
    return f"{epochs} epoch(s)" + (", the last shuffled apart" if apart else "")


def _changed_indexes(members: list, path, then: int) -> List[str]:
    """'<prefix> (now <layout>; <layout> before)' for each member dataset (of a split read
    from `path`) whose index has another layout at `then`, the saving run's request, than
    at its own num_samples (a blend asks ceil(n * w * 1.005) of each member)."""
    from megatron.core.datasets.blended import parse_weighted_prefixes, per_dataset_num_samples
    from megatron.core.datasets.gpt_index import index_layout

    counts = per_dataset_num_samples(then, parse_weighted_prefixes(path)[1]) \
        if len(members) > 1 else [then]
    changed = []
    for ds, count in zip(members, counts):
        before = index_layout(ds.tokens_per_epoch, ds.seq_length, count)
        after = index_layout(ds.tokens_per_epoch, ds.seq_length, ds.num_samples)
        if before != after:
            changed.append(f"{ds.data_prefix} (now {_layout_text(after)}; "
                           f"{_layout_text(before)} before)")
    return changed


def _split_members(saved, run: Dict, split, consumed: int, own_path: str):
    """(member datasets, data path) of a split whose order a resume may change, or None:
    nothing consumed, mock data, an evaluation only (--skip-train), or the seed, split,
    sequence length or data paths changed too (their own warnings say so)."""
    if not isinstance(saved, dict) or consumed <= 0 or split is None or run.get("skip_train"):
        return None
    same = ("seed", "split", "seq_length", "data_path", own_path, "mock_data")
    if any(_plain(saved, k) is _ABSENT or _plain(saved, k) != _plain(run, k) for k in same):
        return None
    path = _plain(run, "data_path") or _plain(run, own_path)
    members = list(getattr(split, "datasets", [split]))
    if not path or not hasattr(members[0], "tokens_per_epoch"):
        return None
    return members, path


def train_order_warning(saved: Optional[Dict], run: Dict, train, asked: int,
                        consumed: int) -> Optional[str]:
    """One WARNING line when a resume reads its train data in another order only because it
    asks the data for another number of samples (`asked`: a longer --train-iters or
    --train-samples, another --global-batch-size) than the run that saved the checkpoint
    (its stored arguments `saved`): a dataset's index then spans another number of epochs
    (or shuffles its last one apart or not), so all its samples are shuffled anew, as
    Megatron-LM does silently, and the `consumed` count points into the new order.
    `train` is the run's train dataset (a GPTDataset or a blend of them). None when the
    order is kept, for mock data, an evaluation only (--skip-train), or when the seed,
    split, sequence length or data paths changed too (their own warnings say so)."""
    from megatron.core.datasets.gpt_index import same_layout_range

    found = _split_members(saved, run, train, consumed, "train_data_path")
    then = _saved_train_request(saved) if found else None
    if not then or then == asked:
        return None
    members, path = found
    changed = _changed_indexes(members, path, then)
    if not changed:
        return None
    text = (f"WARNING: this run asks its train data for {asked} samples, the run that saved "
            f"the checkpoint for {then} (--train-iters x --global-batch-size, or "
            f"--train-samples), so the train index of {', '.join(changed)} changes: its "
            f"samples are shuffled in another order, some of the {consumed} consumed so far come "
            "again and others never (Megatron-LM reshuffles the same way, silently); "
            "continuing is allowed")
    if len(members) == 1:
        lo, hi = same_layout_range(members[0].tokens_per_epoch, members[0].seq_length, then)
        gbs = _plain(run, "global_batch_size")
        if _plain(run, "train_samples") or not isinstance(gbs, int) or gbs <= 0:
            text += f"; --train-samples {max(lo, 1)} to {hi} keeps the saved order"
        elif max(1, -(-lo // gbs)) <= hi // gbs:
            text += (f"; --train-iters {max(1, -(-lo // gbs))} to {hi // gbs} keeps the saved "
                     f"order at global batch size {gbs}")
    return text


def _saved_valid_request(saved: Dict) -> Optional[int]:
    """The validation samples the saving run asked of its data (Megatron's rule:
    (--train-iters // --eval-interval + 1) x --eval-iters x --global-batch-size); None
    when unknown."""
    values = [_plain(saved, k) for k in ("train_iters", "eval_interval", "eval_iters",
                                         "global_batch_size")]
    if any(v is _ABSENT or v is None for v in values[1:]):
        return None
    iters, interval, evals, gbs = values
    if iters is _ABSENT or not interval:
        return None
    return ((int(iters or 0) // int(interval)) + 1) * int(evals) * int(gbs)


def valid_order_warning(saved: Optional[Dict], run: Dict, valid, asked: int,
                        consumed: int) -> Optional[str]:
    """One WARNING line when a resume reads its validation data in another order only
    because it asks the data for another number of samples (`asked`: Megatron sizes the
    validation set by (--train-iters // --eval-interval + 1) x --eval-iters x global batch,
    so a longer --train-iters asks more) than the run that saved the checkpoint: a
    dataset's index then spans another number of epochs, so its samples are shuffled anew,
    as Megatron-LM does silently, and the checkpoint's `consumed` validation count points
    into the new order. `valid` is the run's validation dataset. None in the cases of
    `train_order_warning`, with --skip-train (the set is read from its start), and when
    this run asks for no samples (--eval-iters 0: it evaluates nothing). The test set
    (--eval-iters x global batch, read from its start) does not depend on --train-iters."""
    if asked <= 0:
        return None
    found = _split_members(saved, run, valid, consumed, "valid_data_path")
    then = _saved_valid_request(saved) if found else None
    if not then or then == asked:
        return None
    changed = _changed_indexes(*found, then)
    if not changed:
        return None
    return (f"WARNING: this run asks its validation data for {asked} samples, the run that "
            f"saved the checkpoint for {then} ((--train-iters // --eval-interval + 1) x "
            f"--eval-iters x --global-batch-size), so the validation index of "
            f"{', '.join(changed)} changes: its samples are shuffled in another order, so the "
            f"evaluations from here on read other samples than the saving run would have, some "
            f"of the {consumed} evaluated so far again (Megatron-LM reshuffles the same way, "
            "silently); continuing is allowed, to keep the order resume with the checkpoint's "
            "--train-iters, --eval-interval and --eval-iters")


__all__ = ["data_order_warning", "norm_epsilon_warning", "seq_length_warning",
           "tokenizer_warning",
           "train_order_warning",
           "valid_order_warning"]

