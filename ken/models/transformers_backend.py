"""Transformers backend: a pretrained body (encoder or decoder), mean pooling, a linear head."""

from __future__ import annotations

import functools
import inspect
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ken.errors import ModelError
from ken.models.data_text import encode_rows
from ken.models.head import LinearHead
from ken.models.model import DeviceConfig, Model, ModelSpec, Prediction

BODY_KINDS = ("encoder", "decoder")


@dataclass(frozen=True)
class BodyConfig:
    """Which pretrained network produces features and how they are pooled.

    ``layer`` picks the hidden state to mean-pool (``None``: the last layer's output). For a
    decoder, layers after ``layer`` are dropped at load time since their output is never used.
    """

    source: str  # a local folder or a hub model id
    kind: str = "encoder"
    layer: int | None = None
    max_tokens: int = 128

    def __post_init__(self) -> None:
        if self.kind not in BODY_KINDS:
            raise ModelError(f"body kind must be one of {BODY_KINDS}, not {self.kind!r}")
        if self.max_tokens < 2:
            raise ModelError(f"max_tokens must be at least 2, got {self.max_tokens}")


def count_params(net: Any) -> int:
    """Parameters of a torch module."""
    return sum(p.numel() for p in net.parameters())


def weight_bytes(net: Any) -> int:
    """Resident bytes of a torch module's parameters and buffers."""
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    return params + sum(b.numel() * b.element_size() for b in net.buffers())


#: on a GPU, padded widths are rounded up to a multiple of this (capped at the model's limit),
#: so batches come in few distinct shapes (what cached GPU kernels and fp16 tensor cores want,
#: and a launch-bound GPU runs a few more columns for free); the attention mask keeps the extra
#: columns out of every result. Not on a CPU, where every padded column costs: rounding to 8
#: made MiniLM-L6 5-18% slower per row at batch 32-128 on 2 cores (benchmarks/gpu_overhead.py
#: measures both on either device).
PAD_MULTIPLE = 8

#: On a GPU a batch's width is rounded up to one of these (at most the model's limit) and its
#: rows to a power of two, so batches come in few shapes, all run once before serving
#: (``TransformersBody.warm_shapes``). Each new shape's first call is slow in half precision:
#: measured on an H200 (``benchmarks/gpu_check.py``), MiniLM-L3's profile at fp16 ran 20-45 ms
#: per batch at the sizes whose shapes were new against 3 ms at the others, and a raw fp16
#: matrix product's first call of a shape took 6x its second.
GPU_WIDTHS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
#: the largest batch ``warm_shapes`` prepares by default (the profiles' largest size)
GPU_WARM_ROWS = 128


def gpu_width(longest: int, limit: int) -> int:
    """The GPU width bucket of a batch whose longest row has ``longest`` tokens: the smallest
    of ``GPU_WIDTHS`` that holds it, at most ``limit`` (never below ``longest``)."""
    fit = next((w for w in GPU_WIDTHS if w >= longest), limit)
    return max(longest, min(fit, limit))


def gpu_rows(rows: int) -> int:
    """The GPU row bucket of a batch of ``rows`` rows: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


def padded_width(longest: int, limit: int, multiple: int = PAD_MULTIPLE) -> int:
    """``longest`` rounded up to a multiple of ``multiple``, but not past ``limit`` (a row of
    ``longest`` tokens always fits: the width is never below it)."""
    if multiple <= 1:
        return longest
    return max(longest, min(-(-longest // multiple) * multiple, limit))


def pad_arrays(sequences: Sequence[Sequence[int]], pad_id: int, left: bool = False,
               width: int | None = None, out: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """Token-id rows padded to ``width`` (the longest row by default) as int64 numpy arrays
    ``(input_ids, attention_mask)``, vectorised: one pass over the tokens, no per-row writes.

    ``out``, when given, is an int64 array of shape ``(2, rows, width)`` to fill (ids, then the
    mask), e.g. the numpy view of a pinned host tensor; the two returned arrays are its halves.
    """
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    longest = int(lengths.max()) if lengths.size else 0
    width = longest if width is None else int(width)
    if width < longest:
        raise ModelError(f"cannot pad rows of {longest} tokens to width {width}")
    columns = np.arange(width, dtype=np.int64)
    real = columns >= (width - lengths)[:, None] if left else columns < lengths[:, None]
    if out is None:
        out = np.empty((2, len(lengths), width), dtype=np.int64)
    elif out.shape != (2, len(lengths), width) or out.dtype != np.int64:
        raise ModelError(f"pad buffer of shape {out.shape} ({out.dtype}), need "
                         f"{(2, len(lengths), width)} int64")
    input_ids, mask = out[0], out[1]
    input_ids.fill(pad_id)
    # a boolean index walks the array in row-major order, which is the order of the rows'
    # tokens laid end to end, on either side of the padding
    input_ids[real] = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64,
                                  count=int(lengths.sum()))
    mask[...] = real
    return input_ids, mask


@functools.cache
def _cache_argument(net_class: type) -> str:
    """The name a causal LM's ``forward`` takes its KV cache by: ``cache`` since transformers
    5.2x, ``past_key_values`` before (still accepted then, with a deprecation warning)."""
    params = inspect.signature(net_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def with_cache(net: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands ``cache`` to ``net``'s forward pass."""
    return {_cache_argument(type(net)): cache}


def returned_cache(result: Any) -> Any:
    """The KV cache a forward pass with ``use_cache=True`` returned (``cache``, or
    ``past_key_values`` in older transformers)."""
    cache = getattr(result, "cache", None)
    return cache if cache is not None else result.past_key_values


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int, left: bool = False
              ) -> tuple[Any, Any]:
    """Token-id rows padded to the longest: ``(input_ids, attention_mask)`` as torch tensors.

    Encoders pad on the right; decoders that read the last position pad on the left.
    """
    import torch

    input_ids, mask = pad_arrays(sequences, pad_id, left)
    return torch.from_numpy(input_ids), torch.from_numpy(mask)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class TransformersBody:
    """Tokenizer + transformer network mapping texts to attention-masked mean-pooled features."""

    def __init__(self, config: BodyConfig, device: DeviceConfig | None = None) -> None:
        import torch
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        _quiet_transformers()
        self.config = config
        self.device = device or DeviceConfig()
        if self.device.kind == "cuda" and not torch.cuda.is_available():
            raise ModelError("a CUDA device was requested but torch sees no GPU")
        # local folders never touch the network; hub ids do (for users who have internet)
        local = os.path.isdir(config.source)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(config.source, local_files_only=local)
            extra = {}
            if AutoConfig.from_pretrained(config.source, local_files_only=local
                                          ).model_type == "bert":
                extra["add_pooling_layer"] = False  # mean pooling needs no (random) pooler
            net = AutoModel.from_pretrained(config.source, local_files_only=local,
                                            dtype=self.device.torch_dtype, **extra)
        except OSError as exc:
            raise ModelError(f"cannot load model from {config.source!r}: {exc}") from exc
        if config.kind == "decoder" and config.layer is not None:
            layers = net.layers
            if not 0 < config.layer <= len(layers):
                raise ModelError(f"{config.source} has {len(layers)} layers, not {config.layer}")
            net.layers = layers[: config.layer]
            net.config.num_hidden_layers = config.layer
        self.net = net.eval().to(self.device.torch_device)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id or 0
        # A decoder tokenizer may add no special tokens, so an empty text would have no token to
        # pool over: always start decoder inputs with BOS (or EOS when there is no BOS).
        self.prefix: list[int] = []
        if config.kind == "decoder" and not self.tokenizer("")["input_ids"]:
            first = self.tokenizer.bos_token_id
            self.prefix = [first if first is not None else self.pad_id]
        limit = getattr(self.net.config, "max_position_embeddings", config.max_tokens)
        self.max_tokens = min(config.max_tokens, int(limit))
        self.pad_multiple = PAD_MULTIPLE if self.device.kind == "cuda" else 1

    @property
    def num_params(self) -> int:
        return count_params(self.net)

    @property
    def memory_bytes(self) -> int:
        return weight_bytes(self.net)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, truncated to the model's limit (special tokens included)."""
        room = self.max_tokens - len(self.prefix)
        ids = encode_rows(self.tokenizer, texts, truncation=True, max_length=room)
        return [self.prefix + row for row in ids]

    def features(self, texts: Sequence[str], batch_size: int = 32,
                 on_batch: Callable[[int], None] | None = None) -> np.ndarray:
        """Mean-pooled hidden states as float32, shape ``(len(texts), hidden)``, in input order
        (``embed`` without the token counts)."""
        return self.embed(texts, batch_size, on_batch)[0]

    def embed(self, texts: Sequence[str], batch_size: int = 32,
              on_batch: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Mean-pooled hidden states as float32, shape ``(len(texts), hidden)``, in input order,
        and each text's token count as run (``tokenize``; int64).

        Rows are sorted by token count before batching so that a batch pads to similar lengths
        (its width rounded up to ``pad_multiple``; on a GPU to a ``GPU_WIDTHS`` bucket, with
        filler rows up to a power of two); results are put back in input order. On a
        GPU the host pads each batch into pinned memory and copies it without waiting
        (ids and mask in one copy), pooled rows stay on the device, and one copy brings them
        all back at the end: nothing waits for the GPU between batches, so the host pads batch
        k+1 while the GPU runs batch k (``on_batch`` then says a batch was queued, not done).
        """
        import torch

        if batch_size < 1:
            raise ModelError(f"batch size must be at least 1, got {batch_size}")
        hidden = int(self.net.config.hidden_size)
        out = np.zeros((len(texts), hidden), dtype=np.float32)
        if not texts:
            return out, np.zeros(0, dtype=np.int64)
        torch.set_num_threads(self.device.threads)
        ids = self.tokenize(texts)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        order = np.argsort(lengths, kind="stable")
        device = torch.device(self.device.torch_device)
        on_gpu = device.type == "cuda"
        pooled_rows = (torch.empty((len(texts), hidden), dtype=torch.float32, device=device)
                       if on_gpu else None)  # sorted order, on the device
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                seqs = [ids[i] for i in rows]
                if on_gpu:  # few shapes, all warmed up: bucketed widths, filler rows
                    width = gpu_width(int(lengths[rows].max()), self.max_tokens)
                    seqs += [[self.pad_id]] * (gpu_rows(len(rows)) - len(rows))
                else:
                    width = padded_width(int(lengths[rows].max()), self.max_tokens,
                                         self.pad_multiple)
                host = torch.empty((2, len(seqs), width), dtype=torch.long, pin_memory=on_gpu)
                pad_arrays(seqs, self.pad_id, width=width, out=host.numpy())
                # pinned memory is not reused before its copy is done (torch's host allocator
                # records the copy), so a fresh buffer per batch is safe without a sync
                batch = host.to(device, non_blocking=True) if on_gpu else host
                pooled = self.pool(batch[0], batch[1])[: len(rows)]
                if pooled_rows is not None:
                    pooled_rows[start:start + len(rows)] = pooled
                else:
                    out[rows] = pooled.numpy()
                if on_batch:
                    on_batch(len(rows))
        if pooled_rows is not None:
            out[order] = pooled_rows.cpu().numpy()
        return out, lengths

    def warm_shapes(self, max_rows: int = GPU_WARM_ROWS) -> int:
        """On a GPU, run every batch shape ``features`` can give for batches of up to
        ``max_rows`` rows once (see ``GPU_WIDTHS``), so that no request or profiled batch pays
        a shape's first call; returns how many shapes ran (0 on a CPU, which needs none)."""
        import torch

        if self.device.kind != "cuda":
            return 0
        device = torch.device(self.device.torch_device)
        widths = sorted({gpu_width(w, self.max_tokens) for w in GPU_WIDTHS})
        top = gpu_rows(max_rows)  # a batch of max_rows rows is padded to this many
        shapes = [(1 << k, w) for k in range(top.bit_length()) for w in widths]
        with torch.inference_mode():
            for rows, width in shapes:
                ids = torch.full((rows, width), self.pad_id, dtype=torch.long, device=device)
                full = torch.ones_like(ids)
                self.pool(ids, full)  # a batch without padding: attention runs unmasked
                if width > 1:  # and one with padding: masked attention, other kernels
                    padded = full.clone()
                    padded[:, -1] = 0
                    self.pool(ids, padded)
        torch.cuda.synchronize(device)
        return len(shapes)

    def pool(self, input_ids, mask):  # noqa: ANN001, ANN202 - torch tensors
        """Mean of the chosen layer's hidden states over the unmasked tokens, in float32 (a
        half-precision sum over 128 tokens could overflow or round badly)."""
        if self.config.layer is None:
            states = self.net(input_ids=input_ids, attention_mask=mask).last_hidden_state
        else:
            result = self.net(input_ids=input_ids, attention_mask=mask,
                              output_hidden_states=True)
            states = result.hidden_states[self.config.layer]
        states = states.float()
        weights = mask.unsqueeze(-1).to(states.dtype)
        return (states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


class TransformersClassifier(Model):
    """A transformers body with a linear head: ``predict(texts) -> labels, probabilities``."""

    def __init__(self, spec: ModelSpec, body: TransformersBody, head: LinearHead) -> None:
        if tuple(head.label_names) != tuple(spec.labels):
            raise ModelError(f"{spec.name}: head labels {head.label_names} != {spec.labels}")
        self.spec = spec
        self.body = body
        self.head = head
        self.device = body.device

    def warm_up(self, max_batch: int = 8) -> None:
        """``Model.warm_up``; on a GPU first every batch shape up to ``GPU_WARM_ROWS`` rows (or
        ``max_batch``, if larger)."""
        self.body.warm_shapes(max(max_batch, GPU_WARM_ROWS))
        super().warm_up(max_batch)

    def row_sizes(self, rows: Sequence[str]) -> np.ndarray:
        """The tokens each row runs as (``TransformersBody.tokenize``): a batch pads to its
        longest row, whose tokens its runtime grows with (characters tell them apart less
        well: ``benchmarks/call_rows.py``)."""
        return np.fromiter(map(len, self.body.tokenize(list(rows))), dtype=np.int64,
                           count=len(rows))

    def predict(self, texts: Sequence[str], batch_size: int = 32,
                on_batch: Callable[[int], None] | None = None) -> Prediction:
        features, tokens = self.body.embed(texts, batch_size, on_batch)
        probs = self.head.predict_proba(features)
        if len(texts) == 0:
            probs = np.zeros((0, len(self.spec.labels)), dtype=np.float32)
        return Prediction(probs.argmax(axis=1).astype(np.int64), probs, self.spec.labels,
                          row_sizes=tokens)
