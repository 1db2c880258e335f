"""Where the learner's traffic comes from: a ``hash_ids`` trace, or a run recorded by the collector in DuckDB.

Either way the result is a :class:`Traffic`: requests in admission order, each with its chain of full prompt
block identities (prefix-chained: equal identities mean equal prefixes), its prompt length and its output
length, at one block size. That is all the offline replay (:func:`kvfabric.sim.offline.replay_chains`) needs.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import duckdb

from kvfabric.contract import schema as S
from kvfabric.sim.offline import TRACE_BLOCK_TOKENS, block_keys, load_trace


@dataclass
class Traffic:
    chains: list[list[int]]
    input_lengths: list[int]
    output_lengths: list[int]
    block_size: int
    source: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.chains)

    def unique_blocks(self) -> int:
        seen: set[int] = set()
        for c in self.chains:
            seen.update(c)
        return len(seen)

    def longest_request_blocks(self) -> int:
        return max(-(-(n + 1) // self.block_size) for n in self.input_lengths) if self.input_lengths else 0


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def from_trace(path: str, block_size: int = 16, skip: int = 0, limit: int | None = None) -> Traffic:
    """Rows ``[skip, skip + limit)`` of a ``hash_ids`` JSONL trace (``shared/traces/README.md``)."""
    if TRACE_BLOCK_TOKENS % block_size:
        raise ValueError(f"--block-size must divide {TRACE_BLOCK_TOKENS}")
    rows = load_trace(path, None if limit is None else skip + limit)[skip:]
    return Traffic(
        chains=[block_keys(r, block_size) for r in rows],
        input_lengths=[r.input_length for r in rows],
        output_lengths=[r.output_length for r in rows],
        block_size=block_size,
        source={"kind": "trace", "path": os.path.basename(path), "sha256": _sha256(path), "skip": skip,
                "limit": limit, "rows": len(rows)},
    )


def from_db(path: str, run: str) -> Traffic:
    """The admissions of collector run ``run`` in the DuckDB file ``path``, rebuilt from its events.

    A request's chain is the digests of the blocks it hit (``block_touched``) or sealed (``block_sealed``) at
    depths ``0, 1, ...`` below its prompt's full blocks, up to the first depth with neither (a block the admission
    gate kept out of the cache); requests are ordered by their first ``prefix_lookup``.
    """

    if not os.path.isfile(path):
        raise ValueError(f"no database file {path!r}")
    con = duckdb.connect(path, read_only=True)
    try:
        row = con.execute("SELECT max(block_size) FROM streams WHERE run_id = ?", [run]).fetchone()
        if row is None or row[0] is None:
            known = [r[0] for r in con.execute("SELECT DISTINCT run_id FROM streams ORDER BY 1").fetchall()]
            raise ValueError(f"run {run!r} is not in {path} (runs: {', '.join(known) or 'none'})")
        block_size = int(row[0])
        rows = con.execute(
            f"""
            WITH lookups AS (
                SELECT request_id, arg_min(prompt_tokens, rowid) AS prompt_tokens, min(rowid) AS first
                FROM events WHERE run_id = $run AND event = '{S.PREFIX_LOOKUP}' AND request_id IS NOT NULL
                GROUP BY request_id),
            blocks AS (
                SELECT request_id, depth, arg_min(block_hash, rowid) AS h
                FROM events
                WHERE run_id = $run AND event IN ('{S.BLOCK_TOUCHED}', '{S.BLOCK_SEALED}')
                  AND request_id IS NOT NULL AND depth IS NOT NULL AND block_hash IS NOT NULL
                GROUP BY request_id, depth)
            SELECT l.request_id, l.prompt_tokens, list(b.h ORDER BY b.depth), list(b.depth ORDER BY b.depth)
            FROM lookups l LEFT JOIN blocks b USING (request_id)
            GROUP BY l.request_id, l.prompt_tokens, l.first
            ORDER BY l.first
            """,
            {"run": run},
        ).fetchall()
    finally:
        con.close()
    chains: list[list[int]] = []
    lengths: list[int] = []
    for _, prompt_tokens, hashes, depths in rows:
        full = (prompt_tokens or 0) // block_size
        chain: list[int] = []
        for h, d in zip(hashes or [], depths or [], strict=True):
            if h is None or d != len(chain) or d >= full:
                break
            chain.append(int(h))
        chains.append(chain)
        lengths.append(int(prompt_tokens or 0))
    if not chains:
        raise ValueError(f"run {run!r} in {path} has no admissions (prefix_lookup events)")
    return Traffic(chains=chains, input_lengths=lengths, output_lengths=[1] * len(chains), block_size=block_size,
                   source={"kind": "db", "path": os.path.basename(path), "run": run, "rows": len(chains)})
