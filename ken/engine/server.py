"""What serves a planned function's calls, whatever the plan's kind.

The serving manager keeps one map from function to ``Server``: the classifier ``Engine``
(``ken.engine.serving``; one engine serves every function with a gear plan on the session's
devices) or a ``GenerationEngine`` (``ken.engine.decode``; a decode server per generating
function). SQL call sites submit rows through this interface and get ``Outcome``s
(``ken.engine.outcome``) back; ``shutdown`` drains or cancels the same way for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol


class Server(Protocol):
    """A running server of one or more planned functions."""

    workers: str  # "process", "thread" or "ray": where its models run

    def submit_many(self, texts: Sequence, bulk: bool = False, operator: str | None = None
                    ) -> list[Future]:
        """Rows of ``operator``'s calls; each future resolves to an ``Outcome``. ``bulk``
        rows (an analytical chunk) are served by the plan's most accurate gear."""
        ...

    def shutdown(self, drain: bool = True) -> int:
        """Stop: with ``drain``, admitted requests finish first; the rest end ``cancelled``.
        Returns how many were cancelled."""
        ...

    def describe_serving(self, bulk_threshold: int, operator: str | None = None) -> str:
        """How it serves a query's calls (EXPLAIN), of ``operator`` where that matters."""
        ...
