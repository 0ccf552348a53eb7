"""What "auto" precision means for a causal LM (issue 34, item 5): bf16 on a CPU that
multiplies it natively, fp32 elsewhere, an explicit precision or $KEN_LLM_PRECISION kept."""

from __future__ import annotations

import pytest

from ken.errors import KenError
from ken.models import model as model_module
from ken.models.model import (
    CPU_LLM_AUTO_PRECISION,
    LLM_PRECISION_ENV,
    DeviceConfig,
    cpu_has_bf16,
)


def test_cpu_flags_decide_native_bf16(tmp_path) -> None:  # noqa: ANN001
    with_bf16 = tmp_path / "a"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 avx512_vnni\n")
    amx = tmp_path / "b"
    amx.write_text("flags\t: fpu avx512f amx_tile amx_bf16\n")
    without = tmp_path / "c"
    without.write_text("flags\t: fpu sse2 avx2 avx512f avx512_vnni\n")
    assert cpu_has_bf16(str(with_bf16)) and cpu_has_bf16(str(amx))
    assert not cpu_has_bf16(str(without))
    assert not cpu_has_bf16(str(tmp_path / "absent"))


@pytest.mark.parametrize("native", [True, False])
def test_auto_resolves_for_a_causal_lm(monkeypatch, native) -> None:  # noqa: ANN001
    monkeypatch.delenv(LLM_PRECISION_ENV, raising=False)
    monkeypatch.setattr(model_module, "cpu_has_bf16", lambda: native)
    lm = DeviceConfig(threads=2).for_causal_lm()
    expected = CPU_LLM_AUTO_PRECISION if native else "fp32"
    assert lm.precision == expected and lm.threads == 2
    assert lm.label == ("cpu-2t" if expected == "fp32" else f"cpu-2t-{expected}")
    # encoders and every other model keep "auto" = fp32 on a CPU
    assert DeviceConfig(threads=2).dtype_name == "fp32"


def test_explicit_precision_and_gpus_are_kept(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(model_module, "cpu_has_bf16", lambda: True)
    monkeypatch.setenv(LLM_PRECISION_ENV, "bf16")
    fp32 = DeviceConfig(threads=2, precision="fp32")
    assert fp32.for_causal_lm() is fp32
    gpu = DeviceConfig("cuda", 0)
    assert gpu.for_causal_lm() is gpu


@pytest.mark.parametrize("value", ["fp32", "BF16 "])
def test_the_environment_overrides_auto(monkeypatch, value) -> None:  # noqa: ANN001
    monkeypatch.setattr(model_module, "cpu_has_bf16", lambda: True)
    monkeypatch.setenv(LLM_PRECISION_ENV, value)
    assert DeviceConfig().for_causal_lm().precision == value.strip().lower()


def test_a_bad_environment_value_is_refused(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv(LLM_PRECISION_ENV, "int8")
    with pytest.raises(KenError, match="KEN_LLM_PRECISION must be fp32 or bf16, not 'int8'"):
        DeviceConfig().for_causal_lm()


@pytest.mark.models
def test_a_loaded_lm_runs_and_is_named_in_its_precision(home, monkeypatch) -> None:  # noqa: ANN001
    """SmolLM2 loaded for an "auto" device runs in the resolved precision, and its models
    carry that device, so profiles (keyed by the device label) of fp32 and bf16 stay apart."""
    import torch

    from ken.models.llm import GenerativeModel
    from ken.models.resources import Resources
    from ken.ops.prompts import SEM_QA

    monkeypatch.delenv(LLM_PRECISION_ENV, raising=False)
    auto = Resources(DeviceConfig(threads=2), home=home).causal_lm("smollm2-135m")
    expected = CPU_LLM_AUTO_PRECISION if cpu_has_bf16() else "fp32"
    assert auto.device.precision == expected
    assert next(auto.net.parameters()).dtype == {"fp32": torch.float32,
                                                 "bf16": torch.bfloat16}[expected]
    fp32 = Resources(DeviceConfig(threads=2, precision="fp32"), home=home).causal_lm(
        "smollm2-135m")
    assert next(fp32.net.parameters()).dtype == torch.float32
    models = [GenerativeModel(lm, SEM_QA, "qa", "sem-qa", SEM_QA.key, 8, stop=("\n",),
                              num_inputs=2) for lm in (auto, fp32)]
    assert models[1].device.label == "cpu-2t"
    assert (models[0].device.label == "cpu-2t") == (expected == "fp32")
    row = ("What is the capital of France?", "Paris is the capital and largest city of France.")
    answers = [m.predict([row]).values[0] for m in models]
    assert all("Paris" in a for a in answers), answers


@pytest.mark.parametrize(("env", "taken_out"), [(None, True), ("1", False)])
def test_cudnn_attention_is_taken_out_unless_asked_for(monkeypatch, env, taken_out) -> None:  # noqa: ANN001
    """A causal LM on a GPU takes cuDNN out of torch's attention kernels (it builds a plan per
    new shape: 3x slower decode steps on an H100); KEN_CUDNN_ATTENTION=1 keeps it."""
    import torch

    from ken.models.resources import CUDNN_ATTENTION_ENV, avoid_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        if env is None:
            monkeypatch.delenv(CUDNN_ATTENTION_ENV, raising=False)
        else:
            monkeypatch.setenv(CUDNN_ATTENTION_ENV, env)
        assert avoid_cudnn_attention() is taken_out
        assert torch.backends.cuda.cudnn_sdp_enabled() is not taken_out
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
