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
from typing import TYPE_CHECKING

import numpy as np

from ken.errors import ModelError
from ken.models.transformers_backend import pad_batch

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


def end_token_ids(lm: CausalLM) -> frozenset[int]:
    """Tokens that end an answer: the tokenizer's end of sequence and, for chat models,
    the end-of-turn token."""
    tok = lm.tokenizer
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for special in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>"):
        token = tok.convert_tokens_to_ids(special)
        if isinstance(token, int) and token != tok.unk_token_id and token >= 0:
            ids.add(token)
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
    """Greedy answers to ``prompts`` (token ids), in input order.

    Rows are sorted by prompt length so a batch pads little. The text of a row ends before
    its first stop string (the tokens and log-probabilities are those of the tokens kept, up
    to the one that completed the stop string).
    """
    import torch

    if batch_size < 1:
        raise ModelError(f"batch size must be at least 1, got {batch_size}")
    if max_new_tokens < 0:
        raise ModelError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if any(not len(p) for p in prompts):
        raise ModelError("every prompt needs at least one token")
    out: list[Generation | None] = [None] * len(prompts)
    ends = end_token_ids(lm)
    device = lm.device.torch_device
    torch.set_num_threads(lm.device.threads)
    order = np.argsort([len(p) for p in prompts], kind="stable")
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = [int(i) for i in order[start:start + batch_size]]
            batch = [list(prompts[i]) for i in rows]
            for i, g in zip(rows, _generate_batch(lm, batch, max_new_tokens, stop, ends,
                                                  device), strict=True):
                out[i] = g
            if on_batch:
                on_batch(len(rows))
    return [g for g in out if g is not None]


def _generate_batch(lm: CausalLM, prompts: list[list[int]], max_new_tokens: int,
                    stop: Sequence[str], ends: frozenset[int], device: str) -> list[Generation]:
    import torch

    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    finish = ["length"] * n
    done = [max_new_tokens == 0] * n
    input_ids, mask = pad_batch(prompts, lm.pad_id, left=True)
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    past = None
    step = 0
    while not all(done):
        result = lm.net(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                        past_key_values=past, use_cache=True, logits_to_keep=1)
        past = result.past_key_values
        logp = torch.log_softmax(result.logits[:, -1, :].float(), dim=-1)
        best = logp.argmax(dim=-1)
        picked = logp.gather(1, best[:, None])[:, 0].cpu().tolist()
        best_ids = best.cpu().tolist()
        step += 1
        for j in range(n):
            if done[j]:
                continue
            token = int(best_ids[j])
            if token in ends:
                done[j], finish[j] = True, "eos"
                continue
            tokens[j].append(token)
            logps[j].append(float(picked[j]))
            if stop:
                text = lm.tokenizer.decode(tokens[j], skip_special_tokens=True)
                if _cut_at_stop(text, stop)[1]:
                    done[j], finish[j] = True, "stop"
                    continue
            if step >= max_new_tokens:
                done[j] = True
        if all(done):
            break
        # the next pass feeds each row's new token (finished rows feed pad, ignored)
        next_ids = torch.tensor([[best_ids[j] if not done[j] else lm.pad_id] for j in range(n)],
                                dtype=torch.long, device=device)
        input_ids = next_ids
        positions = positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=1)
    out = []
    for j in range(n):
        text = lm.tokenizer.decode(tokens[j], skip_special_tokens=True)
        text, _ = _cut_at_stop(text, stop)
        out.append(Generation(text.strip(), tuple(tokens[j]), tuple(logps[j]),
                              len(prompts[j]), finish[j]))
    return out


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

    All (context, option) pairs run as one batched list of continuations, sorted by length.
    """
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
