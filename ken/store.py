"""The model store (``KEN_HOME``): atomic writes, hashed entries, a verification cache, a lock.

Everything ken keeps in ``KEN_HOME`` (converted models, fine-tuned bodies and heads, model
cards, trees files, calibrations, profiles, plans) is written and loaded as an :class:`Entry`:
a folder, or a group of files in a shared folder, whose **manifest** records the sha256 and
size of every file (paths relative to the entry, so a store can be moved or copied). The
manifest is written last, atomically, so its presence marks a complete entry.

* :func:`ensure` checks an entry before ken loads it. A file whose size, inode and change
  times are those of its last good check is not hashed again (the per-entry cache
  ``.ken-verified.json``), so loading stays cheap; anything else is hashed and compared. A
  missing, unreadable, truncated or changed file raises :class:`~ken.errors.StoreError`
  naming the file and the command that rebuilds it: never a wrong answer. Callers repair
  where that is cheap and safe (re-convert, re-profile, re-plan) and raise otherwise.
* An entry written before ken kept manifests has none: its ``legacy`` check (the card's
  fingerprint, structural checks: JSON parses, safetensors sizes agree) decides whether it is
  adopted (a manifest is written from its files) or treated as damaged.
* :func:`write_text`, :func:`write_bytes`, :func:`atomic_path` and :func:`staging_dir` write
  under a unique temporary name in the target's folder, fsync and rename into place, so a
  killed run never leaves a file or folder that looks complete.
* :func:`store_lock` (``fcntl`` on ``KEN_HOME/.lock``) keeps concurrent prepare, profile and
  plan runs of different processes apart; it is re-entrant within a process and says whom it
  waits for.

>>> # entry = Entry(home / "profiles" / "m-cpu-1t-0123", "the profile of m", "run `ken profile`")
>>> # with staging_dir(entry.root) as tmp:
>>> #     (tmp / "header.json").write_text("{}"); seal(Entry(tmp, "", ""))
>>> # ensure(entry)  # StoreError if a byte changed since
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from ken.errors import StoreError
from ken.paths import ken_home

MANIFEST = ".ken-manifest.json"
VERIFIED = ".ken-verified.json"
LOCK = ".lock"
MANIFEST_VERSION = 1
REPAIR = "`ken models verify --repair`"
_BLOCK = 1 << 22  # 4 MiB reads while hashing


# --------------------------------------------------------------------------- atomic writes


def temporary_name(path: Path, suffix: str = ".tmp") -> Path:
    """A unique hidden name next to ``path`` (same folder, so the final rename is atomic)."""
    return path.parent / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{suffix}"


def _fsync_dir(folder: Path) -> None:
    with suppress(OSError):  # not every file system lets a folder be opened for fsync
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a unique temporary path next to ``path``; when the block ends without an error the
    file written there is fsynced and renamed to ``path`` (else removed).

    For writers that need a file name (safetensors, Parquet, numpy):

    >>> # with atomic_path(folder / "head.safetensors") as tmp:
    >>> #     save_file(tensors, str(tmp))
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        with suppress(FileNotFoundError):
            tmp.unlink()


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (unique temporary name, fsync, rename)."""
    path = Path(path)
    with atomic_path(path) as tmp, tmp.open("wb") as f:
        f.write(data)
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_bytes(path, text.encode("utf-8"))


@contextmanager
def staging_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield an empty hidden folder next to ``out_dir``; on success it replaces ``out_dir``.

    Building next to the target keeps the final rename on one file system (so it is atomic);
    the ``.partial`` name marks leftovers of a killed run as incomplete. An existing
    ``out_dir`` is replaced only after the new folder is complete: at every moment
    ``out_dir`` is the old or the new complete folder (or absent).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise StoreError(f"{out_dir} exists and is not a folder; move it away or choose "
                         "another path")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir (unlike tempfile.mkdtemp, which forces 0700) honours the umask, so the finished
    # folder gets the same permissions as any folder the user creates.
    staging = temporary_name(out_dir, ".partial")
    os.mkdir(staging)
    try:
        yield staging
        _normalise_permissions(staging)
        for path in staging.rglob("*"):
            if path.is_file():
                _fsync_file(path)
        _restat_cache(Entry(staging, "", ""))
        if out_dir.exists():
            old = temporary_name(out_dir, ".old")
            os.replace(out_dir, old)
            os.replace(staging, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
        _fsync_dir(out_dir.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _normalise_permissions(folder: Path) -> None:
    """Give every file in ``folder`` the folder's umask-derived read/write bits.

    transformers writes ``model.safetensors`` through a private temporary file (mode 0600);
    a model in a shared cache should be readable like the rest of the folder.
    """
    mode = folder.stat().st_mode & 0o666
    for path in folder.rglob("*"):
        if path.is_file() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


def is_leftover(path: Path) -> bool:
    """Whether ``path`` is a temporary of an interrupted write (safe to delete)."""
    name = path.name
    return name.startswith(".") and name.endswith((".tmp", ".partial", ".old"))


# --------------------------------------------------------------------------- entries


@dataclass(frozen=True)
class Entry:
    """Files ken writes and loads together, and what to tell a user when they are damaged.

    ``files=None``: a folder entry, every file under ``root`` (its manifest inside it).
    Otherwise a group of files in the shared folder ``root`` (plans, heads, ...), the manifest
    beside them (``.<first file>.manifest.json``). ``what`` names the entry in messages
    ("the minilm-l3 model of the minilm-sentiment family"); ``fix`` says how to rebuild it
    ("run `ken models prepare`"). ``legacy`` checks an entry written before manifests existed
    and returns the files to record (None: all of them); it raises StoreError when the entry
    does not pass.
    """

    root: Path
    what: str
    fix: str
    files: tuple[str, ...] | None = None
    legacy: Callable[[Entry], tuple[str, ...] | None] | None = field(default=None,
                                                                     compare=False, repr=False)

    @property
    def manifest(self) -> Path:
        return self.root / (MANIFEST if self.files is None else f".{self.files[0]}.manifest.json")

    @property
    def verified(self) -> Path:
        return self.root / (VERIFIED if self.files is None else f".{self.files[0]}.verified.json")

    @property
    def main(self) -> Path:
        """The path a user knows the entry by: its folder, or its first file."""
        return self.root if self.files is None else self.root / self.files[0]

    def exists(self) -> bool:
        return self.main.exists()

    def sealed(self) -> bool:
        """Whether its manifest is there (it may still fail verification)."""
        return self.manifest.is_file()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _entry_files(entry: Entry) -> list[str]:
    if entry.files is not None:
        return list(entry.files)
    out = []
    for path in sorted(entry.root.rglob("*")):
        rel = path.relative_to(entry.root)
        if not path.is_file() or rel.parts[0] in (MANIFEST, VERIFIED) or \
                any(is_leftover(Path(p)) for p in rel.parts):
            continue
        out.append(rel.as_posix())
    return out


def _stat_key(st: os.stat_result) -> list[int]:
    # size, inode and both times: a rewrite (even one that restores the mtime) changes ctime
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def seal(entry: Entry, files: Iterable[str] | None = None) -> dict[str, dict]:
    """Record the sha256 and size of ``files`` (relative to ``entry.root``; default: the
    entry's files) in its manifest, written last and atomically. Returns the records."""
    names = list(files) if files is not None else _entry_files(entry)
    records: dict[str, dict] = {}
    cache: dict[str, list] = {}
    for rel in names:
        path = entry.root / rel
        try:
            sha = file_sha256(path)
            st = path.stat()
        except OSError as exc:
            raise StoreError(f"cannot record {path} in the model store: {exc}") from exc
        records[rel] = {"sha256": sha, "size": st.st_size}
        cache[rel] = [*_stat_key(st), sha]
    manifest = {"version": MANIFEST_VERSION, "files": records}
    write_text(entry.manifest, json.dumps(manifest, indent=1, sort_keys=True))
    _write_cache(entry, cache)
    return records


def read_manifest(entry: Entry) -> dict[str, dict] | None:
    """The entry's file records, or None when it has no manifest (StoreError if unreadable)."""
    try:
        raw = entry.manifest.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(_message(entry, [f"{entry.manifest} cannot be read ({exc})"])) from exc
    try:
        data = json.loads(raw)
        files = data["files"]
        if data.get("version") != MANIFEST_VERSION or not isinstance(files, dict) or any(
                not isinstance(r.get("sha256"), str) or not isinstance(r.get("size"), int)
                for r in files.values()):
            raise ValueError("unexpected layout")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreError(_message(entry, [f"{entry.manifest} (the list of its files and their "
                                          f"hashes) is damaged ({exc})"])) from None
    return files


def _read_cache(entry: Entry) -> dict[str, list]:
    try:
        data = json.loads(entry.verified.read_bytes())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(entry: Entry, cache: dict[str, list]) -> None:
    try:
        write_text(entry.verified, json.dumps(cache))
    except OSError:
        pass  # a read-only store: every load hashes again, which is only slower


def _restat_cache(entry: Entry) -> None:
    """Record the current stats of files this process has just hashed and then only chmod-ed
    (which changes their ctime, never their bytes), so the first load need not hash them."""
    cache = _read_cache(entry)
    if not cache:
        return
    fresh = {}
    for rel, cached in cache.items():
        try:
            fresh[rel] = [*_stat_key((entry.root / rel).stat()), cached[-1]]
        except OSError:
            continue
    _write_cache(entry, fresh)


def problems(entry: Entry) -> list[str]:
    """What is wrong with a sealed entry's files (empty: every file is as written).

    Files whose (size, inode, mtime, ctime) match the last good check are not hashed again.
    Raises StoreError when the manifest itself is damaged; returns ``["... no manifest"]``
    when there is none.
    """
    records = read_manifest(entry)
    if records is None:
        return [f"{entry.manifest} is missing: the entry was not completely written"]
    cache = _read_cache(entry)
    fresh: dict[str, list] = {}
    found = []
    for rel, record in sorted(records.items()):
        path = entry.root / rel
        try:
            st = path.stat()
        except FileNotFoundError:
            found.append(f"{path} is missing")
            continue
        except OSError as exc:
            found.append(f"{path} cannot be read ({exc.strerror or exc})")
            continue
        if st.st_size != record["size"]:
            found.append(f"{path} has {st.st_size:,} bytes, ken wrote {record['size']:,} "
                         "(truncated or overwritten)")
            continue
        key = _stat_key(st)
        cached = cache.get(rel)
        if cached == [*key, record["sha256"]]:
            fresh[rel] = cached
            continue
        try:
            sha = file_sha256(path)
        except OSError as exc:
            found.append(f"{path} cannot be read ({exc.strerror or exc})")
            continue
        if sha != record["sha256"]:
            found.append(f"{path} differs from what ken wrote (sha256 {sha[:12]}..., recorded "
                         f"{record['sha256'][:12]}...; changed or corrupted on disk)")
            continue
        fresh[rel] = [*key, sha]
    if not found and fresh != cache:
        _write_cache(entry, fresh)
    return found


def _message(entry: Entry, found: list[str]) -> str:
    more = f" (and {len(found) - 1} more problem(s))" if len(found) > 1 else ""
    what = f" It belongs to {entry.what}." if entry.what else ""
    fix = f" To fix it: {entry.fix}" if entry.fix else ""
    if fix and REPAIR not in fix:
        fix += f", or {REPAIR}"
    return f"model store: {found[0]}{more}.{what}{fix}."


def ensure(entry: Entry) -> None:
    """Check ``entry`` before loading it: StoreError (naming the file and the fix) unless every
    recorded file is as written. An entry without a manifest is adopted when its ``legacy``
    check passes (a manifest is written from its files), else reported as incomplete."""
    if not entry.exists():
        raise StoreError(_message(entry, [f"{entry.main} is missing"]))
    if read_manifest(entry) is None:
        if entry.legacy is None:
            raise StoreError(_message(entry, [
                f"{entry.manifest} is missing: {entry.main} was not completely written (an "
                "interrupted run?)"]))
        files = entry.legacy(entry)
        seal(entry, files)
        return
    found = problems(entry)
    if found:
        raise StoreError(_message(entry, found))


def check(entry: Entry) -> tuple[str, list[str]]:
    """``(state, problems)`` for ``ken models verify``: state is ``ok``, ``adopted`` (an
    entry from before manifests that passed its legacy check and now has one) or
    ``damaged``."""
    try:
        sealed = read_manifest(entry) is not None
        ensure(entry)
    except StoreError as exc:
        return "damaged", [str(exc)]
    return ("ok" if sealed else "adopted"), []


def remove(entry: Entry) -> None:
    """Delete an entry (its folder, or its files with their manifest and cache)."""
    if entry.files is None:
        shutil.rmtree(entry.root, ignore_errors=True)
        return
    for path in (*(entry.root / f for f in entry.files), entry.manifest, entry.verified):
        with suppress(FileNotFoundError):
            path.unlink()


def content_id(folder: str | Path) -> str:
    """A short id of a model folder's contents: the hash of its manifest's records when it is
    a store entry (the same wherever the store lives), else the folder's path."""
    folder = Path(folder)
    try:
        records = read_manifest(Entry(folder, "", ""))
    except StoreError:
        records = None
    if records is None:
        return str(folder)
    text = json.dumps({k: v["sha256"] for k, v in records.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- structural checks


def check_json(path: Path, entry: Entry | None = None) -> object:
    """The parsed JSON of ``path``; StoreError (naming it) when it is missing or not JSON."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        problem = f"{path} is missing"
    except OSError as exc:
        problem = f"{path} cannot be read ({exc.strerror or exc})"
    except ValueError as exc:
        problem = f"{path} is not valid JSON ({exc})"
    raise StoreError(_message(entry, [problem]) if entry else f"model store: {problem}")


def check_safetensors(path: Path, entry: Entry | None = None) -> None:
    """StoreError unless ``path`` is a complete safetensors file: a readable header whose last
    tensor ends exactly at the end of the file (catches truncation and appended bytes)."""
    problem = ""
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 2 or 8 + length > size:
                problem = f"{path} is not a complete safetensors file (bad header length)"
            else:
                header = json.loads(f.read(length))
                ends = [int(v["data_offsets"][1]) for k, v in header.items()
                        if k != "__metadata__"]
                if 8 + length + max(ends, default=0) != size:
                    problem = (f"{path} is not a complete safetensors file ({size:,} bytes, its "
                               f"header describes {8 + length + max(ends, default=0):,})")
    except FileNotFoundError:
        problem = f"{path} is missing"
    except OSError as exc:
        problem = f"{path} cannot be read ({exc.strerror or exc})"
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        problem = f"{path} is not a safetensors file (its header: {exc})"
    if problem:
        raise StoreError(_message(entry, [problem]) if entry else f"model store: {problem}")


# --------------------------------------------------------------------------- installed wheels


def verify_installed(dist_name: str, folder: Path, home: Path | None = None) -> None:
    """Check the files of an installed wheel under ``folder`` against the sha256 pip recorded
    in the wheel's RECORD (cached by size and times in ``KEN_HOME``, like store entries).
    StoreError names a changed file and the ``pip`` command that reinstalls the wheel."""
    from importlib import metadata

    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise StoreError(f"the package {dist_name!r} is not installed; run `pip install "
                         f"--no-deps {dist_name}`") from None
    folder = Path(folder).resolve()
    fix = f"reinstall it: `pip install --no-deps --force-reinstall {dist_name}`"
    cache_entry = Entry((home or ken_home()) / ".wheels", "", "",
                        files=(f"{dist_name}-{dist.version}",))
    cache = _read_cache(cache_entry)
    fresh: dict[str, list] = {}
    for file in dist.files or ():
        if file.hash is None or file.hash.mode != "sha256":
            continue
        path = Path(str(dist.locate_file(file))).resolve()
        if folder not in path.parents:
            continue
        want = base64.urlsafe_b64decode(file.hash.value + "=" * (-len(file.hash.value) % 4)).hex()
        try:
            st = path.stat()
            key = [*_stat_key(st), want]
            if cache.get(str(path)) != key:
                if file.size is not None and st.st_size != file.size:
                    raise StoreError(f"{path} of the installed package {dist_name} has "
                                     f"{st.st_size:,} bytes, its wheel {file.size:,}; {fix}")
                if file_sha256(path) != want:
                    raise StoreError(f"{path} of the installed package {dist_name} differs "
                                     f"from its wheel (sha256 mismatch); {fix}")
        except OSError as exc:
            raise StoreError(f"{path} of the installed package {dist_name} cannot be read "
                             f"({exc.strerror or exc}); {fix}") from None
        fresh[str(path)] = key
    if fresh != cache:
        with suppress(OSError):
            cache_entry.root.mkdir(parents=True, exist_ok=True)
            _write_cache(cache_entry, fresh)


# --------------------------------------------------------------------------- the store lock


class _Held:
    """This process's hold on one store's lock file (re-entrant across calls and threads)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.count = 0
        self.file = None
        self.pid = os.getpid()


# One entry per store folder: the lock a process holds is process-wide by nature (fcntl locks
# belong to the process), so this table is the one piece of module state here.
_HELD: dict[str, _Held] = {}
_HELD_LOCK = threading.Lock()


def _held(home: Path) -> _Held:
    key = str(home.resolve())
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is None or held.pid != os.getpid():  # a forked child holds nothing
            held = _HELD[key] = _Held()
        return held


def lock_holder(home: Path) -> str:
    """``"pid N, <what>"`` of the process holding (or last holding) the store's lock."""
    try:
        return (home / LOCK).read_text().strip()
    except OSError:
        return ""


@contextmanager
def store_lock(home: Path | None = None, what: str = "writing to the model store",
               on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the store's lock (``KEN_HOME/.lock``) for a prepare, profile or plan run.

    Another process holding it makes this wait, after ``on_wait("waiting for another ken
    process (pid N) that is <what> ...")``; threads of one process wait for each other; the
    same thread may nest it. POSIX only (elsewhere it only serialises threads).
    """
    home = Path(home) if home is not None else ken_home()
    home.mkdir(parents=True, exist_ok=True)
    held = _held(home)
    if not held.lock.acquire(blocking=False):
        if on_wait is not None:
            on_wait(f"waiting for another thread of this process that is using {home} ...")
        held.lock.acquire()
    try:
        if held.count == 0:
            held.file = _acquire(home, what, on_wait)
        held.count += 1
        try:
            yield
        finally:
            held.count -= 1
            if held.count == 0 and held.file is not None:
                _release(held.file)
                held.file = None
    finally:
        held.lock.release()


def _acquire(home: Path, what: str, on_wait: Callable[[str], None] | None):  # noqa: ANN202
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    f = (home / LOCK).open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            f.close()
            raise StoreError(f"cannot lock the model store {home}: {exc}") from exc
        if on_wait is not None:
            holder = lock_holder(home) or "pid unknown"
            pid, _, doing = holder.partition(" ")
            on_wait(f"waiting for another ken process ({pid.replace('pid=', 'pid ')}) that is "
                    f"{doing or 'using the store'} ...")
        fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    f.truncate()
    f.write(f"pid={os.getpid()} {what}\n")
    f.flush()
    return f


def _release(f) -> None:  # noqa: ANN001
    import fcntl

    try:
        fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        f.close()
