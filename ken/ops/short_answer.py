"""Short answers from a reader that restates the question (issue 34, item 2).

Asked "Who is the current pastor of the church located in the town ...?", Qwen2.5-Coder-0.5B
often answers "Lisa Martin is the current pastor of the church located in the town ...": the
answer is in there, wrapped in the question's own words, and token F1 counts every one of them
against it. :func:`short_answer` takes the question's words back out: the runs of at least
:data:`RESTATED_RUN` words that the answer copies from the question (case and punctuation
ignored) are cut, the function words at the edges of what is left are dropped, and the longest
piece remains ("Lisa Martin"). An answer that copies no such run is returned as it is, so short
answers are never touched; so is an answer that copies one of the alternatives a question
offers ("Which came out first, The Fellowship of the Ring or The Two Towers?": a copied run
next to an "or" of the question), which is then the answer itself.

Measured on HybridQA dev questions 300-599 (not the 300 that docs/results.md scores), with
Qwen reading: 25 of 300 answers changed, F1 41.8 -> 43.6; runs of 3 or 5 words changed 28
and 23, with the same F1.
"""

from __future__ import annotations

import re

#: the fewest consecutive question words an answer must copy to count as a restatement
RESTATED_RUN = 4
#: words dropped from the edges of what is left ("... belongs to the Jackson family" ->
#: "Jackson family")
FUNCTION_WORDS = frozenset("""
a an the is was are were be been being of in on at to by for from with as that which who whom
whose and or it its his her their this these those has have had belongs belong belonged does
did do
""".split())
_NOT_WORD = re.compile(r"[^\w]", re.UNICODE)


def _norm(token: str) -> str:
    return _NOT_WORD.sub("", token.lower())


def short_answer(answer: str | None, question: str, run: int = RESTATED_RUN) -> str | None:
    """``answer`` without the runs of ``run`` or more words it copies from ``question`` (see
    the module); unchanged when it copies none, when a run it copies is one of the question's
    alternatives (next to an "or"), or when nothing would be left."""
    if not answer or not answer.strip():
        return answer
    tokens = answer.split()
    words = [_norm(t) for t in tokens]
    asked = [w for w in (_norm(t) for t in question.split()) if w]
    longest_run = min(len(asked), len(tokens))  # a copied run is no longer than the answer
    grams: dict[tuple[str, ...], bool] = {}  # each run of the question: next to an "or"?
    for n in range(run, longest_run + 1):
        for i in range(len(asked) - n + 1):
            beside_or = (i > 0 and asked[i - 1] == "or") or (
                i + n < len(asked) and asked[i + n] == "or")
            key = tuple(asked[i:i + n])
            grams[key] = grams.get(key, False) or beside_or
    copied = [False] * len(tokens)
    i = 0
    while i < len(tokens):  # the longest copied run starting at each word, left to right
        longest = next((j - i for j in range(len(tokens), i + run - 1, -1)
                        if tuple(words[i:j]) in grams), 0)
        if longest and grams[tuple(words[i:i + longest])]:
            return answer  # an alternative the question offers: the answer itself
        for k in range(i, i + longest):
            copied[k] = True
        i += longest or 1
    if not any(copied):
        return answer
    pieces: list[list[str]] = [[]]
    for token, cut in zip(tokens, copied, strict=True):
        if cut:
            pieces.append([])
        else:
            pieces[-1].append(token)
    best = max((_strip(p) for p in pieces), key=len)
    if not best:  # the answer is all question
        return answer
    return " ".join(best).strip(" .,;:")


def _strip(piece: list[str]) -> list[str]:
    """``piece`` without function words (or bare punctuation) at either end."""
    def weak(token: str) -> bool:
        return _norm(token) in FUNCTION_WORDS or not _norm(token)

    start, end = 0, len(piece)
    while start < end and weak(piece[start]):
        start += 1
    while end > start and weak(piece[end - 1]):
        end -= 1
    return piece[start:end]
