"""The `tools/checkpoint_convert.py to-hf` command: our checkpoints (any tp/pp layout,
shards merged by megatron.checkpoint_reshard) to Hugging Face model directories, with the
state-dict mapping of megatron.hf_interop in between, and the logit comparison `to-hf
--verify` runs. `from-hf` is megatron/hf_import.py."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Callable, Dict, List, Optional

import torch

from megatron.core.config import ModelConfig
from megatron.hf_files import (
    hold_directory,
    install_export,
    leftover_exports,
    make_staging,
    other_entries,
    save_hf_checkpoint,
    write_in_place,
)
from megatron.hf_interop import FAMILIES, detect_family, hf_config, to_hf_state_dict


# ---------------------------------------------------------------------------- verify
def dtype_kwarg(dtype: torch.dtype) -> dict:
    """`from_pretrained`'s keyword for the weights' dtype in the installed transformers:
    `dtype` from 4.56 (`torch_dtype` warns there), `torch_dtype` before (where `dtype`
    went into the model's config and saving it failed: dtype is not JSON serializable)."""
    import transformers

    version = tuple(int(n) for n in re.findall(r"\d+", transformers.__version__)[:2])
    return {"dtype" if version >= (4, 56) else "torch_dtype": dtype}


# to-hf --verify's default tolerance: VERIFY_RTOL x the largest |logit| of ours (at least
# 1). Both models run in fp32 on CPU on the exported weights (ours rounded to the export's
# dtype first), so the export's dtype does not enter: what remains is fp32 summation order,
# measured at ~4e-7 of the largest logit (hidden 256, 4 layers) and 0 on smaller models,
# while a real mapping mistake is far above 1e-5 of it (GeLU's tanh form for the erf one:
# 3e-5 to 2e-4 of it). An absolute 1e-3 passed those mistakes.
VERIFY_RTOL = 1e-5


@torch.no_grad()
def compare_logits(model: torch.nn.Module, hf_dir: str, vocab_size: int, batch: int = 2,
                   seq_length: int = 32, seed: int = 0) -> tuple:
    """(max |logits_ours - logits_hf|, max |logits_ours|) over random tokens [batch,
    seq_length] (< vocab_size), both models in fp32 on CPU; `model` is our one-process
    GPTModel (eval mode). Needs transformers (ImportError otherwise)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, **dtype_kwarg(torch.float32)).eval()
    seq_length = min(seq_length, model.config.max_position_embeddings)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq_length), generator=g)
    ours = model.float().cpu()(tokens)[..., :vocab_size].float()
    theirs = hf(input_ids=tokens).logits
    return float((ours - theirs.float()).abs().max()), float(ours.abs().max())


def verify_tolerance(given: Optional[float], scale: float) -> tuple:
    """(the largest accepted max |logit difference|, how it was set) for logits whose
    largest magnitude is `scale`: --verify-tolerance when `given`, else `VERIFY_RTOL`
    relative to max(scale, 1)."""
    if given is not None:
        return given, "--verify-tolerance"
    return VERIFY_RTOL * max(scale, 1.0), (f"{VERIFY_RTOL:.0e} x max |logits| {scale:.3g}, "
                                           "fp32 on both sides")


# ------------------------------------------------------------------------- to-hf CLI
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_to_hf_arguments(parser) -> None:
    """Export a checkpoint as a Hugging Face GPT2LMHeadModel or LlamaForCausalLM."""
    parser.add_argument("--load", required=True, help="our checkpoint directory (any tp/pp)")
    parser.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    parser.add_argument("--output", required=True, help="directory for the Hugging Face model")
    parser.add_argument("--family", choices=("auto",) + FAMILIES, default="auto",
                        help="auto: llama for RMSNorm+SwiGLU+rotary models, else gpt2")
    parser.add_argument("--true-vocab-size", type=int, default=None,
                        help="vocabulary rows to keep (default: the checkpoint's tokenizer's "
                             "size when it can be built, else the padded size)")
    parser.add_argument("--dtype", choices=("auto",) + tuple(_DTYPES), default="auto",
                        help="weights dtype (auto: the checkpoint's --fp16/--bf16)")
    parser.add_argument("--max-shard-size-gb", type=float, default=5.0)
    parser.add_argument("--eos-token-id", type=int, default=None,
                        help="config.json's eos_token_id (default: the checkpoint's "
                             "tokenizer's end-of-document id)")
    parser.add_argument("--bos-token-id", type=int, default=None,
                        help="config.json's bos_token_id (default: gpt2 the eos id, llama none)")
    parser.add_argument("--tokenizer-type", default=None,
                        help="default: the checkpoint's; with the three below, its tokenizer "
                             "given again when the files recorded in it moved")
    parser.add_argument("--vocab-file", default=None, help="default: the checkpoint's")
    parser.add_argument("--merge-file", default=None, help="default: the checkpoint's")
    parser.add_argument("--tokenizer-model", default=None, help="default: the checkpoint's")
    parser.add_argument("--verify", action="store_true",
                        help="load the export with transformers and compare logits with ours")
    parser.add_argument("--verify-tolerance", type=float, default=None,
                        help="largest accepted max |logit difference| (default: "
                             f"{VERIFY_RTOL:.0e} x the largest |logit| of ours, at least "
                             f"{VERIFY_RTOL:.0e}: both models run in fp32 on CPU on the "
                             "exported weights, whatever --dtype)")
    parser.add_argument("--overwrite", action="store_true",
                        help="allow an --output directory that is not empty: the earlier "
                             "export there is replaced as a whole once the new one is "
                             "written; files that are not an export's (README.md, .git) are "
                             "kept; other weight files (pytorch_model*.bin, ...) are refused")


def _shown(names: List[str]) -> str:
    return ", ".join(names[:5]) + (f", ... ({len(names)} entries)" if len(names) > 5 else "")


def check_output(output: str, overwrite: bool = False) -> None:
    """Before any work: SystemExit when `output` is a file, or a directory that is not
    empty and not `overwrite` (an earlier export, or another model's files, would be
    replaced without a word), or that holds weight or tokenizer files that are not an
    export's (`other_entries`: kept, a loader would read them with the new export)."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise SystemExit(f"error: --output {output} is a file; pass a directory")
    found = sorted(os.listdir(output)) if os.path.isdir(output) else []
    if found and not overwrite:
        raise SystemExit(f"error: --output {output} is not empty ({_shown(found)}); writing "
                         "there would replace its config.json and weight files. Pass an "
                         "empty or new directory, or add --overwrite to replace them")
    refused = other_entries(output)[1] if found else []
    if refused:
        raise SystemExit(f"error: --output {output} holds {_shown(refused)}, not files of an "
                         "export: --overwrite replaces an export's files and keeps other "
                         "files, and a Hugging Face loader would read these with the new "
                         "export. Move them out of the directory, or pass an empty or new one")


_TOKENIZER_DESTS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def _tokenizer_args(args: dict, a) -> dict:
    """The checkpoint's args with the tokenizer flags given to to-hf in place of the
    recorded ones (files moved since training, or a run on another machine)."""
    given = {k: getattr(a, k, None) for k in _TOKENIZER_DESTS}
    return {**args, **{k: v for k, v in given.items() if v is not None}}


def _tokenizer_of(args: dict, saved: dict):
    """(the tokenizer of `args`, None), or (None, why) when it cannot be built here.
    ValueError for one with more ids than the vocabulary rows of the model whose
    checkpoint args are `saved` (not the files it was trained with)."""
    from megatron.tokenizer.tokenizer import checkpoint_vocab_mismatch

    try:
        from megatron.tokenizer import build_tokenizer

        tok = build_tokenizer(args.get("tokenizer_type"), vocab_file=args.get("vocab_file"),
                              merge_file=args.get("merge_file"),
                              tokenizer_model=args.get("tokenizer_model"),
                              vocab_size=args.get("vocab_size"),
                              vocab_extra_ids=args.get("vocab_extra_ids") or 0)
    except (ImportError, OSError, ValueError, TypeError) as e:
        return None, str(e)
    mismatch = checkpoint_vocab_mismatch(tok.vocab_size, saved)
    if mismatch is not None and mismatch[0]:
        raise ValueError(f"{mismatch[1]}; pass those files with --vocab-file/--merge-file/"
                         "--tokenizer-model")
    if mismatch is not None:
        print(f"WARNING: {mismatch[1]}")
    return tok, None


_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_files(args: dict) -> Dict[str, str]:
    """{name in the export: path} of the checkpoint's tokenizer files that a Hugging Face
    tokenizer loads as they are: tokenizer.json (+ its tokenizer_config.json and
    special_tokens_map.json) of HuggingFaceTokenizer, GPT-2's vocab.json / merges.txt,
    GPTSentencePieceTokenizer's model as tokenizer.model. {} when one it needs is not
    readable here, and for the other tokenizers (SentencePieceTokenizer adds ids of its
    own, NullTokenizer has no file)."""
    kind, model = args.get("tokenizer_type"), args.get("tokenizer_model")
    found: Dict[str, Optional[str]] = {}
    if kind == "HuggingFaceTokenizer" and model:
        folder = model if os.path.isdir(model) else os.path.dirname(model)
        found = {n: os.path.join(folder, n) for n in _HF_TOKENIZER_FILES}
        if not os.path.isdir(model):
            found["tokenizer.json"] = model
    elif kind == "GPT2BPETokenizer":
        found = {"vocab.json": args.get("vocab_file"), "merges.txt": args.get("merge_file")}
    elif kind == "GPTSentencePieceTokenizer":
        found = {"tokenizer.model": model}
    readable = {n: p for n, p in found.items() if p and os.path.isfile(p)}
    needed = {"tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model"} & set(found)
    return readable if needed <= set(readable) else {}  # never half a tokenizer


def _sentencepiece_specials(path: str) -> dict:
    """tokenizer_config.json's bos/eos/unk pieces of the sentencepiece model at `path` ({}
    without sentencepiece, or for ids the model lacks)."""
    try:
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except (ImportError, OSError, RuntimeError):
        return {}
    ids = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id()}
    return {k: sp.id_to_piece(i) for k, i in ids.items() if 0 <= i < sp.get_piece_size()}


def _tokenizer_config(files: Dict[str, str], family: str) -> Optional[dict]:
    """A tokenizer_config.json naming the class that reads `files` where the one
    AutoTokenizer picks for `family`'s model_type does not (GPT-2's reads vocab.json +
    merges.txt, Llama's tokenizer.model): else a gpt2 export's tokenizer.model loads as a
    GPT2Tokenizer of other ids, a llama export's vocab.json not at all. None when not needed
    (or when the copied files hold one). For tokenizer.model that is transformers 5's
    generic class (PreTrainedTokenizerFast): its ids are sentencepiece's own, with no bos/eos
    added, as GPTSentencePieceTokenizer's; LlamaTokenizer's differ (unknown characters,
    whitespace)."""
    if "tokenizer_config.json" in files:
        return None
    if family == "llama" and "vocab.json" in files:
        return {"tokenizer_class": "GPT2Tokenizer"}
    if family == "gpt2" and "tokenizer.model" in files:
        return {"tokenizer_class": "PreTrainedTokenizerFast",
                **_sentencepiece_specials(files["tokenizer.model"])}
    return None


def _copy_tokenizer(args: dict, output: str, family: str) -> List[str]:
    """Copy `tokenizer_files(args)` into `output` (with the `_tokenizer_config` that a
    `family` export needs to load them); the names written."""
    files = tokenizer_files(args)
    for name, path in files.items():
        write_in_place(os.path.join(output, name), lambda tmp, src=path: shutil.copyfile(src, tmp))
    config = _tokenizer_config(files, family)
    if config is None:
        return sorted(files)
    write_in_place(os.path.join(output, "tokenizer_config.json"),
                   lambda tmp: _dump_json(tmp, config))
    return sorted(files) + ["tokenizer_config.json"]


def _dump_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _write_export(a, args: dict, hf_state: dict, config: dict,
                  gen: Optional[dict]) -> tuple:
    """Write the export into a staging directory beside --output and move it in whole
    (`install_export`): (weight file names, tokenizer files copied, files kept from the
    earlier --output). A failed write (a full disk) removes the staging directory and
    leaves --output as it was: SystemExit saying so, with the free space."""
    existed = os.path.isdir(a.output)
    staging = held = None
    try:
        staging = make_staging(a.output)
        held = hold_directory(staging)  # until moved in: `leftover_exports` sees it in use
        names = save_hf_checkpoint(staging, hf_state, config, gen,
                                   int(a.max_shard_size_gb * 2**30))
        copied = _copy_tokenizer(args, staging, config.get("model_type", "gpt2"))
        kept = install_export(staging, a.output)
    except BaseException as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(exc, OSError):
            raise
        from megatron.checkpoint_dirs import free_space_text
        where = os.path.dirname(os.path.realpath(a.output))
        left = (f"--output {a.output} is as it was (the export is written beside it and moved "
                "in once complete)" if existed else "nothing was left")
        raise SystemExit(f"error: writing to --output {a.output} failed ({type(exc).__name__}: "
                         f"{exc}); {left}; {free_space_text(where)}. Free space or pass "
                         "another --output") from exc
    finally:
        if held is not None:
            held.close()
    return names, copied, kept


def _eod_of(tok) -> Optional[int]:
    try:
        return None if tok is None else int(tok.eod)
    except (AttributeError, ValueError):  # a tokenizer without an end-of-document token
        return None


def _special_ids(a, args: dict, tok, vocab: int, family: str) -> tuple:
    """(eos, bos) ids for config.json: --eos-token-id / --bos-token-id, else the tokenizer's
    end-of-document id (bos the same for gpt2, none for llama: only that one id is known).
    An id outside the exported vocabulary is a ValueError naming the fix."""
    eod = a.eos_token_id if a.eos_token_id is not None else _eod_of(tok)
    bos = a.bos_token_id if a.bos_token_id is not None else (eod if family == "gpt2" else None)
    for flag, value in (("--eos-token-id", eod), ("--bos-token-id", bos)):
        if value is None or 0 <= value < vocab:
            continue
        if flag == "--eos-token-id" and a.eos_token_id is None:
            raise ValueError(f"--true-vocab-size {vocab} leaves out the end-of-document id "
                             f"{value} of the checkpoint's tokenizer ({tok.vocab_size} ids), "
                             f"which config.json names as eos/bos; pass --true-vocab-size "
                             f"{value + 1} or more")
        raise ValueError(f"{flag} {value} is outside the exported vocabulary of {vocab} ids")
    if a.eos_token_id is None and args.get("tokenizer_type") == "NullTokenizer" and eod is not None:
        print(f"note: eos_token_id {eod} is NullTokenizer's end-of-document id (--vocab-size); "
              "a model imported from Hugging Face without its tokenizer files had its own ids: "
              "pass them as --eos-token-id N --bos-token-id N")
    return eod, bos


def run_to_hf(a) -> int:
    """`to-hf`: merge the checkpoint's shards, map to the HF family, write, optionally verify.
    Returns 0, or 1 when --verify finds logits further apart than --verify-tolerance;
    SystemExit with the reason for a model or flags it cannot convert."""
    try:
        return _to_hf(a)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def refuse_switch_mlp(args: dict) -> None:
    """ValueError for a checkpoint of a --num-experts model: no Hugging Face class we
    export to (GPT2LMHeadModel, LlamaForCausalLM) has a top-1 switch MLP."""
    experts = args.get("num_experts")
    if experts is not None:
        raise ValueError(
            f"the checkpoint's model has --num-experts {experts} (Megatron-LM 23.05's top-1 "
            "switch MLP); no Hugging Face GPT-2 or Llama class has that MLP, so to-hf cannot "
            "export it. tools/checkpoint_convert.py to-megatron writes it for Megatron-LM, "
            "and tools/generate.py samples from it as it is")


def _refuse_true_vocab_size(given: Optional[int], args: dict) -> None:
    """ValueError for a --true-vocab-size outside [1, the checkpoint's padded rows] (its
    saved `args`), before any weight is read: 0 is not 'not given'."""
    rows = args.get("padded_vocab_size")
    if given is None or (given >= 1 and (rows is None or given <= rows)):
        return
    raise ValueError(f"--true-vocab-size {given} is outside [1, {rows}] (the checkpoint's "
                     "padded vocabulary rows); pass the tokenizer's vocabulary size, or leave "
                     "it out to take the checkpoint's tokenizer's")


def _refuse_missing_tokenizer_files(a) -> None:
    """ValueError for a --vocab-file/--merge-file/--tokenizer-model given to to-hf that is
    not there (a typo), before any weight is read."""
    for dest in _TOKENIZER_DESTS[1:]:
        path = getattr(a, dest, None)
        if path is not None and not os.path.exists(path):
            raise ValueError(f"the tokenizer given cannot be built: --{dest.replace('_', '-')} "
                             f"{path} does not exist; check the path")


def _to_hf(a) -> int:
    for line in leftover_exports(a.output):  # of a to-hf stopped by kill -9, a power loss
        print(line, flush=True)
    check_output(a.output, a.overwrite)
    print(f"reading the checkpoint under {a.load} (its shards merged into one model) ...",
          flush=True)
    def check_args(saved: dict) -> None:
        refuse_switch_mlp(saved)
        _refuse_true_vocab_size(a.true_vocab_size, saved)
        _refuse_missing_tokenizer_files(a)

    args, model_cfg, state, iteration = load_full_checkpoint(a.load, a.iteration,
                                                             check_args=check_args)
    family = detect_family(model_cfg) if a.family == "auto" else a.family
    from megatron.tokenizer.tokenizer import checkpoint_tokenizer_overrides

    tok, why = _tokenizer_of(_tokenizer_args(args, a), args)
    given = [f"--{k.replace('_', '-')} {getattr(a, k)}" for k in _TOKENIZER_DESTS
             if getattr(a, k, None) is not None]
    if tok is None and given:  # a note would export every padded row and no tokenizer
        raise ValueError(f"the tokenizer given ({' '.join(given)}) cannot be built: {why}")
    for note in checkpoint_tokenizer_overrides(args, {k: getattr(a, k, None)
                                                      for k in _TOKENIZER_DESTS}):
        print(f"WARNING: {note}")  # the export would cut the rows to another vocabulary
    args = _tokenizer_args(args, a)
    vocab = a.true_vocab_size if a.true_vocab_size is not None else (
        tok.vocab_size if tok is not None else model_cfg.padded_vocab_size)
    if tok is None and a.true_vocab_size is None:
        print(f"note: the checkpoint's tokenizer ({args.get('tokenizer_type')}) cannot be built "
              f"here ({why}); keeping all {vocab} padded vocabulary rows: give its files "
              "again (--vocab-file/--merge-file/--tokenizer-model), or set --true-vocab-size")
    dtype = _DTYPES.get(a.dtype) or _DTYPES.get(
        {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(args.get("params_dtype")), "fp32"))
    eod, bos = _special_ids(a, args, tok, vocab, family)
    hf_state = to_hf_state_dict(state, model_cfg, family, vocab, dtype)
    if not a.verify:  # hf_state holds copies: the merged model is not needed while writing
        state = None
    config = hf_config(model_cfg, family, vocab, dtype, eod, hf_state)
    config["bos_token_id"] = bos
    gen = None if eod is None else {"eos_token_id": eod, "_from_model_config": True,
                                    **({"bos_token_id": bos} if bos is not None else {})}
    print(f"writing {len(hf_state)} tensors to {a.output} ...", flush=True)
    names, copied, kept = _write_export(a, args, hf_state, config, gen)
    written = names + copied + ["config.json"] + (["generation_config.json"] if gen else [])
    print(f"wrote {family} model ({len(hf_state)} tensors, vocab {vocab}, {dtype}) from "
          f"{a.load} iteration {iteration} to {a.output}: {', '.join(written)}"
          + (f"; kept from the earlier directory: {_shown(kept)}" if kept else ""))
    if not copied:
        print(f"note: no tokenizer files written (the checkpoint's {args.get('tokenizer_type')} "
              "has none a Hugging Face tokenizer reads, or they are not readable here); add "
              f"them to {a.output} for AutoTokenizer")
    if not a.verify:
        return 0
    return _verify(a, model_cfg, state, vocab, dtype)


def _verify(a, model_cfg: ModelConfig, state: dict, vocab: int, dtype: torch.dtype) -> int:
    from megatron.core.models.gpt.gpt_model import GPTModel

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("error: --verify needs the transformers package (pip install "
                         "transformers); the export itself was written") from None
    model_cfg = dataclasses.replace(model_cfg, params_dtype=torch.float32, sequence_parallel=False,
                                    compile_layers=False, embedding_weights_in_fp32=False)
    model = GPTModel(model_cfg, device="meta")
    rounded = {k: v.to(dtype).float() if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(rounded, strict=True, assign=True)
    diff, scale = compare_logits(model.float().eval(), a.output, vocab)
    tol, how = verify_tolerance(a.verify_tolerance, scale)
    ok = diff <= tol
    print(f"verify: max |logits ours - transformers| = {diff:.3e} (tolerance {tol:.1e}: "
          f"{how}): {'OK' if ok else 'FAILED'}")
    if not ok and a.verify_tolerance is None and diff <= 10 * tol:
        print("verify: a mapping mistake is usually further apart than this; in a deep model "
              "fp32 summation order alone can come near the default tolerance: compare a few "
              "generations, and if they agree rerun with --verify-tolerance "
              f"{10 * tol:.1e}")
    return 0 if ok else 1


# ------------------------------------------- checkpoint access (merge / split of shards)
def load_full_checkpoint(load: str, iteration: Optional[int] = None,
                         check_args: Optional[Callable[[dict], None]] = None):
    """(args, one-process ModelConfig, full state dict, iteration) of our checkpoint under
    `load` (any tp/pp/virtual layout; shards merged by megatron.checkpoint_reshard).
    `check_args(saved args)` runs before any weight is read (it raises to refuse)."""
    from megatron.checkpoint_reshard import config_from_args, full_model_state, locate_iteration
    from megatron.checkpoint_source import SourceCheckpoint
    from megatron.core.models.gpt.gpt_model import GPTModel

    iter_dir, iteration, release = locate_iteration(load, iteration)
    src = SourceCheckpoint(iter_dir)
    if not src.args:
        raise SystemExit(f"error: {iter_dir} holds no 'args': the model shape is unknown")
    if check_args is not None:
        check_args(src.args)
    config = config_from_args(src.args)
    state = full_model_state(src, GPTModel(config.model, device="meta"))
    return config.args, config.model, state, 0 if release else iteration
