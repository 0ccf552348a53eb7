"""Where KEN keeps converted models, trained heads and profiles (``KEN_HOME``)."""

from __future__ import annotations

import os
from pathlib import Path


def ken_home() -> Path:
    """The cache directory: ``$KEN_HOME`` or ``~/.cache/ken``."""
    env = os.environ.get("KEN_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ken"


def shared_data_dir() -> Path:
    """Default location of the shared third-party data (``$KEN_DATA_DIR`` or ``../shared/data``).

    Relative to the current directory first, then to the repository checkout.
    """
    env = os.environ.get("KEN_DATA_DIR")
    if env:
        return Path(env).expanduser()
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        candidate = base.parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return Path.cwd().parent / "shared" / "data"


def package_dir(package: str, pip_name: str | None = None) -> Path:
    """Folder of an installed package, found without importing it.

    The packaged model and data wheels import heavy dependencies (sklearn, llama_cpp) in their
    ``__init__``; KEN only reads their files, so it never imports them.
    """
    import importlib.util

    from ken.errors import KenError

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise KenError(
            f"the package {pip_name or package!r} is not installed; "
            f"run `pip install --no-deps {pip_name or package}`"
        )
    return Path(list(spec.submodule_search_locations)[0])
