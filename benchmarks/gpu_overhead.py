"""ken's model path against the raw forward pass, a CUDA graph and the arithmetic bound
(issue 18, item 3: the GPU fast path).

Three parts (``--part``, default all of them):

``encoders``
    Per packaged encoder (MiniLM-L3, MiniLM-L6; the SmolLM2 layer-15 body unless ``--quick``)
    and batch size (1, 8, 32, 128), on held-out tweets of 24-32 tokens:

    (a) ken: ``model.predict(texts)`` (tokenise, pad, forward, pool, copy back, head), timed in
        each weight precision of ``--precisions``, with the device's padding (``pad_multiple``:
        1 on a CPU, 8 on a GPU) and with the other one, to show what rounding widths costs;
        also the host-side parts alone: tokenising, padding (vectorised, as ken does it now)
        and the per-row padding loop ken used before;
    (b) raw: the same forward pass and pooling on pre-tokenised tensors already on the device;
    (c) CUDA only: that forward pass captured in a CUDA graph in fp16 on static input buffers
        of ``--graph-tokens`` (32) tokens per row (the reference the issue compares against;
        it is not in ken's serving path);
    (d) the arithmetic bound: FLOPs of the pass (from the model config, real tokens only)
        over ``--peak-tflops`` (an H100's dense fp16 peak by default; fp32 rows use
        ``--peak-fp32-tflops``), or its weight bytes over ``--mem-gbs``, whichever is longer.
        It is an estimate of what the hardware could do, not a measurement.

``llm``
    SmolLM2-135M (and Qwen2.5-Coder-0.5B when it is already in KEN_HOME), random prompts of
    ``--prompt-tokens`` tokens, ``--new-tokens`` greedy tokens (end of sequence ignored), per
    batch size (1, 16, 64): time to first token and per-step decode time of ken's
    ``DecodeBatch`` and of Hugging Face ``generate``; a greedy loop over a static KV cache
    (transformers' ``StaticCache``) run eagerly, and on CUDA the same loop with its step captured
    in a CUDA graph in fp16 (the reference); and the arithmetic bound of a decode step. Each
    static-cache loop's tokens are checked against ``DecodeBatch``'s.

``quality``
    Whether half precision holds: the packaged sentiment family's members loaded in fp32, bf16
    and fp16 classify ``--rows`` held-out rows (accuracy, labels that agree with fp32, cosine of
    the features to fp32's); SmolLM2 (and Qwen when present) answers chat prompts greedily in
    each precision (answers equal to fp32's). Runs on a CPU too: it chose ``auto``'s half
    precision for GPUs (``ken.models.model.CUDA_AUTO_PRECISION``).

Timings are medians of repeated calls (each call synchronised with the GPU). On ``--device cpu``
the CUDA-only columns are skipped, and the output and JSON say so. Writes
benchmarks/results/gpu_overhead/gpu_overhead_<device>[_quick].json and .png.

    python benchmarks/gpu_overhead.py --device cpu --quick      # ~3 minutes on 2 cores
    python benchmarks/gpu_overhead.py --device cuda             # on a GPU, a few minutes
    python benchmarks/gpu_overhead.py --device cpu --part quality --rows 300
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "gpu_overhead"
PARTS = ("encoders", "llm", "quality")
ENCODER_NAMES = ("minilm-l3", "minilm-l6", "smollm2-135m")
LLM_NAMES = ("smollm2-135m", "qwen2.5-coder-0.5b")
H100_FP16_TFLOPS = 989.0  # H100 SXM, dense fp16/bf16 tensor cores
H100_FP32_TFLOPS = 67.0  # H100 SXM, fp32 without tensor cores
H100_MEM_GBS = 3350.0  # H100 SXM, HBM3
CUDA_ONLY = "needs --device cuda (a CUDA graph); skipped on this device"


# --------------------------------------------------------------------------- timing


def timed_ms(fn: Callable[[], Any], sync: Callable[[], None], reps: int, budget_s: float,
             warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` (synchronised), over at least 3 and at most ``reps``
    calls, stopping once ``budget_s`` seconds were spent."""
    for _ in range(warmup):
        fn()
        sync()
    times: list[float] = []
    spent = 0.0
    while len(times) < max(3, reps) and (len(times) < 3 or spent < budget_s):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return 1000.0 * statistics.median(times)


def synchroniser(device: str) -> Callable[[], None]:
    import torch

    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def capture_graph(fn: Callable[[], Any], warmup: int = 3) -> tuple[Any, Any]:
    """``fn`` captured in a CUDA graph after ``warmup`` calls on a side stream (the recipe of
    torch.cuda.graphs); returns the graph and the output of the captured call, which every
    ``replay`` overwrites."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


# --------------------------------------------------------------------------- arithmetic


def _dims(config: Any) -> dict[str, int]:
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return {"hidden": hidden, "layers": int(config.num_hidden_layers),
            "inter": int(config.intermediate_size), "heads": heads, "head_dim": head_dim,
            "kv_heads": kv_heads, "vocab": int(config.vocab_size)}


def layer_matmul_flops(config: Any) -> int:
    """Multiply-add FLOPs of one layer's weight matmuls per token (2 per weight)."""
    d = _dims(config)
    q_out = d["heads"] * d["head_dim"]
    kv_out = d["kv_heads"] * d["head_dim"]
    attn = d["hidden"] * (q_out + 2 * kv_out) + q_out * d["hidden"]
    gated = getattr(config, "model_type", "") not in ("bert", "mpnet", "roberta", "xlm-roberta")
    mlp = (3 if gated else 2) * d["hidden"] * d["inter"]
    return 2 * (attn + mlp)


def encoder_flops(config: Any, lengths: Sequence[int]) -> float:
    """FLOPs of one forward pass over rows of ``lengths`` real tokens (attention over each
    row's own tokens; padding is not counted: it is work the bound does not need)."""
    d = _dims(config)
    q_out = d["heads"] * d["head_dim"]
    tokens = float(sum(lengths))
    attention = sum(4.0 * n * n * q_out for n in lengths)  # QK^T and AV
    return d["layers"] * (tokens * layer_matmul_flops(config) + attention)


def decode_step_flops(config: Any, batch: int, context: int) -> float:
    """FLOPs of one decode step of ``batch`` rows attending over ``context`` tokens, with the
    LM head over the vocabulary."""
    d = _dims(config)
    q_out = d["heads"] * d["head_dim"]
    per_row = d["layers"] * (layer_matmul_flops(config) + 4.0 * context * q_out)
    return batch * (per_row + 2.0 * d["hidden"] * d["vocab"])


def prefill_flops(config: Any, batch: int, prompt: int) -> float:
    """FLOPs of the prompt pass (causal attention, LM head at the last position only)."""
    d = _dims(config)
    q_out = d["heads"] * d["head_dim"]
    per_row = d["layers"] * (prompt * layer_matmul_flops(config) + 2.0 * prompt * prompt * q_out)
    return batch * (per_row + 2.0 * d["hidden"] * d["vocab"])


def bound_ms(flops: float, read_bytes: float, peak_tflops: float, mem_gbs: float) -> float:
    """The longer of compute at peak and reading ``read_bytes`` at full memory bandwidth."""
    return 1000.0 * max(flops / (peak_tflops * 1e12), read_bytes / (mem_gbs * 1e9))


def peak_for(dtype_name: str, args: argparse.Namespace) -> float:
    return args.peak_fp32_tflops if dtype_name == "fp32" else args.peak_tflops


# --------------------------------------------------------------------------- encoders


def pad_loop(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """How ken padded a batch before (a Python loop of per-row tensor writes): the baseline
    of the host-side padding column."""
    import torch

    width = max(len(seq) for seq in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for j, seq in enumerate(sequences):
        input_ids[j, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[j, : len(seq)] = 1
    return input_ids, mask


def load_encoder(name: str, device: Any) -> tuple[Any, Any, str]:
    """``(predict, body, what)``: the prepared family member when there is one (its
    ``predict`` is ken's path), else the packaged body (``features``, the same path less the
    linear head)."""
    from ken.errors import KenError
    from ken.models import family
    from ken.models.transformers_backend import BodyConfig, TransformersBody

    try:
        model = family.load_models(family.FamilyData(), device, names=(name,))[name]
        return model.predict, model.body, "model.predict (prepared family member)"
    except KenError:
        m = family.member(name)
        body = TransformersBody(BodyConfig(str(family.body_dir(m)), m.kind, m.layer,
                                           m.max_tokens), device)
        return body.features, body, ("body.features (family not prepared: the packaged body, "
                                     "no head)")


def pick_texts(body: Any, texts: Sequence[str], low: int, high: int, count: int) -> list[str]:
    """``count`` texts of ``low``..``high`` tokens (cycling through them if there are fewer)."""
    lengths = [len(row) for row in body.tokenize(texts)]
    chosen = [t for t, n in zip(texts, lengths, strict=True) if low <= n <= high]
    if not chosen:
        chosen = list(texts)
    return [chosen[i % len(chosen)] for i in range(count)]


def bench_encoder(name: str, precision: str, texts: Sequence[str], args: argparse.Namespace,
                  reporter: Any) -> dict:
    import torch

    from ken.models.model import DeviceConfig
    from ken.models.transformers_backend import PAD_MULTIPLE, pad_arrays, padded_width

    device = DeviceConfig(args.device, args.index, args.threads, precision)
    sync = synchroniser(args.device)
    predict, body, what = load_encoder(name, device)
    config = body.net.config
    chosen = pick_texts(body, texts, 24, args.graph_tokens, max(args.batch_sizes))
    graph_body = None
    if args.device == "cuda" and precision == args.precisions[0]:
        graph_body = load_encoder(name, DeviceConfig(args.device, args.index, args.threads,
                                                     "fp16"))[1]
    own = body.pad_multiple
    other = PAD_MULTIPLE if own == 1 else 1
    rows = []
    for bs in args.batch_sizes:
        batch = chosen[:bs]
        ids = body.tokenize(batch)
        lengths = [len(r) for r in ids]
        row: dict[str, Any] = {"batch": bs, "mean_tokens": float(np.mean(lengths)),
                               "max_tokens": max(lengths)}
        budget = args.budget_s
        row["ken_ms"] = timed_ms(lambda b=batch, n=bs: predict(b, n), sync, args.reps, budget)
        body.pad_multiple = other
        row[f"ken_ms_pad{other}"] = timed_ms(lambda b=batch, n=bs: predict(b, n), sync,
                                             args.reps, budget)
        body.pad_multiple = own
        row[f"ken_ms_pad{own}"] = row["ken_ms"]
        row["tokenize_ms"] = timed_ms(lambda b=batch: body.tokenize(b), sync, args.reps, budget)
        width = padded_width(max(lengths), body.max_tokens, own)
        row["width"] = width
        row["pad_ms"] = timed_ms(lambda i=ids, w=width: pad_arrays(i, body.pad_id, width=w),
                                 sync, args.reps, budget)
        row["pad_loop_ms"] = timed_ms(lambda i=ids: pad_loop(i, body.pad_id), sync, args.reps,
                                      budget)
        input_ids, mask = (torch.from_numpy(a).to(body.device.torch_device)
                           for a in pad_arrays(ids, body.pad_id, width=width))

        def raw(i: Any = input_ids, m: Any = mask) -> Any:
            with torch.inference_mode():
                return body.pool(i, m)

        row["raw_ms"] = timed_ms(raw, sync, args.reps, budget)
        flops = encoder_flops(config, lengths)
        row["gflops"] = flops / 1e9
        row["bound_ms"] = bound_ms(flops, body.memory_bytes, peak_for(device.dtype_name, args),
                                   args.mem_gbs)
        row["ken_over_raw"] = row["ken_ms"] / row["raw_ms"]
        if graph_body is not None:
            row.update(graph_encoder(graph_body, ids, args, reporter, name, bs))
        rows.append(row)
        reporter.note(f"  {name:13s} {device.dtype_name:4s} batch {bs:3d}: ken "
                      f"{row['ken_ms']:8.2f} ms (pad{other} {row[f'ken_ms_pad{other}']:8.2f}), raw "
                      f"{row['raw_ms']:8.2f} ms, x{row['ken_over_raw']:.2f}; tokenise "
                      f"{row['tokenize_ms']:.2f}, pad {row['pad_ms']:.3f} (loop "
                      f"{row['pad_loop_ms']:.3f}) ms"
                      + (f"; CUDA graph fp16 {row['graph_fp16_ms']:.3f} ms"
                         if row.get("graph_fp16_ms") is not None else "")
                      + f"; bound {row['bound_ms']:.4f} ms")
    return {"path": what, "precision": device.dtype_name, "device_label": device.label,
            "pad_multiple": own, "params": body.num_params, "weight_bytes": body.memory_bytes,
            "rows": rows}


def graph_encoder(body: Any, ids: Sequence[Sequence[int]], args: argparse.Namespace,
                  reporter: Any, name: str, bs: int) -> dict:
    """The fp16 forward pass and pooling captured in a CUDA graph on static buffers of
    ``--graph-tokens`` tokens per row, checked against ken's features of the same rows."""
    import torch

    from ken.models.transformers_backend import pad_arrays

    try:
        rows = [list(r[: args.graph_tokens]) for r in ids]
        host_ids, host_mask = pad_arrays(rows, body.pad_id, width=args.graph_tokens)
        static_ids = torch.from_numpy(host_ids).to(body.device.torch_device)
        static_mask = torch.from_numpy(host_mask).to(body.device.torch_device)
        with torch.inference_mode():
            graph, out = capture_graph(lambda: body.pool(static_ids, static_mask))
        ms = timed_ms(graph.replay, torch.cuda.synchronize, args.reps, args.budget_s)
        with torch.inference_mode():
            eager = body.pool(static_ids, static_mask).float().cpu().numpy()
        graph.replay()
        got = out.float().cpu().numpy()
        return {"graph_fp16_ms": ms, "graph_fp16_max_abs_diff": float(np.abs(got - eager).max())}
    except Exception as exc:  # noqa: BLE001 - a reference that fails is reported, not fatal
        reporter.note(f"  {name} batch {bs}: CUDA graph capture failed: {exc!r}")
        return {"graph_fp16_ms": None, "graph_fp16_error": repr(exc)}


# --------------------------------------------------------------------------- LLM decode


class StaticDecoder:
    """Greedy decoding over transformers' ``StaticCache``: one prompt pass (eager), then a
    decode step that reads and writes only fixed buffers (the next token, its position, the
    cache and a token log), so it can be captured in a CUDA graph and replayed per step.

    Every row's prompt has the same length (no padding, so no attention mask is needed: the
    static cache masks the slots not written yet).
    """

    def __init__(self, lm: Any, prompts: Sequence[Sequence[int]], max_steps: int) -> None:
        import torch
        from transformers import StaticCache

        self.lm = lm
        net = lm.net
        width = len(prompts[0])
        if any(len(p) != width for p in prompts):
            raise ValueError("StaticDecoder needs prompts of one length")
        device = next(net.parameters()).device
        self.cache = StaticCache(config=net.config, max_cache_len=width + max_steps + 1)
        params = inspect.signature(net.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._cache_position = "cache_position" in params  # transformers < 5 wants it
        batch = len(prompts)
        self.tokens = torch.zeros((batch, max_steps + 1), dtype=torch.long, device=device)
        self.count = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.full((batch, 1), width, dtype=torch.long, device=device)
        self.cache_position = torch.full((1,), width, dtype=torch.long, device=device)
        ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=device)
        positions = torch.arange(width, device=device).expand(batch, -1)
        with torch.inference_mode():
            logits = self._forward(ids, positions,
                                   torch.arange(width, device=device))
            self.next = logits.argmax(dim=-1, keepdim=True)
            self.tokens[:, :1] = self.next
            self.count += 1

    def _forward(self, ids: Any, positions: Any, cache_position: Any) -> Any:
        kwargs = {self._cache_kw: self.cache, "position_ids": positions, "use_cache": True,
                  "logits_to_keep": 1}
        if self._cache_position:
            kwargs["cache_position"] = cache_position
        return self.lm.net(input_ids=ids, **kwargs).logits[:, -1, :]

    def step(self) -> Any:
        """One greedy step on the fixed buffers (call under ``torch.inference_mode``)."""
        logits = self._forward(self.next, self.position, self.cache_position)
        self.next.copy_(logits.argmax(dim=-1, keepdim=True))
        self.tokens.index_copy_(1, self.count, self.next)
        self.count += 1
        self.position += 1
        self.cache_position += 1
        return self.next

    def generated(self) -> list[list[int]]:
        n = int(self.count.item())
        return self.tokens[:, :n].cpu().tolist()


def ken_decode(lm: Any, prompts: Sequence[Sequence[int]], new_tokens: int, sync: Callable
               ) -> tuple[float, list[float], list[list[int]]]:
    """``DecodeBatch``: prefill (time to first token) then ``new_tokens - 1`` steps."""
    from ken.models.generation import DecodeBatch

    start = time.perf_counter()
    batch = DecodeBatch.prefill(lm, prompts, list(range(len(prompts))),
                                [new_tokens] * len(prompts), ignore_eos=True)
    sync()
    ttft = time.perf_counter() - start
    steps = []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        batch.step()
        sync()
        steps.append(time.perf_counter() - start)
    tokens = [list(r.tokens) for r in batch.rows]
    return 1000 * ttft, [1000 * s for s in steps], tokens


def hf_generate_ms(lm: Any, prompts: Sequence[Sequence[int]], new_tokens: int, sync: Callable
                   ) -> float:
    import torch

    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long,
                       device=lm.device.torch_device)
    start = time.perf_counter()
    with torch.inference_mode():
        lm.net.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        pad_token_id=lm.pad_id, temperature=None, top_p=None, top_k=None)
    sync()
    return 1000 * (time.perf_counter() - start)


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Share of token positions where two greedy runs agree (compared up to the shorter)."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        n = min(len(x), len(y))
        same += sum(int(p == q) for p, q in zip(x[:n], y[:n], strict=True))
        total += n
    return same / total if total else 1.0


def bench_llm(name: str, precision: str, args: argparse.Namespace, reporter: Any) -> dict:
    import torch

    from ken.models.model import DeviceConfig
    from ken.models.resources import Resources
    from ken.optimizer.tokens import random_prompts

    device = DeviceConfig(args.device, args.index, args.threads, precision)
    sync = synchroniser(args.device)
    lm = Resources(device).causal_lm(name)
    graph_lm = None
    if args.device == "cuda" and precision == args.precisions[0]:
        graph_lm = Resources(DeviceConfig(args.device, args.index, args.threads, "fp16")
                             ).causal_lm(name)
    torch.set_num_threads(args.threads)
    n = args.new_tokens
    rows = []
    rng = np.random.default_rng(0)
    for bs in args.llm_batch_sizes:
        prompts = random_prompts(lm, bs, args.prompt_tokens, rng)
        ken_decode(lm, prompts, 3, sync)  # warm-up
        ttft, steps, ken_tokens = ken_decode(lm, prompts, n, sync)
        row: dict[str, Any] = {"batch": bs, "ken_ttft_ms": ttft,
                               "ken_step_ms": statistics.median(steps)}
        hf_generate_ms(lm, prompts, 2, sync)  # warm-up
        hf_first = statistics.median(hf_generate_ms(lm, prompts, 1, sync) for _ in range(2))
        hf_all = hf_generate_ms(lm, prompts, n, sync)
        row["hf_ttft_ms"] = hf_first
        row["hf_step_ms"] = (hf_all - hf_first) / max(1, n - 1)
        row.update(static_eager(lm, prompts, n, sync, ken_tokens))
        if graph_lm is not None:
            row.update(static_graph(graph_lm, prompts, args, reporter, name, bs))
        config = lm.net.config
        kv = _dims(config)
        context = args.prompt_tokens + n // 2
        kv_bytes = (bs * kv["layers"] * 2 * context * kv["kv_heads"] * kv["head_dim"]
                    * torch.finfo(device.torch_dtype).bits / 8)
        peak = peak_for(device.dtype_name, args)
        row["step_bound_ms"] = bound_ms(decode_step_flops(config, bs, context),
                                        lm.memory_bytes + kv_bytes, peak, args.mem_gbs)
        row["ttft_bound_ms"] = bound_ms(prefill_flops(config, bs, args.prompt_tokens),
                                        lm.memory_bytes, peak, args.mem_gbs)
        rows.append(row)
        reporter.note(f"  {name:13s} {device.dtype_name:4s} batch {bs:3d}: TTFT ken "
                      f"{row['ken_ttft_ms']:8.1f} / HF {row['hf_ttft_ms']:8.1f} ms; per step ken "
                      f"{row['ken_step_ms']:7.2f}, HF generate {row['hf_step_ms']:7.2f}, static "
                      f"cache eager {row['static_eager_step_ms']:7.2f} ms (tokens agree "
                      f"{row['static_eager_agree']:.0%})"
                      + (f", CUDA graph fp16 {row['graph_fp16_step_ms']:.3f} ms"
                         if row.get("graph_fp16_step_ms") is not None else "")
                      + f"; bound {row['step_bound_ms']:.4f} ms")
    return {"precision": device.dtype_name, "device_label": device.label,
            "params": lm.num_params, "weight_bytes": lm.memory_bytes, "rows": rows}


def static_eager(lm: Any, prompts: Sequence[Sequence[int]], n: int, sync: Callable,
                 ken_tokens: Sequence[Sequence[int]]) -> dict:
    """The static-cache greedy loop run eagerly: per-step time, and its tokens against ken's."""
    import torch

    decoder = StaticDecoder(lm, prompts, n)
    steps = []
    with torch.inference_mode():
        for _ in range(n - 1):
            start = time.perf_counter()
            decoder.step()
            sync()
            steps.append(1000 * (time.perf_counter() - start))
    return {"static_eager_step_ms": statistics.median(steps),
            "static_eager_agree": agreement(decoder.generated(), ken_tokens)}


def static_graph(lm: Any, prompts: Sequence[Sequence[int]], args: argparse.Namespace,
                 reporter: Any, name: str, bs: int) -> dict:
    """The static-cache decode step captured in a CUDA graph (fp16): per-step replay time,
    and its tokens against ken's ``DecodeBatch`` in fp16 on the same prompts."""
    import torch

    n, warmup = args.new_tokens, 3
    try:
        decoder = StaticDecoder(lm, prompts, n + warmup + 1)
        with torch.inference_mode():
            graph, _ = capture_graph(decoder.step, warmup)  # the warm-up steps decode too
        start = time.perf_counter()
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
        per_step = 1000 * (time.perf_counter() - start) / n
        ken_tokens = ken_decode(lm, prompts, warmup + n + 1, torch.cuda.synchronize)[2]
        return {"graph_fp16_step_ms": per_step,
                "graph_fp16_agree": agreement(decoder.generated(), ken_tokens)}
    except Exception as exc:  # noqa: BLE001 - a reference that fails is reported, not fatal
        reporter.note(f"  {name} batch {bs}: CUDA graph decode failed: {exc!r}")
        return {"graph_fp16_step_ms": None, "graph_fp16_error": repr(exc)}


# --------------------------------------------------------------------------- quality


def quality(args: argparse.Namespace, reporter: Any) -> dict:
    """fp32 vs bf16 vs fp16 on held-out rows (classifiers) and greedy answers (LMs)."""
    from ken.models import family
    from ken.models.generation import chat_prompt, generate
    from ken.models.model import DeviceConfig
    from ken.models.resources import Resources

    data = family.FamilyData()
    sample = family.heldout_sample(data)
    texts = list(sample.texts[: args.rows])
    labels = np.asarray(sample.labels[: args.rows])
    out: dict[str, Any] = {"rows": len(texts), "data": data.tag, "classifiers": {}, "lms": {}}
    prepared = [c.name for c in family.load_cards(data, missing_ok=True)]
    if missing := [n for n in family.MEMBER_NAMES if n not in prepared]:
        out["classifiers_skipped"] = (f"{', '.join(missing)} not prepared for {data.tag}: run "
                                      "`ken models prepare`")
        reporter.note(f"  skipped {out['classifiers_skipped']}")
    for name in prepared:
        found: dict[str, Any] = {}
        for precision in ("fp32", "bf16", "fp16"):
            device = DeviceConfig(args.device, args.index, args.threads, precision)
            model = family.load_models(data, device, names=(name,))[name]
            start = time.perf_counter()
            feats = model.body.features(texts, 32)
            seconds = time.perf_counter() - start
            probs = model.head.predict_proba(feats)
            found[precision] = (feats, probs, seconds)
        base_feats, base_probs, _ = found["fp32"]
        base_labels = base_probs.argmax(axis=1)
        per: dict[str, Any] = {}
        for precision, (feats, probs, seconds) in found.items():
            cos = (feats * base_feats).sum(1) / np.maximum(
                np.linalg.norm(feats, axis=1) * np.linalg.norm(base_feats, axis=1), 1e-12)
            got = probs.argmax(axis=1)
            per[precision] = {
                "accuracy": float((got == labels).mean()),
                "agree_with_fp32": float((got == base_labels).mean()),
                "labels_changed": int((got != base_labels).sum()),
                "min_cosine": float(cos.min()), "median_cosine": float(np.median(cos)),
                "max_prob_diff": float(np.abs(probs - base_probs).max()),
                "non_finite": int((~np.isfinite(feats)).sum()),
                "seconds": seconds}
            reporter.note(f"  {name:13s} {precision}: accuracy {per[precision]['accuracy']:.3f},"
                          f" labels changed {per[precision]['labels_changed']:3d}/{len(texts)},"
                          f" min cosine {per[precision]['min_cosine']:.5f}, max |dp| "
                          f"{per[precision]['max_prob_diff']:.4f}, {seconds:.1f} s")
        out["classifiers"][name] = per
    prompts_text = [f"Is this tweet positive or negative? Say why in one sentence.\n\n{t}"
                    for t in texts[: args.lm_prompts]]
    for name in llm_names(args):
        answers: dict[str, Any] = {}
        for precision in ("fp32", "bf16", "fp16"):
            lm = Resources(DeviceConfig(args.device, args.index, args.threads, precision)
                           ).causal_lm(name)
            prompts = [chat_prompt(lm, t) for t in prompts_text]
            start = time.perf_counter()
            gens = generate(lm, prompts, max_new_tokens=args.lm_tokens, batch_size=8)
            answers[precision] = (gens, time.perf_counter() - start)
        base = answers["fp32"][0]
        per = {}
        for precision, (gens, seconds) in answers.items():
            per[precision] = {
                "same_answer": float(np.mean([g.token_ids == b.token_ids
                                              for g, b in zip(gens, base, strict=True)])),
                "token_agreement": agreement([g.token_ids for g in gens],
                                             [b.token_ids for b in base]),
                "first_token_logprob_diff": float(max(
                    abs(g.logprobs[0] - b.logprobs[0]) if g.logprobs and b.logprobs else 0.0
                    for g, b in zip(gens, base, strict=True))),
                "non_finite": int(sum(not np.isfinite(g.logprobs).all() for g in gens)),
                "seconds": seconds}
            reporter.note(f"  {name:13s} {precision}: answers equal to fp32's "
                          f"{per[precision]['same_answer']:.0%}, tokens agree "
                          f"{per[precision]['token_agreement']:.0%}, first-token |dlogp| "
                          f"{per[precision]['first_token_logprob_diff']:.3f}, {seconds:.1f} s")
        out["lms"][name] = per
    return out


# --------------------------------------------------------------------------- main


def llm_names(args: argparse.Namespace) -> list[str]:
    """SmolLM2, and Qwen2.5-Coder only when it is already converted (never downloaded here)."""
    from ken.paths import ken_home

    names = [n for n in args.llms if n == "smollm2-135m"
             or (ken_home() / "models" / n / "config.json").is_file()]
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--index", type=int, default=0, help="GPU index")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--part", default="all",
                    help=f"comma list of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--quick", action="store_true",
                    help="fewer models, sizes, rows and repeats (a couple of minutes on 2 cores)")
    ap.add_argument("--precisions", default=None,
                    help="weight precisions of ken's path (default: fp32 on cpu, "
                         "fp32,auto on cuda)")
    ap.add_argument("--encoders", default=None, help="comma list (default: all three; "
                                                       "--quick: the MiniLMs)")
    ap.add_argument("--llms", default="smollm2-135m,qwen2.5-coder-0.5b",
                    help="Qwen runs only when it is already in KEN_HOME")
    ap.add_argument("--batch-sizes", default="1,8,32,128")
    ap.add_argument("--llm-batch-sizes", default=None, help="default 1,16,64; --quick: 1,8")
    ap.add_argument("--graph-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=None, help="default 32; --quick: 8")
    ap.add_argument("--rows", type=int, default=None,
                    help="held-out rows of the quality part (default 300; --quick: 200)")
    ap.add_argument("--lm-prompts", type=int, default=None, help="default 24; --quick: 8")
    ap.add_argument("--lm-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=None, help="most calls per timing (20; "
                                                             "--quick: 5)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop repeating a timing after this many seconds (2; --quick: 0.4)")
    ap.add_argument("--peak-tflops", type=float, default=H100_FP16_TFLOPS,
                    help="half-precision peak of the bound (default: an H100's dense fp16)")
    ap.add_argument("--peak-fp32-tflops", type=float, default=H100_FP32_TFLOPS)
    ap.add_argument("--mem-gbs", type=float, default=H100_MEM_GBS)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    quick = args.quick
    args.parts = PARTS if args.part == "all" else tuple(p.strip() for p in args.part.split(","))
    if bad := [p for p in args.parts if p not in PARTS]:
        ap.error(f"unknown part {bad[0]!r}; use {', '.join(PARTS)} or all")
    args.precisions = tuple((args.precisions or ("fp32,auto" if args.device == "cuda"
                                                 else "fp32")).split(","))
    args.encoders = tuple((args.encoders or ("minilm-l3,minilm-l6" if quick
                                             else ",".join(ENCODER_NAMES))).split(","))
    args.llms = tuple(args.llms.split(","))
    args.batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    args.llm_batch_sizes = tuple(int(b) for b in (args.llm_batch_sizes
                                                  or ("1,8" if quick else "1,16,64")).split(","))
    args.new_tokens = args.new_tokens or (8 if quick else 32)
    args.rows = args.rows or (200 if quick else 300)
    args.lm_prompts = args.lm_prompts or (8 if quick else 24)
    args.reps = args.reps or (5 if quick else 20)
    args.budget_s = args.budget_s if args.budget_s is not None else (0.4 if quick else 2.0)
    if min(args.batch_sizes + args.llm_batch_sizes) < 1 or args.new_tokens < 2:
        ap.error("batch sizes must be >= 1 and --new-tokens >= 2")
    if args.graph_tokens < 2 or args.prompt_tokens < 1:
        ap.error("--graph-tokens must be >= 2 and --prompt-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from ken.models import family
    from ken.models.model import DeviceConfig
    from ken.progress import Reporter

    reporter = Reporter()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no GPU", file=sys.stderr)
        return 2
    for p in args.precisions:
        DeviceConfig(args.device, args.index, args.threads, p)  # validates
    started = time.perf_counter()
    skipped = {} if args.device == "cuda" else {
        "graph_fp16_ms": CUDA_ONLY, "graph_fp16_step_ms": CUDA_ONLY}
    hardware = (torch.cuda.get_device_name(args.index) if args.device == "cuda"
                else f"CPU, {args.threads} threads")
    result: dict[str, Any] = {
        "setup": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                  for k, v in vars(args).items()},
        "hardware": hardware, "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "bound_note": (f"arithmetic bound: FLOPs from the model config over {args.peak_tflops:g} "
                       f"TFLOP/s (half) / {args.peak_fp32_tflops:g} (fp32), or weight bytes over "
                       f"{args.mem_gbs:g} GB/s, whichever is longer; an estimate for that "
                       "hardware, not a measurement"),
        "skipped": skipped}
    reporter.note(f"gpu_overhead on {hardware}; parts {', '.join(args.parts)}")
    for column, why in skipped.items():
        reporter.note(f"  skipped {column}: {why}")
    if "encoders" in args.parts:
        reporter.note("encoders: ken's predict path vs the raw forward pass")
        texts = list(family.heldout_sample(family.FamilyData()).texts)
        result["encoders"] = {
            name: {p: bench_encoder(name, p, texts, args, reporter) for p in args.precisions}
            for name in args.encoders}
    if "llm" in args.parts:
        reporter.note("llm: DecodeBatch vs HF generate vs a static-cache loop")
        result["llm"] = {name: {p: bench_llm(name, p, args, reporter) for p in args.precisions}
                         for name in llm_names(args)}
        if missing := [n for n in args.llms if n not in result["llm"]]:
            result["skipped"]["llm"] = f"{', '.join(missing)}: not in KEN_HOME (not downloaded)"
    if "quality" in args.parts:
        reporter.note(f"quality: fp32 vs bf16 vs fp16 on {args.rows} held-out rows")
        result["quality"] = quality(args, reporter)
    result["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_overhead_{args.device}" + ("_quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{stem}.png")
    reporter.note(f"wrote {args.out}/{stem}.json and {stem}.png in "
                  f"{result['wall_s'] / 60:.1f} min")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, str, list[tuple[str, list, list, str, str]]]] = []
    styles = ("-", "--", ":", "-.")  # one per precision of ken's path
    setup = result["setup"]

    def bound_label(precision: str) -> str:
        peak = setup["peak_fp32_tflops"] if precision == "fp32" else setup["peak_tflops"]
        return f"arithmetic bound at {peak:g} TFLOP/s ({precision}, est.)"

    for name, by_precision in result.get("encoders", {}).items():
        lines = []
        for k, (precision, r) in enumerate(by_precision.items()):
            style = styles[k % len(styles)]
            xs = [row["batch"] for row in r["rows"]]
            lines.append((f"ken predict ({r['precision']})", xs,
                          [row["ken_ms"] for row in r["rows"]], "tab:red", style))
            lines.append((f"raw forward ({r['precision']})", xs,
                          [row["raw_ms"] for row in r["rows"]], "tab:blue", style))
            lines.append((bound_label(r["precision"]), xs,
                          [row["bound_ms"] for row in r["rows"]], "tab:gray", style))
            graph = [row.get("graph_fp16_ms") for row in r["rows"]]
            if precision == next(iter(by_precision)) and any(g is not None for g in graph):
                lines.append(("CUDA graph (fp16)", xs, graph, "tab:green", "-"))
        panels.append((name, "ms per call", lines))
    for name, by_precision in result.get("llm", {}).items():
        lines = []
        for k, r in enumerate(by_precision.values()):
            style = styles[k % len(styles)]
            xs = [row["batch"] for row in r["rows"]]
            for key, label, colour in (("ken_step_ms", "ken DecodeBatch", "tab:red"),
                                       ("hf_step_ms", "HF generate", "tab:orange"),
                                       ("static_eager_step_ms", "static cache, eager",
                                        "tab:purple"),
                                       ("step_bound_ms", "", "tab:gray")):
                label = f"{label} ({r['precision']})" if label else bound_label(r["precision"])
                lines.append((label, xs,
                              [row[key] for row in r["rows"]], colour, style))
            graph = [row.get("graph_fp16_step_ms") for row in r["rows"]]
            if any(g is not None for g in graph):
                lines.append(("static cache, CUDA graph (fp16)", xs, graph, "tab:green",
                              "-"))
        panels.append((f"{name}: decode step", "ms per step", lines))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, ylabel, lines) in zip(axes[0], panels, strict=True):
        for label, xs, ys, colour, style in lines:
            points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if points:
                ax.plot(*zip(*points, strict=True), style, color=colour, marker="o",
                        markersize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} ({result['hardware']})", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
