"""Checkpoints of other programs given to --load: what the directory or file looks like, why
it is not read here, and the command that converts it (or what to do instead).

This framework reads Megatron-LM 23.05's layout (`latest_checkpointed_iteration.txt`,
`iter_XXXXXXX/mp_rank_XX[_YYY]/model_optim_rng.pt`, the 23.05 model's parameter names) and,
through `tools/checkpoint_convert.py from-hf`, Hugging Face GPT-2 and Llama model
directories. Recognised here, from file names and, for a single PyTorch file, from the
names its pickle holds (listed by `pickletools`, which parses a pickle without running it):

- a Hugging Face model directory (config.json + model.safetensors / pytorch_model.bin, or
  their sharded *.index.json), its weights without config.json, or one weights file;
- a Megatron-Core distributed checkpoint (--ckpt-format torch_dist / zarr of later
  Megatron-LM: metadata.json, common.pt, *.distcp), and Megatron-Core's parameter names
  (`decoder.layers.N.self_attention.linear_qkv`, `mlp.experts.local_experts.E`) or the later
  legacy model's norm names (`input_norm`) in Megatron-LM 23.05's layout;
- a NeMo model: a .nemo archive, its extracted directory (model_config.yaml and
  model_weights.ckpt, mp_rank_XX/model_weights.ckpt or model_weights/), NeMo 2's
  context/ + weights/;
- a DeepSpeed checkpoint (`latest`, global_stepN/ with *model_states.pt and
  zero_pp_rank_*_optim_states.pt), also as Megatron-DeepSpeed writes it: with a Megatron
  tracker file naming N and no iter_N directory;
- nanoGPT's ckpt.pt (model, model_args, iter_num), as a file or in its out/ directory;
- a PyTorch Lightning checkpoint (*.ckpt: state_dict, pytorch-lightning_version, epoch,
  global_step, ...), as a file, in a directory or its checkpoints/ subdirectory; the
  LightningModule's state_dict names tell GPT-2-shaped (Hugging Face GPT2LMHeadModel or
  nanoGPT) and Llama-shaped (Hugging Face LlamaForCausalLM) models apart from others;
- one rank's model_optim_rng.pt copied out of its checkpoint directory.

Library code: no torch, reads nothing it does not need (a JSON file, a directory listing,
a zip member of a PyTorch file).
"""
from __future__ import annotations

import json
import os
import pickletools
import re
import shlex
import zipfile
from typing import Iterable, List, Optional, Set

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
_HF_WEIGHTS_RE = re.compile(r"^(.+\.safetensors|pytorch_model.*\.bin)(\.index\.json)?$")
_DS_STEP_RE = re.compile(r"^global_step\d+$")
_DS_STATES_RE = re.compile(r"_(model|optim)_states\.pt$")
_MAX_PICKLE_BYTES = 64 * 2**20  # a state dict's pickle (tensors are stored beside it)
_MAX_JSON_BYTES = 2**20

# Megatron-Core GPTModel's names (any transformer spec), and the later legacy model's norms
_MCORE_PREFIXES = ("decoder.", "embedding.")
_MCORE_PARTS = (".linear_qkv.", ".linear_proj.", ".linear_fc1.", ".linear_fc2.",
                ".pre_mlp_layernorm.")
_LATER_MOE_PART = ".local_experts."
_LATER_NORM_PARTS = (".input_norm.", ".post_attention_norm.", ".final_norm.")
# PyTorch Lightning's checkpoint dict (Trainer.save_checkpoint / ModelCheckpoint)
_LIGHTNING_KEYS = {"state_dict", "pytorch-lightning_version"}
_GPT2_NAME_RE = re.compile(r"^(.*)transformer\.h\.\d+\.attn\.c_attn\.weight$")
_LLAMA_NAME_RE = re.compile(r"^(.*)layers\.\d+\.self_attn\.q_proj\.weight$")


def from_hf_command(src: str, flag: Optional[str]) -> str:
    """The import of a Hugging Face model directory `src`, and the flag to pass after (None:
    whichever option took the checkpoint)."""
    then = f"{flag} DIR" if flag else "load DIR"
    return (f"python tools/checkpoint_convert.py from-hf --input {src} --save DIR (GPT-2 and "
            f"Llama models), then {then}")


def later_megatron_fix(flag: Optional[str]) -> str:
    """The way to the weights of a later Megatron-LM release's checkpoint: through Hugging
    Face."""
    return ("export it to a Hugging Face model with the Megatron-LM release that wrote it (or "
            f"NVIDIA's Megatron-Bridge) and import that: {from_hf_command('HF_DIR', flag)}")


def _listing(path: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _evidence(names: Iterable[str], limit: int = 3, noun: str = "files") -> str:
    names = list(names)
    more = f", ... ({len(names)} {noun})" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _quote(path: str) -> str:
    return shlex.quote(path)


# ------------------------------------------------------------------ Megatron-Core dist
def dist_backend(path: str) -> Optional[str]:
    """The `sharded_backend` of the Megatron-Core distributed checkpoint directory `path`
    (its metadata.json), "torch_dist" for *.distcp files without one; else None."""
    meta = os.path.join(path, "metadata.json")
    try:
        if os.path.isfile(meta) and os.path.getsize(meta) <= _MAX_JSON_BYTES:
            with open(meta, encoding="utf-8") as f:
                backend = json.load(f).get("sharded_backend")
            if isinstance(backend, str):
                return backend
    except (OSError, ValueError, AttributeError):
        pass
    return "torch_dist" if any(n.endswith(".distcp") for n in _listing(path)) else None


def dist_checkpoint_message(path: str, subject: Optional[str] = None,
                            flag: Optional[str] = None) -> Optional[str]:
    """Why the Megatron-Core distributed checkpoint directory `path` (an iteration directory
    of later Megatron-LM's --ckpt-format torch_dist / zarr) is not read, and the way to its
    weights; None when `path` is not one. `subject` names it (default: the path)."""
    backend = dist_backend(path)
    if backend is None:
        return None
    names = _listing(path)
    shown = [n for n in ("metadata.json", "common.pt") if n in names]
    shown = shown + [n for n in names if n.endswith(".distcp")] or names
    return (f"{subject or path} is a Megatron-Core distributed checkpoint (--ckpt-format "
            f"{backend}: {_evidence(shown)}), written by a Megatron-LM release after 23.05; "
            "this framework reads Megatron-LM 23.05's layout (iter_XXXXXXX/mp_rank_XX/"
            "model_optim_rng.pt), and that release's --ckpt-convert-format torch output keeps "
            "Megatron-Core's parameter names, which do not load here either. To use its "
            f"weights, {later_megatron_fix(flag)}")


def later_megatron_names_message(path: str, names: Iterable[str]) -> Optional[str]:
    """Why the checkpoint file `path`, whose model has the parameter `names`, is not read:
    Megatron-Core's GPTModel names, later releases' MoE experts (`local_experts`) or the later
    legacy model's norm names; None when the names are not such. Names of this framework
    and Megatron-LM 23.05 (`language_model.encoder.layers.N...`) never match."""
    names = [n for n in names if isinstance(n, str)]
    telling = [n for n in names if any(p in n for p in _MCORE_PARTS)]  # shown first
    seen = set(telling)
    mcore = telling + [n for n in names if n.startswith(_MCORE_PREFIXES) and n not in seen]
    moe = [n for n in names if _LATER_MOE_PART in n]
    norms = [n for n in names if any(p in n for p in _LATER_NORM_PARTS)]
    if not (mcore or moe or norms):
        return None
    if mcore:
        shown = _evidence(moe[:1] + mcore, 2, "names")
        what = (f"a Megatron-Core GPTModel (parameter names such as {shown}), written by a "
                "Megatron-LM release after 23.05 that trains Megatron-Core models (its "
                "--ckpt-format torch)")
    elif moe:
        what = ("a mixture of experts of a Megatron-LM release after 23.05 "
                f"({_evidence(moe, 2, 'names')})")
    else:
        what = ("the model of a Megatron-LM release after 23.05, whose norms are named "
                "input_norm / post_attention_norm / final_norm "
                f"({_evidence(norms, 2, 'names')})")
    text = (f"error: checkpoint file {path} holds {what}; this framework reads Megatron-LM "
            "23.05's model and names (language_model.encoder.layers.N.self_attention."
            "query_key_value.weight, ...input_layernorm...).")
    if moe:
        return (text + " Its experts (mlp.experts.local_experts.E: later releases' MoE, "
                "routing and expert parallelism) have no counterpart here (MIGRATING.md, "
                "Known gaps), so its weights cannot be used here")
    return text + f" To use its weights, {later_megatron_fix(None)}"


# ------------------------------------------------------------------ directories
def _nemo_message(path: str, subject: str, flag: str) -> Optional[str]:
    names = set(_listing(path))
    if {"context", "weights"} <= names and os.path.isdir(os.path.join(path, "weights")):
        evidence = "NeMo 2: context/, weights/"
    elif "model_config.yaml" in names:
        weights = [n for n in ("model_weights.ckpt", "model_weights") if n in names]
        weights += [f"{n}/model_weights.ckpt" for n in sorted(names)
                    if os.path.isfile(os.path.join(path, n, "model_weights.ckpt"))][:1]
        evidence = _evidence(["model_config.yaml"] + weights)
    elif path.endswith(".nemo") and os.path.isfile(path):
        evidence = "a .nemo archive"
    else:
        return None
    return (f"{subject} is a NeMo model ({evidence}), not a Megatron-LM checkpoint; export it "
            "to a Hugging Face model with NeMo (NeMo 2: `nemo llm export` with target=hf; a "
            "NeMo 1 .nemo: its scripts/checkpoint_converters/convert_<model>_nemo_to_hf.py) "
            f"and import that: {from_hf_command('HF_DIR', flag)}")


def _deepspeed_step_dir(root: str) -> Optional[str]:
    """The global_stepN directory of the DeepSpeed checkpoint `root` (its `latest` file's,
    else the last one), or `root` itself when it is one; None when there is none."""
    if _DS_STEP_RE.match(os.path.basename(os.path.normpath(root))) and \
            any(_DS_STATES_RE.search(n) for n in _listing(root)):
        return root
    steps = [n for n in _listing(root) if _DS_STEP_RE.match(n)
             and any(_DS_STATES_RE.search(f) for f in _listing(os.path.join(root, n)))]
    try:
        with open(os.path.join(root, "latest"), encoding="utf-8") as f:
            tag = f.read(200).strip()
        if tag in steps:
            return os.path.join(root, tag)
    except (OSError, UnicodeDecodeError):
        pass
    steps.sort(key=lambda n: int(n[len("global_step"):]))
    return os.path.join(root, steps[-1]) if steps else None


def deepspeed_message(root: str, subject: Optional[str] = None,
                      flag: Optional[str] = None) -> Optional[str]:
    """Why the DeepSpeed checkpoint `root` (or one of its global_stepN directories) is not
    read, and how to convert it; None when `root` is not one."""
    step_dir = _deepspeed_step_dir(root)
    if step_dir is None:
        return None
    top = os.path.dirname(step_dir) if step_dir == root else root
    files = [n for n in _listing(step_dir) if _DS_STATES_RE.search(n)]
    latest = "latest -> " if os.path.isfile(os.path.join(top, "latest")) else ""
    evidence = f"{latest}{os.path.basename(step_dir)}/ with {_evidence(files, 2)}"
    script = os.path.join(top, "zero_to_fp32.py")
    where = f"{_quote(script)}" if os.path.isfile(script) else "zero_to_fp32.py (DeepSpeed's)"
    return (f"{subject or root} is a DeepSpeed checkpoint ({evidence}), whose layout is not "
            "read here. Written by Megatron-DeepSpeed: its tools/convert_checkpoint/"
            f"deepspeed_to_megatron.py --input_folder {_quote(step_dir)} --output_folder DIR "
            f"writes Megatron-LM's layout, then {flag or 'load'} DIR; of another model: "
            f"{where} gathers "
            "its weights into one state dict, to save as a Hugging Face model and import: "
            f"{from_hf_command('HF_DIR', flag)}")


def _hf_weight_names(path: str) -> List[str]:
    return [n for n in _listing(path) if _HF_WEIGHTS_RE.match(n)]


def _hf_dir_message(path: str, subject: str, flag: str) -> Optional[str]:
    weights = _hf_weight_names(path)
    if not weights:
        return None
    if os.path.isfile(os.path.join(path, "config.json")):
        return (f"{subject} is a Hugging Face model directory (config.json and weights), not a "
                f"checkpoint of this framework; import it first: python tools/checkpoint_"
                f"convert.py from-hf --input {_quote(path)} --save DIR, then {flag} DIR")
    return (f"{subject} holds Hugging Face weights ({_evidence(weights)}) but no config.json, "
            "which from-hf needs for the model's shape; put the model's config.json beside "
            f"them and import it: {from_hf_command(_quote(path), flag)}")


def _nanogpt_message(path: str, subject: str, flag: str) -> Optional[str]:
    ckpt = path if os.path.isfile(path) else os.path.join(path, "ckpt.pt")
    names = pickled_names(ckpt) if os.path.isfile(ckpt) else None
    if not names or not {"model_args", "iter_num"} <= names:
        return None
    where = "" if ckpt == path else f"{os.path.basename(ckpt)}: "
    return (f"{subject} is a nanoGPT checkpoint ({where}model, model_args, iter_num), not a "
            "Megatron-LM one, and no converter here reads it; save its model as a Hugging "
            "Face GPT-2 model (GPT2LMHeadModel, a GPT2Config from its model_args; the "
            "attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj weights transposed, zero "
            f"biases where bias=False) and import that: {from_hf_command('HF_DIR', flag)}")


def _lightning_file(path: str) -> Optional[str]:
    """The Lightning checkpoint file `path` is or holds (itself, or a *.ckpt in it or in
    its checkpoints/ subdirectory: last.ckpt first); None when there is none. One file's
    pickle is parsed at most."""
    if os.path.isfile(path):
        names = pickled_names(path)
        return path if names and _LIGHTNING_KEYS <= names else None
    for where in (path, os.path.join(path, "checkpoints")):
        files = [n for n in _listing(where) if n.endswith(".ckpt")
                 and os.path.isfile(os.path.join(where, n))]
        if files:
            first = "last.ckpt" if "last.ckpt" in files else files[0]
            return _lightning_file(os.path.join(where, first))
    return None


def _lightning_model_advice(names: Set[str], flag: str) -> str:
    """What the LightningModule's state_dict `names` look like, and the way to its weights
    that comes closest: from-hf after saving the model as a Hugging Face model."""
    gpt2 = sorted(n for n in names if _GPT2_NAME_RE.match(n))
    llama = sorted(n for n in names if _LLAMA_NAME_RE.match(n))
    then = from_hf_command("HF_DIR", flag)
    if gpt2:
        return (f"its state_dict has GPT-2-shaped names ({gpt2[0]}, as Hugging Face's "
                "GPT2LMHeadModel and nanoGPT name them): the closest converter is from-hf; "
                "save the wrapped model as a Hugging Face GPT-2 model (save_pretrained of a "
                "GPT2LMHeadModel; a nanoGPT GPT into a GPT2LMHeadModel, its attn.c_attn, "
                f"attn.c_proj, mlp.c_fc and mlp.c_proj weights transposed) and import it: {then}")
    if llama:
        return (f"its state_dict has Llama-shaped names ({llama[0]}, as Hugging Face's "
                "LlamaForCausalLM names them): the closest converter is from-hf; save the "
                f"wrapped model with save_pretrained and import it: {then}")
    return ("its state_dict's names are of no model a converter here reads; to use its "
            f"weights, save the model as a Hugging Face GPT-2 or Llama model and import it: {then}")


def _lightning_message(path: str, subject: str, flag: str) -> Optional[str]:
    ckpt = _lightning_file(path)
    if ckpt is None:
        return None
    where = "" if ckpt == path else f"{os.path.relpath(ckpt, path)}: "
    return (f"{subject} is a PyTorch Lightning checkpoint ({where}state_dict, "
            "pytorch-lightning_version, epoch, global_step), not a Megatron-LM one, and no "
            f"converter here reads it; {_lightning_model_advice(pickled_names(ckpt) or set(), flag)}")


def _directory_message(path: str, flag: str) -> Optional[str]:
    subject = f"{flag} {path}"
    dist = dist_checkpoint_message(path, subject, flag)
    if dist is not None:
        return dist
    for probe in (_nemo_message, _hf_dir_message, _nanogpt_message, _lightning_message):
        found = probe(path, subject, flag)
        if found is not None:
            return found
    return deepspeed_message(path, subject, flag)


# ------------------------------------------------------------------ single files
def pickled_names(path: str) -> Optional[Set[str]]:
    """The strings (dictionary keys, short values, 'module name' of classes) in the pickle
    of the PyTorch zip file `path`, found by parsing it (`pickletools.genops`): nothing is
    unpickled. None when `path` is not a PyTorch zip file or its pickle is too large."""
    try:
        with zipfile.ZipFile(path) as zf:
            member = next((i for i in zf.infolist() if i.filename.endswith("data.pkl")), None)
            if member is None or member.file_size > _MAX_PICKLE_BYTES:
                return None
            data = zf.read(member)
    except (OSError, zipfile.BadZipFile, RuntimeError):
        return None
    out: Set[str] = set()
    try:
        for _, arg, _ in pickletools.genops(data):
            if isinstance(arg, str):
                out.add(arg)
    except Exception:  # a damaged pickle: what was parsed so far
        pass
    return out


def _rank_file_message(path: str, subject: str, flag: str) -> str:
    fix = (f"mkdir -p DIR/release/mp_rank_00 && cp {_quote(path)} DIR/release/mp_rank_00/"
           f"model_optim_rng.pt && printf release > DIR/{TRACKER_FILENAME}")
    return (f"{subject} is one rank's model file of a Megatron-LM-layout checkpoint, outside "
            f"its checkpoint directory; {flag} takes the directory --save wrote (its "
            f"{TRACKER_FILENAME} beside iter_XXXXXXX/mp_rank_XX/). To load this file alone (a "
            f"checkpoint saved without tensor or pipeline parallelism): {fix}, then {flag} DIR "
            "(its weights, from iteration 0)")


def _file_message(path: str, flag: str) -> Optional[str]:
    subject, name = f"{flag} {path}", os.path.basename(path)
    parent = os.path.dirname(os.path.abspath(path))
    if _HF_WEIGHTS_RE.match(name):
        config = os.path.isfile(os.path.join(parent, "config.json"))
        beside = "holding it and its config.json" if config else \
            "holding it (with the model's config.json beside it)"
        return (f"{subject} is a Hugging Face weights file; {flag} takes a checkpoint "
                f"directory: import the model directory {beside} first: "
                f"{from_hf_command(_quote(os.path.dirname(path) or '.'), flag)}")
    if name.endswith(".nemo"):
        return _nemo_message(path, subject, flag)
    if name.endswith(".distcp") or name in ("metadata.json", "common.pt", ".metadata"):
        dist = dist_checkpoint_message(parent, flag=flag)
        if dist is not None:
            return f"{subject} is a file of a checkpoint: {dist}"
    if _DS_STATES_RE.search(name):
        found = deepspeed_message(parent, flag=flag)
        if found is not None:
            return f"{subject} is a file of a checkpoint: {found}"
    names = pickled_names(path) or set()
    if {"model_args", "iter_num"} <= names:
        return _nanogpt_message(path, subject, flag)
    if _LIGHTNING_KEYS <= names:
        return _lightning_message(path, subject, flag)
    if "checkpoint_version" in names:
        return _rank_file_message(path, subject, flag)
    return None


def foreign_format_message(path: str, flag: str = "--load") -> Optional[str]:
    """One line naming what `path` (given to `flag`, with no tracker file at it) is, why it
    is not read, and the command that converts it; None for anything else (an empty or new
    directory, this framework's checkpoints, an unknown file)."""
    if os.path.isdir(path):
        return _directory_message(path, flag)
    if os.path.isfile(path):
        return _file_message(path, flag)
    return None


__all__ = ["deepspeed_message", "dist_backend", "dist_checkpoint_message",
           "foreign_format_message", "from_hf_command", "later_megatron_fix",
           "later_megatron_names_message", "pickled_names"]
