"""Lexical evidence for multi-hop retrieval (``ken.models.retrieval``)."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ken.models.retrieval import (
    PASSAGE_WEIGHT,
    SIMILARITY_WEIGHT,
    Candidate,
    best_sentences,
    content_words,
    rank,
    sentences,
)


def test_content_words_drop_stopwords_and_case() -> None:
    assert content_words("What is the middle name of Jerry Rice's coach?") == {
        "middle", "jerry", "rice", "s", "coach"}


def test_the_row_naming_the_entity_wins_over_a_similar_one() -> None:
    question = "Which team did Emmitt Smith play for in 1990?"
    rows = [Candidate("Player: Walter Payton; Team: Chicago Bears", similarity=0.50),
            Candidate("Player: Emmitt Smith; Team: Dallas Cowboys", similarity=0.40),
            Candidate("Player: Barry Sanders; Team: Detroit Lions", similarity=0.45)]
    assert rank(question, rows)[0] == 1


def test_a_linked_passage_counts_less_than_the_row_itself() -> None:
    question = "Who founded the club in Leeds?"
    in_row = Candidate("Club: Leeds United")
    in_passage = Candidate("Club: Elland Road FC", ("Leeds",))
    assert rank(question, [in_passage, in_row]) == [1, 0]


def test_a_word_every_row_has_counts_less_than_one_row_alone_has() -> None:
    question = "Which Brazil player was born in Santos?"
    rows = [Candidate(f"Name: {n}; Country: Brazil", similarity=0.3)
            for n in ("Ana", "Bia", "Davi", "Enzo")]
    rows.append(Candidate("Name: Caio; Town: Santos; Country: Chile"))
    assert rank(question, rows)[0] == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alpha beta", "gamma", "beta delta", "epsilon"]),
                          st.sampled_from(["", "alpha", "gamma delta"]),
                          st.floats(-1, 1)), min_size=1, max_size=8))
def test_rank_equals_sorting_by_the_stated_score(rows) -> None:  # noqa: ANN001
    question = "alpha beta gamma"
    n = len(rows)
    words = {"alpha", "beta", "gamma"}

    def idf(word: str, column: int) -> float:  # rows holding the word, by brute force
        df = sum(word in set(r[column].split()) for r in rows)
        return math.log((n + 1) / (df + 0.5))

    expected_scores = [
        sum(idf(w, 0) for w in words & set(text.split()))
        + PASSAGE_WEIGHT * sum(idf(w, 1) for w in words & set(linked.split()))
        + SIMILARITY_WEIGHT * sim for text, linked, sim in rows]
    candidates = [Candidate(text, (linked,) if linked else (), sim) for text, linked, sim in rows]
    got = rank(question, candidates)
    assert sorted(got) == list(range(n))
    expected = sorted(range(n), key=lambda i: -expected_scores[i])
    assert [round(expected_scores[i], 9) for i in got] == [
        round(expected_scores[i], 9) for i in expected]


def test_sentences_split_after_full_stops() -> None:
    assert sentences("He was born in 1950. In 1972 he won gold! Did he? 3.5 m high.") == [
        "He was born in 1950.", "In 1972 he won gold!", "Did he?", "3.5 m high."]


def test_best_sentences_keep_the_evidence_in_order_within_the_budget() -> None:
    passage = ("Jerry Rice is a former wide receiver. He grew up in Mississippi. "
               "Rice was born in Starkville in 1962. He played for the 49ers.")
    got = best_sentences("Where was Jerry Rice born?", [passage], 80)
    assert got == "Jerry Rice is a former wide receiver. Rice was born in Starkville in 1962."
    assert best_sentences("Where was Jerry Rice born?", [passage], 10) == ""


def test_best_sentences_respect_any_budget() -> None:
    rnd = random.Random(3)
    words = ["rice", "born", "gold", "team", "city", "the", "was", "in"]
    for _ in range(200):
        texts = [". ".join(" ".join(rnd.choice(words).capitalize() if j == 0 else
                                    rnd.choice(words) for j in range(rnd.randint(1, 6)))
                           for _ in range(rnd.randint(1, 5))) + "."
                 for _ in range(rnd.randint(1, 3))]
        budget = rnd.randint(0, 120)
        got = best_sentences("rice born team", texts, budget)
        assert len(got) <= budget
        for s in sentences(got):
            assert any(s in t for t in texts)
