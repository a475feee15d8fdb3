"""Detokenizers for the pre-tokenised evaluation texts, chosen by the file's path.

WikiText-103 and PTB ship their text split into space-separated tokens ("don 't", "1 @,@
000"); a GPT tokenizer scores the text as it would be written, so the spacing is undone
before tokenising. Each detokenizer is a table of rewrites applied in order: a `str` row
is a plain substring replacement, an `re` row a regular-expression substitution.

* WikiText: Megatron-LM's rules (see WIKITEXT_RULES). Its second rule is a regular
  expression that matches only the literal text "/' <digit>/" -- kept as it is, so the
  numbers stay Megatron's.
* PTB: " '" -> "'", spaces around newlines, " n't" -> "n't", the number placeholder " N "
  -> "1 ", "$ 1" -> "$1", "# 1" -> "#1".
* LAMBADA: the text as it is (Megatron-LM's LAMBADA detokenizer changes nothing).
* Any other path: the text is left as it is (Megatron-LM has no detokenizer for it and
  stops with a TypeError).

The path is matched as Megatron-LM matches it: "ptb", then "wiki" (so WikiText-103's own
file names, wiki.test.tokens / wiki.valid.tokens, select it wherever they lie), then
"lambada", as substrings of the whole path.
"""
from __future__ import annotations

import re
from typing import Callable, Sequence, Tuple

Rule = Tuple[str, str, str]  # (kind: "str" | "re", pattern, replacement)


def _bracket_rule(open_: str, close: str) -> Rule:
    """Strip the spaces just inside one pair of brackets or quotes: "( a b )" -> "(a b)"
    (non-greedy: the nearest closing mark ends the pair)."""
    o, c = re.escape(open_), re.escape(close)
    return ("re", rf"{o}\s*([^{c}]*?)\s*{c}", rf"{open_}\1{close}")


WIKITEXT_RULES: Sequence[Rule] = (
    ("str", "s '", "s'"),
    ("re", r"/' [0-9]/", r"/'[0-9]/"),
    ("str", " @-@ ", "-"),
    ("str", " @,@ ", ","),
    ("str", " @.@ ", "."),
    ("str", " : ", ": "),
    ("str", " ; ", "; "),
    ("str", " . ", ". "),
    ("str", " ! ", "! "),
    ("str", " ? ", "? "),
    ("str", " , ", ", "),
    _bracket_rule("(", ")"),
    _bracket_rule("[", "]"),
    _bracket_rule("{", "}"),
    _bracket_rule('"', '"'),
    _bracket_rule("'", "'"),
    ("str", "= = = =", "===="),
    ("str", "= = =", "==="),
    ("str", "= =", "=="),
    ("str", " \u00b0 ", "\u00b0"),
    ("str", " \n", "\n"),
    ("str", "\n ", "\n"),
    ("str", " N ", " 1 "),
    ("str", " 's", "'s"),
)

PTB_RULES: Sequence[Rule] = (
    ("str", " '", "'"),
    ("str", " \n", "\n"),
    ("str", "\n ", "\n"),
    ("str", " n't", "n't"),
    ("str", " N ", "1 "),
    ("str", "$ 1", "$1"),
    ("str", "# 1", "#1"),
)

LAMBADA_RULES: Sequence[Rule] = ()


def apply_rules(text: str, rules: Sequence[Rule]) -> str:
    """`text` rewritten by each rule in turn."""
    for kind, pattern, replacement in rules:
        if kind == "str":
            text = text.replace(pattern, replacement)
        else:
            text = re.sub(pattern, replacement, text)
    return text


def wikitext_detokenizer(text: str) -> str:
    return apply_rules(text, WIKITEXT_RULES)


def ptb_detokenizer(text: str) -> str:
    return apply_rules(text, PTB_RULES)


def lambada_detokenizer(text: str) -> str:
    return apply_rules(text, LAMBADA_RULES)


# path substring -> detokenizer, first match wins
_BY_PATH = (("ptb", ptb_detokenizer), ("wiki", wikitext_detokenizer),
            ("lambada", lambada_detokenizer))


def get_detokenizer(path: str) -> Callable[[str], str]:
    """The detokenizer for a file: by the first of "ptb", "wiki", "lambada" found in its
    path (case-sensitive, as Megatron-LM), else the identity."""
    for key, fn in _BY_PATH:
        if key in path:
            return fn
    return lambda text: text
