"""``sem_similarity(a, b) -> DOUBLE``: how close two texts are in meaning, for retrieval.

The cosine similarity (-1..1) of the two texts' sentence embeddings from all-MiniLM-L6-v2
(packaged; trained for semantic search on question/passage pairs, mean-pooled). Each distinct
text of a call is embedded once, so a question compared with many candidate passages or table
rows costs one embedding for the question. Inputs over 128 tokens are cut to their first 128
(what the encoder was trained on): a passage is judged by its start, which names its subject.

It ranks candidates, e.g. the passage or table row a question is about::

    SELECT doc_id FROM passages
    ORDER BY sem_similarity('Who directed Jaws?', title || '. ' || text) DESC LIMIT 1

One model, no cascade (its value has no certainty to escalate on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ken.models.model import DeviceConfig, Model, ModelSpec, Output
from ken.models.resources import ENCODER_MAX_TOKENS, Resources, normalise_rows
from ken.models.transformers_backend import TransformersBody
from ken.ops.base import Bound, OpContext, Operator, Stage

ENCODER = "minilm-l6"


class SimilarityPairModel(Model):
    """Rows are ``(a, b)`` text pairs; the value is the cosine similarity of their
    embeddings (certainty 1). Blank texts have no meaning to compare: the value is None."""

    def __init__(self, body: TransformersBody, encoder: str = ENCODER) -> None:
        self.body = body
        self.device = body.device
        self.spec = ModelSpec(
            name=f"similarity-{encoder}", family="sem-similarity", backend="transformers",
            source=body.config.source, num_params=body.num_params,
            memory_bytes=body.memory_bytes, max_tokens=ENCODER_MAX_TOKENS, labels=(),
            fingerprint=f"similarity-{encoder}", num_inputs=2)

    def predict(self, texts: Sequence, batch_size: int = 32) -> Output:
        rows = [tuple(r) for r in texts]
        live = [i for i, r in enumerate(rows)
                if all(isinstance(t, str) and t.strip() for t in r)]
        distinct = sorted({t for i in live for t in rows[i]})
        values: list = [None] * len(rows)
        if distinct:
            embedded = normalise_rows(self.body.features(distinct, batch_size))
            index = {t: k for k, t in enumerate(distinct)}
            for i in live:
                a, b = rows[i]
                values[i] = float(np.dot(embedded[index[a]], embedded[index[b]]))
        return Output(values, np.ones(len(rows)))


def load_similarity(resources: Resources, device: DeviceConfig) -> Model:
    return SimilarityPairModel(resources.encoder(ENCODER, device))


class SemSimilarity(Operator):
    name = "sem_similarity"
    num_columns = 2
    constants = ()
    output_type = "double"
    doc = "cosine similarity of the two texts' sentence embeddings (MiniLM-L6), for ranking"

    def stages(self, ctx: OpContext, constants: tuple[str, ...]) -> list[Stage]:
        return [Stage(f"similarity-{ENCODER}", load_similarity)]

    def detail(self, constants: tuple[str, ...]) -> str:
        return f"cosine of {ENCODER} embeddings, inputs cut to {ENCODER_MAX_TOKENS} tokens"

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        """The one stage; calibrated, as a similarity has no threshold to calibrate."""
        return replace(super().bind(ctx, constants), calibrated=True)


OPERATOR = SemSimilarity
