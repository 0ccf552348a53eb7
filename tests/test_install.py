"""Installing ken keeps the user's torch build (issue 18, item 1).

A user with a CUDA (or ROCm) build of torch must be able to ``pip install`` ken without pip
replacing that torch by another release. pip leaves an installed distribution in place when it
satisfies every requirement on it, so two checks, both offline:

- every requirement on torch, ken's own and those of everything ken installs (read from the
  installed distributions' metadata), admits other torch builds and releases;
- pip itself, in a throwaway environment holding a stand-in "torch 2.9.0+cu126", resolves ken's
  torch requirement to "already satisfied" and installs nothing.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
#: torch builds a user may have: CUDA and ROCm builds, older and newer releases
OTHER_TORCH = ("2.6.0+cu124", "2.9.0+cu126", "2.13.0+cu130", "2.11.0+rocm6.4", "2.14.0")


def _ken_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def _torch_requirements() -> dict[str, Requirement]:
    """Every requirement on torch of ken and of the distributions it pulls in (installed
    here), by who asks for it; extras' requirements are left out (ken asks for none of
    theirs)."""
    found: dict[str, Requirement] = {}
    todo = [("ken", r) for r in _ken_requirements()]
    seen: set[str] = set()
    while todo:
        who, req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name == "torch":
            found[who] = req
            continue
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue  # an optional dependency not installed here asks for nothing
        todo += [(req.name, Requirement(r)) for r in requires]
    return found


def test_every_requirement_on_torch_admits_other_builds() -> None:
    found = _torch_requirements()
    assert "ken" in found, "ken must ask for torch"
    for who, req in found.items():
        for version in OTHER_TORCH:
            assert req.specifier.contains(version, prereleases=True), (
                f"{who} asks for {req}, which an installed torch {version} does not satisfy: "
                "pip would replace the user's torch")


def _fake_torch_wheel(folder: Path, version: str) -> Path:
    """A minimal wheel named torch (a stand-in: an empty module with torch's metadata)."""
    dist = f"torch-{version}.dist-info"
    path = folder / f"torch-{version}-py3-none-any.whl"
    files = {"torch/__init__.py": f"__version__ = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: ken-test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in {**files, f"{dist}/RECORD": record}.items():
            whl.writestr(name, text)
    return path


def test_pip_keeps_an_installed_cuda_torch(tmp_path: Path) -> None:
    """pip (the one of this environment, driving a throwaway one) finds the stand-in CUDA
    torch already satisfies ken's requirement and installs nothing; with the old exact pin it
    would have gone looking for another torch."""
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check"]
    wheel = _fake_torch_wheel(tmp_path, "2.9.0+cu126")
    done = subprocess.run([*pip, "install", "--no-index", "-q", str(wheel)],
                          capture_output=True, text=True)
    if done.returncode != 0 and "no such option: --python" in done.stderr:
        pytest.skip("this pip cannot drive another environment (needs pip >= 22.3)")
    assert done.returncode == 0, done.stderr
    torch_req = next(str(r) for r in _ken_requirements() if canonicalize_name(r.name) == "torch")
    report = tmp_path / "report.json"
    done = subprocess.run([*pip, "install", "--dry-run", "--no-index", "--report", str(report),
                           torch_req], capture_output=True, text=True)
    assert done.returncode == 0, f"pip could not keep torch 2.9.0+cu126 for {torch_req!r}: " \
                                 f"{done.stderr}"
    assert re.search(r"already satisfied: torch.*2\.9\.0\+cu126", done.stdout), done.stdout
    assert json.loads(report.read_text())["install"] == []
    # the check can fail: an exact pin on another release cannot be satisfied by the stand-in
    done = subprocess.run([*pip, "install", "--dry-run", "--no-index", "torch==2.13.0"],
                          capture_output=True, text=True)
    assert done.returncode != 0
