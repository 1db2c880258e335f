"""The reuse model the ``learned`` policy reads: a binned table of how often blocks of each class were used again.

A *class* is a tuple of small bucketed features of a block at the moment it becomes an eviction candidate (its
last reference went), all of them things the hook already has or keeps cheaply (:mod:`kvfabric.policies.learned`
computes them; :data:`FEATURES` defines them). For each class the model holds how many candidates were seen in
the training traffic, how many of those were asked for again later, and a histogram of *when* (the reuse
distance, in requests admitted after the freeing request, on a log2 grid).

The file is JSON (``kvfabric-reuse-model``, version 1), small (a few hundred classes at most), read with the
standard library only, and written by ``kvfabric learn`` (:mod:`kvfabric.learn`), which records in it what it
was trained on and how well it predicts on a held-out tail of its own training data.

Invariants:
  * a model names its features; the policy computes exactly those, in that order, and looks the class up by a
    mixed-radix index (O(1));
  * every class has ``0 <= reused <= n`` and ``sum(hist) == reused``; a class never seen in training has the
    base rate (smoothing is toward the base rate with :data:`PRIOR` pseudo-candidates);
  * loading validates everything above and raises :class:`ModelError` (a ``ValueError``) with one line on any
    violation, so a bad file is refused before a policy is built from it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

FORMAT = "kvfabric-reuse-model"
VERSION = 1

#: Feature name -> bucket labels, in index order. The policy computes each feature's bucket index.
FEATURES: dict[str, tuple[str, ...]] = {
    # Requests that used this content so far, this cached life plus earlier ones remembered by the ghost memory.
    "uses": ("1", "2", "3", "4", "5-7", "8+"),
    # Whether the content existed before the freeing request (hit, or rebuilt right after its eviction) or was new.
    "role": ("new", "old"),
    # Share of the freeing request's prompt that was known (hit or recently evicted): a first turn sees little,
    # a continuing conversation most of its prompt.
    "seen": ("<1/4", "1/4-3/4", ">=3/4"),
    # Where the block sits in the freeing request's prompt, from its end: the last 1/16 of the prompt, the rest,
    # or past the prompt (a block of generated tokens).
    "tail": ("last 1/16", "body", "output"),
}
DEFAULT_FEATURES: tuple[str, ...] = ("uses", "role", "seen")

#: Reuse-distance histogram bins, in requests admitted after the freeing request: bin k holds distances
#: ``< 2**k`` (and ``>= 2**(k-1)``); the last bin holds everything beyond.
DISTANCE_BINS = 20

#: Smoothing: a class's reuse probability is ``(reused + PRIOR * base) / (n + PRIOR)``.
PRIOR = 50.0


class ModelError(ValueError):
    """The model file is missing, not JSON, or not a valid ``kvfabric-reuse-model``."""


def uses_bucket(uses: int) -> int:
    if uses <= 4:
        return max(0, uses - 1)
    return 4 if uses < 8 else 5


def distance_bin(distance: int) -> int:
    """Histogram bin of a reuse distance (requests, >= 1)."""
    return min(DISTANCE_BINS - 1, max(0, distance).bit_length())


@dataclass
class ClassStats:
    n: int = 0
    reused: int = 0
    hist: list[int] = field(default_factory=lambda: [0] * DISTANCE_BINS)


@dataclass
class ReuseModel:
    """Per-class reuse counts over named features (see the module docstring)."""

    features: tuple[str, ...] = DEFAULT_FEATURES
    classes: dict[int, ClassStats] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [f for f in self.features if f not in FEATURES]
        if unknown or not self.features or len(set(self.features)) != len(self.features):
            raise ModelError(f"bad feature list {list(self.features)} (known: {', '.join(FEATURES)})")
        self.radix = [len(FEATURES[f]) for f in self.features]
        self.num_classes = math.prod(self.radix)

    # ---- classes -----------------------------------------------------------------------------------------------

    def index(self, buckets: Sequence[int]) -> int:
        """Mixed-radix class index of per-feature bucket indexes (in :attr:`features` order)."""
        i = 0
        for b, r in zip(buckets, self.radix, strict=True):
            i = i * r + b
        return i

    def buckets(self, index: int) -> list[int]:
        out = []
        for r in reversed(self.radix):
            out.append(index % r)
            index //= r
        return out[::-1]

    def label(self, index: int) -> str:
        return ", ".join(f"{f}={FEATURES[f][b]}" for f, b in zip(self.features, self.buckets(index), strict=True))

    # ---- fitting -----------------------------------------------------------------------------------------------

    def add(self, index: int, distance: int | None) -> None:
        """One training candidate of class ``index``, reused ``distance`` requests later (None: never)."""
        c = self.classes.get(index)
        if c is None:
            c = self.classes[index] = ClassStats()
        c.n += 1
        if distance is not None:
            c.reused += 1
            c.hist[distance_bin(distance)] += 1

    # ---- what the policy reads ---------------------------------------------------------------------------------

    @property
    def total(self) -> int:
        return sum(c.n for c in self.classes.values())

    @property
    def base_rate(self) -> float:
        n = self.total
        return sum(c.reused for c in self.classes.values()) / n if n else 0.0

    def probability(self, index: int) -> float:
        """Smoothed probability that a candidate of this class is asked for again."""
        base = self.base_rate
        c = self.classes.get(index)
        if c is None:
            return base
        return (c.reused + PRIOR * base) / (c.n + PRIOR)

    def lift(self, index: int) -> float:
        """Reuse probability relative to the base rate (1 = average)."""
        base = self.base_rate
        return self.probability(index) / base if base > 0 else 1.0

    def favoured(self) -> list[bool]:
        """Per class index: whether its candidates are reused more often than the average candidate."""
        return [self.lift(i) > 1.0 for i in range(self.num_classes)]

    @property
    def predictive(self) -> bool:
        """Whether the model predicted reuse better than the base rate on the part of its training traffic it was
        not fitted on (validation log loss below the base rate's). A model without validation counts as
        predictive (it was written by hand or by an older learner: its author vouches for it)."""
        val = self.metrics.get("validation") or {}
        ll, base = val.get("log_loss"), val.get("log_loss_base_rate")
        if ll is None or base is None:
            return True
        return float(ll) < float(base)

    def favoured_classes(self) -> list[bool]:
        """What the policy favours: :meth:`favoured` when the model is :attr:`predictive`; otherwise the classes
        of content used at least twice (adaptive_aging's "proven" rule, the prior a useless model falls back to;
        nothing, i.e. LRU order, when the model has no ``uses`` feature)."""
        if self.predictive:
            return self.favoured()
        if "uses" not in self.features:
            return [False] * self.num_classes
        k = self.features.index("uses")
        return [self.buckets(i)[k] >= 1 for i in range(self.num_classes)]

    # ---- file format -------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "features": list(self.features),
            "buckets": {f: list(FEATURES[f]) for f in self.features},
            "distance_bins": "bin k: reuse distance in requests in [2**(k-1), 2**k); the last bin: beyond",
            "base_rate": self.base_rate,
            "predictive": self.predictive,
            "classes": [
                {"index": i, "label": self.label(i), "n": c.n, "reused": c.reused,
                 "probability": round(self.probability(i), 6), "favoured": self.lift(i) > 1.0, "hist": c.hist}
                for i, c in sorted(self.classes.items())
            ],
            "training": self.training,
            "metrics": self.metrics,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n")

    @classmethod
    def from_json(cls, data: Any, where: str = "model") -> ReuseModel:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ModelError(f"{where}: not a {FORMAT} file")
        if data.get("version") != VERSION:
            raise ModelError(f"{where}: version {data.get('version')!r}, this kvfabric reads version {VERSION}")
        features = data.get("features")
        if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
            raise ModelError(f"{where}: 'features' must be a list of names")
        model = cls(tuple(features), training=dict(data.get("training") or {}), metrics=dict(data.get("metrics") or {}))
        rows = data.get("classes")
        if not isinstance(rows, list):
            raise ModelError(f"{where}: 'classes' must be a list")
        for row in rows:
            try:
                i, n, reused, hist = int(row["index"]), int(row["n"]), int(row["reused"]), [int(h) for h in row["hist"]]
            except (KeyError, TypeError, ValueError) as exc:
                raise ModelError(f"{where}: malformed class row {row!r} ({exc})") from None
            if not 0 <= i < model.num_classes or i in model.classes:
                raise ModelError(f"{where}: class index {i} out of range or repeated")
            if not 0 <= reused <= n or len(hist) != DISTANCE_BINS or sum(hist) != reused or min(hist) < 0:
                raise ModelError(f"{where}: class {i} has inconsistent counts")
            model.classes[i] = ClassStats(n, reused, hist)
        if model.total == 0:
            raise ModelError(f"{where}: no training candidates")
        return model

    @classmethod
    def load(cls, path: str | Path) -> ReuseModel:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ModelError(f"{path}: cannot read ({exc.strerror or exc})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_json(data, str(path))


def default_model_path() -> Path:
    """The model shipped with the package (package data), used when no model path is given."""
    return Path(str(resources.files("kvfabric.policies").joinpath("models/default.json")))


def load_model(path: str | Path | None) -> ReuseModel:
    """The model at ``path``, or the built-in default when ``path`` is None or empty."""
    return ReuseModel.load(path if path else default_model_path())


def auc_from_counts(rows: Iterable[tuple[float, int, int]]) -> float | None:
    """Area under the ROC curve of a scorer that gives each candidate its class's score, from per-score counts
    ``(score, positives, negatives)`` (equal scores count half). None without both positives and negatives."""
    merged: dict[float, list[int]] = {}
    for score, p, n in rows:
        m = merged.setdefault(score, [0, 0])
        m[0] += p
        m[1] += n
    pos = sum(m[0] for m in merged.values())
    neg = sum(m[1] for m in merged.values())
    if pos == 0 or neg == 0:
        return None
    below = 0  # negatives with a lower score
    area = 0.0
    for score in sorted(merged):
        p, n = merged[score]
        area += p * (below + n / 2.0)
        below += n
    return area / (pos * neg)
