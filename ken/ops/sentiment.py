"""``sentiment(text) -> VARCHAR``: negative / neutral / positive, by the minilm-sentiment cascade.

Candidates: the packaged family (MiniLM-L3, MiniLM-L6, SmolLM2-135M with trained heads,
``ken.models.family``). Evaluation sample: the family's held-out tweets (accuracy). The cascade
a query runs is the user's (``session.sentiment_cascade = ken.Cascade(...)``) or, by default,
the cheapest Pareto cascade at least as accurate as the best single model, chosen from the
profiles by the session's cascade chooser (the optimizer; operators know nothing of it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from ken.models import family
from ken.models.cascade import Cascade
from ken.models.model import DeviceConfig, Model
from ken.models.quality import EvalSample
from ken.ops.base import Bound, ClassifierBinding, OpContext, Operator


def family_data(ctx: OpContext) -> family.FamilyData:
    return ctx.data or family.FamilyData()


def family_models(ctx: OpContext) -> dict[str, Model]:
    """The minilm-sentiment models on the session's device, prepared on first use and loaded
    once per session."""

    def load() -> dict[str, Model]:
        data = family_data(ctx)
        family.prepare(data, ctx.device, home=ctx.home, reporter=ctx.reporter)
        return dict(family.load_models(data, ctx.device, home=ctx.home))

    return ctx.resource("family-models", load)


class Sentiment(Operator):
    name = "sentiment"
    num_columns = 1
    constants = ()
    output_type = "varchar"
    doc = "negative / neutral / positive, by the minilm-sentiment cascade"

    def __init__(self) -> None:
        self.cascade: Cascade | None = None  # the user's choice; None: chosen from profiles

    def bind(self, ctx: OpContext, constants: tuple[str, ...]) -> Bound:
        models = family_models(ctx)
        chosen = ctx.choose_cascade(self, self.cascade)
        return ClassifierBinding("sentiment", chosen.cascade, models,
                                 stage_fractions=chosen.stage_fractions,
                                 expected_accuracy=chosen.accuracy)

    def eval_sample(self, ctx: OpContext) -> EvalSample:
        return family.heldout_sample(family_data(ctx)).as_eval()

    def plannable(self) -> bool:
        return True

    def eval_description(self) -> str:
        return "the family's held-out tweets (3 classes), accuracy"

    def candidates(self, ctx: OpContext, device: DeviceConfig) -> Mapping[str, Model]:
        if device == ctx.device:
            return family_models(ctx)
        data = family_data(ctx)
        family.prepare(data, ctx.device, home=ctx.home, reporter=ctx.reporter)
        return dict(family.load_models(data, device, home=ctx.home))

    def loaders(self, ctx: OpContext, threads: int) -> Mapping[str, Callable[[], Model]]:
        data = family_data(ctx)
        family.prepare(data, ctx.device, home=ctx.home, reporter=ctx.reporter)
        device = DeviceConfig(threads=threads)
        return {c.name: functools.partial(family.load_model, c, device, ctx.home, data)
                for c in family.load_cards(data, ctx.home)}


OPERATOR = Sentiment
