"""Short answers from a reader that restates the question (``ken.ops.short_answer``)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ken.ops.short_answer import short_answer


def test_a_restated_question_is_cut_back_to_the_answer() -> None:
    q = "Who is the current pastor of the church located in the town hit by Hurricane Michael?"
    assert short_answer("Lisa Martin is the current pastor of the church located in the "
                        "town hit by Hurricane Michael.", q) == "Lisa Martin"
    q = "What was the last film in the Before trilogy of the director of Bernie?"
    assert short_answer("The last film in the Before trilogy of the director of Bernie was "
                        "Before Midnight.", q) == "Before Midnight"
    q = "What family does the older person that appeared on March 4 belong to ?"
    assert short_answer("The older person that appeared on March 4 belongs to the Jackson "
                        "family.", q) == "Jackson family"


def test_short_answers_and_answers_that_copy_few_words_are_left_alone() -> None:
    q = "What is the nationality of the driver who won in 1998?"
    for answer in ("Finnish", "Mika Hakkinen, a Finnish driver", "He won in 1998 for Finland",
                   "", None):
        assert short_answer(answer, q) == answer


def test_an_answer_that_copies_an_alternative_of_the_question_is_left_alone() -> None:
    q = "Which film came out first, The Fellowship of the Ring or The Return of the King?"
    for answer in ("The Fellowship of the Ring came out first",
                   "It was The Return of the King, in 2003"):
        assert short_answer(answer, q) == answer
    # an "or" elsewhere in the question does not stop the cut
    q = "In which territory or state is the county that was named after a California senator?"
    assert short_answer("The county that was named after a California senator is the "
                        "Territory of Kansas.", q) == "Territory of Kansas"


def test_the_qa_stage_cuts_its_answers() -> None:
    from ken.models.resources import short_hash
    from ken.ops import sem_qa
    from ken.ops.prompts import SEM_QA

    stage = sem_qa.SemQA().llm_stage("smollm2-135m", ())
    assert stage.name.endswith(f"[{short_hash(SEM_QA.key, sem_qa.ANSWER_FORM)}]")
    q = "Who is the current pastor of the church located in the town of Mexico Beach?"
    assert sem_qa.answer_of("Lisa Martin is the current pastor of the church located in the "
                            "town of Mexico Beach.", (q, "context")) == "Lisa Martin"


def test_nothing_left_after_the_cut_keeps_the_answer() -> None:
    q = "Which team won the cup in the year of the flood?"
    assert short_answer("the team won the cup in the year of the flood", q) == (
        "the team won the cup in the year of the flood")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("the a of team won cup in 1998 Leeds United is was big red"
                                .split()), max_size=14),
       st.lists(st.sampled_from("the of team won cup in 1998 Leeds is who which".split()),
                max_size=12))
def test_the_short_answer_is_words_of_the_answer_in_order(answer, question) -> None:  # noqa: ANN001
    text = " ".join(answer)
    got = short_answer(text, " ".join(question))
    if not text.strip():
        assert got == text
        return
    kept = got.split()
    words = text.split()
    # a contiguous run of the answer's words
    assert any(words[i:i + len(kept)] == kept for i in range(len(words) - len(kept) + 1))
    assert kept
