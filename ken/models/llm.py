"""Causal LMs as models of the output contract: scored choices and generated text.

* :class:`ContinuationModel` answers multiple choice by likelihood (HellaSwag): each row is a
  context and its options (one per line); the value is the index of the option most likely
  to continue the context, the certainty its probability among the options.
* :class:`ChoiceModel` answers with one of a fixed set of options: each option is scored as
  the assistant's answer to a chat prompt holding the text, calibrated against content-free
  inputs so that an option the model likes whatever the text says does not win by default.
* :class:`ScoreModel` gives a number on a small integer scale: the expected value of the
  scale under a :class:`ChoiceModel`'s calibrated distribution over its points.
* :class:`GenerativeModel` generates free text for a chat prompt; the certainty is the
  length-normalised sequence probability (``mean_prob``) or its least likely token
  (``min_prob``). A ``finish(answer, row)`` callable turns the answer to a row into the SQL
  value (e.g. NULL for "none", or the span of the row's text the answer names).

How a row becomes a prompt is the operator's business: models take a ``Prompter``, a
picklable callable ``prompter(lm, row) -> token ids`` (so worker processes can rebuild
models from loaders). Rows that cannot be answered (NULL or empty input, no options) get
the value None with certainty 1: nothing to escalate. A blank context has no continuation
to score either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ken import store
from ken.errors import ModelError
from ken.models.data_text import encode_row
from ken.models.generation import (
    END_OF_TURN,
    Generation,
    generate,
    option_probabilities,
    score_options,
    special_token_ids,
)
from ken.models.model import Model, ModelSpec, Output
from ken.models.resources import CausalLM, short_hash

#: ``prompter(lm, row) -> token ids`` of the prompt (None: the row has no answer)
Prompter = Callable[[CausalLM, Any], "list[int] | None"]

#: how option scores are normalised before the choice: ``"sum"`` (log-likelihood of the
#: option), ``"bytes"`` (per byte of the option's text, as the LM evaluation harnesses'
#: ``acc_norm``), ``"tokens"`` (per token)
NORMALISATIONS = ("sum", "bytes", "tokens")

#: the content-free inputs a :class:`ChoiceModel` calibrates its option scores against
CONTENT_FREE = ("N/A", "[MASK]", "none")


def truncate_ids(ids: list[int], limit: int, side: str) -> list[int]:
    """At most ``limit`` tokens, dropping from the ``side`` ("left" keeps the end)."""
    if limit < 1:
        raise ModelError(f"a token limit must be >= 1, got {limit}")
    if len(ids) <= limit:
        return ids
    return ids[-limit:] if side == "left" else ids[:limit]


def split_options(text: Any) -> list[str]:
    """A row's options: one per non-empty line."""
    if not isinstance(text, str):
        return []
    return [line.strip() for line in text.split("\n") if line.strip()]


def _spec(name: str, family: str, lm: CausalLM, max_tokens: int, labels: tuple[str, ...],
          num_inputs: int, *key: object) -> ModelSpec:
    return ModelSpec(name=name, family=family, backend="transformers", source=lm.source,
                     num_params=lm.num_params, memory_bytes=lm.memory_bytes,
                     max_tokens=max_tokens, labels=labels,
                     fingerprint=f"{name}-{short_hash(store.content_id(lm.source), *key)}",
                     num_inputs=num_inputs)


def normalised(scores: np.ndarray, lengths: np.ndarray, normalise: str) -> np.ndarray:
    """Option scores as ``normalise`` says. Per-byte and per-token scores are put back on
    the scale of a sum (times the mean length), so probabilities from them stay comparable to
    those of ``"sum"``."""
    if normalise == "sum":
        return np.asarray(scores)
    return np.asarray(scores) / np.maximum(lengths, 1) * max(float(lengths.mean()), 1.0)


def _choose(scores: np.ndarray, lengths: np.ndarray, normalise: str) -> tuple[int, float]:
    """The chosen option and its probability among the options."""
    z = normalised(scores, lengths, normalise)
    p = option_probabilities(z)
    best = int(np.argmax(z))
    return best, float(p[best])


class ContinuationModel(Model):
    """Multiple choice by likelihood: rows are ``(context, options one per line)``; the
    value is the 0-based index of the option that most likely continues the context."""

    def __init__(self, lm: CausalLM, name: str, family: str, normalise: str = "bytes",
                 max_context_tokens: int = 256, max_option_tokens: int = 64,
                 calibrate: bool = False) -> None:
        if normalise not in NORMALISATIONS:
            raise ModelError(f"normalise must be one of {NORMALISATIONS}, not {normalise!r}")
        self.lm = lm
        self.device = lm.device
        self.normalise = normalise
        self.max_context_tokens = max_context_tokens
        self.max_option_tokens = max_option_tokens
        #: subtract each option's mean score after the content-free contexts (each row has
        #: its own options, so this costs 3 more scoring passes per row); off by default: on
        #: HellaSwag it lost accuracy (docs/results.md)
        self.calibrate = calibrate
        self.spec = _spec(name, family, lm, max_context_tokens, (), 2, normalise,
                          max_context_tokens, max_option_tokens,
                          *(("calibrated",) if calibrate else ()))

    def _encode(self, row: Any) -> tuple[list[int], list[list[int]], list[str]] | None:
        if not isinstance(row, (tuple, list)) or len(row) != 2:
            raise ModelError(f"{self.name} answers (context, options) pairs, got {row!r}")
        context, options_text = row
        options = split_options(options_text)
        if not options or not isinstance(context, str) or not context.strip():
            return None
        tok = self.lm.tokenizer
        # an over-long context keeps its end (what the options continue)
        ctx = truncate_ids(encode_row(tok, context), self.max_context_tokens, "left")
        opts = [truncate_ids(encode_row(tok, " " + o),
                             self.max_option_tokens, "right") for o in options]
        return ctx, opts, options

    def predict(self, texts: Sequence, batch_size: int = 16) -> Output:
        encoded = [self._encode(row) for row in texts]
        live = [i for i, e in enumerate(encoded) if e is not None]
        values: list[Any] = [None] * len(texts)
        certainty = np.ones(len(texts))
        if live:
            scores = score_options(self.lm, [encoded[i][0] for i in live],
                                   [encoded[i][1] for i in live], batch_size=batch_size)
            if self.calibrate:
                tok = self.lm.tokenizer
                free = [encode_row(tok, t) for t in CONTENT_FREE]
                priors = score_options(self.lm, [c for _ in live for c in free],
                                       [encoded[i][1] for i in live for _ in free],
                                       batch_size=batch_size)
                k = len(free)
                scores = [np.asarray(s) - np.mean(priors[j * k:(j + 1) * k], axis=0)
                          for j, s in enumerate(scores)]
            for i, row_scores in zip(live, scores, strict=True):
                options = encoded[i][2]
                if self.normalise == "bytes":
                    lengths = np.array([len((" " + o).encode()) for o in options], float)
                else:
                    lengths = np.array([len(t) for t in encoded[i][1]], float)
                values[i], certainty[i] = _choose(row_scores, lengths, self.normalise)
        return Output(values, certainty)


class ChoiceModel(Model):
    """One of ``options`` per row, each scored as the assistant's answer to the chat prompt
    ``prompter(lm, row)``; the value is the option text.

    With ``calibrate`` (the default) the scores are calibrated against content-free inputs
    (:data:`CONTENT_FREE`, "contextual calibration", Zhao et al., ICML 2021): each option's
    mean score when the row's text is replaced by one of them is its prior, the model's taste
    for that option whatever the text says, and is subtracted from the row's scores before
    the softmax. The prior is measured once per model (one short batched pass). The
    certainty is how far the calibrated distribution is from uniform,
    ``(p_best - 1/k) / (1 - 1/k)``: 0 when the model cannot tell the options apart, 1 when
    it is sure, on the same scale for two options or ten (so one escalation threshold means
    the same for any option list).
    """

    def __init__(self, lm: CausalLM, options: Sequence[str], prompter: Prompter, name: str,
                 family: str, prompt_version: str, normalise: str = "sum",
                 calibrate: bool = True) -> None:
        if normalise not in NORMALISATIONS:
            raise ModelError(f"normalise must be one of {NORMALISATIONS}, not {normalise!r}")
        if len(options) < 2:
            raise ModelError(f"{name} needs at least two options, got {list(options)}")
        self.lm = lm
        self.device = lm.device
        self.options = tuple(options)
        self.prompter = prompter
        self.normalise = normalise
        self.option_ids = self.encode_options()
        self.lengths = np.array([len(ids) for ids in self.option_ids], float)
        self.prior = self._prior() if calibrate else np.zeros(len(self.options))
        self.spec = _spec(name, family, lm, lm.context_tokens, self.options, 1,
                          prompt_version, normalise,
                          f"calibrated:{','.join(CONTENT_FREE)}" if calibrate else "raw")

    def encode_options(self) -> list[list[int]]:
        """The token ids each option is scored as (its text, as the assistant's answer)."""
        encode = self.lm.tokenizer.encode
        return [encode(o, add_special_tokens=False) for o in self.options]

    def _prior(self) -> np.ndarray:
        """Each option's mean (normalised) score over the content-free inputs."""
        columns = len(getattr(self.prompter, "columns", ("text",)))
        rows = [text if columns == 1 else (text,) * columns for text in CONTENT_FREE]
        prompts = [p for p in (self.prompter(self.lm, row) for row in rows) if p]
        if not prompts:
            raise ModelError(f"{self.name}'s prompt gives no prompt for the content-free inputs "
                             f"{CONTENT_FREE}: it cannot be calibrated")
        scores = score_options(self.lm, prompts, [self.option_ids] * len(prompts))
        return np.mean([normalised(s, self.lengths, self.normalise) for s in scores], axis=0)

    def option_probabilities(self, texts: Sequence, batch_size: int = 16) -> np.ndarray:
        """Each row's calibrated option distribution, ``(rows, k)``; NaN for a row with no
        prompt (NULL or blank input)."""
        prompts = [self.prompter(self.lm, t) for t in texts]
        live = [i for i, p in enumerate(prompts) if p]
        probs = np.full((len(texts), len(self.options)), np.nan)
        if live:
            scores = score_options(self.lm, [prompts[i] for i in live],
                                   [self.option_ids] * len(live), batch_size=batch_size)
            for i, row_scores in zip(live, scores, strict=True):
                probs[i] = option_probabilities(
                    normalised(row_scores, self.lengths, self.normalise) - self.prior)
        return probs

    def predict(self, texts: Sequence, batch_size: int = 16) -> Output:
        probs = self.option_probabilities(texts, batch_size)
        k = len(self.options)
        values: list[Any] = [None] * len(texts)
        certainty = np.ones(len(texts))
        for i, p in enumerate(probs):
            if np.isnan(p).any():
                continue
            best = int(np.argmax(p))
            values[i] = self.options[best]
            certainty[i] = (p[best] - 1.0 / k) / (1.0 - 1.0 / k)
        return Output(values, certainty)


def end_of_turn_id(lm: CausalLM) -> int:
    """The token that ends the assistant's turn: the chat template's end of turn, else the
    tokenizer's end of sequence."""
    turn = special_token_ids(lm, END_OF_TURN)
    if turn:
        return turn[0]
    if lm.tokenizer.eos_token_id is None:
        raise ModelError(f"{lm.source}: the tokenizer has no end-of-turn or end-of-sequence "
                         "token, so an answer that is a prefix of another cannot be scored")
    return int(lm.tokenizer.eos_token_id)


def scale_certainty(p: np.ndarray, points: np.ndarray) -> float:
    """How little a score distribution ``p`` over ``points`` lets its expected value move:
    ``1 - std / ((hi - lo) / 2)``, 1 when all mass is on one point, 0 when it is split evenly
    between the two ends (the largest spread a distribution on ``[lo, hi]`` can have)."""
    mean = float(p @ points)
    std = float(np.sqrt(max(float(p @ (points - mean) ** 2), 0.0)))
    half_range = (float(points[-1]) - float(points[0])) / 2.0
    return float(np.clip(1.0 - std / half_range, 0.0, 1.0))


class ScoreModel(ChoiceModel):
    """A score on the integer scale ``lo..hi`` per row: the expected value of the scale under
    the LM's calibrated distribution over its points.

    Each point is scored as the assistant's whole answer to ``prompter(lm, row)`` with the
    scoring and content-free calibration of :class:`ChoiceModel` (the points are its options).
    LMs here write "10" as the tokens "1", "0", so on a scale with a point whose tokens begin
    another's (0..10, 1..10) every point is scored followed by the end-of-turn token:
    otherwise "1" would also collect the probability of every answer that starts with it.

    ``score_distribution(rows)`` gives each row's distribution over the points (what
    ``predict`` averages), for callers that need more than the mean (top-k).

    The certainty is :func:`scale_certainty`, ``1 - std / ((hi - lo) / 2)`` of the row's
    distribution, rather than ChoiceModel's distance from uniform: the value is a mean, and
    what decides whether a larger LM could change it much is how spread the distribution is,
    not how much mass its single likeliest point has (mass split between 4 and 5 gives a
    dependable 4.5; mass split between 1 and 5 gives a meaningless 3).
    """

    def __init__(self, lm: CausalLM, scale: tuple[int, int], prompter: Prompter, name: str,
                 family: str, prompt_version: str, calibrate: bool = True) -> None:
        lo, hi = scale
        if not (0 <= lo < hi):
            raise ModelError(f"{name}: a score scale needs 0 <= lo < hi, got {scale}")
        self.scale = (int(lo), int(hi))
        self.points = np.arange(lo, hi + 1, dtype=np.float64)
        super().__init__(lm, [str(v) for v in range(lo, hi + 1)], prompter, name, family,
                         prompt_version, normalise="sum", calibrate=calibrate)
        # values are numbers, not labels; the scale and the answer encoding are behaviour
        self.spec = _spec(name, family, lm, lm.context_tokens, (), 1, prompt_version, "score",
                          self.scale, [len(ids) for ids in self.option_ids],
                          f"calibrated:{','.join(CONTENT_FREE)}" if calibrate else "raw")

    def encode_options(self) -> list[list[int]]:
        ids = super().encode_options()
        prefix = any(a != b and b[:len(a)] == a for a in ids for b in ids)
        if prefix:
            end = end_of_turn_id(self.lm)
            ids = [i + [end] for i in ids]
        return ids

    def score_distribution(self, texts: Sequence, batch_size: int = 16) -> np.ndarray:
        """Each row's calibrated distribution over the scale's points ``lo..hi``,
        ``(rows, hi - lo + 1)``; NaN for a row with no prompt (NULL or blank input)."""
        return self.option_probabilities(texts, batch_size)

    def predict(self, texts: Sequence, batch_size: int = 16) -> Output:
        probs = self.score_distribution(texts, batch_size)
        values: list[Any] = [None] * len(texts)
        certainty = np.ones(len(texts))
        for i, p in enumerate(probs):
            if np.isnan(p).any():
                continue
            values[i] = float(p @ self.points)
            certainty[i] = scale_certainty(p, self.points)
        return Output(values, certainty)


class GenerativeModel(Model):
    """Free text for the chat prompt ``prompter(lm, row)``, greedy, at most
    ``max_new_tokens`` tokens; ``finish(text, row)`` gives the value (None: no answer)."""

    def __init__(self, lm: CausalLM, prompter: Prompter, name: str, family: str,
                 prompt_version: str, max_new_tokens: int = 32, stop: Sequence[str] = (),
                 certainty: str = "mean_prob",
                 finish: Callable[[str, Any], Any] | None = None, num_inputs: int = 1
                 ) -> None:
        self.lm = lm
        self.device = lm.device
        self.prompter = prompter
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(stop)
        self.certainty_kind = certainty
        self.finish = finish
        self.spec = _spec(name, family, lm, lm.context_tokens, (), num_inputs,
                          prompt_version, max_new_tokens, self.stop, certainty)

    def requests(self, texts: Sequence) -> list[list[int] | None]:
        """Each row's prompt (token ids), or None for a row with no answer."""
        return [self.prompter(self.lm, t) or None for t in texts]

    def predict(self, texts: Sequence, batch_size: int = 8) -> Output:
        """Static batching: ``batch_size`` rows at a time, each batch until its longest
        answer ends (``ken.engine.decode.generate_rows`` is the continuous alternative)."""
        prompts = self.requests(texts)
        live = [i for i, p in enumerate(prompts) if p]
        answers = generate(self.lm, [prompts[i] for i in live], self.max_new_tokens,
                           self.stop, batch_size=batch_size) if live else []
        return self.output(texts, live, answers)

    def value(self, text: str, row: Any) -> Any:
        """The value of the answer ``text`` to ``row``."""
        return self.finish(text, row) if self.finish else text

    def output(self, rows: Sequence, live: Sequence[int], answers: Sequence[Generation]
               ) -> Output:
        """The output for ``rows``, of which those at ``live`` got the ``answers``."""
        n = len(rows)
        values: list[Any] = [None] * n
        certainty = np.ones(n)
        tokens = np.zeros(n, dtype=np.int64)
        logprobs: list[np.ndarray] = [np.zeros(0)] * n
        for i, g in zip(live, answers, strict=True):
            values[i] = self.value(g.text, rows[i])
            certainty[i] = g.certainty(self.certainty_kind)
            tokens[i] = g.num_tokens
            logprobs[i] = np.asarray(g.logprobs)
        return Output(values, certainty, token_counts=tokens, logprobs=tuple(logprobs))
