"""Seeded, deterministic workloads for the CPU harness.

A workload is a list of :data:`WorkItem` ``(arrival_s, request_id, prompt_token_ids, max_tokens, extra_args)``
sorted by arrival time (ties keep generation order). The same arguments always give the same list, on any
machine: all randomness comes from ``random.Random`` seeded with integers (and, for traces, NumPy generators
seeded per hash id).

Request ids carry their family by convention, ``<family>/<name>`` (``tpl-2/r0013``, ``conv-4/t2``,
``uniq/u0007``, ``trace/000042``); ``extra_args`` repeats it as ``{"kvfabric_family": ...}`` and conversations add
``{"kvfabric_session": ...}``, so either the request-id convention or the hint can name the family.

Conversations need to know what the engine will answer: their next turn's prompt is the previous prompt, then
the previous answer, then new user tokens. The answer of request ``r`` is
``[output_token(r, i) for i in range(max_tokens)]`` (see :func:`kvfabric.sim.harness.output_token`), because the
harness generates exactly ``max_tokens`` tokens with that function.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvfabric.sim.harness import TOKEN_ID_HIGH, TOKEN_ID_LOW, output_token

__all__ = [
    "DEMO_NUM_BLOCKS",
    "WorkItem",
    "answer_tokens",
    "demo_workload",
    "iter_trace_workload",
    "trace_workload",
    "unique_cold_workload",
]

WorkItem = tuple[float, str, list[int], int, dict[str, Any] | None]

#: Pool size (blocks of 16 tokens, null block included) the demo workload is sized for: small enough that the
#: unique traffic pushes template prefixes and idle conversations out, large enough that hot prefixes survive.
DEMO_NUM_BLOCKS = 640


def answer_tokens(request_id: str, max_tokens: int) -> list[int]:
    """The exact tokens the harness generates for ``request_id`` with ``max_tokens``."""
    return [output_token(request_id, i) for i in range(max_tokens)]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(n)]


def _sorted(items: list[WorkItem]) -> list[WorkItem]:
    # Stable sort: equal arrival times keep generation order, which is itself deterministic.
    return sorted(items, key=lambda item: item[0])


def demo_workload(
    seed: int = 0,
    *,
    duration_s: float = 40.0,
    num_families: int = 5,
    family_prefix_blocks: tuple[int, int] = (12, 40),
    template_requests: int = 260,
    template_suffix_tokens: tuple[int, int] = (24, 200),
    num_conversations: int = 14,
    turns: tuple[int, int] = (3, 6),
    first_turn_tokens: tuple[int, int] = (200, 600),
    user_turn_tokens: tuple[int, int] = (30, 160),
    turn_gap_s: tuple[float, float] = (0.5, 4.0),
    unique_requests: int = 70,
    unique_prompt_tokens: tuple[int, int] = (400, 1400),
    max_tokens: tuple[int, int] = (16, 96),
    block_size: int = 16,
) -> list[WorkItem]:
    """The product demo: template families, returning multi-turn conversations and cold one-off requests.

    * **Template families** ``tpl-<i>``: a shared system prompt of ``family_prefix_blocks`` full blocks, then a
      private suffix per request. Popularity is Zipf-like (family 0 hottest), so cold families are evicted
      between their visits and their prefix is rebuilt when they come back.
    * **Conversations** ``conv-<i>``: turn ``t+1`` = turn ``t``'s prompt + its answer + new user tokens, arriving
      ``turn_gap_s`` after turn ``t`` with other traffic in between, so under pressure the previous turn's blocks
      may be gone (rebuilt) and otherwise they are hit.
    * **Unique** ``uniq``: long one-off prompts that share nothing and push everything else out.

    Arrivals are Poisson over ``duration_s`` for templates and unique requests; conversations start in the first
    half. Ranges are inclusive ``(low, high)``. With the defaults, ``DEMO_NUM_BLOCKS`` and the ``qwen`` latency
    model there is real memory pressure: evictions and rebuilt blocks are both nonzero.
    """
    rng = random.Random(seed)
    items: list[WorkItem] = []

    # Template families: shared prefixes of whole blocks, so the family boundary is a block boundary.
    prefixes = [_tokens(rng, rng.randint(*family_prefix_blocks) * block_size) for _ in range(num_families)]
    weights = [1.0 / (i + 1) for i in range(num_families)]
    t = 0.0
    rate = template_requests / duration_s
    for j in range(template_requests):
        t += rng.expovariate(rate)
        fam = rng.choices(range(num_families), weights)[0]
        prompt = prefixes[fam] + _tokens(rng, rng.randint(*template_suffix_tokens))
        family = f"tpl-{fam}"
        items.append((t, f"{family}/r{j:04d}", prompt, rng.randint(*max_tokens), {"kvfabric_family": family}))

    # Conversations: each turn extends the previous one with its exact answer.
    for c in range(num_conversations):
        family = f"conv-{c}"
        t = rng.uniform(0.0, duration_s / 2)
        prompt = _tokens(rng, rng.randint(*first_turn_tokens))
        for turn in range(rng.randint(*turns)):
            rid = f"{family}/t{turn}"
            out = rng.randint(*max_tokens)
            extra = {"kvfabric_family": family, "kvfabric_session": family}
            items.append((t, rid, prompt, out, extra))
            prompt = prompt + answer_tokens(rid, out) + _tokens(rng, rng.randint(*user_turn_tokens))
            t += rng.uniform(*turn_gap_s)

    # Unique cold traffic.
    t = 0.0
    rate = unique_requests / duration_s
    for j in range(unique_requests):
        t += rng.expovariate(rate)
        prompt = _tokens(rng, rng.randint(*unique_prompt_tokens))
        items.append((t, f"uniq/u{j:04d}", prompt, rng.randint(*max_tokens), {"kvfabric_family": "uniq"}))

    return _sorted(items)


def unique_cold_workload(
    seed: int = 0,
    *,
    num_requests: int = 200,
    prompt_tokens: tuple[int, int] = (256, 1024),
    max_tokens: tuple[int, int] = (16, 64),
    rate_per_s: float = 8.0,
) -> list[WorkItem]:
    """``ordinary_unique_cold``: Poisson arrivals of random prompts that share nothing (not even a block).

    A policy must cost nothing here: there is no prefix to keep.
    """
    rng = random.Random(seed)
    items: list[WorkItem] = []
    t = 0.0
    for j in range(num_requests):
        t += rng.expovariate(rate_per_s)
        prompt = _tokens(rng, rng.randint(*prompt_tokens))
        items.append((t, f"uniq/u{j:05d}", prompt, rng.randint(*max_tokens), {"kvfabric_family": "uniq"}))
    return items


@lru_cache(maxsize=8192)
def _hash_id_tokens(seed: int, hash_id: int, block_tokens: int) -> tuple[int, ...]:
    """The ``block_tokens`` token ids standing for one trace hash id: a pure function of (seed, id)."""
    # numpy: only for trace hash ids, not for `kvfabric bench --help`
    import numpy as np

    gen = np.random.default_rng([seed, hash_id])
    return tuple(gen.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, size=block_tokens).tolist())


def iter_trace_workload(
    path: str | Path,
    limit: int | None = None,
    max_output_tokens: int | None = None,
    block_tokens: int = 512,
    seed: int = 0,
    *,
    max_input_tokens: int | None = None,
) -> Iterator[WorkItem]:
    """Stream a Mooncake ``hash_ids`` trace (``shared/traces/README.md``) as work items, one row at a time.

    Every hash id expands to ``block_tokens`` deterministic token ids, the prompt is truncated to
    ``input_length`` (and to ``max_input_tokens`` if given: truncating a prompt keeps its prefix, so sharing
    is preserved). Equal hash-id prefixes give equal token prefixes, so vLLM's own 16-token block hashes see
    exactly the trace's sharing. ``timestamp`` (ms) becomes ``arrival_s`` relative to the first row;
    ``output_length`` (at least 1, at most ``max_output_tokens``) becomes ``max_tokens``.
    """
    first_ts: float | None = None
    with open(path) as fh:
        for row_no, line in enumerate(fh):
            if limit is not None and row_no >= limit:
                break
            row = json.loads(line)
            ts = float(row["timestamp"])
            if first_ts is None:
                first_ts = ts
            length = int(row["input_length"])
            if max_input_tokens is not None:
                length = min(length, max_input_tokens)
            hash_ids = row["hash_ids"]
            needed = math.ceil(length / block_tokens)
            if needed > len(hash_ids):
                raise ValueError(f"{path}:{row_no + 1}: {len(hash_ids)} hash ids cannot cover {length} tokens")
            prompt: list[int] = []
            for hid in hash_ids[:needed]:
                prompt.extend(_hash_id_tokens(seed, int(hid), block_tokens))
            del prompt[length:]
            out = max(1, int(row["output_length"]))
            if max_output_tokens is not None:
                out = min(out, max_output_tokens)
            yield (
                (ts - first_ts) / 1000.0,
                f"trace/{row_no:06d}",
                prompt,
                out,
                {"kvfabric_trace_row": row_no},
            )


def trace_workload(
    path: str | Path,
    limit: int | None = None,
    max_output_tokens: int | None = None,
    block_tokens: int = 512,
    seed: int = 0,
    *,
    max_input_tokens: int | None = None,
) -> list[WorkItem]:
    """:func:`iter_trace_workload` as a list, sorted by arrival.

    Memory: the full conversation half-trace expands to ~77M prompt tokens; use ``limit`` (or the iterator).
    """
    return _sorted(
        list(iter_trace_workload(path, limit, max_output_tokens, block_tokens, seed, max_input_tokens=max_input_tokens))
    )
