"""The GPU fast path (issue 18): weight precision, vectorised and bucketed padding, the
pinned / non-blocking / one-copy-back path on CUDA, and the reference decode loop of
benchmarks/gpu_overhead.py.

Everything but the last two tests runs on a CPU; those need CUDA and say so when skipped.
The real-model tests use all-MiniLM-L6-v2 from its installed wheel (no conversion) and a tiny
random Llama saved to a temporary folder, so they stay fast and never touch KEN_HOME.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ken.errors import KenError, ModelError
from ken.models import convert
from ken.models.model import CUDA_AUTO_PRECISION, PRECISIONS, DeviceConfig
from ken.models.resources import CausalLM
from ken.models.transformers_backend import (
    GPU_WIDTHS,
    PAD_MULTIPLE,
    BodyConfig,
    TransformersBody,
    gpu_rows,
    gpu_width,
    pad_arrays,
    pad_batch,
    padded_width,
)

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False on this machine)"
BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_overhead.py"


def loop_pad(sequences, pad_id, left=False):  # noqa: ANN001, ANN201
    """pad_batch as it was before it was vectorised: a Python loop of per-row writes."""
    width = max(len(seq) for seq in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for j, seq in enumerate(sequences):
        span = slice(width - len(seq), width) if left else slice(0, len(seq))
        input_ids[j, span] = torch.tensor(list(seq), dtype=torch.long)
        mask[j, span] = 1
    return input_ids, mask


# ----------------------------------------------------------------- padding


rows_strategy = st.lists(st.lists(st.integers(0, 50_000), max_size=40), min_size=1,
                         max_size=12)


@settings(max_examples=200, deadline=None)
@given(rows_strategy, st.integers(0, 3), st.booleans(), st.sampled_from([list, tuple,
                                                                          np.array]))
def test_vectorised_padding_equals_the_loop(rows, pad_id, left, kind) -> None:
    sequences = [kind(r) if kind is not np.array else np.array(r, dtype=np.int64)
                 for r in rows]
    want_ids, want_mask = loop_pad(sequences, pad_id, left)
    ids, mask = pad_batch(sequences, pad_id, left)
    assert ids.dtype == want_ids.dtype == torch.long and mask.dtype == torch.long
    assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask)


@settings(max_examples=100, deadline=None)
@given(rows_strategy, st.integers(0, 16), st.booleans())
def test_padding_to_a_wider_width_only_adds_pad_columns(rows, extra, left) -> None:
    want_ids, want_mask = loop_pad(rows, 7, left)
    longest = want_ids.shape[1]
    out = np.full((2, len(rows), longest + extra), -1, dtype=np.int64)  # stale contents
    ids, mask = pad_arrays(rows, 7, left, width=longest + extra, out=out)
    assert ids.base is out or np.shares_memory(ids, out)
    cols = slice(extra, None) if left else slice(0, longest)
    pads = slice(0, extra) if left else slice(longest, None)
    assert np.array_equal(ids[:, cols], want_ids.numpy())
    assert np.array_equal(mask[:, cols], want_mask.numpy())
    assert (ids[:, pads] == 7).all() and (mask[:, pads] == 0).all()


def test_padding_rejects_a_narrow_width_and_a_wrong_buffer() -> None:
    with pytest.raises(ModelError, match="width 2"):
        pad_arrays([[1, 2, 3]], 0, width=2)
    with pytest.raises(ModelError, match="pad buffer"):
        pad_arrays([[1, 2, 3]], 0, width=4, out=np.zeros((2, 1, 3), dtype=np.int64))
    with pytest.raises(ModelError, match="pad buffer"):
        pad_arrays([[1, 2, 3]], 0, width=3, out=np.zeros((2, 1, 3), dtype=np.int32))
    ids, mask = pad_arrays([], 0)
    assert ids.shape == mask.shape == (0, 0)


def test_padded_width_rounds_up_to_the_multiple_within_the_limit() -> None:
    assert [padded_width(n, 128) for n in (1, 8, 9, 17, 121, 128)] == [8, 8, 16, 24, 128, 128]
    assert padded_width(126, 126) == 126  # capped at the model's limit
    assert padded_width(130, 128) == 130  # never below the longest row
    assert padded_width(9, 128, 1) == 9 and padded_width(9, 128, 32) == 32
    assert PAD_MULTIPLE == 8


def test_gpu_buckets_hold_every_batch_and_come_in_few_shapes() -> None:
    for longest in range(1, 600):
        w = gpu_width(longest, 512)
        assert w >= longest and (w in GPU_WIDTHS or w == longest > 512)
        assert gpu_width(longest, 128) <= max(128, longest)  # capped at the model's limit
    assert len({gpu_width(n, 128) for n in range(1, 129)}) == 8
    for rows in range(1, 300):
        b = gpu_rows(rows)
        assert b >= rows and b & (b - 1) == 0 and b < 2 * rows
    assert [gpu_rows(n) for n in (1, 2, 3, 5, 128)] == [1, 2, 4, 8, 128]


# ----------------------------------------------------------------- device precision


def test_device_precision_is_validated_and_named_in_the_label() -> None:
    assert PRECISIONS == ("auto", "fp32", "bf16", "fp16")
    with pytest.raises(KenError, match="precision must be one of"):
        DeviceConfig(precision="fp8")
    cpu = DeviceConfig(threads=2)
    assert cpu.precision == "auto" and cpu.dtype_name == "fp32"
    assert cpu.torch_dtype == torch.float32
    # fp32 keeps the labels (profile cache keys) it always had
    assert cpu.label == DeviceConfig(threads=2, precision="fp32").label == "cpu-2t"
    assert DeviceConfig("cuda", 1).label == f"cuda1-{CUDA_AUTO_PRECISION}"
    assert DeviceConfig("cuda", 0, precision="fp32").label == "cuda0"
    assert DeviceConfig(threads=2, precision="bf16").label == "cpu-2t-bf16"
    assert DeviceConfig("cuda", precision="bf16").torch_dtype == torch.bfloat16
    assert DeviceConfig(precision="fp16").torch_dtype == torch.float16
    assert DeviceConfig("cuda").torch_dtype == {"fp16": torch.float16,
                                                "bf16": torch.bfloat16}[CUDA_AUTO_PRECISION]
    # different precisions are different devices (Resources keys its networks by device)
    assert DeviceConfig(precision="fp16") != DeviceConfig(precision="bf16")
    assert len({DeviceConfig(), DeviceConfig(precision="fp32"), DeviceConfig(precision="fp16")}
               ) == 3


# ----------------------------------------------------------------- a real encoder

TEXTS = ["", "ok", "this flight was delayed again and again and again, never flying again",
         "lovely crew, smooth landing :)", " ".join(["long text"] * 200), "meh", "a b c d e f g",
         "worst customer service i have had in years, two hours on hold for nothing at all"]


@pytest.fixture(scope="module")
def minilm() -> TransformersBody:
    return TransformersBody(BodyConfig(str(convert.minilm_l6_dir())), DeviceConfig(threads=1))


def reference_features(body: TransformersBody, texts: list[str], batch_size: int) -> np.ndarray:
    """features() as it was: the padding loop, one batch at a time, copied back per batch."""
    ids = body.tokenize(texts)
    order = np.argsort([len(r) for r in ids], kind="stable")
    out = np.zeros((len(texts), int(body.net.config.hidden_size)), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            input_ids, mask = loop_pad([ids[i] for i in rows], body.pad_id)
            out[rows] = body.pool(input_ids, mask).float().cpu().numpy()
    return out


@pytest.mark.models
def test_features_equal_the_previous_path(minilm) -> None:
    assert minilm.pad_multiple == 1  # a CPU pads to the longest row
    for batch_size in (1, 3, 32):
        got = minilm.features(TEXTS, batch_size)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, reference_features(minilm, TEXTS, batch_size),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.models
def test_bucketed_widths_give_the_same_features(minilm) -> None:
    plain = minilm.features(TEXTS, 3)
    widths = []
    original = minilm.pool

    def spy(input_ids, mask):  # noqa: ANN001, ANN202
        widths.append(int(input_ids.shape[1]))
        return original(input_ids, mask)

    try:
        minilm.pool = spy
        for multiple in (8, 32, 1000):
            widths.clear()
            minilm.pad_multiple = multiple
            np.testing.assert_allclose(minilm.features(TEXTS, 3), plain, atol=1e-5, rtol=1e-5)
            assert all(w % multiple == 0 or w == minilm.max_tokens for w in widths), widths
            assert max(widths) == minilm.max_tokens  # the long text: capped, never past it
    finally:
        minilm.pad_multiple = 1
        del minilm.pool


@pytest.mark.models
@pytest.mark.parametrize(("precision", "min_cosine"), [("bf16", 0.999), ("fp16", 0.9999)])
def test_half_precision_encoder_is_close_to_fp32(minilm, precision, min_cosine) -> None:
    body = TransformersBody(BodyConfig(str(convert.minilm_l6_dir())),
                            DeviceConfig(threads=1, precision=precision))
    dtype = DeviceConfig(precision=precision).torch_dtype
    assert {p.dtype for p in body.net.parameters()} == {dtype}
    assert body.memory_bytes * 2 == pytest.approx(minilm.memory_bytes, rel=0.01)
    want = minilm.features(TEXTS, 4)
    got = body.features(TEXTS, 4)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() > min_cosine, cosine


# ----------------------------------------------------------------- a tiny causal LM


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer random Llama with MiniLM's tokenizer: cheap, and a real transformers folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = AutoTokenizer.from_pretrained(str(convert.minilm_l6_dir()))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         initializer_range=0.3, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


PROMPTS = [[101, 2023, 3462, 2001], [101, 2307], [101, 9202, 2326, 1010, 2053, 2062, 102]]


@pytest.mark.models
def test_causal_lm_loads_in_the_device_precision(tiny_llama) -> None:
    scores = {}
    for precision in ("fp32", "bf16", "fp16"):
        lm = CausalLM(tiny_llama, DeviceConfig(threads=1, precision=precision))
        assert {p.dtype for p in lm.net.parameters()} == {lm.device.torch_dtype}
        scores[precision] = lm.next_token_scores(PROMPTS, [[1996], [2000, 2001]], batch_size=2)
        assert scores[precision].dtype == np.float64
        assert np.isfinite(scores[precision]).all()
    np.testing.assert_allclose(scores["fp16"], scores["fp32"], atol=0.02)
    np.testing.assert_allclose(scores["bf16"], scores["fp32"], atol=0.15)


def load_benchmark():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("gpu_overhead", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.models
def test_static_cache_reference_decodes_like_decode_batch(tiny_llama) -> None:
    from ken.models.generation import DecodeBatch

    bench = load_benchmark()
    lm = CausalLM(tiny_llama, DeviceConfig(threads=1))
    prompts = [[101, 2023, 3462, 2001, 2200], [101, 2307, 2154, 999, 102]]  # one length
    steps = 6
    batch = DecodeBatch.prefill(lm, prompts, [0, 1], [steps + 1] * 2, ignore_eos=True)
    while any(not r.done for r in batch.rows):
        batch.step()
    want = [list(r.tokens) for r in batch.rows]
    decoder = bench.StaticDecoder(lm, prompts, steps)
    with torch.inference_mode():
        for _ in range(steps):
            decoder.step()
    assert decoder.generated() == want
    assert len(set(want[0])) > 1  # really decodes, not one token over and over


def test_benchmark_arithmetic_counts_the_weight_matmuls() -> None:
    from transformers import AutoConfig

    bench = load_benchmark()
    config = AutoConfig.from_pretrained(str(convert.minilm_l6_dir()))
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token = 2 * (4 * h * h + 2 * h * i)
    assert bench.layer_matmul_flops(config) == per_token
    assert bench.encoder_flops(config, [10, 20]) == layers * (30 * per_token
                                                            + 4 * (100 + 400) * h)
    assert bench.bound_ms(1e12, 0, 1.0, 1.0) == pytest.approx(1000.0)
    assert bench.bound_ms(0, 2e9, 1.0, 1.0) == pytest.approx(2000.0)
    args = bench.parse_args(["--device", "cpu", "--quick"])
    assert args.precisions == ("fp32",) and args.encoders == ("minilm-l3", "minilm-l6")


# ----------------------------------------------------------------- CUDA only


@pytest.mark.models
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_features_copy_pinned_without_waiting_and_come_back_once(minilm, monkeypatch
                                                                      ) -> None:
    device = DeviceConfig("cuda", threads=1, precision="fp32")
    body = TransformersBody(BodyConfig(str(convert.minilm_l6_dir())), device)
    assert body.pad_multiple == PAD_MULTIPLE
    uploads, downloads = [], []
    real_to, real_cpu = torch.Tensor.to, torch.Tensor.cpu
    hidden = int(body.net.config.hidden_size)

    def to(self, *args, **kwargs):  # noqa: ANN001, ANN202
        if self.device.type == "cpu" and self.dtype == torch.long and self.dim() == 3:
            uploads.append((self.is_pinned(), kwargs.get("non_blocking", False)))
        return real_to(self, *args, **kwargs)

    def cpu(self, *args, **kwargs):  # noqa: ANN001, ANN202
        if self.device.type == "cuda" and tuple(self.shape) == (len(TEXTS), hidden):
            downloads.append(tuple(self.shape))
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    got = body.features(TEXTS, 3)
    monkeypatch.undo()
    assert uploads == [(True, True)] * 3  # ids and mask in one pinned, non-blocking copy
    assert downloads == [(len(TEXTS), hidden)]  # one copy back for all batches
    np.testing.assert_allclose(got, minilm.features(TEXTS, 3), atol=2e-4, rtol=1e-3)


@pytest.mark.models
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_auto_precision_is_half_and_close_to_fp32(minilm) -> None:
    body = TransformersBody(BodyConfig(str(convert.minilm_l6_dir())), DeviceConfig("cuda"))
    assert {p.dtype for p in body.net.parameters()} == {DeviceConfig("cuda").torch_dtype}
    got, want = body.features(TEXTS, 4), minilm.features(TEXTS, 4)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert got.dtype == np.float32 and cosine.min() > 0.999
