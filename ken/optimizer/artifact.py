"""The KEN paper artifact's measured V100 profiles as a planning catalog.

``../shared/data/ken-artifact/bert_v100_profile.json`` holds measured V100 runtimes for batch
sizes 1..100 and memory of BERT tiny/mini/small/medium/base(/large) classifiers;
``v100_gpu.json`` the GPU's memory. The artifact has no per-sample predictions, so per-sample
outcomes are *synthesised*: each sample gets a difficulty ``z ~ N(0, 1)`` shared by all models,
and model ``m`` puts probability ``sigmoid(scale * (skill_m - z) + noise)`` on the true class,
with ``skill_m`` chosen so single-model accuracies rise with model size (``ARTIFACT_ACCURACY``,
close to the artifact's Sentiment-140 numbers). Cascades built on this catalog therefore have
realistic runtimes and plausible, but not measured, accuracies; the planner benchmark uses it
to measure planning *time* at the paper's scale.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy.special import expit
from scipy.stats import norm

from ken.errors import ProfileError
from ken.optimizer.perf import Catalog, ModelPerf
from ken.optimizer.profile import Profile
from ken.optimizer.workload import Device, Hardware
from ken.paths import shared_data_dir

ARTIFACT_DIR = Path("ken-artifact")
BERT_MODELS = ("tiny", "mini", "small", "medium", "base")
#: single-model accuracy the synthetic outcomes are drawn to reach (Sentiment-140-like)
ARTIFACT_ACCURACY = {"tiny": 0.78, "mini": 0.80, "small": 0.815, "medium": 0.825,
                     "base": 0.845, "large": 0.85}
LABEL_NAMES = ("negative", "positive")
_SCALE = 2.0
_NOISE = 1.0


def artifact_dir(data_dir: str | Path | None = None) -> Path:
    base = Path(data_dir) if data_dir is not None else shared_data_dir()
    folder = base / ARTIFACT_DIR
    if not (folder / "bert_v100_profile.json").is_file():
        raise ProfileError(f"the KEN artifact profiles are not at {folder}; pass the folder "
                           "that holds ken-artifact/bert_v100_profile.json")
    return folder


def load_bert_perf(data_dir: str | Path | None = None,
                   models: tuple[str, ...] = BERT_MODELS) -> dict[str, ModelPerf]:
    """Measured V100 runtime per batch size (1..100) and memory of the BERT models."""
    raw = json.loads((artifact_dir(data_dir) / "bert_v100_profile.json").read_text())
    out = {}
    for name in models:
        if name not in raw:
            raise ProfileError(f"the artifact has no BERT model {name!r}; it has {sorted(raw)}")
        runtime = raw[name]["runtime"]
        sizes = sorted(int(k) for k in runtime if k != "default")
        mem = np.asarray(raw[name]["memory"]).ravel()
        out[name] = ModelPerf(f"bert-{name}", tuple(sizes),
                              (tuple(float(runtime[str(b)]) for b in sizes),),
                              (int(mem[0]),), (1,))
    return out


def v100_hardware(num_devices: int = 16, per_node: int = 8,
                  data_dir: str | Path | None = None) -> Hardware:
    """``num_devices`` V100s (memory from the artifact), ``per_node`` per node."""
    raw = json.loads((artifact_dir(data_dir) / "v100_gpu.json").read_text())
    mem = int(raw["gpu_memory"])
    return Hardware(tuple(Device(f"gpu{i}", "cuda", mem, i // per_node)
                          for i in range(num_devices)))


def bert_profiles(data_dir: str | Path | None = None, num_rows: int = 4000,
                  models: tuple[str, ...] = BERT_MODELS, seed: int = 0) -> dict[str, Profile]:
    """Artifact runtimes plus synthetic per-sample outcomes (see the module docstring), as
    ``Profile`` objects, so the cascade search and ``Catalog.from_profiles`` apply unchanged."""
    perf = load_bert_perf(data_dir, models)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, num_rows)
    z = rng.standard_normal(num_rows)
    spread = np.sqrt(_SCALE ** 2 + _NOISE ** 2)
    sample_hash = f"synthetic-{num_rows}-{seed}"
    out = {}
    for short, mp in perf.items():
        # P(scale * (skill - z) + noise > 0) = Phi(scale * skill / spread) = target accuracy
        skill = norm.ppf(ARTIFACT_ACCURACY[short]) * spread / _SCALE
        p_true = expit(_SCALE * (skill - z) + _NOISE * rng.standard_normal(num_rows))
        probs = np.empty((num_rows, 2), dtype=np.float32)
        probs[np.arange(num_rows), labels] = p_true
        probs[np.arange(num_rows), 1 - labels] = 1.0 - p_true
        preds = np.where(p_true > 0.5, labels, 1 - labels)
        out[mp.name] = Profile(
            model=mp.name, hardware="v100", batch_sizes=mp.batch_sizes,
            batch_runtime_s=mp.runtime_s[0], memory_bytes=mp.memory_bytes[0],
            peak_memory_bytes=mp.memory_bytes[0], label_names=LABEL_NAMES,
            sample_name="synthetic-sentiment140", sample_hash=sample_hash,
            model_fingerprint=f"artifact-{mp.name}",
            quality=(preds == labels).astype(np.float64), scores=probs,
            values=tuple(LABEL_NAMES[i] for i in preds.tolist()))
    return out


def bert_catalog(data_dir: str | Path | None = None, num_rows: int = 4000,
                 models: tuple[str, ...] = BERT_MODELS, seed: int = 0) -> Catalog:
    return Catalog.from_profiles(bert_profiles(data_dir, num_rows, models, seed))
