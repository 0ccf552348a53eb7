"""Fine-tuning a transformers body and its linear head together on labelled texts.

Frozen features fall short on sentiment (a head on frozen MiniLM or SmolLM2 features is barely
better than a lexicon off its training domain); training the top layers of the body with the
head fixes that on this CPU in minutes. The trained body is saved as a transformers folder and
the head as a ``LinearHead`` (no standardisation), so a fine-tuned model loads and serves exactly
like a frozen one (``TransformersBody`` + ``LinearHead``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ken.errors import ModelError
from ken.models.data_text import encode_rows
from ken.models.datasets import LabelledSample
from ken.models.head import LinearHead
from ken.models.model import DeviceConfig
from ken.models.transformers_backend import BodyConfig, TransformersBody, pad_batch
from ken.progress import QUIET, Reporter


@dataclass(frozen=True)
class FineTune:
    """How to fine-tune: AdamW with linear warm-up and decay, one pass by default.

    ``top_layers`` trains only the last N transformer layers (``None``: every layer and the
    embeddings); the layers below stay frozen and run without gradients. ``max_tokens`` caps
    the training inputs (serving keeps the body's own limit).
    """

    epochs: float = 1.0
    learning_rate: float = 8e-5
    batch_size: int = 32
    max_tokens: int = 64
    top_layers: int | None = None
    warmup: float = 0.06
    weight_decay: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs <= 0 or self.learning_rate <= 0 or self.batch_size < 1:
            raise ModelError(f"bad fine-tuning settings: {self}")
        if self.top_layers is not None and self.top_layers < 1:
            raise ModelError(f"top_layers must be at least 1, got {self.top_layers}")

    def steps(self, rows: int) -> int:
        return max(1, round(rows / self.batch_size * self.epochs))


def _layers(net):  # noqa: ANN001, ANN202 - a transformers model
    if hasattr(net, "layers"):  # decoders (Llama-style)
        return net.layers
    return net.encoder.layer  # BERT-style encoders


def _trainable(net, top_layers: int | None) -> list:  # noqa: ANN001
    """Parameters to train; freezes everything below the top ``top_layers`` layers."""
    if top_layers is None:
        return [p for p in net.parameters()]
    for p in net.parameters():
        p.requires_grad_(False)
    layers = _layers(net)
    top = list(layers[max(0, len(layers) - top_layers):])
    params = [p for layer in top for p in layer.parameters()]
    if hasattr(net, "norm"):  # a decoder's final norm follows the last layer
        params += list(net.norm.parameters())
    for p in params:
        p.requires_grad_(True)
    return params


def fine_tune(config: BodyConfig, train: LabelledSample, out_dir: Path,
              settings: FineTune = FineTune(), device: DeviceConfig = DeviceConfig(threads=2),
              reporter: Reporter = QUIET, title: str = "") -> tuple[BodyConfig, LinearHead]:
    """Train ``config``'s body and a linear head on ``train``; save the body to ``out_dir``.

    Returns the saved body's config (same pooling, ``source=out_dir``) and the head. Rows are
    shuffled with ``settings.seed``; the run is deterministic on a given machine and thread
    count.
    """
    import torch

    if len(train) == 0:
        raise ModelError("cannot fine-tune on an empty training set")
    classes = len(train.label_names)
    if classes < 2:
        raise ModelError(f"cannot fine-tune a classifier on one class ({train.label_names})")
    torch.manual_seed(settings.seed)
    torch.set_num_threads(device.threads)
    # training updates the weights in place: always in fp32 ("auto" is fp16 on a GPU), and the
    # saved body is then loaded in whatever precision serves it
    device = replace(device, precision="fp32")
    body = TransformersBody(config, device)
    net = body.net
    head = torch.nn.Linear(int(net.config.hidden_size), classes).to(device.torch_device)
    params = _trainable(net, settings.top_layers) + list(head.parameters())
    optimiser = torch.optim.AdamW(params, lr=settings.learning_rate,
                                  weight_decay=settings.weight_decay)
    steps = settings.steps(len(train))
    warm = max(1, round(settings.warmup * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / warm) * max(0.0, 1.0 - s / steps))
    room = min(settings.max_tokens, body.max_tokens) - len(body.prefix)
    ids = [body.prefix + row for row in encode_rows(
        body.tokenizer, train.texts, truncation=True, max_length=room)]
    labels = torch.as_tensor(train.labels, dtype=torch.long)
    rng = np.random.default_rng(settings.seed)
    size = min(settings.batch_size, len(train))
    net.train()
    started, step, losses = time.perf_counter(), 0, []
    what = title or Path(config.source).name
    with reporter.task(f"{what}: fine-tuning on {len(train)} rows ({steps} steps)",
                       steps) as advance:
        while step < steps:
            order = rng.permutation(len(train))
            for start in range(0, len(order) - size + 1, size):
                if step >= steps:
                    break
                rows = order[start:start + size]
                input_ids, mask = pad_batch([ids[i] for i in rows], body.pad_id)
                pooled = body.pool(input_ids.to(device.torch_device),
                                   mask.to(device.torch_device))
                loss = torch.nn.functional.cross_entropy(
                    head(pooled), labels[rows].to(device.torch_device))
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                schedule.step()
                losses.append(float(loss.detach()))
                step += 1
                advance(1)
    net.eval()
    for p in net.parameters():
        p.requires_grad_(True)
    out_dir.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(str(out_dir))
    body.tokenizer.save_pretrained(str(out_dir))
    tail = float(np.mean(losses[-max(1, len(losses) // 10):]))
    reporter.note(f"  {what}: {steps} steps in {time.perf_counter() - started:.0f} s, "
                  f"final loss {tail:.3f}")
    hidden = int(net.config.hidden_size)
    linear = LinearHead(
        weight=head.weight.detach().cpu().numpy().T.astype(np.float32).copy(),
        bias=head.bias.detach().cpu().numpy().astype(np.float32).copy(),
        mean=np.zeros(hidden, dtype=np.float32), scale=np.ones(hidden, dtype=np.float32),
        label_names=tuple(train.label_names), l2=0.0)
    return BodyConfig(str(out_dir), config.kind, config.layer, config.max_tokens), linear
