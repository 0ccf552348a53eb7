"""LLM operators on a CPU in fp32, bf16 and int8 (issue 34, item 5): rows per second of
``sem_qa`` and ``sem_map`` over a 200-row table, and what each precision does to the answers.

For each causal LM (``--models``: SmolLM2-135M and Qwen2.5-Coder-0.5B) and precision:

- ``fp32`` and ``bf16``: the operators through SQL, as a user runs them, in a session whose
  device has that precision (``ken.connect(device=DeviceConfig(threads=..., precision=...))``),
  with the operator's LLM list set to the one model (``SET sem_qa_llms = '<model>'``):
  ``SELECT sem_qa(question, passage) FROM t`` and ``SELECT sem_map(passage, '<instruction>')
  FROM t`` over ``--rows`` rows;
- ``int8``: torch's dynamic quantisation of every linear layer of the fp32 model
  (``torch.ao.quantization.quantize_dynamic``), which is not a precision ken offers: timed on
  the first ``--int8-rows`` rows with ``ken.models.generation.generate`` on the operators' own
  prompts and decoding settings (the same token ids the operators send), not through SQL.

The table: HybridQA dev questions whose gold answer is in exactly one linked passage, with that
passage (``sem_qa``'s own evaluation sample, ``hybridqa_passage_sample``). Reported per model
and precision: rows/s of each operator (wall time of the query, the model already loaded and
warmed up on two rows), the fraction of answers equal to fp32's, and ``sem_qa``'s token F1
against the gold answers (mean and standard error). Each (model, precision) runs in the same
process one after the other; the machine should be otherwise idle (the script records the CPU
other processes used meanwhile).

Writes ``OUT/llm_precision.json``, ``llm_precision.md`` and ``llm_precision.png`` (OUT:
``--out``, default benchmarks/results/llm_precision). Qwen is fetched on first use (478 MB).

    python benchmarks/llm_precision.py                 # ~25 min on 2 cores
    python benchmarks/llm_precision.py --rows 40 --models smollm2-135m   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from llm_backends import busy_cpu_s  # the same busy-CPU count as its table

import ken
from ken.models.generation import generate
from ken.models.model import DeviceConfig, cpu_has_bf16
from ken.models.quality import token_f1
from ken.models.resources import CausalLM, causal_lm_dir
from ken.ops import sem_map as sem_map_op
from ken.ops import sem_qa as sem_qa_op
from ken.ops.prompts import SEM_MAP, SEM_QA

RESULTS = Path(__file__).parent / "results" / "llm_precision"
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
INSTRUCTION = "Who or what is this passage about? Answer in a few words."


def other_cpu_s() -> float:
    """CPU seconds used by every process but this one so far."""
    t = os.times()
    return busy_cpu_s() - (t.user + t.system)


def sql_run(model: str, precision: str, rows: list[tuple[str, str]], threads: int) -> dict:
    """Both operators through SQL in a session of ``precision``: answers and wall times."""
    table = pa.table({"i": list(range(len(rows))), "question": [q for q, _ in rows],
                      "passage": [p for _, p in rows]})
    out: dict = {"path": "SQL"}
    with ken.connect(device=DeviceConfig(threads=threads, precision=precision), cache=False) as s:
        s.register_table("t", table)
        s.register_table("warm", table.slice(0, 2))
        s.sql(f"SET sem_qa_llms = '{model}'")
        s.sql(f"SET sem_map_llms = '{model}'")
        queries = {"sem_qa": "sem_qa(question, passage)",
                   "sem_map": f"sem_map(passage, '{INSTRUCTION}')"}
        for op, call in queries.items():
            s.sql(f"SELECT {call} FROM warm").fetchall()  # loads and warms the model
            cpu0, t0 = other_cpu_s(), time.perf_counter()
            got = s.sql(f"SELECT i, {call} AS a FROM t ORDER BY i").fetchall()
            wall = time.perf_counter() - t0
            out[op] = {"answers": [a for _, a in got], "wall_s": wall,
                       "rows_per_s": len(rows) / wall,
                       "other_cpu_share": (other_cpu_s() - cpu0) / wall}
    return out


def int8_run(model: str, rows: list[tuple[str, str]], threads: int) -> dict:
    """Dynamic int8 quantisation of the fp32 model, through ``generate`` on the operators'
    own prompts and decoding settings."""
    import torch

    lm = CausalLM(causal_lm_dir(model), DeviceConfig(threads=threads, precision="fp32"))
    lm.net = torch.ao.quantization.quantize_dynamic(lm.net, {torch.nn.Linear},
                                                    dtype=torch.qint8)
    out: dict = {"path": "generate() on the operators' prompts"}
    jobs = {"sem_qa": ([SEM_QA(lm, r) for r in rows], sem_qa_op.MAX_NEW_TOKENS, ("\n",)),
            "sem_map": ([SEM_MAP.with_constants({"instruction": INSTRUCTION})(lm, p)
                         for _, p in rows], sem_map_op.MAX_NEW_TOKENS, ())}
    for op, (prompts, new, stop) in jobs.items():
        generate(lm, prompts[:2], new, stop=stop)
        cpu0, t0 = other_cpu_s(), time.perf_counter()
        gens = generate(lm, prompts, new, stop=stop)
        wall = time.perf_counter() - t0
        out[op] = {"answers": [g.text.strip() for g in gens], "wall_s": wall,
                   "rows_per_s": len(rows) / wall,
                   "other_cpu_share": (other_cpu_s() - cpu0) / wall}
    return out


def summarise(runs: dict, gold: list[str]) -> list[dict]:
    """One row per (model, precision, operator): speed, agreement with fp32, sem_qa's F1."""
    table = []
    for model, by_prec in runs.items():
        for prec, run in by_prec.items():
            for op in ("sem_qa", "sem_map"):
                r = run[op]
                n = len(r["answers"])
                base = by_prec.get("fp32", {}).get(op, {}).get("answers")
                fp32_speed = by_prec.get("fp32", {}).get(op, {}).get("rows_per_s")
                same = (None if base is None or prec == "fp32" else float(np.mean(
                    [a == b for a, b in zip(r["answers"], base[:n], strict=True)])))
                row = {"model": model, "precision": prec, "operator": op, "rows": n,
                       "path": run["path"], "rows_per_s": r["rows_per_s"],
                       "speedup_vs_fp32": (r["rows_per_s"] / fp32_speed
                                           if fp32_speed else None),
                       "same_as_fp32": same, "other_cpu_share": r["other_cpu_share"]}
                if op == "sem_qa":
                    f1 = token_f1([a or "" for a in r["answers"]], gold[:n])
                    row["f1"] = float(f1.mean())
                    row["f1_se"] = float(f1.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0
                    if base is not None and prec != "fp32":
                        f0 = token_f1([a or "" for a in base[:n]], gold[:n])
                        row["f1_fp32_same_rows"] = float(f0.mean())
                table.append(row)
    return table


def markdown(rows: list[dict]) -> str:
    lines = ["| model | precision | operator | rows | rows/s | vs fp32 | answers = fp32 | "
             "sem_qa F1 ± se (fp32 on the same rows) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f1 = ""
        if "f1" in r:
            f1 = f"{100 * r['f1']:.1f} ± {100 * r['f1_se']:.1f}"
            if "f1_fp32_same_rows" in r:
                f1 += f" ({100 * r['f1_fp32_same_rows']:.1f})"
        speed = "" if r["speedup_vs_fp32"] is None else f"{r['speedup_vs_fp32']:.2f}x"
        same = "" if r["same_as_fp32"] is None else f"{r['same_as_fp32']:.0%}"
        busy = " (contended)" if r["other_cpu_share"] > 0.1 else ""
        lines.append(f"| {r['model']} | {r['precision']} | {r['operator']} | {r['rows']} | "
                     f"{r['rows_per_s']:.2f}{busy} | {speed} | {same} | {f1} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, op in zip(axes, ("sem_qa", "sem_map"), strict=True):
        sel = [r for r in rows if r["operator"] == op]
        labels = [f"{r['model'].split('-')[0]}\n{r['precision']}" for r in sel]
        ax.bar(range(len(sel)), [r["rows_per_s"] for r in sel],
               color=["#888" if r["precision"] == "fp32" else "#2a7" if r["precision"] == "bf16"
                      else "#c83" for r in sel])
        ax.set_xticks(range(len(sel)), labels, fontsize=8)
        ax.set_title(f"{op}: rows/s on 2 CPU threads")
        for i, r in enumerate(sel):
            if r["same_as_fp32"] is not None:
                ax.text(i, r["rows_per_s"], f"{r['same_as_fp32']:.0%} = fp32",
                        ha="center", va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS),
                    type=lambda s: [m.strip() for m in s.split(",") if m.strip()])
    ap.add_argument("--precisions", default="fp32,bf16,int8",
                    type=lambda s: [p.strip() for p in s.split(",") if p.strip()])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--int8-rows", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    bad = [p for p in args.precisions if p not in ("fp32", "bf16", "int8")]
    if bad:
        ap.error(f"unknown precisions {bad}: use fp32, bf16, int8")
    if args.rows < 2 or args.int8_rows < 2:
        ap.error("--rows and --int8-rows must be at least 2")
    started = time.perf_counter()
    sample = sem_qa_op.hybridqa_passage_sample(args.rows)
    rows = [tuple(r) for r in sample.inputs]
    gold = [str(a) for a in sample.references]
    print(f"{len(rows)} HybridQA rows; this CPU multiplies bf16 natively: {cpu_has_bf16()}",
          flush=True)
    runs: dict = {}
    for model in args.models:
        runs[model] = {}
        for prec in args.precisions:
            t0 = time.perf_counter()
            runs[model][prec] = (int8_run(model, rows[:args.int8_rows], args.threads)
                                 if prec == "int8" else
                                 sql_run(model, prec, rows, args.threads))
            speeds = ", ".join(f"{op} {runs[model][prec][op]['rows_per_s']:.2f} rows/s"
                               for op in ("sem_qa", "sem_map"))
            print(f"{model} {prec}: {speeds} ({time.perf_counter() - t0:.0f} s)", flush=True)
    table = summarise(runs, gold)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_precision.json").write_text(json.dumps(
        {"setup": {"rows": len(rows), "int8_rows": args.int8_rows, "threads": args.threads,
                   "instruction": INSTRUCTION, "cpu_has_bf16": cpu_has_bf16(),
                   "wall_s": time.perf_counter() - started},
         "table": table, "runs": runs, "gold": gold}, indent=1))
    (args.out / "llm_precision.md").write_text(markdown(table))
    plot(table, args.out / "llm_precision.png")
    print(markdown(table))
    print(f"wrote {args.out}/llm_precision.json, .md and .png in "
          f"{(time.perf_counter() - started) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
