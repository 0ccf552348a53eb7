"""Row text is data, never control: tokenising it can never give a model's special tokens.

A tokenizer matches its special tokens (``[SEP]`` of a BERT encoder, ``<|im_start|>`` of a
chat model) anywhere in the text it is given. Text from a table that holds such a string would
then end a BERT segment, or open a new turn of a chat prompt with the row's own instructions.
Every place KEN tokenises row text goes through this module:

- ``encode_rows``/``encode_row`` tokenise with special tokens split (the tokenizer treats
  ``[SEP]`` in the text as the characters ``[``, ``SEP``, ``]``); the special tokens a model
  needs (``[CLS] ... [SEP]``) are still added around the text where asked.
- ``defuse`` is for text that is spliced into a string template before tokenising (the chat
  prompts of the LLM operators): every special-token string in it is broken by a zero-width
  space after its first character, so it tokenises as plain text. Text without such strings is
  returned unchanged, so ordinary prompts tokenise exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: inserted after the first character of a special-token string found in row text
BREAK = "\u200b"


def encode_rows(tokenizer: Any, texts: Sequence[str], **options: Any) -> list[list[int]]:
    """Token ids of each text with special-token strings split into plain tokens; ``options``
    go to the tokenizer (``truncation``, ``max_length``, ``add_special_tokens``)."""
    if not texts:
        return []
    return [list(row) for row in
            tokenizer(list(texts), split_special_tokens=True, **options)["input_ids"]]


def encode_row(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one text, no special tokens added, none produced by the text itself."""
    return encode_rows(tokenizer, [text], add_special_tokens=False)[0]


def special_strings(tokenizer: Any) -> tuple[str, ...]:
    """Every string the tokenizer turns into a special token, longest first."""
    cached = getattr(tokenizer, "_ken_special_strings", None)
    if cached is not None:
        return cached
    found = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            found.add(str(token.content))
    out = tuple(sorted((s for s in found if s), key=lambda s: (-len(s), s)))
    try:
        tokenizer._ken_special_strings = out
    except AttributeError:  # a tokenizer that takes no attributes: compute again next time
        pass
    return out


def defuse(text: str, tokenizer: Any) -> str:
    """``text`` with every special-token string of ``tokenizer`` broken (see the module
    docstring); unchanged when it holds none."""
    for special in special_strings(tokenizer):
        if special in text:
            text = text.replace(special, special[0] + BREAK + special[1:])
    return text
