"""benchmarks/gpu_check.py, the one-command check of ken's GPU paths: its pure helpers, the
command it prints for the GPU machine, and its model-building path on a tiny random BERT read
through ken's own loader (the full CPU run, ``--device cpu --quick``, takes ~40 s: run it by
hand)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # the engine part's loaders pickle by this name
    spec.loader.exec_module(module)
    return module


def test_statistics_helpers(gc) -> None:
    p = gc.percentiles([0.001 * i for i in range(1, 101)])
    assert p["p50_ms"] == pytest.approx(50.5) and p["p95_ms"] == pytest.approx(95.05)
    assert p["max_ms"] == pytest.approx(100.0)
    assert np.isnan(gc.percentiles([])["p50_ms"])
    a = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    b = np.array([[2.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    np.testing.assert_allclose(gc.cosines(a, b), [1.0, np.sqrt(0.5), 0.0])


def test_token_comparisons(gc) -> None:
    assert gc.truncate_at([5, 6, 2, 7], frozenset({2})) == [5, 6]
    assert gc.truncate_at([5, 6], frozenset({2})) == [5, 6]
    assert gc.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert gc.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert gc.first_divergence([1, 2], [1, 2, 3]) == 2
    assert gc.agreement([[1, 2, 3], [4]], [[1, 0, 3], [4, 5]]) == pytest.approx(3 / 4)
    assert gc.cycle(["a", "b", "c"], 5, 1) == ["b", "c", "a", "b", "c"]


def test_junit_summary_counts_and_names_failures(gc, tmp_path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="boom"/></testcase>'
        '<testcase classname="tests.test_a" name="test_skip"><skipped message="no gpu"/>'
        "</testcase></testsuite></testsuites>")
    got = gc.junit_summary(xml)
    assert (got["tests"], got["passed"], got["failures"], got["skipped"]) == (3, 1, 1, 1)
    assert got["cases"]["tests.test_a::test_bad"] == "failure: boom"
    assert got["cases"]["tests.test_a::test_ok"] == "passed"


def test_device_command_fits_the_tool_and_installs_the_carried_wheels(gc) -> None:
    command = gc.device_command()
    assert len(command) <= 2000
    assert ".gpu/whl/*.whl" in command and "--target /tmp/site" in command
    assert "PYTHONPATH=/tmp/site:." in command and "--device cuda" in command
    assert "tee $OUT/gpu_check.log" in command and "--quick" not in command
    assert "--quick" in gc.device_command(quick=True)


def test_add_exclude_appends_once(gc, tmp_path) -> None:
    path = tmp_path / "info" / "exclude"
    assert gc.add_exclude(path, "/.gpu/")
    assert not gc.add_exclude(path, "/.gpu/")
    path.write_text(path.read_text() + "/.other/")  # no final newline
    assert gc.add_exclude(path, "/.x/")
    assert path.read_text().splitlines() == ["/.gpu/", "/.other/", "/.x/"]


def test_summary_reports_errors_and_skips(gc, tmp_path) -> None:
    result = {"device": "cpu", "quick": True, "wall_s": 3.0, "setup": {"batch_sizes": [1]},
              "parts": {"env": {"status": "ok", "seconds": 0.1, "result": {"torch": "x"}},
                        "llm": {"status": "error", "seconds": 0.2,
                                "error": "Traceback ...\nValueError: broken"},
                        "pytest": {"status": "skipped: time budget", "seconds": 0.0}}}
    gc.write(result, tmp_path)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| llm | error |" in md and "ValueError: broken" in md
    assert "| pytest | skipped: time budget |" in md and "random weights" in md
    assert json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["env"]["status"] == "ok"


def test_random_model_loads_through_kens_body_and_classifier(gc, tmp_path) -> None:
    """A tiny BERT (L6's tokenizer, random weights) written by build_random is what ken's
    TransformersBody loads; the classifier answers every row with finite probabilities."""
    from ken.models import convert
    from ken.models.head import fit_logistic
    from ken.models.model import DeviceConfig
    from ken.models.transformers_backend import TransformersBody

    try:
        l6 = convert.minilm_l6_dir()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"MiniLM-L6's package is not installed: {exc}")
    src = tmp_path / "src"
    src.mkdir()
    config = json.loads((l6 / "config.json").read_text())
    config.update(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64)
    (src / "config.json").write_text(json.dumps(config))
    for name in gc.MODEL_FILES[1:]:
        if (l6 / name).is_file():
            (src / name).write_bytes((l6 / name).read_bytes())
    folder = gc.build_random(src, tmp_path / "tiny", causal=False, seed=1)
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert gc.build_random(src, folder, causal=False) == folder  # built once
    device = DeviceConfig("cpu", 0, 1, "fp32")
    texts = ["good day", "a terrible, awful film", "meh", "fine I guess"]
    body = TransformersBody(gc.body_config("minilm-l6", folder), device)
    feats = body.features(texts, 2)
    assert feats.shape == (4, 32) and np.isfinite(feats).all()
    head = fit_logistic(feats, np.array([1, 0, 0, 1]), ("negative", "positive"))
    model = gc.classifier("tiny", folder, device, head, body)
    pred = model.predict(texts, 3)
    assert len(pred) == 4 and np.isfinite(pred.probabilities).all()
    assert model.spec.memory_bytes == body.memory_bytes and model.spec.labels == head.label_names
