"""A user's own causal LM: `ken models add NAME PATH` (ken/models/registry.py), named by the
LLM operators like the packaged ones.

The added model is a copy of the packaged SmolLM2 folder (conftest's ``home`` converted it), so
it must score and answer exactly as ``smollm2-135m`` does. What a user may give is checked
before anything is written: pickled weights, remote code, a model that is no causal LM, bad or
taken names; each is refused with a ModelError naming the path and the reason, and leaves
nothing in the store.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import FAMILY_DEVICE, SMALL_FAMILY

import ken
from ken import store
from ken.cli import main
from ken.errors import KenError, ModelError, StoreError
from ken.models import convert, registry
from ken.models.gguf_file import read_header
from ken.models.resources import CAUSAL_LMS, Resources, causal_lm_dir, lm_names
from ken.ops.llm_operator import stage_prefix

TEXTS = ["I love this phone, it works perfectly.", None,
         "Terrible service, I want my money back.", "Is this a question?"]


def smol_dir(home: Path) -> Path:
    return causal_lm_dir("smollm2-135m", home)


def leftovers(home: Path) -> list[Path]:
    return [p for p in (home / "models").iterdir() if store.is_leftover(p)]


@pytest.fixture(scope="module")
def my_smol(home: Path) -> registry.AddedLM:  # noqa: ANN001 - conftest's KEN_HOME
    """SmolLM2's converted folder added as ``my-smol`` (its hidden store files are not
    copied: the copy is sealed anew)."""
    return registry.add("my-smol", smol_dir(home), home=home, force=True)


# --------------------------------------------------------------------------- without models


def test_packaged_names_are_reserved() -> None:
    assert set(CAUSAL_LMS) <= set(registry.packaged_names())
    for name in ("smollm2-135m", "SmolLM2-135M", "qwen2.5-coder-0.5b", "minilm-l6", "gguf"):
        with pytest.raises(ModelError, match="packaged with ken"):
            registry.check_name(name)
    for bad in ("", "../evil", "a b", ".hidden", "x/y", "-dash", "é", "a" * 65):
        with pytest.raises(ModelError, match="not a valid model name"):
            registry.check_name(bad)
    registry.check_name("my-lm_2.5")


def test_stage_names_keep_added_lms_apart() -> None:
    assert stage_prefix("sem_qa", "smollm2-135m") == "qa-smol"
    assert stage_prefix("sem_qa", "my-lm") == "qa-my-lm"
    assert stage_prefix("sem_qa", "smol") == "qa-added-smol"  # not the packaged one's name


def test_refused_before_anything_is_written(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}

    def folder(name: str, files: dict[str, bytes | dict]) -> Path:
        out = tmp_path / name
        out.mkdir()
        for file, data in files.items():
            (out / file).write_bytes(json.dumps(data).encode() if isinstance(data, dict)
                                     else data)
        return out

    cases = [
        (tmp_path / "nowhere", "no such file or folder"),
        (folder("pickled", {"config.json": config, "pytorch_model.bin": b"\x80\x04junk"}),
         r"pickled \(pytorch_model.bin\).*convert it to safetensors"),
        (folder("remote", {"config.json": {**config, "auto_map": {
            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}},
            "model.safetensors": b""}), "asks for remote code"),
        (folder("no-config", {"model.safetensors": b""}), "no config.json"),
        (folder("no-weights", {"config.json": config}), "no weights"),
        (folder("cut", {"config.json": config, "model.safetensors": b"\x10\0\0\0\0\0\0\0{}"}),
         "not a complete safetensors file"),
    ]
    fake, other = tmp_path / "fake.gguf", tmp_path / "weights.txt"
    fake.write_bytes(b"not a gguf")
    other.write_text("x")
    cut = tmp_path / "cut.gguf"  # the magic number, then a header cut short
    cut.write_bytes(b"GGUF\x03\0\0\0" + b"\xff" * 16 + bytes(64))
    cases += [(fake, "not a GGUF file"), (other, "neither a transformers model folder"),
              (cut, "not a valid GGUF file: it claims 18,446,744,073,709,551,615 metadata")]
    for path, reason in cases:
        with pytest.raises(ModelError, match=reason) as info:
            registry.add("x", path, home=home)
        assert f"cannot add {path.absolute()} as 'x'" in str(info.value)
    assert not (home / "models" / "x").exists()


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: a template that loops 10^10 times: it must not hang ken
LOOP_BOMB = ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
             "{% endfor %}")


def test_chat_templates_are_programs_checked_before_they_are_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's chat template is Jinja that ken renders: a long one, one that loops for
    ever, one that renders a flood, one that reaches for Python's internals and one that
    does not parse are each refused with the reason; a real one passes."""
    monkeypatch.setattr(registry, "TEMPLATE_SECONDS", 1.0)  # the default 5 s, sooner
    registry.check_chat_template(CHATML, {"bos_token": "<s>"})
    registry.check_chat_template({"default": CHATML, "tool_use": CHATML})
    registry.check_chat_template(None)
    cases = [
        ("x" * (registry.MAX_TEMPLATE_CHARS + 1), "over ken's limit of 65,536"),
        (LOOP_BOMB, "did not render a four-message conversation within 1 s of CPU"),
        ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
         "renders a four-message conversation as 100,000,000 characters"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
        ("{% for %}", "TemplateSyntaxError"),
        ({"default": CHATML, "evil": LOOP_BOMB}, "chat template 'evil' did not render"),
    ]
    for template, reason in cases:
        with pytest.raises(ModelError, match=reason):
            registry.check_chat_template(template)


# --------------------------------------------------------------------------- with SmolLM2


@pytest.mark.models
def test_added_lm_scores_like_the_packaged_one(home: Path, my_smol: registry.AddedLM) -> None:
    assert my_smol.folder == home / "models" / "my-smol" == causal_lm_dir("my-smol", home)
    assert my_smol.source == str(smol_dir(home))
    assert my_smol.architecture == "LlamaForCausalLM" and 130e6 < my_smol.num_params < 140e6
    assert not (my_smol.folder / ".ken-manifest.json").read_text().count("safetensors.index")
    assert store.check(registry.entry("my-smol", home))[0] == "ok"
    assert "my-smol" in lm_names(home) and registry.added_names(home) == ("my-smol",)
    resources = Resources(FAMILY_DEVICE, home=home)
    mine, packaged = resources.causal_lm("my-smol"), resources.causal_lm("smollm2-135m")
    assert mine is not packaged and Path(mine.source) == my_smol.folder
    tok = packaged.tokenizer
    contexts = [tok.encode(t) for t in ("The capital of France is", "One, two, three,")]
    endings = [tok.encode(t, add_special_tokens=False) for t in (" Paris.", " four")]
    a = mine.continuation_logprobs(contexts, endings)
    b = packaged.continuation_logprobs(contexts, endings)
    assert np.all(np.isfinite(a)) and np.allclose(a, b)


@pytest.mark.models
def test_operators_answer_with_an_added_lm(home: Path, my_smol: registry.AddedLM) -> None:
    query = "SELECT sem_choice(x, 'yes|no') AS a FROM t ORDER BY id"
    answers = {}
    for lm in ("my-smol", "smollm2-135m"):
        with ken.connect(device=FAMILY_DEVICE, data=SMALL_FAMILY, home=home) as s:
            s.register_table("t", pa.table({"id": list(range(len(TEXTS))), "x": TEXTS}))
            s.operators["sem_choice"].llms = (lm,)
            answers[lm] = [r[0] for r in s.sql(query).fetchall()]
            if lm == "my-smol":
                assert "choice-my-smol[" in s.explain(query)
                s.operators["sem_qa"].llms = ("smollm2-135m", "no-such-lm")
                with pytest.raises(KenError, match=r"sem_qa\(\): unknown language model "
                                   r"'no-such-lm'; packaged: smollm2-135m.*added.*my-smol"):
                    s.sql("SELECT sem_qa(x, x) FROM t")
                s.operators["sem_qa"].llms = "my-smol"  # a string, not a tuple
                with pytest.raises(KenError, match="non-empty tuple"):
                    s.sql("SELECT sem_qa(x, x) FROM t")
    assert answers["my-smol"] == answers["smollm2-135m"]
    assert answers["my-smol"][1] is None and set(answers["my-smol"]) - {None} <= {"yes", "no"}


@pytest.mark.models
def test_names_taken_and_models_that_are_no_causal_lm(home: Path, my_smol: registry.AddedLM
                                                      ) -> None:
    with pytest.raises(ModelError, match="already added; pass --force"):
        registry.add("my-smol", smol_dir(home), home=home)
    with pytest.raises(ModelError, match="packaged with ken"):
        registry.add("smollm2-135m", smol_dir(home), home=home)
    (home / "models" / "stray").mkdir(exist_ok=True)  # a folder ken did not add
    with pytest.raises(ModelError, match="not made by `ken models add`"):
        registry.add("stray", smol_dir(home), home=home)
    (home / "models" / "stray").rmdir()
    # a sentence encoder (BERT without an LM head) is not a causal LM: refused, nothing kept
    with pytest.raises(ModelError, match="cannot add .* as 'encoder': its weights do not fill"):
        registry.add("encoder", convert.minilm_l6_dir(), home=home)
    assert not (home / "models" / "encoder").exists() and not leftovers(home)
    assert registry.added_names(home) == ("my-smol",)
    assert causal_lm_dir("my-smol", home) == my_smol.folder  # untouched by the refusals


@pytest.mark.models
def test_cli_add_list_remove(home: Path, my_smol: registry.AddedLM,
                             capsys: pytest.CaptureFixture[str]) -> None:
    source = home / "cli-source"
    shutil.copytree(smol_dir(home), source, dirs_exist_ok=True)
    (source / "pytorch_model.bin").write_bytes(b"pickled")  # beside safetensors: not copied
    (source / "modeling_x.py").write_text("raise SystemExit")  # code: never copied
    assert main(["models", "add", "cli-smol", str(source), "--quiet"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "added cli-smol: LlamaForCausalLM" in out
    folder = home / "models" / "cli-smol"
    assert not (folder / "pytorch_model.bin").exists() and not (folder / "modeling_x.py").exists()
    assert main(["models", "add", "cli-smol", str(source), "--quiet"]) == 1
    assert "pass --force" in capsys.readouterr().err
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "cli-smol" in out and "my-smol" in out and "LlamaForCausalLM" in out
    # a changed file is caught on load, with the command that adds it again
    with (folder / "config.json").open("a") as f:
        f.write(" ")
    with pytest.raises(StoreError, match=r"config.json.*ken models add cli-smol"):
        causal_lm_dir("cli-smol", home)
    assert main(["models", "remove", "cli-smol"]) == 0
    assert not folder.exists() and not leftovers(home)
    with pytest.raises(ModelError, match="unknown language model 'cli-smol'"):
        causal_lm_dir("cli-smol", home)
    assert main(["models", "remove", "smollm2-135m"]) == 1
    assert "packaged with ken" in capsys.readouterr().err
    assert main(["models", "add", "smollm2-135m", str(source)]) == 1
    assert main(["models", "add", "bad name", str(source)]) == 1
    assert "not a valid model name" in capsys.readouterr().err
    shutil.rmtree(source)


@pytest.mark.models
def test_sql_sets_an_operators_llms_and_queries_bind_again(home) -> None:  # noqa: ANN001
    """``SET sem_choice_llms = '...'`` is ``operators['sem_choice'].llms = (...)``; a query after
    it binds the new LMs (a session binds again when an operator's LMs change); ``RESET``
    restores the default; a bad name or setting is an error and changes nothing."""
    s = ken.connect(device=FAMILY_DEVICE, data=SMALL_FAMILY, home=home)
    try:
        op = s.operators["sem_choice"]
        default = op.llms
        assert s.sql("SET sem_choice_llms = ' smollm2-135m '").fetchall() == [
            ("sem_choice_llms", "smollm2-135m")]
        assert op.llms == ("smollm2-135m",)
        first = s.bind("sem_choice", ("yes|no",))
        assert [m.split("[")[0] for m in first.cascade.models] == ["choice-smol"]
        with pytest.raises(KenError, match="no-such-lm"):
            s.sql("SET sem_choice_llms = 'no-such-lm'")
        assert op.llms == ("smollm2-135m",)  # unchanged
        op.threshold = 0.7  # another setting the binding depends on: bound again
        assert s.bind("sem_choice", ("yes|no",)) is not first
        s.sql("RESET sem_choice_llms")
        assert op.llms == default
        with pytest.raises(KenError, match="LLM operators are"):
            s.sql("SET sentiment_llms = 'smollm2-135m'")
    finally:
        s.close()


@pytest.mark.models
def test_a_folder_whose_chat_template_never_finishes_is_refused(home: Path,
                                                                 tmp_path: Path) -> None:
    """SmolLM2's folder with its chat template replaced by a loop that never ends: the model
    itself loads and scores, the template is what is refused, and nothing is written."""
    folder = tmp_path / "loops"
    shutil.copytree(smol_dir(home), folder,
                    ignore=shutil.ignore_patterns(".*", registry.CARD))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = LOOP_BOMB
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # where newer files keep it
    with pytest.raises(ModelError, match="chat template did not render") as info:
        registry.add("loops", folder, home=home)
    assert f"cannot add {folder}" in str(info.value)
    assert not (home / "models" / "loops").exists() and not leftovers(home)


#: a template that reaches for Python's internals, which the sandbox refuses
ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"


def with_chat_template(src: Path, out: Path, template: str) -> Path:
    """A copy of the GGUF file ``src`` whose chat template is ``template``, padded with spaces
    to the original's length (so every offset after it stays where it was)."""
    data = bytearray(src.read_bytes())
    key = b"tokenizer.chat_template"
    at = data.find(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    kind, length = struct.unpack_from("<IQ", data, at)
    new = template.encode()
    assert at > 8 + len(key) and kind == 8 and len(new) <= length
    data[at + 12:at + 12 + length] = new.ljust(length)
    out.write_bytes(data)
    return out


@pytest.mark.models
def test_a_gguf_whose_chat_template_escapes_the_sandbox_is_refused(home: Path,
                                                                  tmp_path: Path) -> None:
    """The packaged SmolLM2 GGUF with its chat template replaced by one that reaches for
    Python's internals: the weights convert and score, the template is refused, nothing is
    written."""
    folder, file = convert.smollm2_gguf()
    assert read_header(folder / file).metadata["tokenizer.chat_template"]  # it has one
    evil = with_chat_template(folder / file, tmp_path / "evil.gguf", ESCAPE)
    assert read_header(evil).metadata["tokenizer.chat_template"].rstrip() == ESCAPE
    with pytest.raises(ModelError, match="chat template cannot render a four-message "
                                         "conversation.*SecurityError") as info:
        registry.add("evil", evil, home=home)
    assert f"cannot add {evil}" in str(info.value)
    assert not (home / "models" / "evil").exists() and not leftovers(home)
