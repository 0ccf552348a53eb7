"""The entity-matching data ``sem_match`` learns from: labelled pairs of records
(:class:`EntityPairs`) read from the DeepMatcher/Ditto files in
``<data-dir>/entity-matching/<dataset>/{train,valid,test}.txt``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ken.errors import DataError
from ken.models.records import PLAIN, parse_record
from ken.paths import shared_data_dir

DATASETS = ("Abt-Buy", "Amazon-Google", "Beer", "DBLP-ACM", "Fodors-Zagats")
DATASET_ALL = "all"  # the default: every data set above that is present, schema-free features
DEFAULT_DATASET = DATASET_ALL
SPLITS = ("train", "valid", "test")


@dataclass(frozen=True, eq=False)
class EntityPairs:
    """Labelled pairs of entity records as text (see :func:`as_record`); 1 means a match."""

    name: str
    left: tuple[str, ...]
    right: tuple[str, ...]
    labels: np.ndarray  # int64, 0 = no match, 1 = match

    def __post_init__(self) -> None:
        if not len(self.left) == len(self.right) == len(self.labels):
            raise DataError(f"{self.name}: {len(self.left)} left, {len(self.right)} right "
                            f"texts and {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.left)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return list(zip(self.left, self.right, strict=True))

    def subset(self, indices: Sequence[int], name: str) -> EntityPairs:
        idx = np.asarray(indices, dtype=np.int64)
        return EntityPairs(name, tuple(self.left[i] for i in idx),
                           tuple(self.right[i] for i in idx), self.labels[idx])

    def sample(self, limit: int | None, seed: int = 0) -> EntityPairs:
        """At most ``limit`` pairs, drawn at random (seeded) and kept in file order."""
        if limit is None or limit >= len(self):
            return self
        if limit < 1:
            raise DataError(f"cannot sample {limit} pairs")
        keep = np.sort(np.random.default_rng(seed).permutation(len(self))[:limit])
        return self.subset(keep, f"{self.name}[{limit}]")

    @staticmethod
    def concat(parts: Sequence[EntityPairs], name: str) -> EntityPairs:
        return EntityPairs(name, tuple(t for p in parts for t in p.left),
                           tuple(t for p in parts for t in p.right),
                           np.concatenate([p.labels for p in parts]).astype(np.int64))


def dataset_dir(dataset: str, data_dir: Path | None = None) -> Path:
    return (data_dir or shared_data_dir()) / "entity-matching" / dataset


def present_datasets(data_dir: Path | None = None) -> tuple[str, ...]:
    return tuple(d for d in DATASETS if _has_files(d, data_dir))


def _has_files(dataset: str, data_dir: Path | None) -> bool:
    folder = dataset_dir(dataset, data_dir)
    return all((folder / f"{s}.txt").is_file() for s in SPLITS)


def has_data(dataset: str, data_dir: Path | None = None) -> bool:
    if dataset == DATASET_ALL:
        return bool(present_datasets(data_dir))
    return _has_files(dataset, data_dir)


def load_pairs(dataset: str, split: str, data_dir: Path | None = None,
               attribute: str | None = None) -> EntityPairs:
    """One split of an entity-matching dataset: whole records (``COL ... VAL ...`` text), or
    one attribute's values with ``attribute`` (``"first"``: each record's first attribute).

    Lines are ``<left record> TAB <right record> TAB <label>``.
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of: {', '.join(SPLITS)}")
    if dataset == DATASET_ALL:
        return EntityPairs.concat([load_pairs(d, split, data_dir, attribute)
                                   for d in _need(data_dir)], f"{DATASET_ALL}-{split}")
    path = dataset_dir(dataset, data_dir) / f"{split}.txt"
    if not path.is_file():
        raise DataError(f"entity-matching data not found at {path}; put the DeepMatcher/Ditto "
                        f"files in <data-dir>/entity-matching/{dataset}/ or pass data_dir")
    left: list[str] = []
    right: list[str] = []
    labels: list[int] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 3 or parts[2].strip() not in ("0", "1"):
                raise DataError(f"{path}:{number}: expected '<left> TAB <right> TAB 0|1'")
            for side, out in ((parts[0], left), (parts[1], right)):
                if attribute is None:
                    parse_record(side)  # fail here, with the line, on a malformed record
                    out.append(side.strip())
                    continue
                record = parse_record(side)
                key = next(iter(record)) if attribute == "first" else attribute
                if key not in record:
                    raise DataError(f"{path}:{number}: no attribute {key!r}; this dataset has "
                                    f"{', '.join(record)}")
                out.append(record[key])
            labels.append(int(parts[2]))
    return EntityPairs(f"{dataset}-{split}", tuple(left), tuple(right),
                       np.asarray(labels, dtype=np.int64))


def _need(data_dir: Path | None) -> tuple[str, ...]:
    present = present_datasets(data_dir)
    if not present:
        raise DataError(f"no entity-matching data sets at {dataset_dir('', data_dir)} "
                        f"(expected folders {', '.join(DATASETS)})")
    return present


def data_hash(dataset: str, data_dir: Path | None = None) -> str:
    h = hashlib.sha256()
    names = _need(data_dir) if dataset == DATASET_ALL else (dataset,)
    for name in names:
        h.update(name.encode())
        for split in SPLITS:
            h.update((dataset_dir(name, data_dir) / f"{split}.txt").read_bytes())
    return h.hexdigest()[:16]


def training_splits(dataset: str, data_dir: Path | None = None,
                    per_dataset: int | None = None) -> dict[str, EntityPairs]:
    """Train / valid / test pairs; ``per_dataset`` caps the training pairs of each data set.
    For :data:`DATASET_ALL` it also caps validation and test pairs at half as many per data
    set (a single data set keeps them whole)."""
    names = _need(data_dir) if dataset == DATASET_ALL else (dataset,)
    half = None if per_dataset is None or dataset != DATASET_ALL else max(1, per_dataset // 2)
    caps = {"train": per_dataset, "valid": half, "test": half}
    splits = {}
    for split in SPLITS:
        parts = [load_pairs(name, split, data_dir).sample(caps[split]) for name in names]
        splits[split] = EntityPairs.concat(parts, f"{dataset}-{split}")
    return splits


def schema(records: Sequence[Mapping[str, str]]) -> tuple[str, ...]:
    """The attributes to compare one by one: those of the records if they all share them,
    else none (schema-free features)."""
    if not records:
        return ()
    keys = tuple(records[0])
    if keys == (PLAIN,) or any(tuple(r) != keys for r in records):
        return ()
    return keys
