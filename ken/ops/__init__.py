"""The semantic operators, one module each, behind one interface (``ken.ops.base``).

Registration is this list: a module named here defines ``OPERATOR``, an ``Operator`` subclass
that a session instantiates (each session gets its own instances, so a user's choices, such as
``session.sentiment_cascade``, stay in that session). Modules are imported on first use. What
the operators keep in the model store (``Operator.store_entries``) is gathered over the same
list (:func:`store_entries`), so ``ken store`` needs no list of its own.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ken import store
from ken.ops.base import Operator

BUILTIN_MODULES = ("sentiment", "sem_filter", "sem_match", "sem_classify", "sem_choice",
                   "sem_score", "sem_complete", "sem_qa", "sem_extract", "sem_map",
                   "sem_agg", "sem_similarity", "sem_join")


def builtin_operators() -> dict[str, Operator]:
    """A fresh instance of every built-in operator, by SQL name."""
    out: dict[str, Operator] = {}
    for module in BUILTIN_MODULES:
        op = importlib.import_module(f"ken.ops.{module}").OPERATOR()
        out[op.name] = op
    return out


def store_entries(home: Path) -> list[tuple[str, store.Entry]]:
    """``(kind, entry)`` for everything the built-in operators keep in the model store at
    ``home`` (matchers and heads trained on a user's labels, ...), in registry order."""
    return [item for op in builtin_operators().values() for item in op.store_entries(home)]
