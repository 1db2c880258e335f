"""The recorded traffic of a run: each admission's prompt as a chain of block hashes, rebuilt from the events.

Source: ``kvfabric/queries/sql/admission_chains.sql`` (one row per ``prefix_lookup``, in lookup order). An
admission's chain position ``m`` holds the digest of the block it hit there (``block_touched``) or sealed there
(``block_sealed``); a position it did neither for (the admission gate refused it, or the request never computed it)
is unknown (None). Two uses:

* :func:`to_trace_requests` feeds the offline replay (:mod:`kvfabric.sim.offline`) at the run's own block size, one
  key per recorded block, so the replay sees exactly the sharing the engine saw (``kvfabric whatif``);
* :func:`trace_rows` writes the Mooncake ``hash_ids`` format (``shared/traces/README.md``) with ``block_tokens``
  tokens per hash id (``kvfabric export --format mooncake``).

Hash ids are small integers in order of first appearance (:class:`HashIds`); digests, token ids and request ids
never leave this module.

Invariants:
  * an id is shared by two trace blocks only when the events prove they hold the same tokens: every recorded block
    of the group is known and full, and the last one's digest (a prefix hash: it covers everything before it) is the
    same; any other group (the partial last one, one with an unknown block) gets an id of its own;
  * :func:`estimated_output_tokens` is the smallest output length consistent with the blocks the admission took
    (vLLM gives every token a KV slot except the last one sampled).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvfabric.queries import QueryRunner
from kvfabric.sim.offline import TraceRequest

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake traces (and what ``kvfabric replay`` reads)."""


@dataclass(frozen=True)
class RecordedAdmission:
    """One admission (``prefix_lookup``) of a recorded run with the block chain its events show."""

    engine: str
    request_id: str
    family: str | None
    ts_ns: int
    end_ns: int
    prompt_tokens: int
    hit_tokens: int
    block_size: int
    allocated_blocks: int
    chain: tuple[int | None, ...]
    """Digest per full prompt block position (``prompt_tokens // block_size`` of them), None where unknown."""

    @property
    def full_blocks(self) -> int:
        return self.prompt_tokens // self.block_size

    @property
    def output_tokens(self) -> int:
        return estimated_output_tokens(self.prompt_tokens, self.hit_tokens, self.allocated_blocks, self.block_size)


def estimated_output_tokens(prompt_tokens: int, hit_tokens: int, allocated_blocks: int, block_size: int) -> int:
    """Output tokens of an admission from the blocks it held: hit blocks plus blocks allocated for it cover
    ``prompt + output - 1`` tokens, so the smallest consistent output is ``(blocks - 1) * bs - prompt + 2``
    (at least 1: every admitted request samples a token)."""
    blocks = hit_tokens // block_size + allocated_blocks
    return max(1, (blocks - 1) * block_size - prompt_tokens + 2)


def recorded_traffic(runner: QueryRunner, run: str, engine: str | None = None) -> list[RecordedAdmission]:
    """Every admission of ``run`` (of one ``engine`` if given) in lookup order. Raises UnknownRun."""
    out: list[RecordedAdmission] = []
    for r in runner.admission_chains(run):
        if engine is not None and r["engine"] != engine:
            continue
        bs = int(r["block_size"])
        prompt = int(r["prompt_tokens"])
        chain: list[int | None] = [None] * (prompt // bs)
        for pos, h in zip(r["positions"], r["hashes"], strict=True):
            if 0 <= pos < len(chain):
                chain[pos] = int(h)
        out.append(
            RecordedAdmission(
                engine=r["engine"], request_id=r["request_id"], family=r["family"], ts_ns=int(r["ts_ns"]),
                end_ns=int(r["end_ns"]), prompt_tokens=prompt, hit_tokens=int(r["hit_tokens"]), block_size=bs,
                allocated_blocks=int(r["allocated_blocks"]), chain=tuple(chain),
            )
        )
    return out


class HashIds:
    """Small integer ids, in order of first appearance, for hashable keys; :meth:`fresh` for a one-off id."""

    def __init__(self) -> None:
        self._ids: dict[Any, int] = {}
        self._next = itertools.count()

    def of(self, key: Any) -> int:
        i = self._ids.get(key)
        if i is None:
            i = self._ids[key] = next(self._next)
        return i

    def fresh(self) -> int:
        return next(self._next)


def group_ids(adm: RecordedAdmission, block_tokens: int, ids: HashIds) -> list[int]:
    """The admission's ``ceil(prompt / block_tokens)`` trace hash ids (see the module invariants)."""
    bs = adm.block_size
    if block_tokens % bs:
        raise ValueError(f"block_tokens ({block_tokens}) must be a multiple of the run's block size ({bs})")
    per = block_tokens // bs
    chain = adm.chain
    out: list[int] = []
    for g in range(-(-adm.prompt_tokens // block_tokens)):
        last = (g + 1) * per - 1
        group = chain[g * per : last + 1]
        if last < len(chain) and all(h is not None for h in group):
            out.append(ids.of(chain[last]))
        else:
            out.append(ids.fresh())
    return out


def trace_rows(admissions: Sequence[RecordedAdmission], block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[dict]:
    """Mooncake ``hash_ids`` rows (timestamp ms relative to the first admission, input_length, output_length,
    hash_ids), in admission order; a ``block_tokens`` field is added when it is not the Mooncake 512."""
    ids = HashIds()
    t0 = admissions[0].ts_ns if admissions else 0
    rows = []
    for a in admissions:
        row: dict[str, Any] = {
            "timestamp": (a.ts_ns - t0) // 1_000_000,
            "input_length": a.prompt_tokens,
            "output_length": a.output_tokens,
            "hash_ids": group_ids(a, block_tokens, ids),
        }
        if block_tokens != MOONCAKE_BLOCK_TOKENS:
            row["block_tokens"] = block_tokens
        rows.append(row)
    return rows


def to_trace_requests(admissions: Sequence[RecordedAdmission]) -> list[Any]:
    """:class:`kvfabric.sim.offline.TraceRequest` rows at the run's own block size (replay with
    ``trace_block_tokens=block_size``). ``output_length`` is the output less its last token, so the replay
    allocates the blocks the engine allocated (it gives every output token a slot)."""
    ids = HashIds()
    t0 = admissions[0].ts_ns if admissions else 0
    return [
        TraceRequest(
            timestamp_ms=(a.ts_ns - t0) / 1e6,
            input_length=a.prompt_tokens,
            output_length=a.output_tokens - 1,
            hash_ids=tuple(group_ids(a, a.block_size, ids)),
        )
        for a in admissions
    ]


def mean_concurrency(admissions: Iterable[RecordedAdmission]) -> float:
    """Mean number of requests in flight (admitted, not yet finished) at an admission, itself included."""
    ends: list[int] = []
    total = 0
    n = 0
    for a in sorted(admissions, key=lambda a: a.ts_ns):
        while ends and ends[0] <= a.ts_ns:
            heapq.heappop(ends)
        total += len(ends) + 1
        n += 1
        heapq.heappush(ends, a.end_ns)
    return total / n if n else 1.0
