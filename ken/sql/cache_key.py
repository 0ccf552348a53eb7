"""What a cached answer depends on besides its input: the namespace of a call site's answers in
the result cache (``ken.cache``).

Two calls share answers only when they share all of: the operator and its constant arguments;
the output type; the cascade run in-process (models, exact thresholds, certainty) with the
bound's description (which names a trained head and how it was calibrated), or, for a site an
online engine serves, the gear plan; the content fingerprint and precision of every model the
bound holds; and the code of ken itself (a hash of the package's source files, so an upgrade or
a local change never serves answers an older implementation gave).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ken import store
from ken.ops.base import Bound


@dataclass(frozen=True)
class Namespace:
    """A call site's answers in the cache: ``id`` keys them, ``description`` names them in
    ``ken cache stats``."""

    id: str
    operator: str
    description: str


@functools.cache
def code_fingerprint() -> str:
    """A hash of every source file of the ``ken`` package (read once per process)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def model_fingerprint(model: object) -> str:
    """What identifies a model's answers: its spec's content fingerprint (else its name and its
    folder's content id) and the precision it runs at."""
    spec = getattr(model, "spec", None)
    if spec is None:
        return type(model).__qualname__
    ident = spec.fingerprint or f"{spec.name}:{store.content_id(spec.source)}"
    device = getattr(model, "device", None)
    precision = getattr(device, "dtype_name", "")
    return f"{ident}@{precision}" if precision else ident


def namespace(function: str, constants: tuple[str, ...], bound: Bound,
              plan_json: str | None = None) -> Namespace:
    """The namespace of the answers of ``function(..., *constants)`` run by ``bound`` (or, when
    ``plan_json`` is given, by the online engine serving that plan)."""
    models = {name: model_fingerprint(m) for name, m in sorted(bound.models.items())}
    parts = {
        "function": function,
        "constants": list(constants),
        "output": bound.output_type,
        "runs": plan_json if plan_json is not None else bound.cascade.to_json(),
        "bound": bound.describe(),
        "models": models,
        "code": code_fingerprint(),
    }
    ident = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    args = ", ".join(repr(c) for c in constants)
    how = "a served gear plan" if plan_json is not None else bound.cascade.describe()
    return Namespace(ident, function, f"{function}(..{', ' + args if args else ''}) by {how}")
