"""``sentiment(text) -> VARCHAR``: negative / neutral / positive, by the minilm-sentiment cascade.

Candidates: the packaged family (MiniLM-L3, MiniLM-L6, SmolLM2-135M with trained heads,
``ken.models.family``). Evaluation sample: the family's held-out tweets (accuracy). The cascade
a query runs is the user's (``session.sentiment_cascade = ken.Cascade(...)``) or, by default,
the cheapest Pareto cascade at least as accurate as the best single model, chosen from the
profiles by the session's cascade chooser (the optimizer; operators know nothing of it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ken.errors import KenError
from ken.models import family
from ken.models.cascade import Cascade
from ken.models.datasets import LabelledSample
from ken.models.model import DeviceConfig, Model
from ken.models.quality import EvalSample
from ken.models.resources import Resources
from ken.ops.base import Bound, ClassifierBinding, OpContext, Operator, Stage
from ken.ops.training import Trained, TrainingData


def family_data(ctx: OpContext, op: Any = None) -> family.FamilyData:
    """The data ``op``'s family trains on: the user's (``session.train``), the session's, or
    the default (``family.default_data``)."""
    return getattr(op, "data", None) or ctx.data or family.default_data()


def family_models(ctx: OpContext, data: family.FamilyData | None = None) -> dict[str, Model]:
    """The minilm-sentiment models on the session's device, prepared on first use and loaded
    once per session (per training data)."""
    data = data or family_data(ctx)

    def load() -> dict[str, Model]:
        family.prepare(data, ctx.device, home=ctx.home, reporter=ctx.reporter)
        return dict(family.load_models(data, ctx.device, home=ctx.home))

    return ctx.resource(f"family-models-{data.tag}", load)


def load_member(resources: Resources, device: DeviceConfig, card: family.ModelCard,
                data: family.FamilyData) -> Model:
    return family.load_model(card, device, resources.home, data)


class Sentiment(Operator):
    name = "sentiment"
    num_columns = 1
    constants = ()
    output_type = "varchar"
    doc = "negative / neutral / positive, by the minilm-sentiment cascade"

    def __init__(self) -> None:
        self.cascade: Cascade | None = None  # the user's choice; None: chosen from profiles
        self.data: family.FamilyData | None = None  # set by train(): the user's labels
        self.trained: Trained | None = None

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        models = family_models(ctx, family_data(ctx, self))
        chosen = ctx.choose_cascade(self, self.cascade)
        return ClassifierBinding(self.name, chosen.cascade, models,
                                 stage_fractions=chosen.stage_fractions,
                                 expected_accuracy=chosen.accuracy,
                                 cost_ms_per_row=chosen.cost_ms_per_row,
                                 trained=self.trained.describe() if self.trained else "")

    def eval_sample(self, ctx: OpContext) -> EvalSample:
        return family.heldout_sample(family_data(ctx, self)).as_eval()

    def plannable(self) -> bool:
        return True

    def eval_description(self) -> str:
        if self.trained is not None:
            return f"the held-out fifth of {self.trained.data}, accuracy"
        return "the family's held-out rows (3 classes), accuracy"

    def train(self, ctx: OpContext, data: TrainingData, *,
              models: tuple[str, ...] = family.MEMBER_NAMES, **options: Any) -> Trained:
        """Fine-tune the family's members on the user's labelled texts (one text column, two
        or more classes; a fifth held out to measure them). Cached by the rows' content hash:
        the same rows train once."""
        if options:
            raise KenError(f"sentiment training takes no option {', '.join(options)}")
        if len(data.columns) != 1:
            raise KenError(f"sentiment() reads one text column; {data.source} gives "
                           f"{len(data.columns)} ({', '.join(data.columns)})")
        data.need_classes(2)
        classes = data.classes
        index = {c: i for i, c in enumerate(classes)}
        rows = LabelledSample(data.source, data.texts[0],
                              np.array([index[v] for v in data.labels], dtype=np.int64),
                              classes)
        fam = family.FamilyData.from_rows(rows, members=tuple(models))
        cards = family.prepare(fam, ctx.device, home=ctx.home, reporter=ctx.reporter)
        scores = ", ".join(f"{c.name} {c.heldout_accuracy:.1%}" for c in cards)
        self.data = fam
        self.trained = Trained(self.name, data.describe(), data.content_hash,
                               f"validation accuracy on {fam.num_test} held-out rows: {scores}",
                               str(family.family_dir(fam, ctx.home)))
        return self.trained

    def stages(self, ctx: OpContext, constants: tuple[str, ...]) -> list[Stage]:
        """The family's members (trained on the user's labels once ``train`` ran), prepared
        on first use."""
        data = family_data(ctx, self)
        family.prepare(data, ctx.device, home=ctx.home, reporter=ctx.reporter)
        return [Stage(c.name, load_member, (c, data)) for c in family.load_cards(data, ctx.home)]

    def candidates(self, ctx: OpContext, device: DeviceConfig) -> Mapping[str, Model]:
        """On the session's device, the models the session already loaded."""
        if device == ctx.device:
            return family_models(ctx, family_data(ctx, self))
        return super().candidates(ctx, device)


OPERATOR = Sentiment
