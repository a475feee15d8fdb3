"""Megatron's check_checkpoint_args: does a checkpoint's model fit this run's flags?

Megatron-LM 23.05, when loading without --finetune, asserts that num_layers, hidden_size,
num_attention_heads and add_position_embedding equal the checkpoint's, and with --vocab-file
also max_position_embeddings, make_vocab_size_divisible_by, padded_vocab_size and
tokenizer_type (and the tp / pp sizes). This framework reshards on load, so the parallel
sizes may differ -- and a vocabulary padded for another tp size is re-padded, and with
--vocab-file --make-vocab-size-divisible-by may differ where the run at another tp size pads
to the checkpoint's rows (the README's way to keep one padded size) -- but it checks
every argument that gives a weight its shape or says how it is read: the same QKV rows mean
other things with other heads or query groups. Those are checked with --finetune as well;
the other items are skipped with --finetune, as Megatron skips its whole check.

Arguments the checkpoint's `args` (a plain dict) or the run's do not hold -- an older
writer -- are not checked. A mismatch is a clean exit naming every differing argument with
both values and the fix.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional

from megatron.arguments_common import FLAG_SPECS, flag_for_dest
from megatron.checkpointing import args_to_plain
from megatron.core.config import position_embedding_type_for

_ABSENT = object()

# the shape of a weight, or how its rows are read: checked even with --finetune
# (post-layernorm residuals: the same weights, other sums -- a silently other model)
SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "kv_channels", "swiglu", "untie_embeddings_and_output_weights", "normalization",
              "add_bias_linear", "apply_layernorm_1p", "num_experts",
              "apply_residual_connection_post_layernorm")
# how the weights are used: skipped with --finetune (fine-tuning may change them on purpose)
OTHER_ARGS = ("vocab_size", "vocab_extra_ids", "rotary_percent", "rotary_base")
# Megatron's items that it checks only when the run has --vocab-file (not with --finetune)
VOCAB_FILE_ARGS = ("max_position_embeddings", "make_vocab_size_divisible_by", "tokenizer_type")


class Mismatch(NamedTuple):
    """One argument whose value differs: its name (a flag), both values, and the flags
    that give the checkpoint's value."""

    name: str
    saved: object
    run: object
    fix: str


def _flag_setting(dest: str, value) -> str:
    """The command-line words that set `dest` to `value`: '--swiglu', 'no --swiglu',
    '--hidden-size 64', 'no --disable-bias-linear'."""
    flag = flag_for_dest(dest)
    kind = next((s.kind for s in FLAG_SPECS.values() if s.dest == dest), None)
    if kind in ("true", "false"):
        on = bool(value) if kind == "true" else not value
        return flag if on else f"no {flag}"
    return f"no {flag}" if value is None else f"{flag} {value}"


def _plain(args: dict, key: str):
    return args_to_plain(args[key]) if key in args else _ABSENT


def _compare(saved: dict, run: dict, dest: str) -> Optional[Mismatch]:
    a, b = _plain(saved, dest), _plain(run, dest)
    if a is _ABSENT or b is _ABSENT or a == b:
        return None
    return Mismatch(flag_for_dest(dest), a, b, _flag_setting(dest, a))


def _query_groups(args: dict):
    """Key/value groups of the attention (the heads without --group-query-attention)."""
    if "group_query_attention" not in args or "num_attention_heads" not in args:
        return _ABSENT
    return args.get("num_query_groups") if args["group_query_attention"] \
        else args["num_attention_heads"]


def _groups_item(saved: dict, run: dict) -> Optional[Mismatch]:
    a, b = _query_groups(saved), _query_groups(run)
    if a is _ABSENT or b is _ABSENT or a == b:
        return None
    if not (saved["group_query_attention"] or run["group_query_attention"]):
        return None  # the heads differ: reported as --num-attention-heads
    fix = (f"--group-query-attention --num-query-groups {a}" if saved["group_query_attention"]
           else "no --group-query-attention")
    return Mismatch("query groups (--group-query-attention --num-query-groups)", a, b, fix)


def _position_type(args: dict):
    if "position_embedding_type" in args:
        return args["position_embedding_type"]
    if "add_position_embedding" not in args:
        return _ABSENT
    return position_embedding_type_for(bool(args.get("use_rotary_position_embeddings")),
                                       bool(args["add_position_embedding"]))  # a 23.05 writer


def _position_item(saved: dict, run: dict) -> Optional[Mismatch]:
    a, b = _position_type(saved), _position_type(run)
    if a is _ABSENT or b is _ABSENT or a == b:
        return None
    return Mismatch("--position-embedding-type", a, b, f"--position-embedding-type {a}")


def _max_positions_item(saved: dict, run: dict) -> Optional[Mismatch]:
    """The rows of the learned position table."""
    learned = ("learned_absolute", "rope+learned")
    if _position_type(saved) in learned and _position_type(saved) == _position_type(run):
        return _compare(saved, run, "max_position_embeddings")
    return None


def _vocab_rows_item(saved: dict, run: dict) -> Optional[Mismatch]:
    """The rows of the word embedding: at the same tp size nothing re-pads them."""
    tp = "tensor_model_parallel_size"
    if _plain(saved, tp) is _ABSENT or _plain(saved, tp) != _plain(run, tp):
        return None
    item = _compare(saved, run, "padded_vocab_size")
    if item is None:
        return None
    words = [f"--tokenizer-type {saved.get('tokenizer_type')}"]
    if saved.get("vocab_size") is not None:
        words.append(f"--vocab-size {saved['vocab_size']}")
    words.append(f"--make-vocab-size-divisible-by {saved.get('make_vocab_size_divisible_by')}")
    return item._replace(name="padded vocabulary size (rows of the word embedding)",
                         fix=" ".join(words) + " (the checkpoint's tokenizer)")


def _same_rows(saved: dict, run: dict) -> bool:
    """Whether a run at another tp size pads the vocabulary to the checkpoint's rows (as
    --make-vocab-size-divisible-by 256 at tp 1 and 128 at tp 2 do): the divisor then only
    chose that size, and the weights load unpadded. At the same tp size Megatron's check of
    the divisor stands."""
    tp, rows = "tensor_model_parallel_size", "padded_vocab_size"
    return _ABSENT not in (_plain(saved, tp), _plain(saved, rows)) and \
        _plain(saved, tp) != _plain(run, tp) and _plain(saved, rows) == _plain(run, rows)


def _activation(args: dict):
    """The MLP's activation as Megatron-LM 23.05's MLP picks it (first of --openai-gelu,
    --swiglu, --squared-relu, else GeLU); the tanh and erf GeLU forms count as one."""
    if "squared_relu" not in args:
        return _ABSENT
    for key in ("openai_gelu", "swiglu", "squared_relu"):
        if args.get(key):
            return "gelu" if key == "openai_gelu" else key
    return "gelu"


def _activation_item(saved: dict, run: dict) -> Optional[Mismatch]:
    """Same shapes, another function: a GeLU checkpoint resumed with --squared-relu (or the
    reverse). A --swiglu difference is reported as --swiglu (it changes fc1's shape)."""
    a, b = _activation(saved), _activation(run)
    if a is _ABSENT or b is _ABSENT or a == b or "swiglu" in (a, b):
        return None
    fix = "no --squared-relu" if a == "gelu" else "--squared-relu"
    if a == "squared_relu" and run.get("openai_gelu"):
        fix += " and no --openai-gelu"
    return Mismatch("MLP activation (--squared-relu, else GeLU)", a, b, fix)


_ROTARY_ARGS = ("rotary_percent", "rotary_base")


def _uses_rotary(args: dict) -> bool:
    """Whether rotary positions read --rotary-percent / --rotary-base (a writer that does
    not say counts as one that does). Compared only when both models use them: a run or
    checkpoint without rotary positions never reads them, and a position type that
    differs is reported as --position-embedding-type."""
    kind = _position_type(args)
    return kind is _ABSENT or "rope" in kind


def _tokenizer_item(item: Optional[Mismatch], saved: dict, run: dict) -> Optional[Mismatch]:
    """A --vocab-size mismatch (`item`) between two tokenizer types is the type's: one that
    reads no --vocab-size (None) against NullTokenizer's. Named as --tokenizer-type, with
    the checkpoint's tokenizer flags as the fix ('no --vocab-size' would not build
    NullTokenizer)."""
    a, b = _plain(saved, "tokenizer_type"), _plain(run, "tokenizer_type")
    if item is None or _ABSENT in (a, b) or a == b:
        return item
    return Mismatch(flag_for_dest("tokenizer_type"), a, b, _tokenizer_flags(saved))


def _tokenizer_flags(saved: dict) -> str:
    """The checkpoint's tokenizer flags: '--tokenizer-type T --tokenizer-model M'."""
    words = [f"--tokenizer-type {saved.get('tokenizer_type')}"]
    for dest in ("vocab_file", "merge_file", "tokenizer_model", "vocab_size"):
        if saved.get(dest) is not None:
            words.append(f"{flag_for_dest(dest)} {saved[dest]}")
    return " ".join(words)


def _vocab_range(args: dict):
    """(low, high, rows, tp): the tokenizer vocabularies that pad to `args`' embedding rows
    are low+1..high tokens; _ABSENT where `args` does not say."""
    keys = ("padded_vocab_size", "make_vocab_size_divisible_by", "tensor_model_parallel_size")
    rows, divisor, tp = (_plain(args, k) for k in keys)
    if not all(isinstance(v, int) and v > 0 for v in (rows, divisor, tp)):
        return _ABSENT
    return max(rows - divisor * tp, 0), rows, rows, tp


def _vocab_size_item(saved: dict, run: dict) -> Optional[Mismatch]:
    """At another tp size the embedding is re-padded on load (_vocab_rows_item compares the
    rows at the same size), so a tokenizer of another vocabulary loaded silently: its ids
    past the checkpoint's rows read padding rows, or trained rows were cut off. Caught
    where no vocabulary size pads to both the checkpoint's rows and this run's."""
    a, b = _vocab_range(saved), _vocab_range(run)
    if a is _ABSENT or b is _ABSENT or a[3] == b[3] or (a[0] < b[1] and b[0] < a[1]):
        return None
    saved_text, run_text = (f"{lo + 1}..{hi} tokens (padded to {rows} rows at tensor-parallel "
                            f"size {tp})" for lo, hi, rows, tp in (a, b))
    return Mismatch("tokenizer vocabulary size", saved_text, run_text,
                    _tokenizer_flags(saved) + " (the checkpoint's tokenizer)")


_SHAPE_ITEMS: List[Callable[[dict, dict], Optional[Mismatch]]] = [
    _groups_item, _position_item, _max_positions_item, _vocab_rows_item]


def checkpoint_arg_mismatches(saved: Dict, run: Dict, finetune: bool = False) -> List[Mismatch]:
    """The checkpoint's arguments `saved` against the run's `run` (plain dicts): the shape
    and layout items always, the others unless `finetune`. Keys either lacks are skipped."""
    found = [_compare(saved, run, dest) for dest in SHAPE_ARGS]
    found += [item(saved, run) for item in _SHAPE_ITEMS]
    if not finetune:
        found += [_compare(saved, run, dest) for dest in OTHER_ARGS
                  if dest not in _ROTARY_ARGS or (_uses_rotary(saved) and _uses_rotary(run))]
        found = [_tokenizer_item(m, saved, run) if m is not None and m.name == "--vocab-size"
                 else m for m in found]
        found.append(_activation_item(saved, run))
        found.append(_vocab_size_item(saved, run))
        if run.get("vocab_file"):
            found += [_compare(saved, run, dest) for dest in VOCAB_FILE_ARGS
                      if dest != "make_vocab_size_divisible_by" or not _same_rows(saved, run)]
    unique: Dict[str, Mismatch] = {}
    for item in found:
        if item is not None:
            unique.setdefault(item.name, _positions_fix(item, saved, run))
    return list(unique.values())


def _positions_fix(item: Mismatch, saved: dict, run: dict) -> Mismatch:
    """A --max-position-embeddings mismatch whose fix (the checkpoint's value) is shorter
    than this run's --seq-length: that fix alone is refused by the argument check, so it
    names the sequence length it needs too, and for rotary positions (no table: Megatron
    compares the value only without --finetune) that --finetune loads the weights."""
    longest = max(run.get("seq_length") or 0, run.get("decoder_seq_length") or 0)
    if item.name != flag_for_dest("max_position_embeddings") or \
            not isinstance(item.saved, int) or longest <= item.saved:
        return item
    fix = f"{item.fix} with --seq-length at most {item.saved}"
    if _position_type(run) == "rope":
        fix += f", or --finetune to train these rotary weights at --seq-length {longest}"
    return item._replace(fix=fix)


def check_checkpoint_args(saved: Optional[Dict], run: Dict, where: str,
                          finetune: bool = False) -> None:
    """SystemExit naming every argument of this run (`run`) that differs from the checkpoint
    in `where` (its stored `saved` args; None: nothing to check), both values and the fix."""
    text = checkpoint_args_message(saved, run, where, finetune)
    if text is not None:
        raise SystemExit(text)


def checkpoint_args_message(saved: Optional[Dict], run: Dict, where: str,
                            finetune: bool = False) -> Optional[str]:
    """`check_checkpoint_args`'s error text, or None when the arguments fit."""
    if not isinstance(saved, dict):
        return None
    items = checkpoint_arg_mismatches(saved, run, finetune)
    if not items:
        return None
    lines = [f"  {m.name}: checkpoint {m.saved}, this run {m.run}" for m in items]
    fixes = "; ".join(m.fix for m in items)
    text = (f"error: the checkpoint in {where} was saved with other model arguments than this "
            f"run's:\n" + "\n".join(lines) + "\n"
            f"Run with the checkpoint's values ({fixes}), or leave these flags out and pass "
            f"--use-checkpoint-args to take them from the checkpoint.")
    if finetune:
        text += (" --finetune does not skip these: they give the weights their shape and "
                 "layout.")
    return text


__all__ = ["Mismatch", "SHAPE_ARGS", "OTHER_ARGS", "VOCAB_FILE_ARGS",
           "checkpoint_arg_mismatches", "check_checkpoint_args", "checkpoint_args_message"]
