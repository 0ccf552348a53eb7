"""Generation and option scoring with the packaged SmolLM2-135M-Instruct (all 30 layers)
against slow references: token-by-token decoding without a cache, and log-probabilities
summed by hand from one unpadded forward pass per sequence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ken.engine.decode import DecodeServer
from ken.errors import EngineError, ModelError
from ken.models.generation import (
    DecodeBatch,
    Generation,
    chat_prompt,
    generate,
    generate_reference,
    option_probabilities,
    score_options,
)
from ken.models.resources import Resources

pytestmark = pytest.mark.models

QUESTIONS = ["What is the capital of France?",
             "Name a fruit that is yellow.",
             "Translate 'good morning' into French. Answer briefly, with nothing else.",
             "2 + 2 ="]


@pytest.fixture(scope="module")
def lm(home):  # noqa: ANN001 - conftest's KEN_HOME (SmolLM2 converted there)
    from conftest import REFERENCE_DEVICE

    return Resources(REFERENCE_DEVICE, home=home).causal_lm("smollm2-135m")


@pytest.fixture(scope="module")
def prompts(lm) -> list[list[int]]:  # noqa: ANN001
    return [chat_prompt(lm, q) for q in QUESTIONS]


def test_generation_equals_token_by_token_reference(lm, prompts) -> None:  # noqa: ANN001
    got = generate(lm, prompts, max_new_tokens=10, batch_size=4)
    assert len({len(p) for p in prompts}) > 1, "prompts of different lengths pad"
    for g, p in zip(got, prompts, strict=True):
        assert list(g.token_ids) == generate_reference(lm, p, 10)
        assert g.prompt_tokens == len(p) and g.num_tokens <= 10
        assert g.finish in ("eos", "length")
        assert all(lp <= 0 for lp in g.logprobs) and len(g.logprobs) == g.num_tokens


def test_batched_generation_equals_one_row_at_a_time(lm, prompts) -> None:  # noqa: ANN001
    batched = generate(lm, prompts, max_new_tokens=16, batch_size=4)
    single = generate(lm, prompts, max_new_tokens=16, batch_size=1)
    assert [g.text for g in batched] == [g.text for g in single]
    assert "paris" in batched[0].text.lower()


def test_token_logprobs_are_the_model_s(lm, prompts) -> None:  # noqa: ANN001
    g = generate(lm, prompts[:1], max_new_tokens=6)[0]
    ids = list(prompts[0]) + list(g.token_ids)
    with torch.inference_mode():
        logp = torch.log_softmax(lm.net(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    n = len(prompts[0])
    expected = [float(logp[n - 1 + k, t]) for k, t in enumerate(g.token_ids)]
    assert np.allclose(g.logprobs, expected, atol=1e-4)
    assert g.certainty("mean_prob") == pytest.approx(math.exp(np.mean(expected)), rel=1e-3)
    assert g.certainty("min_prob") <= g.certainty("mean_prob")


def test_stop_strings_cut_the_text(lm) -> None:  # noqa: ANN001
    prompt = chat_prompt(lm, "Count from 1 to 10, separated by commas.")
    free = generate(lm, [prompt], max_new_tokens=30)[0]
    assert "," in free.text
    cut = generate(lm, [prompt], max_new_tokens=30, stop=[","])[0]
    assert cut.finish == "stop" and "," not in cut.text
    assert free.text.startswith(cut.text)
    assert cut.num_tokens < free.num_tokens
    assert generate(lm, [prompt], max_new_tokens=0)[0].text == ""


def brute_force_logprob(lm, context: list[int], option: list[int]) -> float:  # noqa: ANN001
    with torch.inference_mode():
        ids = torch.tensor([context + option])
        logp = torch.log_softmax(lm.net(input_ids=ids).logits[0].float(), -1)
    return sum(float(logp[len(context) - 1 + k, t]) for k, t in enumerate(option))


def test_option_scores_equal_brute_force_sums(lm) -> None:  # noqa: ANN001
    tok = lm.tokenizer
    contexts = ["The capital of France is", "A man is sitting on a roof. He",
                "I put the milk in the"]
    options = [[" Paris.", " Rome.", " a large city in Europe"],
               [" starts pulling up roofing.", " is holding a cube."],
               [" fridge", " oven", " car", " sky above the sea"]]
    ctx_ids = [tok.encode(c, add_special_tokens=False) for c in contexts]
    opt_ids = [[tok.encode(o, add_special_tokens=False) for o in opts] for opts in options]
    scores = score_options(lm, ctx_ids, opt_ids, batch_size=3)
    for c, opts, row in zip(ctx_ids, opt_ids, scores, strict=True):
        expected = [brute_force_logprob(lm, c, o) for o in opts]
        assert np.allclose(row, expected, atol=2e-3), (row, expected)
    assert int(np.argmax(scores[0][:2])) == 0  # Paris over Rome
    p = option_probabilities(scores[2])
    assert p.sum() == pytest.approx(1.0) and (p > 0).all()
    with pytest.raises(ModelError, match="at least one option"):
        score_options(lm, ctx_ids[:1], [[]])


def test_options_on_a_shared_context_equal_each_pair_run_whole(lm) -> None:  # noqa: ANN001
    """``option_logprobs`` (each context once, its options on the cached keys and values)
    against ``continuation_logprobs`` (each context + option run whole), over rows of
    different lengths and option counts, one-token and longer options, several batch sizes."""
    rng = np.random.default_rng(3)
    contexts = [rng.integers(100, 5000, size=n).tolist() for n in (3, 17, 9, 1, 30)]
    options = [[rng.integers(100, 5000, size=m).tolist() for m in ms]
               for ms in ((1, 2), (4, 1, 3), (2,), (1, 1, 5, 2), (3, 3))]
    flat_ctx = [c for c, opts in zip(contexts, options, strict=True) for _ in opts]
    flat_opt = [o for opts in options for o in opts]
    whole = lm.continuation_logprobs(flat_ctx, flat_opt, batch_size=4)
    for batch_size in (1, 3, 16):
        seen: list[int] = []
        shared = lm.option_logprobs(contexts, options, batch_size=batch_size,
                                    on_batch=seen.append)
        assert np.allclose(np.concatenate(shared), whole, atol=2e-3)
        assert sum(seen) == len(contexts)
    with pytest.raises(ModelError, match="at least one option"):
        lm.option_logprobs(contexts[:1], [[]])


def test_generation_rejects_bad_arguments(lm) -> None:  # noqa: ANN001
    with pytest.raises(ModelError, match="at least one token"):
        generate(lm, [[]])
    with pytest.raises(ModelError, match="batch size"):
        generate(lm, [[1]], batch_size=0)
    assert Generation("", (), (), 3, "eos").certainty() == 1.0


def test_rows_joining_between_passes_get_their_own_answers(lm, prompts) -> None:  # noqa: ANN001
    """Continuous batching: rows join a running batch at different passes and leave when
    done; each row's tokens equal its answer alone."""
    alone = [generate(lm, [p], max_new_tokens=8)[0] for p in prompts]
    batch = DecodeBatch.prefill(lm, prompts[:1], [0], [8])
    got: dict[object, Generation] = dict(batch.pop_finished())
    joined, passes = 1, 0
    while len(batch) or joined < len(prompts):
        if joined < len(prompts) and passes % 2 == 0:
            batch.join(DecodeBatch.prefill(lm, [prompts[joined]], [joined], [8 - joined]))
            joined += 1
        elif len(batch):
            batch.step()
        got.update(batch.pop_finished())
        passes += 1
    for k, g in enumerate(alone):
        assert list(got[k].token_ids) == list(g.token_ids)[:8 - k]
    assert batch.width == 0


def test_decode_server_answers_every_request_once(lm, prompts) -> None:  # noqa: ANN001
    alone = [generate(lm, [p], max_new_tokens=6)[0] for p in prompts]
    with DecodeServer(lm, max_running=2, kv_budget_tokens=200) as server:
        futures = [server.submit(p, 6) for p in prompts]
        too_long = server.submit(list(prompts[0]) * 20, 6)  # over the KV budget, in context
        with pytest.raises(EngineError, match="token ids must be in"):
            server.submit([10**9], 2)
        with pytest.raises(EngineError, match="context"):
            server.submit(prompts[0], 10**6)
        outcomes = [f.result(timeout=120) for f in futures]
        assert too_long.result(timeout=120).status == "rejected"
        assert not futures[0].cancel()  # an outcome always comes
    for o, g in zip(outcomes, alone, strict=True):
        assert o.status == "ok" and o.generation.text == g.text
        assert o.arrival_s <= o.first_token_s <= o.completion_s
    assert server.passes >= 6 and server.prefill_passes >= 2
    with pytest.raises(EngineError, match="not running"):
        server.submit(prompts[0], 2)


def test_decode_server_isolates_failed_passes(lm, prompts, monkeypatch) -> None:  # noqa: ANN001
    """A prefill that fails is retried one request at a time (only the bad one fails); a
    decode pass that fails fails the rows running in it; the server goes on."""
    import time

    poison = chat_prompt(lm, "This prompt breaks the model.")
    real_prefill, real_step = DecodeBatch.prefill, DecodeBatch.step
    steps = {"n": 0}

    def prefill(cls, lm_, rows, keys, *args, **kwargs):  # noqa: ANN001, ANN202
        if any(list(r) == poison for r in rows):
            raise RuntimeError("poisoned prompt")
        if any(list(r) == list(prompts[0]) for r in rows):
            time.sleep(1.0)  # the next two requests queue and join in one prefill
        return real_prefill(lm_, rows, keys, *args, **kwargs)

    def step(self) -> None:  # noqa: ANN001
        steps["n"] += 1
        if steps["n"] == 1 and any(r.max_new == 5 for r in self.rows):
            raise RuntimeError("decode failed")
        real_step(self)

    monkeypatch.setattr(DecodeBatch, "prefill", classmethod(prefill))
    with DecodeServer(lm, max_running=4) as server:
        first = server.submit(prompts[0], 1)
        time.sleep(0.2)
        bad, good = server.submit(poison, 4), server.submit(prompts[1], 1)
        assert first.result(timeout=60).status == "ok"
        assert bad.result(timeout=60).status == "error"
        assert "poisoned" in bad.result().error
        assert good.result(timeout=60).status == "ok"
        monkeypatch.setattr(DecodeBatch, "step", step)
        failed = server.submit(prompts[2], 5).result(timeout=60)
        assert failed.status == "error" and "decode failed" in failed.error
        assert server.submit(prompts[3], 3).result(timeout=60).status == "ok"


def test_decode_server_sizes_the_kv_cache_from_memory(lm) -> None:  # noqa: ANN001
    from ken.engine.decode import kv_tokens_in
    from ken.optimizer.tokens import kv_bytes_per_token

    per_token = kv_bytes_per_token(lm)  # 2 x 30 layers x 3 KV heads x 64 x 4 bytes
    assert per_token == 2 * 30 * 3 * 64 * 4
    weights = lm.memory_bytes
    server = DecodeServer(lm, memory_budget_bytes=weights + 1000 * per_token)
    assert server.scheduler.kv_budget_tokens == 1000
    with pytest.raises(EngineError, match="holds no KV cache"):
        kv_tokens_in(lm, weights // 2)


def test_continuous_rows_equal_static_predict(home) -> None:  # noqa: ANN001
    from conftest import REFERENCE_DEVICE

    from ken.engine.decode import generate_rows
    from ken.ops.sem_map import SemMap

    model = SemMap().stage(Resources(REFERENCE_DEVICE, home=home), "smollm2-135m",
                           ("Answer in at most three words",))
    rows = [*QUESTIONS, "", "Name a colour.", None, "Count to three."]
    static = model.predict(rows, batch_size=3)
    # 2 slots for 7 live rows: rows join as others finish
    continuous = generate_rows(model, rows, max_running=2)
    assert continuous.values == static.values
    assert continuous.values[4] is None and continuous.values[6] is None
    assert continuous.token_counts.tolist() == static.token_counts.tolist()
    assert np.allclose(continuous.scores, static.scores, atol=1e-4)
    assert generate_rows(model, [None, ""]).values == [None, None]


def test_cascade_server_equals_row_by_row_cascade(lm) -> None:  # noqa: ANN001
    """A two-stage plan in one decode server (a lane per model) gives each row what running
    its cascade on that row alone gives: NULLs, duplicates and escalations included."""
    from ken.engine.decode import CascadeServer
    from ken.models.cascade import Cascade
    from ken.models.llm import GenerativeModel
    from ken.ops.prompts import SEM_QA
    from ken.policy.plan import GenGear, GenPlan

    short = GenerativeModel(lm, SEM_QA, "qa-short", "sem-qa", SEM_QA.key, 4, stop=("\n",),
                            num_inputs=2)
    long = GenerativeModel(lm, SEM_QA, "qa-long", "sem-qa", SEM_QA.key, 10, stop=("\n",),
                           num_inputs=2)
    passage = "Ada Lovelace wrote the first program in 1843 for Babbage's engine in London."
    rows = [("Who wrote the first program?", passage), ("In which year?", passage),
            (None, passage), ("Where?", passage), ("Who wrote the first program?", passage),
            ("For which engine?", passage), ("", "")]
    alone = short.predict(rows, batch_size=1)
    # rows 0, 1 and 3 arrive at loads 0, 1 and 2 (row 2 has no prompt): the cascade's gear;
    # the two least certain of them escalate (the threshold half-way to the third: certainties
    # in a batch differ from those alone by float rounding)
    low = np.sort(alone.scores[[0, 1, 3]])
    assert low[2] - low[1] > 1e-3
    threshold = float(low[1] + low[2]) / 2
    plan = GenPlan("sem_qa", (GenGear(Cascade(("qa-short", "qa-long"), (threshold,)), 3),
                              GenGear(Cascade(("qa-short",)))), max_running=2)
    with CascadeServer({"qa-short": short, "qa-long": long}, plan) as server:
        outcomes = [f.result(timeout=300) for f in [server.submit_row(r) for r in rows]]
        with pytest.raises(EngineError, match="submit_row"):
            server.submit([1, 2], 2)
    assert server.dispatcher.load == 0 and server.load == 0
    for row, o, value, certainty in zip(rows, outcomes, alone.values, alone.scores,
                                        strict=True):
        assert o.status == "ok"
        if not row[0]:
            assert o.value is None
            continue
        cascade = plan.gears[o.gear].cascade
        if len(cascade.models) == 2 and certainty < threshold:
            assert (o.model, o.stage) == ("qa-long", 1)
            assert o.value == long.predict([row], batch_size=1).values[0]
        else:
            assert (o.model, o.stage, o.value) == ("qa-short", 0, value)
        assert o.arrival_s <= o.first_token_s <= o.completion_s
    assert any(o.stage == 1 for o in outcomes), "some rows escalate"
    # a duplicate is answered again, by the gear of its own arrival (SQL dedups before)
    assert outcomes[4].gear == 1 and outcomes[4].value == alone.values[4]
