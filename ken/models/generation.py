"""Generation and option scoring with a causal LM (:class:`ken.models.resources.CausalLM`).

``generate`` decodes greedily in batches: prompts are left-padded so every row's last prompt
token sits in the last column, the prompt is one forward pass (prefill) that fills the KV
cache, and each further token is one pass over the batch (decode). A row stops at its end
token, at a stop string, or at ``max_new_tokens``; the batch stops when every row has. Each
row gets the same tokens alone as inside a batch (position ids count from its first real
token), which the tests check against a token-by-token reference without a cache.

``score_options`` is multiple choice by likelihood: the log-probability of each option as the
continuation of its context, in batched passes (``CausalLM.continuation_logprobs``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ken.errors import ModelError
from ken.models.transformers_backend import pad_batch, returned_cache, with_cache

if TYPE_CHECKING:
    from ken.models.resources import CausalLM


@dataclass(frozen=True)
class Generation:
    """One generated answer: its text, its tokens and each token's log-probability."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_tokens: int
    finish: str  # "eos" | "stop" | "length"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def mean_logprob(self) -> float:
        """Length-normalised sequence log-probability (0 for an empty answer)."""
        return float(np.mean(self.logprobs)) if self.logprobs else 0.0

    def certainty(self, kind: str = "mean_prob") -> float:
        """How sure the model was of this text: ``mean_prob`` (the geometric mean of the
        token probabilities, exp of the mean log-probability) or ``min_prob`` (its least
        likely token)."""
        if not self.logprobs:
            return 1.0
        if kind == "mean_prob":
            return math.exp(self.mean_logprob())
        if kind == "min_prob":
            return math.exp(min(self.logprobs))
        raise ModelError(f"unknown certainty {kind!r} for generated text; use mean_prob or "
                         "min_prob")


def chat_prompt(lm: CausalLM, user: str, system: str | None = None,
                answer_prefix: str = "") -> list[int]:
    """Token ids of a one-turn chat in the model's chat template, ending where the
    assistant's answer starts (plus ``answer_prefix``, text the answer is forced to begin
    with). A tokenizer without a template gets a plain ``user``/``assistant`` layout."""
    tok = lm.tokenizer
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return list(tok.encode(text + answer_prefix, add_special_tokens=False))


#: end-of-turn tokens of chat templates, most specific first
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>")


def special_token_ids(lm: CausalLM, names: Sequence[str]) -> list[int]:
    """The ids of those of the special tokens ``names`` the tokenizer has, in that order."""
    tok = lm.tokenizer
    out = []
    for special in names:
        token = tok.convert_tokens_to_ids(special)
        if isinstance(token, int) and token != tok.unk_token_id and token >= 0:
            out.append(token)
    return out


def end_token_ids(lm: CausalLM) -> frozenset[int]:
    """Tokens that end an answer: the tokenizer's end of sequence and, for chat models,
    the end-of-turn token."""
    tok = lm.tokenizer
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    ids.update(special_token_ids(lm, (*END_OF_TURN, "<|endoftext|>")))
    generation_config = getattr(lm.net, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    return frozenset(int(i) for i in ids)


def _cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    cuts = [i for s in stop if s and (i := text.find(s)) >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


def generate(lm: CausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32,
             stop: Sequence[str] = (), batch_size: int = 8,
             on_batch: Callable[[int], None] | None = None) -> list[Generation]:
    """Greedy answers to ``prompts`` (token ids), in input order, in static batches.

    Rows are sorted by prompt length so a batch pads little. The text of a row ends before
    its first stop string (the tokens and log-probabilities are those of the tokens kept, up
    to the one that completed the stop string). A batch runs until its last row is done;
    rows that finish early leave it (continuous batching, where new rows also join between
    steps, is :class:`DecodeBatch` driven by the engine's decode loop).
    """
    import torch

    if batch_size < 1:
        raise ModelError(f"batch size must be at least 1, got {batch_size}")
    check_prompts(prompts, max_new_tokens)
    out: list[Generation | None] = [None] * len(prompts)
    ends = end_token_ids(lm)
    torch.set_num_threads(lm.device.threads)
    order = np.argsort([len(p) for p in prompts], kind="stable")
    for start in range(0, len(order), batch_size):
        rows = [int(i) for i in order[start:start + batch_size]]
        batch = DecodeBatch.prefill(lm, [prompts[i] for i in rows], rows,
                                    [max_new_tokens] * len(rows), stop, ends)
        for key, g in batch.pop_finished():
            out[key] = g
        while len(batch):
            batch.step()
            for key, g in batch.pop_finished():
                out[key] = g
        if on_batch:
            on_batch(len(rows))
    return [g for g in out if g is not None]


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> None:
    limits = [max_new_tokens] if isinstance(max_new_tokens, int) else max_new_tokens
    if any(m < 0 for m in limits):
        raise ModelError(f"max_new_tokens must be >= 0, got {min(limits)}")
    if any(not len(p) for p in prompts):
        raise ModelError("every prompt needs at least one token")


class _Row:
    __slots__ = ("key", "prompt_tokens", "max_new", "tokens", "logps", "finish", "done")

    def __init__(self, key: object, prompt_tokens: int, max_new: int) -> None:
        self.key = key
        self.prompt_tokens = prompt_tokens
        self.max_new = max_new
        self.tokens: list[int] = []
        self.logps: list[float] = []
        self.finish = "length"
        self.done = max_new == 0


class DecodeBatch:
    """Rows decoding together over one left-padded KV cache, one forward pass per step.

    ``prefill`` runs the prompts of new rows (one pass, which also picks each row's first
    token); ``step`` is one decode pass over every row; ``join`` merges another batch in
    between steps (its cache is left-padded to the longer of the two, so both keep their
    positions); ``pop_finished`` takes out the rows that are done (end token, stop string or
    their own ``max_new`` tokens) and drops their cache rows. Keys are the caller's ids.
    A row gets the same tokens here as alone (position ids count from its first real token,
    padded positions are masked), whatever joins or leaves around it.
    """

    def __init__(self, lm: CausalLM, stop: Sequence[str], ends: frozenset[int],
                 ignore_eos: bool = False) -> None:
        self.lm = lm
        self.stop = tuple(stop)
        self.ends = frozenset() if ignore_eos else ends
        self.rows: list[_Row] = []
        self._past: Any = None
        self._mask: Any = None  # (rows, width) 1 for real tokens
        self._next: Any = None  # (rows, 1) the token each row feeds next
        self._pos: Any = None  # (rows, 1) the position of that token
        self.passes = 0

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """Cache length every row is padded to (what a decode pass attends over)."""
        return 0 if self._mask is None else int(self._mask.shape[1])

    @classmethod
    def prefill(cls, lm: CausalLM, prompts: Sequence[Sequence[int]], keys: Sequence[object],
                max_new: Sequence[int], stop: Sequence[str] = (),
                ends: frozenset[int] | None = None, ignore_eos: bool = False) -> DecodeBatch:
        """A batch of new rows after their prompt pass (each has its first token, or is done)."""
        import torch

        check_prompts(prompts, max_new)
        batch = cls(lm, stop, end_token_ids(lm) if ends is None else ends, ignore_eos)
        batch.rows = [_Row(k, len(p), m) for k, p, m in zip(keys, prompts, max_new, strict=True)]
        input_ids, mask = pad_batch([list(p) for p in prompts], lm.pad_id, left=True)
        device = lm.device.torch_device
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        batch._mask = mask
        with torch.inference_mode():
            batch._forward(input_ids, positions)
        return batch

    def step(self) -> None:
        """One decode pass: every row not yet done gets its next token."""
        import torch

        if not self.rows:
            return
        ones = torch.ones((len(self.rows), 1), dtype=self._mask.dtype, device=self._mask.device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        with torch.inference_mode():
            self._forward(self._next, self._pos)

    def _forward(self, input_ids: Any, positions: Any) -> None:
        import torch

        result = self.lm.net(input_ids=input_ids, attention_mask=self._mask,
                             position_ids=positions, **with_cache(self.lm.net, self._past),
                             use_cache=True, logits_to_keep=1)
        self.passes += 1
        self._past = returned_cache(result)
        logp = torch.log_softmax(result.logits[:, -1, :].float(), dim=-1)
        best = logp.argmax(dim=-1)
        picked = logp.gather(1, best[:, None])[:, 0].cpu().tolist()
        best_ids = best.cpu().tolist()
        for row, token, lp in zip(self.rows, best_ids, picked, strict=True):
            if not row.done:
                self._take(row, int(token), float(lp))
        feed = [[t if not r.done else self.lm.pad_id] for t, r in zip(best_ids, self.rows,
                                                                      strict=True)]
        self._next = torch.tensor(feed, dtype=torch.long, device=self._mask.device)
        self._pos = positions[:, -1:] + 1

    def _take(self, row: _Row, token: int, logp: float) -> None:
        if token in self.ends:
            row.done, row.finish = True, "eos"
            return
        row.tokens.append(token)
        row.logps.append(logp)
        if self.stop:
            text = self.lm.tokenizer.decode(row.tokens, skip_special_tokens=True)
            if _cut_at_stop(text, self.stop)[1]:
                row.done, row.finish = True, "stop"
                return
        if len(row.tokens) >= row.max_new:
            row.done = True

    def join(self, other: DecodeBatch) -> None:
        """Merge ``other`` (prefilled, not yet stepped past this batch's step) into this batch."""
        import torch

        if not other.rows:
            return
        if not self.rows:
            passes = self.passes
            self.__dict__.update(other.__dict__)
            self.passes += passes
            return
        width = max(self.width, other.width)
        mine, theirs = self._past.layers, other._past.layers
        for a, b in zip(mine, theirs, strict=True):
            a.keys = torch.cat([_pad_left(a.keys, width, 2), _pad_left(b.keys, width, 2)])
            a.values = torch.cat([_pad_left(a.values, width, 2),
                                  _pad_left(b.values, width, 2)])
        self._mask = torch.cat([_pad_left(self._mask, width, 1),
                                _pad_left(other._mask, width, 1)])
        self._next = torch.cat([self._next, other._next])
        self._pos = torch.cat([self._pos, other._pos])
        self.rows.extend(other.rows)

    def pop_finished(self) -> list[tuple[object, Generation]]:
        """The rows that are done, as ``(key, Generation)``; they leave the batch."""
        done = [j for j, r in enumerate(self.rows) if r.done]
        if not done:
            return []
        out = []
        for j in done:
            r = self.rows[j]
            text, _ = _cut_at_stop(self.lm.tokenizer.decode(r.tokens, skip_special_tokens=True),
                                   self.stop)
            out.append((r.key, Generation(text.strip(), tuple(r.tokens), tuple(r.logps),
                                          r.prompt_tokens, r.finish)))
        keep = [j for j, r in enumerate(self.rows) if not r.done]
        self.rows = [self.rows[j] for j in keep]
        if not keep:
            self._past = self._mask = self._next = self._pos = None
            return out
        import torch

        idx = torch.tensor(keep, dtype=torch.long, device=self._mask.device)
        mask = self._mask[idx]
        # columns that are padding in every remaining row are dropped from the cache
        first = int((mask.sum(dim=0) > 0).nonzero()[0, 0])
        self._mask = mask[:, first:]
        for layer in self._past.layers:
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]
        self._next, self._pos = self._next[idx], self._pos[idx]
        return out


def _pad_left(t: Any, width: int, dim: int) -> Any:
    import torch

    pad = width - t.shape[dim]
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


def generate_reference(lm: CausalLM, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of one prompt without a KV cache or padding: each step runs the whole
    sequence again (slow; the tests' reference for ``generate``)."""
    import torch

    ends = end_token_ids(lm)
    ids = list(prompt)
    new: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = lm.net(input_ids=torch.tensor([ids], device=lm.device.torch_device),
                            use_cache=False).logits[0, -1]
            token = int(logits.float().argmax())
            if token in ends:
                break
            new.append(token)
            ids.append(token)
    return new


def score_options(lm: CausalLM, contexts: Sequence[Sequence[int]],
                  options: Sequence[Sequence[Sequence[int]]], batch_size: int = 16,
                  on_batch: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """``log P(option | context)`` of every option of every row: one array per row.

    Each context runs once, its options on its cached keys and values
    (``CausalLM.option_logprobs``); an LM without that method runs every (context, option)
    pair as one batched list of continuations, sorted by length.
    """
    if hasattr(lm, "option_logprobs"):
        return lm.option_logprobs(contexts, options, batch_size=batch_size, on_batch=on_batch)
    flat_ctx: list[Sequence[int]] = []
    flat_opt: list[Sequence[int]] = []
    for ctx, opts in zip(contexts, options, strict=True):
        if not opts:
            raise ModelError("every row needs at least one option to score")
        for opt in opts:
            flat_ctx.append(ctx)
            flat_opt.append(opt)
    scores = lm.continuation_logprobs(flat_ctx, flat_opt, batch_size=batch_size,
                                      on_batch=on_batch)
    out, at = [], 0
    for opts in options:
        out.append(scores[at:at + len(opts)])
        at += len(opts)
    return out


def option_probabilities(scores: np.ndarray) -> np.ndarray:
    """Softmax of option scores: each option's probability among the options."""
    z = np.asarray(scores, dtype=np.float64)
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()
