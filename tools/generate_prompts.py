"""tools/generate.py's prompts and answer text: --prompt / --prompt-ids / --prompt-file as
checked token ids, the note for a sequence past the model's positions, and the text the
new tokens add to the prompt.

Errors are SystemExit messages naming the flag and the fix. Under torchrun the caller
reports them once: --prompt-file is read, and --prompt-ids parsed, before the model loads
(a missing file or a typo fails before minutes of loading;
`megatron.arguments.exit_before_group`), and a prompt the
tokenizer refuses fails alike on every rank after it (`megatron.agreed_exit`).
"""
from __future__ import annotations

# A library module, not a command: run as a script, it says which command to use.
if __name__ == "__main__":
    raise SystemExit("tools/generate_prompts.py is a library module (the prompts of "
                     "tools/generate.py); run python tools/generate.py --help")

from typing import List, Optional, Sequence

_EMPTY = "error: the prompt is empty: give --prompt TEXT or --prompt-ids with at least one token"


def file_prompts(path: str) -> List[str]:
    """The non-empty lines of --prompt-file (newline and trailing spaces dropped; a UTF-8
    byte order mark, which Windows editors write, is no part of the first prompt)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = [line.rstrip() for line in f]
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"error: --prompt-file {path}: {exc}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise SystemExit(f"error: --prompt-file {path} has no prompt: write one per line")
    return prompts


def _parsed_ids(text: str) -> List[int]:
    """The ids of --prompt-ids TEXT (blank: none, which checked_ids refuses). An empty item
    ("1,,2", "1,2,") is an error naming its position: it is no id to drop silently."""
    if not text.strip():
        return []
    ids = []
    for number, item in enumerate(text.split(","), 1):
        try:
            ids.append(int(item))
        except ValueError:
            shown = repr(item) if len(item) <= 40 else f"{item[:30]!r}... ({len(item)} characters)"
            what = "is empty" if not item.strip() else f"{shown} is not an integer"
            raise SystemExit(f"error: --prompt-ids {text[:60]!r}: item {number} {what}; "
                             "expected comma-separated integers like 1,2,3") from None
    return ids


def early_prompt_ids(text: str) -> List[int]:
    """--prompt-ids TEXT checked as far as it can be before the model loads: integers, at
    least one (the vocabulary check follows the load: `checked_ids`)."""
    ids = _parsed_ids(text)
    if not ids:
        raise SystemExit(_EMPTY)
    return ids


def prompt_ids(a, tokenizer, why_not: Optional[str]) -> List[int]:
    """The ids of --prompt-ids, or of --prompt (a.prompt) through the tokenizer."""
    if a.prompt_ids is not None:
        return _parsed_ids(a.prompt_ids)
    if tokenizer is None:
        raise SystemExit(f"error: --prompt needs the checkpoint's tokenizer, which cannot be "
                         f"built: {why_not}; give its files (--vocab-file/--merge-file/"
                         "--tokenizer-model) or use --prompt-ids")
    try:
        return tokenizer.tokenize(a.prompt)
    except ValueError as exc:
        raise SystemExit(f"error: --prompt {a.prompt[:60]!r}: {exc}; write the prompt as "
                         "the tokenizer expects, or give ids with --prompt-ids") from None


def checked_ids(ids: List[int], vocab: int) -> List[int]:
    """`ids` when the prompt is not empty and every id is a token of the vocabulary."""
    if not ids:
        raise SystemExit(_EMPTY)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise SystemExit(f"error: prompt ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return ids


def all_prompt_ids(a, texts: Optional[List[str]], tokenizer, why_not: Optional[str],
                   vocab: int) -> List[List[int]]:
    """The checked ids of every prompt: --prompt-file's lines (`texts`), else the one
    --prompt / --prompt-ids. SystemExit naming the prompt (and its line) otherwise."""
    if texts is None:
        return [checked_ids(prompt_ids(a, tokenizer, why_not), vocab)]
    out = []
    for number, text in enumerate(texts, 1):
        a.prompt = text
        try:
            out.append(checked_ids(prompt_ids(a, tokenizer, why_not), vocab))
        except SystemExit as exc:
            raise SystemExit(f"{exc} (--prompt-file {a.prompt_file}, prompt {number})") from None
    return out


def window_note(prompt_len: int, max_new_tokens: int, max_len: int) -> Optional[str]:
    """The note that generation runs past the model's `max_len` positions, where the
    context is cut to its last max_len tokens (None when it does not)."""
    if max_new_tokens <= 0 or prompt_len + max_new_tokens - 1 <= max_len:
        return None
    if prompt_len > max_len:
        return (f"the prompt has {prompt_len} tokens, more than the model's {max_len} "
                f"positions (--max-position-embeddings): only its last {max_len} are seen")
    return (f"the prompt's {prompt_len} tokens and {max_new_tokens} new ones pass the "
            f"model's {max_len} positions (--max-position-embeddings): from new token "
            f"{max_len - prompt_len + 2} on, each sees only the last {max_len} tokens")


def continuation_text(tokenizer, prompt: Sequence[int], new: Sequence[int]) -> str:
    """The text the `new` tokens add after the `prompt`'s: the whole sequence's text less
    the prompt's, so that prompt text + this is the text of prompt + new. Decoded alone
    the new tokens can lose what joins them to the prompt (a SentencePiece '\u2581the' at
    the start drops its space; NullTokenizer's separating space). Where the prompt's text
    is not the start of the whole (a --prompt-ids prompt that ends inside a UTF-8
    character), the new tokens decoded alone."""
    whole, head = tokenizer.detokenize(list(prompt) + list(new)), tokenizer.detokenize(prompt)
    return whole[len(head):] if whole.startswith(head) else tokenizer.detokenize(new)


__all__ = ["all_prompt_ids", "checked_ids", "continuation_text", "file_prompts",
           "prompt_ids", "window_note"]
