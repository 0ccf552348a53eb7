"""The models of ``sem_filter``: a similarity stage and two LLM stages, each answering "does
the text satisfy the predicate" with ``P(true)`` (a ``Prediction`` over ``("false", "true")``).

- :class:`SimilarityModel` (MiniLM cost): ``sigmoid(scale * (cos(text, predicate) - offset))``;
- :class:`ChannelLLMModel` (SmolLM2, the default second stage): does the predicate make the
  text more likely;
- :class:`YesNoLLMModel`: the model asked yes or no (near chance at 135M parameters).

Their names carry a hash of the predicate and parameters (:func:`similarity_name`,
:func:`channel_name`), known before a model is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from ken import store
from ken.errors import ModelError
from ken.models.data_text import defuse, encode_rows
from ken.models.llm import ChoiceModel
from ken.models.model import BOOLEAN_LABELS, Model, ModelSpec, Prediction
from ken.models.resources import (
    CausalLM,
    boolean_probabilities,
    normalise_rows,
    short_hash,
    sigmoid,
)
from ken.models.transformers_backend import TransformersBody
from ken.ops.prompts import SEM_FILTER_CHOICE, ChatPrompt

FAMILY = "sem-filter"
SHORT_NAMES = {"minilm-l3": "l3", "minilm-l6": "l6"}

# Uncalibrated defaults, read off all-MiniLM-L6-v2 cosine similarities between short predicates
# and texts: texts on the predicate's topic mostly score 0.2-0.7, unrelated texts -0.1-0.15, and
# texts that share words but not meaning (a punctual flight for "complains about a flight
# delay") 0.25-0.35. The sigmoid is centred in that gap; threshold 0.8 escalates rows with
# |sim - 0.22| < logit(0.8) / 15 ~ 0.09, i.e. similarities in about [0.13, 0.31].
DEFAULT_SCALE = 15.0
DEFAULT_OFFSET = 0.22
DEFAULT_THRESHOLD = 0.80
# The channel stage's log-likelihood ratio is in nats; 0 is its Bayes boundary (see
# ChannelLLMModel) and a scale of 0.5 keeps a 1-nat margin from looking certain.
CHANNEL_SCALE = 0.5
CHANNEL_OFFSET = 0.0

# SmolLM2's answer starts right after "<|im_start|>assistant\n", where it writes "Yes"/"No"
# without a leading space; lower-case and space-prefixed spellings also carry probability (and
# other templates or models prefer them). Summing over every single-token spelling measures
# "the answer is yes" independent of surface form; multi-token spellings ("YES" is "Y" + "ES")
# are left out because their first token does not identify the answer.
YES_SPELLINGS = ("Yes", "yes", " Yes", " yes", "YES", " YES")
NO_SPELLINGS = ("No", "no", " No", " no", "NO", " NO")
SYSTEM_PROMPT = ("You judge whether a statement is true of a text. "
                 "Answer with a single word: Yes or No.")
TEXT_MARKER = "\x00KEN-TEXT\x00"


def similarity_name(predicate: str, encoder: str, scale: float = DEFAULT_SCALE,
                    offset: float = DEFAULT_OFFSET) -> str:
    """The name of a :class:`SimilarityModel` (without loading it)."""
    key = short_hash(predicate, encoder, round(float(scale), 6), round(float(offset), 6))
    return f"sim-{SHORT_NAMES.get(encoder, encoder)}[{key}]"


def channel_name(predicate: str, lm_name: str = "smollm2-135m", max_text_tokens: int = 128,
                 scale: float = CHANNEL_SCALE, offset: float = CHANNEL_OFFSET) -> str:
    """The name of a :class:`ChannelLLMModel` whose texts keep ``max_text_tokens`` tokens
    (the default unless the predicate fills the LM's context)."""
    key = short_hash(predicate, lm_name, max_text_tokens, round(float(scale), 6),
                     round(float(offset), 6))
    return f"channel-{lm_name.split('-')[0]}[{key}]"


class SimilarityModel(Model):
    """``P(true) = sigmoid(scale * (cos(embed(text), embed(predicate)) - offset))``.

    The predicate is embedded once, here; ``predict`` embeds only the texts.
    """

    def __init__(self, body: TransformersBody, predicate: str, scale: float = DEFAULT_SCALE,
                 offset: float = DEFAULT_OFFSET, name: str | None = None,
                 encoder: str = "minilm-l6") -> None:
        self.body = body
        self.predicate = predicate
        self.scale = float(scale)
        self.offset = float(offset)
        self.device = body.device
        self.query = normalise_rows(body.features([predicate], 1))[0].astype(np.float64)
        short = SHORT_NAMES.get(encoder, encoder)
        key = short_hash(predicate, encoder, round(self.scale, 6), round(self.offset, 6))
        self.spec = ModelSpec(
            name=name or similarity_name(predicate, encoder, self.scale, self.offset),
            family=FAMILY, backend="transformers",
            source=body.config.source, num_params=body.num_params,
            memory_bytes=body.memory_bytes, max_tokens=body.max_tokens, labels=BOOLEAN_LABELS,
            fingerprint=f"sim-{short}-{short_hash(key, store.content_id(body.config.source))}",
        )

    def similarity(self, texts: Sequence[str], batch_size: int = 32,
                   on_batch: Callable[[int], None] | None = None) -> np.ndarray:
        """Cosine similarity of each text to the predicate, float64, in input order."""
        features = self.body.features(list(texts), batch_size, on_batch)
        return normalise_rows(features).astype(np.float64) @ self.query

    def probabilities(self, similarities: np.ndarray) -> np.ndarray:
        return boolean_probabilities(sigmoid(self.scale * (similarities - self.offset)))

    def predict(self, texts: Sequence[str], batch_size: int = 32) -> Prediction:
        probs = self.probabilities(self.similarity(texts, batch_size))
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, BOOLEAN_LABELS)


class YesNoLLMModel(Model):
    """SmolLM2 asked whether the predicate is true of the text; ``P(true)`` from yes vs no.

    The prompt (chat template, system prompt, then ``Text:`` and the question) is tokenized once
    around a marker, so each row only tokenizes its own text, truncated to
    ``max_text_tokens``. ``P(true) = softmax(log P(yes), log P(no))[yes]``, shifted by
    ``log_odds_offset`` (0 unless a caller corrects the model's prior towards "no").

    Measured here: zero-shot, this 135M model (de-quantised from 4 bits) separates true from
    false rows no better than chance (ROC AUC 0.41-0.58 on small synthetic topical and
    sentiment sets, 0.45 and 0.57 on 200 tweets for "is about air travel" and "expresses a
    negative opinion"; other prompt layouts did no better), and it answers "no" to most
    questions. Kept for larger instruction-tuned models; not the default stage.
    """

    def __init__(self, lm: CausalLM, predicate: str, max_text_tokens: int = 128,
                 log_odds_offset: float = 0.0, name: str | None = None,
                 lm_name: str = "smollm2-135m") -> None:
        if max_text_tokens < 1:
            raise ModelError(f"max_text_tokens must be at least 1, got {max_text_tokens}")
        self.lm = lm
        self.predicate = predicate
        self.max_text_tokens = int(max_text_tokens)
        self.log_odds_offset = float(log_odds_offset)
        self.device = lm.device
        self.prefix_ids, self.suffix_ids = self._prompt_ids(lm, predicate)
        self.yes_ids = lm.single_token_ids(YES_SPELLINGS)
        self.no_ids = lm.single_token_ids(NO_SPELLINGS)
        if not self.yes_ids or not self.no_ids:
            raise ModelError(f"{lm.source}: its tokenizer has no single-token 'yes'/'no'; "
                             "use another language model for sem_filter")
        room = lm.context_tokens - len(self.prefix_ids) - len(self.suffix_ids)
        if room < 1:
            raise ModelError("the sem_filter predicate is longer than the language model's "
                             "context; shorten the predicate")
        self.max_text_tokens = min(self.max_text_tokens, room)
        short = lm_name.split("-")[0]
        key = short_hash(predicate, lm_name, self.max_text_tokens, round(self.log_odds_offset, 6))
        self.spec = ModelSpec(
            name=name or f"yesno-{short}[{key}]", family=FAMILY, backend="transformers",
            source=lm.source, num_params=lm.num_params, memory_bytes=lm.memory_bytes,
            max_tokens=len(self.prefix_ids) + self.max_text_tokens + len(self.suffix_ids),
            labels=BOOLEAN_LABELS,
            fingerprint=f"yesno-{short}-{short_hash(key, store.content_id(lm.source))}",
        )

    @staticmethod
    def _prompt_ids(lm: CausalLM, predicate: str) -> tuple[list[int], list[int]]:
        # The text goes on its own line after "Text:\n", so the prefix ends in a newline token
        # and the text's first word is tokenized as it would be at a line start.
        question = (f"Text:\n{TEXT_MARKER}\n\nQuestion: is the following true of the text: "
                    f"{defuse(predicate, lm.tokenizer)}? Answer yes or no.")
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": question}]
        try:
            rendered = lm.tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=True)
        except (ValueError, AttributeError) as exc:
            raise ModelError(f"{lm.source} has no chat template; sem_filter needs an "
                             f"instruction-tuned model: {exc}") from exc
        before, after = rendered.split(TEXT_MARKER)
        encode = lm.tokenizer.encode
        return (encode(before, add_special_tokens=False),
                encode(after, add_special_tokens=False))

    def prompt_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """The full prompt of every text, its text truncated to ``max_text_tokens`` tokens."""
        if not texts:
            return []
        ids = encode_rows(self.lm.tokenizer, texts, add_special_tokens=False, truncation=True,
                          max_length=self.max_text_tokens)
        return [self.prefix_ids + list(row) + self.suffix_ids for row in ids]

    def log_odds(self, texts: Sequence[str], batch_size: int = 8) -> np.ndarray:
        """``log P(yes) - log P(no)`` of the next token, per text, before the offset."""
        scores = self.lm.next_token_scores(self.prompt_ids(texts), [self.yes_ids, self.no_ids],
                                           batch_size)
        return scores[:, 0] - scores[:, 1]

    def predict(self, texts: Sequence[str], batch_size: int = 8) -> Prediction:
        probs = boolean_probabilities(sigmoid(self.log_odds(texts, batch_size)
                                              - self.log_odds_offset))
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, BOOLEAN_LABELS)


class ChannelLLMModel(Model):
    """SmolLM2 as a *noisy channel*: does the predicate make the text more likely?

    Scores ``pmi = log P(text | "Here is a text that <predicate>:") - log P(text | "Here is a
    text:")`` (two forward passes per row, batched together), and ``P(true) = sigmoid(scale *
    (pmi - offset))``. By Bayes' rule the pmi is the log-likelihood ratio of the predicate
    given the text, so 0 is a principled uncalibrated boundary. Scoring how well the text fits
    the predicate, instead of asking the model to answer a question about it, is what works for
    small LMs (Min et al., ACL 2022, "Noisy Channel Language Model Prompting"): measured here
    it reaches ROC AUC 0.99 / 0.89 on small synthetic topical sets and 0.72 on 200 tweets ("is
    about air travel") where the yes/no question is at chance (0.47 / 0.58 / 0.45). Like the
    similarity stage it is weak on sentiment ("expresses a negative opinion": 0.58).
    """

    def __init__(self, lm: CausalLM, predicate: str, max_text_tokens: int = 128,
                 scale: float = CHANNEL_SCALE, offset: float = CHANNEL_OFFSET,
                 name: str | None = None, lm_name: str = "smollm2-135m") -> None:
        if max_text_tokens < 1:
            raise ModelError(f"max_text_tokens must be at least 1, got {max_text_tokens}")
        self.lm = lm
        self.predicate = predicate
        self.scale = float(scale)
        self.offset = float(offset)
        self.device = lm.device
        encode = lm.tokenizer.encode
        self.context_ids = encode(f"Here is a text that {predicate}:\n", add_special_tokens=False)
        self.neutral_ids = encode("Here is a text:\n", add_special_tokens=False)
        room = lm.context_tokens - len(self.context_ids)
        if room < 1:
            raise ModelError("the sem_filter predicate is longer than the language model's "
                             "context; shorten the predicate")
        self.max_text_tokens = min(int(max_text_tokens), room)
        short = lm_name.split("-")[0]
        key = short_hash(predicate, lm_name, self.max_text_tokens, round(self.scale, 6),
                         round(self.offset, 6))
        self.spec = ModelSpec(
            name=name or channel_name(predicate, lm_name, self.max_text_tokens, self.scale,
                                      self.offset),
            family=FAMILY, backend="transformers",
            source=lm.source, num_params=lm.num_params, memory_bytes=lm.memory_bytes,
            max_tokens=len(self.context_ids) + self.max_text_tokens, labels=BOOLEAN_LABELS,
            fingerprint=f"channel-{short}-{short_hash(key, store.content_id(lm.source))}",
        )

    def pmi(self, texts: Sequence[str], batch_size: int = 8) -> np.ndarray:
        """``log P(text | predicate context) - log P(text | neutral context)`` per text."""
        if not texts:
            return np.zeros(0)
        ids = encode_rows(self.lm.tokenizer, texts, add_special_tokens=False, truncation=True,
                          max_length=self.max_text_tokens)
        n = len(ids)
        scores = self.lm.continuation_logprobs([self.context_ids] * n + [self.neutral_ids] * n,
                                               list(ids) * 2, batch_size)
        return scores[:n] - scores[n:]

    def predict(self, texts: Sequence[str], batch_size: int = 8) -> Prediction:
        probs = boolean_probabilities(sigmoid(self.scale * (self.pmi(texts, batch_size)
                                                            - self.offset)))
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, BOOLEAN_LABELS)


class ChoiceFilterModel(Model):
    """The predicate as a two-option choice, "yes" or "no", scored by a calibrated
    :class:`~ken.models.llm.ChoiceModel` (prompt ``sem_filter_choice/v1``): ``P(true)`` is the
    probability of "yes" after each option's score on content-free inputs is subtracted, so a
    model that says "no" to everything (Qwen2.5-Coder-0.5B asked yes/no, ``YesNoLLMModel``)
    does not answer false by default. NULL or blank texts get ``P(true) = 0.5``.

    ``prompt`` (a template with a ``{predicate}`` field), ``family`` and ``num_inputs`` let
    another yes/no question use the same scoring (``sem_join``'s pair question)."""

    def __init__(self, lm: CausalLM, predicate: str, lm_name: str = "qwen2.5-coder-0.5b",
                 name: str | None = None, prompt: ChatPrompt = SEM_FILTER_CHOICE,
                 family: str = FAMILY, num_inputs: int = 1) -> None:
        self.lm = lm
        self.predicate = predicate
        self.device = lm.device
        short = lm_name.split("-")[0]
        key = short_hash(predicate, lm_name, prompt.key)
        self.choice = ChoiceModel(lm, ("yes", "no"),
                                  prompt.with_constants({"predicate": predicate}),
                                  name or f"choice-{short}[{key}]", family, prompt.key)
        self.spec = replace(self.choice.spec, labels=BOOLEAN_LABELS, num_inputs=num_inputs)

    def predict(self, texts: Sequence[str], batch_size: int = 8) -> Prediction:
        p = self.choice.option_probabilities(list(texts), batch_size)
        p_true = np.where(np.isnan(p[:, 0]), 0.5, p[:, 0])
        probs = boolean_probabilities(p_true)
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, BOOLEAN_LABELS)


#: the LLM stages ``bind_sem_filter(llm=...)`` offers: (how it scores, which language model)
LLM_STAGES: dict[str, tuple[type[YesNoLLMModel] | type[ChannelLLMModel]
                            | type[ChoiceFilterModel], str]] = {
    "channel": (ChannelLLMModel, "smollm2-135m"),
    "yesno": (YesNoLLMModel, "smollm2-135m"),
    "yesno-qwen": (YesNoLLMModel, "qwen2.5-coder-0.5b"),
    "choice-qwen": (ChoiceFilterModel, "qwen2.5-coder-0.5b"),
}

LLMModel = YesNoLLMModel | ChannelLLMModel | ChoiceFilterModel
