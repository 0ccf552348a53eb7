"""Lexical evidence for multi-hop retrieval (issue 34, item 3): which table rows and which
sentences of their linked passages share the question's words.

Embedding similarity alone (``sem_similarity``) ranks a HybridQA table's rows by what they are
about; the question usually names the row's entity or a fact of its linked passage, which a
word match finds. :func:`rank` combines both: each candidate's content words in common with the
question, each weighted by how rare it is among the candidates (inverse document frequency: a
word every row of the table has, such as a country all the players share, says little about
which row is meant), cells and linked titles fully and linked passages at
:data:`PASSAGE_WEIGHT`, plus :data:`SIMILARITY_WEIGHT` times its embedding similarity.
:func:`best_sentences` keeps the sentences of a passage that share most words with the
question, in their order, within a character budget, so the reader sees the evidence rather
than the first few hundred characters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: words that carry no evidence of which row or sentence a question is about
STOPWORDS = frozenset("""
a an the of in on at to for by with from into about as and or but not no nor is are was were be
been being has have had do does did what which who whom whose when where why how many much
that this these those it its he she his her they them their there than then so such one also
most least more less first second third last name named year years
""".split())
#: weight of a word shared with a linked passage, against 1 for one in the row's cells. Chosen
#: with the rarity weights on HybridQA dev questions 300-599 (not the 300 scored in
#: docs/results.md): the gold answer was in the reader's context for 70.7% at 0.2, 72.3% at
#: 0.5 (68.0% before the rarity weights, at 0.3)
PASSAGE_WEIGHT = 0.5
#: weight of the embedding similarity (cosine, -1..1) against the shared words' rarity weights
#: (about 0.05 for a word every candidate has to 2-3 for a word one of 10-20 has); set when a
#: shared word counted 1 and left there: 1 and 4 gave the same recall within 0.7 points on dev
#: questions 300-599
SIMILARITY_WEIGHT = 2.0
_WORD = re.compile(r"[^\W_]+", re.UNICODE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def content_words(text: str) -> frozenset[str]:
    """The lower-cased words of ``text`` that are not :data:`STOPWORDS`."""
    return frozenset(w for w in _WORD.findall(text.lower()) if w not in STOPWORDS)


@dataclass(frozen=True)
class Candidate:
    """A row (or passage) to rank: its own text, its linked passages' texts, and its
    embedding similarity to the question."""

    text: str
    linked: tuple[str, ...] = ()
    similarity: float = 0.0


def rarity(shared: Sequence[frozenset[str]]) -> dict[str, float]:
    """Each word's inverse document frequency over ``n = len(shared)`` candidates:
    ``log((n + 1) / (df + 0.5))``, with ``df`` the candidates that share it; positive even for
    a word all of them share, largest for a word one of them has."""
    n = len(shared)
    counts: dict[str, int] = {}
    for words in shared:
        for w in words:
            counts[w] = counts.get(w, 0) + 1
    return {w: math.log((n + 1) / (df + 0.5)) for w, df in counts.items()}


def scores(question: str, candidates: Sequence[Candidate]) -> list[float]:
    """Each candidate's score: its words shared with ``question``, each weighted by its
    :func:`rarity` among the candidates (linked passages' words against the linked passages,
    at :data:`PASSAGE_WEIGHT`), plus :data:`SIMILARITY_WEIGHT` times its similarity."""
    words = content_words(question)
    own = [words & content_words(c.text) for c in candidates]
    linked = [words & content_words(" ".join(c.linked)) if c.linked else frozenset()
              for c in candidates]
    own_weight, linked_weight = rarity(own), rarity(linked)
    return [sum(own_weight[w] for w in o) + PASSAGE_WEIGHT * sum(linked_weight[w] for w in k)
            + SIMILARITY_WEIGHT * c.similarity for o, k, c in zip(own, linked, candidates,
                                                                   strict=True)]


def rank(question: str, candidates: Sequence[Candidate]) -> list[int]:
    """Indices of ``candidates`` by :func:`scores`, best first (ties keep their order)."""
    by = scores(question, candidates)
    return sorted(range(len(candidates)), key=lambda i: -by[i])


def sentences(text: str) -> list[str]:
    """``text`` split after ``.``, ``!`` or ``?`` followed by a capital, digit or quote."""
    return [s.strip() for s in _SENTENCE_END.split(text.strip()) if s.strip()]


def best_sentences(question: str, texts: Iterable[str], budget: int) -> str:
    """The sentences of ``texts`` that share most content words with ``question`` (each
    text's first sentence, which says what it is about, counts one word more), at most
    ``budget`` characters in all, joined in their original order. Ties go to earlier
    sentences; a sentence sharing no word is left out unless it is a text's first."""
    words = content_words(question)
    pool: list[tuple[int, tuple[int, int], str]] = []  # (shared words, position, sentence)
    for t, text in enumerate(texts):
        for s, sentence in enumerate(sentences(text)):
            shared = len(words & content_words(sentence)) + (1 if s == 0 else 0)
            if shared:
                pool.append((shared, (t, s), sentence))
    kept: list[tuple[tuple[int, int], str]] = []
    used = 0
    for _shared, position, sentence in sorted(pool, key=lambda x: (-x[0], x[1])):
        if used + len(sentence) + 1 > budget:
            continue
        kept.append((position, sentence))
        used += len(sentence) + 1
    return " ".join(s for _, s in sorted(kept))
