"""The `tools/checkpoint_convert.py from-hf` command: a Hugging Face model directory
read, mapped to our full state dict by megatron.hf_interop, and written as a 'release'
checkpoint split for any tp/pp (by megatron.checkpoint_reshard), with the tokenizer files
it records. `to-hf` is megatron/hf_convert.py."""
from __future__ import annotations

import logging
import os
import shlex
import shutil
from typing import Dict, List, Optional

import torch

from megatron.hf_convert import _HF_TOKENIZER_FILES
from megatron.hf_files import hold_directory, leftover_imports, load_hf_checkpoint, make_staging
from megatron.hf_interop import from_hf_state_dict, megatron_flags_from_hf, sliding_window_note


# ----------------------------------------------------------------------- from-hf CLI
def add_from_hf_arguments(parser) -> None:
    """Import a Hugging Face GPT-2 or Llama model as a checkpoint for any tp/pp."""
    parser.add_argument("--input", required=True, help="Hugging Face model directory "
                        "(config.json + *.safetensors or pytorch_model*.bin)")
    parser.add_argument("--save", required=True, help="directory for our checkpoint")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--seq-length", type=int, default=None,
                        help="recorded in the checkpoint's args (default: min(max positions, 2048))")
    parser.add_argument("--tokenizer-type", default=None, help="recorded in the checkpoint's "
                        "args (default: HuggingFaceTokenizer when --input holds tokenizer.json, "
                        "else GPT2BPETokenizer when it holds vocab.json and merges.txt, else "
                        "GPTSentencePieceTokenizer when it holds tokenizer.model, else "
                        "NullTokenizer with --vocab-size = HF vocab_size - 1). The tokenizer "
                        "files taken from --input are copied into SAVE/tokenizer/ and recorded "
                        "there, so --input may be deleted afterwards")
    for flag in ("--vocab-file", "--merge-file", "--tokenizer-model"):
        parser.add_argument(flag, default=None, help="recorded as given (default: the "
                            "copy of --input's file, for the tokenizer type's files)")
    parser.add_argument("--overwrite", action="store_true",
                        help="allow a --save that already holds a checkpoint (its release "
                             "directory is replaced and the tracker says 'release')")


# from-hf's tokenizer when --tokenizer-type is not given: the first whose files --input
# holds (to-hf writes each of them), else NullTokenizer. {file name: the flag recording it}
_IMPORTED_TOKENIZERS = (
    ("HuggingFaceTokenizer", {"tokenizer.json": "--tokenizer-model"}),
    ("GPT2BPETokenizer", {"vocab.json": "--vocab-file", "merges.txt": "--merge-file"}),
    ("GPTSentencePieceTokenizer", {"tokenizer.model": "--tokenizer-model"}),
)
_TOKENIZER_FILES_OF = dict(_IMPORTED_TOKENIZERS,
                           SentencePieceTokenizer={"tokenizer.model": "--tokenizer-model"})
TOKENIZER_DIR = "tokenizer"  # under from-hf's --save: the copies the checkpoint records


def _unusable(kind: str, paths: Dict[str, str], hf_vocab: int) -> Optional[str]:
    """Why the `kind` tokenizer of these files cannot be the model's, or None (checked
    for GPT2BPETokenizer and GPTSentencePieceTokenizer: another BPE's vocab.json has no
    <|endoftext|>, and another model's files more ids than its vocabulary)."""
    from megatron.tokenizer import build_tokenizer

    if kind == "HuggingFaceTokenizer":
        return None  # recorded as found (its end-of-document token is looked up at use)
    try:
        tok = build_tokenizer(kind, vocab_file=paths.get("vocab.json"),
                              merge_file=paths.get("merges.txt"),
                              tokenizer_model=paths.get("tokenizer.model"))
    except (ImportError, OSError, ValueError) as exc:
        return str(exc)
    if tok.vocab_size > hf_vocab:
        return f"{tok.vocab_size} ids, more than the model's vocab_size {hf_vocab}"
    return None


def _tokenizer_kind(a, in_dir: str, hf_vocab: int) -> str:
    if a.tokenizer_type is not None:
        return a.tokenizer_type
    for kind, files in _IMPORTED_TOKENIZERS:
        paths = {n: os.path.join(in_dir, n) for n in files}
        if not all(os.path.isfile(p) for p in paths.values()):
            continue
        why = _unusable(kind, paths, hf_vocab)
        if why is None:
            return kind
        print(f"note: {' and '.join(files)} in {in_dir} not taken as {kind} ({why}); pass "
              "--tokenizer-type and its files to record the model's tokenizer")
    return "NullTokenizer"


def imported_tokenizer_files(a, in_dir: str, kind: str) -> Dict[str, str]:
    """{file name: path in `in_dir`} of the `kind` tokenizer's files from-hf copies into
    <save>/tokenizer/ (the Hugging Face directory may be deleted once imported): those
    not given with --vocab-file/--merge-file/--tokenizer-model, with tokenizer.json its
    tokenizer_config.json and special_tokens_map.json (the end-of-document token)."""
    given = {"--vocab-file": a.vocab_file, "--merge-file": a.merge_file,
             "--tokenizer-model": a.tokenizer_model}
    files = _TOKENIZER_FILES_OF.get(kind, {})
    names = [n for n, flag in files.items() if given[flag] is None]
    if "tokenizer.json" in names:
        names += [n for n in _HF_TOKENIZER_FILES if n != "tokenizer.json"]
    found = {n: os.path.join(in_dir, n) for n in names}
    return {n: p for n, p in found.items() if os.path.isfile(p)}


def _tokenizer_flags(a, in_dir: str, hf_vocab: int) -> List[str]:
    """The tokenizer flags of the import, naming the files in `in_dir` (moved to the
    checkpoint's copies by `_record_tokenizer_copies` once validated)."""
    kind = _tokenizer_kind(a, in_dir, hf_vocab)
    flags = ["--tokenizer-type", kind]
    if kind == "NullTokenizer":
        flags += ["--vocab-size", str(hf_vocab - 1)]
    given = {"--vocab-file": a.vocab_file, "--merge-file": a.merge_file,
             "--tokenizer-model": a.tokenizer_model}
    for name, path in imported_tokenizer_files(a, in_dir, kind).items():
        flag = _TOKENIZER_FILES_OF[kind].get(name)
        if flag is not None:  # a HuggingFaceTokenizer is recorded as its directory
            given[flag] = os.path.abspath(in_dir if name == "tokenizer.json" else path)
    for flag, value in given.items():
        if value is not None:
            flags += [flag, value]
    return flags


def _record_tokenizer_copies(a, cfg, flags: List[str]) -> Dict[str, str]:
    """Point the checkpoint's args and `flags` at <save>/tokenizer/ for each file taken
    from --input; {source: destination} of the copies to make."""
    kind = flags[flags.index("--tokenizer-type") + 1]
    files = imported_tokenizer_files(a, a.input, kind)
    target = os.path.join(os.path.abspath(a.save), TOKENIZER_DIR)
    for name in files:
        flag = _TOKENIZER_FILES_OF[kind].get(name)
        if flag is None:
            continue
        i = flags.index(flag) + 1
        flags[i] = target if name == "tokenizer.json" else os.path.join(target, name)
        cfg.args[flag[2:].replace("-", "_")] = flags[i]
    return {path: os.path.join(target, name) for name, path in files.items()}


def config_from_hf(hf_cfg: dict, a, in_dir: str):
    """(family, our validated `Config`, the model and tokenizer flags a run training from
    the import passes) for the HF model at the requested tp/pp: the padded vocabulary is
    HF's vocab_size rounded up as a run with that layout pads it."""
    from megatron.arguments import parse_and_validate
    from megatron.arguments_validate import SWIGLU_WIDTH_KEPT

    family, flags = megatron_flags_from_hf(hf_cfg)
    max_pos = int(flags[flags.index("--max-position-embeddings") + 1])
    hf_vocab = int(hf_cfg["vocab_size"])
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    check_import_layout(family, flags, a)
    seq_length = a.seq_length or min(max_pos, 2048)
    window = sliding_window_note(hf_cfg, seq_length)
    if window is not None:
        print(f"note: {window}")
    if hf_cfg.get("model_type") == "qwen2":
        print("note: Qwen2 has biases on q/k/v only; imported with a bias on every linear "
              "layer (--disable-bias-linear off), o_proj's and the MLP's zeros: the same "
              "logits, and those biases train with the rest (to-hf writes a Llama with them)")
    flags += _tokenizer_flags(a, in_dir, hf_vocab) + [
        "--make-vocab-size-divisible-by", str(a.make_vocab_size_divisible_by),
        "--seq-length", str(seq_length)]
    if hf_cfg.get("dtype", hf_cfg.get("torch_dtype")) in ("bfloat16", "float16"):
        flags.append("--bf16" if hf_cfg.get("dtype", hf_cfg.get("torch_dtype")) == "bfloat16"
                     else "--fp16")
    argv = flags + [  # (--log-interval 1: no warning about a 1-iteration run's log lines)
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--micro-batch-size", "1", "--lr", "0", "--train-iters", "1", "--log-interval", "1",
        "--use-cpu-initialization"]
    # the Hugging Face model's MLP width (intermediate_size, n_inner) is its weights': the
    # warning that Megatron-LM 23.05 would replace it under --swiglu asks nothing of the user
    def drop(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(SWIGLU_WIDTH_KEPT)

    log = logging.getLogger("megatron.arguments")
    log.addFilter(drop)
    try:
        cfg = parse_and_validate(argv, world_size=tp * pp, env={}, cuda_available=False,
                                 vocab_size_fn=lambda ns: hf_vocab)
    finally:
        log.removeFilter(drop)
    return family, cfg, flags


# config.json's name of each model flag the layout rules read {family: {flag: field}}
_HF_FIELDS = {
    "gpt2": {"--num-attention-heads": "n_head", "--ffn-hidden-size": "n_inner (or 4 x n_embd)",
             "--num-layers": "n_layer", "--max-position-embeddings": "n_positions"},
    "llama": {"--num-attention-heads": "num_attention_heads",
              "--num-query-groups": "num_key_value_heads",
              "--ffn-hidden-size": "intermediate_size", "--num-layers": "num_hidden_layers",
              "--max-position-embeddings": "max_position_embeddings"}}


# (flag, its dest, the model flags its size divides, why)
_LAYOUT_RULES = (
    ("--tensor-model-parallel-size", "tensor_model_parallel_size",
     ("--num-attention-heads", "--num-query-groups", "--ffn-hidden-size"),
     "each rank holds whole heads and key/value heads, and as many MLP columns"),
    ("--pipeline-model-parallel-size", "pipeline_model_parallel_size", ("--num-layers",),
     "each stage holds as many layers"))


def check_import_layout(family: str, flags: List[str], a) -> None:
    """ValueError for a --tensor/--pipeline-model-parallel-size or --seq-length that the
    Hugging Face model's shape (its model `flags`) does not allow, naming the config.json
    field and the sizes that fit: the shape is the model's, so the general messages' advice
    (another --num-query-groups, --num-layers, --max-position-embeddings) does not apply."""
    fields = _HF_FIELDS[family]
    given = {f: int(flags[flags.index(f) + 1]) for f in fields if f in flags}
    for flag, dest, rules, why in _LAYOUT_RULES:
        size = getattr(a, dest)
        counts = {f: given[f] for f in rules if f in given}
        wrong = [f"{fields[f]} {n}" for f, n in counts.items() if size < 1 or n % size]
        if wrong:
            fits = [d for d in range(1, min(counts.values()) + 1)
                    if all(n % d == 0 for n in counts.values())]
            raise ValueError(f"{flag} {size} does not divide the model's {' and '.join(wrong)} "
                             f"(config.json): {why}; pass {flag} "
                             f"{' or '.join(map(str, fits[-6:]))}")
    max_pos = given["--max-position-embeddings"]
    if a.seq_length is not None and a.seq_length > max_pos:
        raise ValueError(f"--seq-length {a.seq_length} is larger than the model's "
                         f"{fields['--max-position-embeddings']} {max_pos} (config.json); pass "
                         f"--seq-length {max_pos} or less")


_TOKENIZER_FILE_FLAGS = ("--vocab-file", "--merge-file", "--tokenizer-model")


def run_from_hf(a) -> int:
    """`from-hf`: read the HF model, map it to our full state dict, write a 'release'
    checkpoint split for --tensor/--pipeline-model-parallel-size. Returns 0; SystemExit
    with the reason for a model it cannot convert."""
    try:
        return _from_hf(a)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def _from_hf(a) -> int:
    from tools.checkpoint_convert import check_save

    for line in leftover_imports(a.save):  # of a from-hf stopped by kill -9, a power loss
        print(line, flush=True)
    check_save(a.save, a.overwrite)
    print(f"reading the Hugging Face model in {a.input} ...", flush=True)
    hf_cfg, hf_state = load_hf_checkpoint(a.input)
    family, cfg, flags = config_from_hf(hf_cfg, a, a.input)
    copies = _record_tokenizer_copies(a, cfg, flags)
    state = from_hf_state_dict(hf_state, cfg.model, family, int(hf_cfg["vocab_size"]))
    hf_state = None  # `state` holds what the checkpoint needs
    print(f"writing {len(state)} tensors to {a.save} ...", flush=True)
    save_release_checkpoint(a.save, state, cfg, a.overwrite, copies)
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    _note_lost_special_ids(hf_cfg, flags, a.input)
    # --use-checkpoint-args takes the tokenizer type, not its files: those go with it
    files = [w for i, flag in enumerate(flags[:-1]) if flag in _TOKENIZER_FILE_FLAGS
             for w in (flag, flags[i + 1])]
    print(f"wrote {family} model from {a.input} to {os.path.join(a.save, 'release')} (tp {tp}, "
          f"pp {pp}, padded vocab {cfg.model.padded_vocab_size}); train from it with "
          f"pretrain_gpt.py --load {shlex.join([a.save, '--use-checkpoint-args', *files])}, "
          f"or with its model flags: {shlex.join(flags)}")
    return 0


def _note_lost_special_ids(hf_cfg: dict, flags: List[str], in_dir: str) -> None:
    """A NullTokenizer import keeps one end-of-document id (--vocab-size); name the Hugging
    Face config's own eos/bos ids when they differ, and the to-hf flags that restore them."""
    if flags[flags.index("--tokenizer-type") + 1] != "NullTokenizer":
        return
    eod = int(flags[flags.index("--vocab-size") + 1])
    ids = {k: hf_cfg.get(f"{k}_token_id") for k in ("eos", "bos")}
    ids = {k: v for k, v in ids.items() if isinstance(v, int)}
    if all(v == eod for v in ids.values()):
        return
    given = " ".join(f"--{k}-token-id {v}" for k, v in ids.items())
    print(f"note: no tokenizer files in {in_dir}: the checkpoint records NullTokenizer, whose "
          f"end-of-document id is {eod}, not the model's "
          f"{', '.join(f'{k} {v}' for k, v in ids.items())}; pass to-hf {given} when exporting "
          "it, and the model's tokenizer (--tokenizer-type, --tokenizer-model) to train from it")


# ------------------------------------------------ the release checkpoint (from-hf's)
def save_release_checkpoint(save: str, state: Dict[str, torch.Tensor], cfg,
                            overwrite: bool = False,
                            tokenizer: Optional[Dict[str, str]] = None) -> None:
    """Write the full `state` as `<save>/release/mp_rank_*` for cfg's tp/pp, the tracker
    saying "release" (a run loads it at iteration 0 with a fresh optimizer), and the
    `tokenizer` copies {source: <save>/tokenizer/NAME} it records. All is written into a
    temporary directory beside `save` (at tp = pp = 1, then split there by
    `tools/checkpoint_convert.py reshard`) and moved into place once complete, the tracker
    last: a failure leaves `save` as it was. A checkpoint already in `save` is refused
    unless `overwrite` (SystemExit naming it). `save`'s lock is held meanwhile
    (tools/checkpoint_convert.py `save_locked`: a run or another conversion writing there
    is refused)."""
    from tools.checkpoint_convert import check_save, save_locked

    with save_locked(save, "from-hf"):
        check_save(save, overwrite)
        _write_release_checkpoint(save, state, cfg, tokenizer or {})


def _write_release_checkpoint(save: str, state: Dict[str, torch.Tensor], cfg,
                              tokenizer: Dict[str, str]) -> None:
    """`save_release_checkpoint` once `save` is locked and checked."""
    from tools.checkpoint_convert import reshard

    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    root = make_staging(save, "from-hf")  # .NAME.from-hf-HOST-PID-*, created with its parent
    held = hold_directory(root)  # while written: `leftover_imports` sees it in use
    try:
        _write_unsplit(root, state, cfg, tokenizer, os.path.dirname(root))
        release = os.path.join(root, "release")
        if (tp, pp) != (1, 1):
            reshard(root, os.path.join(root, "split"), tp, pp)
            release = os.path.join(root, "split", "release")
        _install_import(save, release, os.path.join(root, TOKENIZER_DIR) if tokenizer else None)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        held.close()


def _write_unsplit(root: str, state: Dict[str, torch.Tensor], cfg,
                   tokenizer: Dict[str, str], parent: str) -> None:
    """`root`/release at tp = pp = 1 with its tracker, and `root`/tokenizer/ holding the
    `tokenizer` copies; a write error (a full disk) removes `root`: SystemExit saying so."""
    from megatron.checkpoint_dirs import free_space_text
    from megatron.checkpointing import CHECKPOINT_VERSION, args_to_plain, checkpoint_name
    from tools.checkpoint_convert import save_file

    path = checkpoint_name(root, 0, 0, 0, 1, release=True)
    args = args_to_plain(cfg.args)  # sizes of this directory (reshard writes tp, pp)
    args.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:  # a full disk: one line
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file({"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                   "iteration": 0, "model": state}, path)
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("release")
        for source, dest in tokenizer.items():
            os.makedirs(os.path.join(root, TOKENIZER_DIR), exist_ok=True)
            shutil.copyfile(source, os.path.join(root, TOKENIZER_DIR, os.path.basename(dest)))
    except OSError as exc:
        shutil.rmtree(root, ignore_errors=True)  # before the free space is measured
        raise SystemExit(f"error: writing the imported model to {root} (a temporary "
                         f"directory beside --save) failed ({type(exc).__name__}: {exc}); "
                         f"it was removed; {free_space_text(parent)}. Free space or pass "
                         "another --save") from exc


def _install_import(save: str, release: str, tokenizer: Optional[str]) -> None:
    """Move the complete `release` directory (and `tokenizer`, for <save>/tokenizer/) into
    `save`, the tracker last. A tracker that names an earlier checkpoint is removed before
    the earlier tokenizer/ is replaced (that checkpoint may record its files): stopped in
    between, `save` is untracked, never a tracker naming one model beside another's
    tokenizer."""
    from megatron.checkpointing import move_into_place, tracker_path
    from tools.checkpoint_convert import publish_checkpoint

    os.makedirs(save, exist_ok=True)
    if tokenizer is not None:
        tracker, target = tracker_path(save), os.path.join(save, TOKENIZER_DIR)
        if os.path.isfile(tracker) and os.path.lexists(target):
            with open(tracker) as f:
                before = f.read().strip()
            print(f"overwrite: {tracker} said {before!r}, now 'release' (removed while "
                  f"{target} and the release directory are replaced)")
            os.remove(tracker)
        move_into_place(save, tokenizer, target)
    publish_checkpoint(save, release, os.path.join(save, "release"), 0, True)
