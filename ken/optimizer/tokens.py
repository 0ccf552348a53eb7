"""Token-level cost of a generating model: what the simulator charges for each forward pass.

A generating request costs one *prefill* pass over its prompt (which also yields its first
token) and one *decode* pass per further token, shared with every request running beside it.
On this kind of hardware a pass costs about

    prefill(batch, tokens) = a + b * batch + c * batch * tokens     (tokens: the padded prompt)
    decode(batch, width)   = a + b * batch + c * batch * width      (width: the padded cache)

:func:`measure_token_cost` times real passes of ``ken.models.generation.DecodeBatch`` on a grid
of batch sizes and lengths; :meth:`TokenCost.fit` fits the coefficients by non-negative least
squares and keeps the measured points and the fit's worst relative error beside them. Memory is
the weights plus the KV cache: ``kv_bytes_per_token`` per cache slot (2 x layers x KV heads x
head size x bytes per value), and the padded cache holds rows x width slots.

Measurements are cached as JSON under ``KEN_HOME/profiles/tokens-<model>-<hash>.json``, keyed by
the model's fingerprint, the hardware and the grid.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ken import store
from ken.errors import ProfileError, StoreError
from ken.machine import OtherLoad, least_loaded
from ken.optimizer.profile import hardware_fingerprint
from ken.paths import ken_home
from ken.progress import QUIET, Reporter

if TYPE_CHECKING:
    from ken.models.resources import CausalLM

SCHEMA_VERSION = 2  # 2: other_cores
Point = tuple[int, int, float]  # (batch, tokens or width, seconds)


def _fit(points: Sequence[Point]) -> tuple[float, float, float]:
    """Non-negative least squares of ``a + b * batch + c * batch * length`` on the points."""
    from scipy.optimize import nnls

    if len(points) < 3:
        raise ProfileError(f"need at least 3 timed passes to fit a cost, got {len(points)}")
    x = np.array([[1.0, b, b * n] for b, n, _ in points])
    y = np.array([t for _, _, t in points])
    # relative error matters (small passes as much as big ones): weight each row by 1 / time
    w = 1.0 / np.maximum(y, 1e-9)
    coef, _ = nnls(x * w[:, None], y * w)
    return float(coef[0]), float(coef[1]), float(coef[2])


def _worst_error(points: Sequence[Point], coef: tuple[float, float, float]) -> float:
    a, b, c = coef
    return max(abs(a + b * bs + c * bs * n - t) / t for bs, n, t in points)


@dataclass(frozen=True)
class TokenCost:
    """Seconds per prefill and decode pass of one model on one hardware configuration."""

    model: str
    hardware: str
    prefill_points: tuple[Point, ...]
    decode_points: tuple[Point, ...]
    prefill_coef: tuple[float, float, float]
    decode_coef: tuple[float, float, float]
    weights_bytes: int
    kv_bytes_per_token: int
    prefill_error: float = 0.0  # worst relative error of the fit on the measured points
    decode_error: float = 0.0
    #: cores other programs kept busy while it was measured (``ken.machine.OtherLoad``;
    #: None: not measured, or not readable here)
    other_cores: float | None = None

    @classmethod
    def fit(cls, model: str, hardware: str, prefill_points: Sequence[Point],
            decode_points: Sequence[Point], weights_bytes: int,
            kv_bytes_per_token: int) -> TokenCost:
        pre = _fit(prefill_points)
        dec = _fit(decode_points)
        return cls(model, hardware, tuple(map(tuple, prefill_points)),
                   tuple(map(tuple, decode_points)), pre, dec, int(weights_bytes),
                   int(kv_bytes_per_token), _worst_error(prefill_points, pre),
                   _worst_error(decode_points, dec))

    def prefill_s(self, batch: int, tokens: int) -> float:
        """One prefill pass of ``batch`` prompts padded to ``tokens``."""
        a, b, c = self.prefill_coef
        return a + b * batch + c * batch * tokens

    def decode_s(self, batch: int, width: int) -> float:
        """One decode pass of ``batch`` rows over a cache padded to ``width``."""
        a, b, c = self.decode_coef
        return a + b * batch + c * batch * width

    def kv_bytes(self, rows: int, width: int) -> int:
        return rows * width * self.kv_bytes_per_token

    def kv_budget_tokens(self, memory_bytes: int) -> int:
        """Cache slots that fit in ``memory_bytes`` beside the weights (0: none)."""
        free = memory_bytes - self.weights_bytes
        return max(0, free // max(1, self.kv_bytes_per_token))

    def to_json(self) -> str:
        return json.dumps({"schema_version": SCHEMA_VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TokenCost:
        data = json.loads(text)
        if data.pop("schema_version", None) != SCHEMA_VERSION:
            raise ProfileError("token cost written by another version of ken; measure again")
        for key in ("prefill_points", "decode_points"):
            data[key] = tuple(tuple(p) for p in data[key])
        for key in ("prefill_coef", "decode_coef"):
            data[key] = tuple(data[key])
        return cls(**data)


def kv_bytes_per_token(lm: CausalLM) -> int:
    """Bytes of one token's keys and values in every layer (the cache's dtype is the model's)."""
    cfg = lm.net.config
    layers = int(cfg.num_hidden_layers)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    itemsize = next(lm.net.parameters()).element_size()
    return 2 * layers * heads * head_dim * itemsize


def random_prompts(lm: CausalLM, batch: int, tokens: int, rng: np.random.Generator
                    ) -> list[list[int]]:
    special = set(lm.tokenizer.all_special_ids)
    vocab = int(lm.tokenizer.vocab_size)
    out = []
    for _ in range(batch):
        ids = [int(t) for t in rng.integers(100, vocab, size=tokens * 2) if int(t) not in special]
        out.append(ids[:tokens])
    return out


def measure_token_cost(lm: CausalLM, model: str, batches: Sequence[int] = (1, 4, 8),
                       lengths: Sequence[int] = (32, 128, 256), decode_steps: int = 6,
                       repeats: int = 2, reporter: Reporter = QUIET, attempts: int = 3,
                       other_load: Callable[[], OtherLoad] = OtherLoad) -> TokenCost:
    """Time prefill passes for every (batch, prompt length) and decode passes for every
    (batch, cache width) of the grid on ``lm``'s device; the median of ``repeats`` runs.

    While it times them, ``other_load`` reads how many cores other programs kept busy; at
    ``machine.BUSY_CORES`` or more it times the grid again, up to ``attempts`` times in all,
    and keeps the cost measured beside the least other load, with a warning when every
    attempt was busy (a cost measured beside a test run made ``ken demo``'s simulated time to
    first token 16x the engine's). The reading is kept in ``other_cores``."""
    if not batches or not lengths or min(batches) < 1 or min(lengths) < 1:
        raise ProfileError("batch sizes and lengths must be positive")

    def measure(attempt: int) -> TokenCost:
        return _time_passes(lm, model, batches, lengths, decode_steps, repeats, reporter,
                            "" if attempt == 1 else f" (attempt {attempt} of {attempts})")

    cost, load, _ = least_loaded(
        measure, f"timing the passes of {model}", attempts, other_load, reporter.note,
        reporter.warn, "the simulated latencies of its generations will be too high; to "
        f"measure it again on a quiet machine, delete KEN_HOME/profiles/tokens-{model}-*.json")
    return replace(cost, other_cores=load.cores)


def _time_passes(lm: CausalLM, model: str, batches: Sequence[int], lengths: Sequence[int],
                 decode_steps: int, repeats: int, reporter: Reporter, attempt: str
                 ) -> TokenCost:
    import torch

    from ken.models.generation import DecodeBatch

    torch.set_num_threads(lm.device.threads)
    rng = np.random.default_rng(0)
    prefill: list[Point] = []
    decode: list[Point] = []
    grid = [(b, n) for b in batches for n in lengths]
    with reporter.task(f"timing passes of {model}{attempt}", len(grid)) as advance:
        for b, n in grid:
            pre_t, dec_t = [], []
            for r in range(repeats + 1):  # the first run warms up
                prompts = random_prompts(lm, b, n, rng)
                t0 = time.perf_counter()
                batch = DecodeBatch.prefill(lm, prompts, list(range(b)), [decode_steps + 1] * b,
                                            ignore_eos=True)
                t1 = time.perf_counter()
                steps = []
                for _ in range(decode_steps):
                    s0 = time.perf_counter()
                    batch.step()
                    steps.append(time.perf_counter() - s0)
                if r:
                    pre_t.append(t1 - t0)
                    dec_t.append(float(np.median(steps)))
            prefill.append((b, n, float(np.median(pre_t))))
            # the median decode pass runs at about the prompt width plus half the steps
            decode.append((b, n + decode_steps // 2, float(np.median(dec_t))))
            advance(1)
    from ken.models.transformers_backend import weight_bytes

    return TokenCost.fit(model, hardware_fingerprint(lm.device), prefill, decode,
                         weight_bytes(lm.net), kv_bytes_per_token(lm))


def token_cost_path(lm: CausalLM, model: str, batches: Sequence[int], lengths: Sequence[int],
                    home: Path | None = None) -> Path:
    from ken.models.resources import short_hash

    key = short_hash(model, store.content_id(lm.source), hardware_fingerprint(lm.device),
                     tuple(batches), tuple(lengths), SCHEMA_VERSION)
    return (home or ken_home()) / "profiles" / f"tokens-{model}-{key}.json"


def token_cost_entry(path: Path) -> store.Entry:
    """The store entry of a token-cost file (one JSON file in ``KEN_HOME/profiles``)."""
    return store.Entry(path.parent, f"the token cost {path.name}",
                       "it is measured again on next use", files=(path.name,),
                       legacy=_adopt_token_cost)


def _adopt_token_cost(entry: store.Entry) -> None:
    path = entry.main
    try:
        TokenCost.from_json(path.read_text())
    except (OSError, ProfileError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"model store: {path} is not a token cost of this ken ({exc}). To fix "
                         f"it: {entry.fix}.") from None


def load_or_measure_token_cost(lm: CausalLM, model: str, batches: Sequence[int] = (1, 4, 8),
                               lengths: Sequence[int] = (32, 128, 256), home: Path | None = None,
                               reporter: Reporter = QUIET) -> TokenCost:
    """The cached token cost of ``model`` on this hardware, measured on first use and again
    when the cached file is damaged (under the store lock)."""
    home = home or ken_home()
    path = token_cost_path(lm, model, batches, lengths, home)
    entry = token_cost_entry(path)
    cost = _cached(entry, reporter)
    if cost is not None:
        return cost
    with store.store_lock(home, f"measuring the token cost of {model}", reporter.note):
        cost = _cached(entry, QUIET)  # measured by another process while this one waited?
        if cost is None:
            cost = measure_token_cost(lm, model, batches, lengths, reporter=reporter)
            store.write_text(path, cost.to_json())
            store.seal(entry)
    return cost


def _cached(entry: store.Entry, reporter: Reporter) -> TokenCost | None:
    if not entry.main.is_file():
        return None
    try:
        store.ensure(entry)
        return TokenCost.from_json(entry.main.read_text())
    except (StoreError, ProfileError, ValueError, KeyError, TypeError) as exc:
        reporter.note(f"{exc}\n  -> measuring it again")
        return None


def store_entries(home: Path) -> list[store.Entry]:
    """Every token-cost file in ``home``."""
    return [token_cost_entry(path) for path in sorted((home / "profiles").glob("tokens-*.json"))]
