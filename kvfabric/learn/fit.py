"""Fit a reuse model: replay the traffic, classify every eviction candidate as the policy would, label it with
its next use, count.

1. **Replay** (:func:`kvfabric.sim.offline.replay_chains`, vLLM's prefix-cache behaviour at block level) under
   LRU order with a :class:`RecordingPolicy`: the ``learned`` policy's own feature code (ghost memory, request
   statistics) runs, so the classes seen in training are computed exactly as they will be when serving. Each
   candidate (a block whose last reference went) is recorded as ``(class, digest, request position)``.
2. **Label** each candidate with its *next-use distance*: the number of requests from the freeing request to the
   next request whose prompt holds that block (what the optimum, Belady's MIN, ranks by), or "never".
3. **Count** per class (:class:`~kvfabric.policies.reuse_model.ReuseModel`); a class is *favoured* when its
   candidates are reused more often than the average candidate.

Metrics recorded in the model: the candidates freed by the first 80 % of the requests fit a model that is scored
on those of the last 20 % (AUC of the class reuse probability as a score, log loss against predicting the base
rate everywhere, and the share of reused candidates in favoured classes); the saved model is then fitted on all
of them. A model whose validation log loss is not below the base rate's is marked not ``predictive`` (the policy
then falls back to adaptive_aging's rule).
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Sequence
from typing import Any, ClassVar

from kvfabric.learn.source import Traffic
from kvfabric.policies.base import BlockStats, RequestInfo
from kvfabric.policies.learned import LearnedPolicy
from kvfabric.policies.optimal import occurrences_of
from kvfabric.policies.reuse_model import ClassStats, ReuseModel, auc_from_counts
from kvfabric.sim.offline import replay_chains

VALIDATION_SHARE = 0.2


class RecordingPolicy(LearnedPolicy):
    """LRU order (key = ``now``) with the learned policy's classification of every candidate recorded."""

    name: ClassVar[str] = "learned"

    def __init__(self, features: Sequence[str]) -> None:
        super().__init__(model=ReuseModel(tuple(features)))
        self.classes = array("i")
        self.digests = array("q")
        self.positions = array("i")

    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        idx, _ = self.classify(t, b, ctx)
        h = t.hash[b]
        if h is not None and ctx is not None and ctx.position is not None:
            self.classes.append(idx)
            self.digests.append(h)
            self.positions.append(ctx.position)
        self.favoured[b] = False
        return float(now)


def record(traffic: Traffic, features: Sequence[str], num_blocks: int, split: int,
           progress: Any = None) -> tuple[ReuseModel, ReuseModel, dict[str, Any]]:
    """Replay ``traffic`` at ``num_blocks`` under LRU; returns the counts of candidates freed by requests before
    position ``split`` and from it on (each labelled with its next-use distance), and the replay's summary."""
    pol = RecordingPolicy(features)
    out = replay_chains(traffic.chains, traffic.input_lengths, [1] * len(traffic), pol, num_blocks,
                        block_size=traffic.block_size, progress=progress)
    occ = occurrences_of(traffic.chains)
    before, after = ReuseModel(tuple(features)), ReuseModel(tuple(features))
    for idx, h, pos in zip(pol.classes, pol.digests, pol.positions, strict=True):
        rows = occ.get(h)
        nxt = None
        if rows:
            j = bisect.bisect_right(rows, pos)
            if j < len(rows):
                nxt = rows[j] - pos
        (before if pos < split else after).add(idx, nxt)
    return before, after, {"num_blocks": num_blocks, "lru_prefix_hit_rate": round(out["prefix_hit_rate"], 6),
                           "candidates": len(pol.classes)}


def merge(models: Sequence[ReuseModel], features: Sequence[str]) -> ReuseModel:
    out = ReuseModel(tuple(features))
    for m in models:
        for i, c in m.classes.items():
            d = out.classes.get(i)
            if d is None:
                d = out.classes[i] = ClassStats()
            d.n += c.n
            d.reused += c.reused
            d.hist = [x + y for x, y in zip(d.hist, c.hist, strict=True)]
    return out


def evaluate(model: ReuseModel, counts: ReuseModel) -> dict[str, Any]:
    """How well ``model`` predicts reuse on the candidates counted in ``counts`` (fitted on others, or not)."""
    pos = [0] * model.num_classes
    neg = [0] * model.num_classes
    for i, c in counts.classes.items():
        pos[i] += c.reused
        neg[i] += c.n - c.reused
    n = sum(pos) + sum(neg)
    if n == 0:
        return {"candidates": 0}
    base = model.base_rate
    fav = model.favoured()
    ll_model = ll_base = 0.0
    eps = 1e-6
    b = min(1 - eps, max(eps, base))
    for i in range(model.num_classes):
        if pos[i] + neg[i] == 0:
            continue
        p = min(1 - eps, max(eps, model.probability(i)))
        ll_model -= pos[i] * math.log(p) + neg[i] * math.log(1 - p)
        ll_base -= pos[i] * math.log(b) + neg[i] * math.log(1 - b)
    reused = sum(pos)
    in_fav = sum(pos[i] + neg[i] for i in range(model.num_classes) if fav[i])
    reused_in_fav = sum(pos[i] for i in range(model.num_classes) if fav[i])
    a = auc_from_counts((model.probability(i), pos[i], neg[i]) for i in range(model.num_classes))
    return {
        "candidates": n,
        "reuse_rate": round(reused / n, 5),
        "auc": None if a is None else round(a, 4),
        "log_loss": round(ll_model / n, 5),
        "log_loss_base_rate": round(ll_base / n, 5),
        "favoured_share": round(in_fav / n, 4),
        "favoured_precision": round(reused_in_fav / in_fav, 4) if in_fav else None,
        "favoured_recall": round(reused_in_fav / reused, 4) if reused else None,
    }


def learn(traffic: Traffic, features: Sequence[str], capacities: Sequence[float],
          progress_factory: Any = None) -> ReuseModel:
    """The model of ``traffic``: candidates recorded at each capacity (a share of the traffic's unique blocks,
    at least one request's worth); a model fitted on the first 80 % of the requests is validated on the last
    20 %, then the saved model is fitted on all of them."""
    if not traffic.chains:
        raise ValueError("no requests to learn from")
    unique = traffic.unique_blocks()
    floor = traffic.longest_request_blocks() + 2
    split = int(len(traffic) * (1 - VALIDATION_SHARE))
    parts_before, parts_after, replays = [], [], []
    for f in capacities:
        n = max(int(unique * f), floor)
        bar = progress_factory(f"learn: replay at {f:.0%} ({n:,} blocks)", len(traffic)) if progress_factory else None
        before, after, summary = record(traffic, features, n, split, progress=bar)
        parts_before.append(before)
        parts_after.append(after)
        summary["capacity"] = f
        replays.append(summary)
    early = merge(parts_before, features)
    late = merge(parts_after, features)
    model = merge([early, late], features)
    if model.total == 0:
        raise ValueError("the replay saw no eviction candidates: nothing to learn from")
    model.metrics = {
        "validation": evaluate(early, late) if early.total else {"candidates": 0},
        "training": evaluate(model, model),
        "replays": replays,
    }
    model.training = {**traffic.source, "block_size": traffic.block_size, "unique_blocks": unique,
                      "capacities": list(capacities), "order": "lru", "validation": "last 20 % of the requests",
                      "label": "next-use distance, in requests"}
    return model
