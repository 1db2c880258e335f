"""``kvfabric export --format mooncake``: a recorded run as a Mooncake ``hash_ids`` JSONL trace.

The trace carries the run's traffic shape and nothing of its content: per admission, in lookup order, its arrival
(``timestamp``, ms after the first admission), ``input_length`` (prompt tokens), ``output_length`` (estimated from
the blocks it took: :func:`kvfabric.analysis.traffic.estimated_output_tokens`) and ``hash_ids``, small integers
numbered in order of first appearance, one per ``block_tokens`` prompt tokens (``shared/traces/README.md``).
No token ids, digests or request ids are written, so a trace can be shared; ``kvfabric replay --trace FILE`` replays
it through vLLM's scheduler.

Granularity: the recorded run has its own block size (16 tokens in vLLM by default), the Mooncake format 512
tokens per id. With 512, a trace block shares its id with another only when all its recorded blocks are known and
equal (:mod:`kvfabric.analysis.traffic`), so sharing survives up to the last 512-token boundary of a shared prefix
and what lies past it is exported as private. ``--block-tokens`` equal to the run's block size keeps every shared
block (each row then says ``block_tokens``; a reader must expand ids by that many tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from kvfabric.analysis.traffic import recorded_traffic, trace_rows
from kvfabric.queries import DatabaseUnavailable, QueryRunner, UnknownRun
from kvfabric.queries import availability as A
from kvfabric.usage import UsageError, unwritable


def export_mooncake(db_path: str, run: str, out_path: str, *, engine: str | None = None,
                    block_tokens: int = 512) -> dict[str, Any]:
    """Write ``run``'s admissions to ``out_path`` (replaced atomically). Returns ``rows``, ``hash_ids`` (distinct
    ids), ``prompt_tokens``, ``block_tokens``, ``out``. Raises UnknownRun, DatabaseUnavailable, ValueError (block
    tokens not a multiple of the run's block size, or no admission to export)."""
    if block_tokens < 1:
        raise ValueError(f"--block-tokens must be positive, got {block_tokens}")
    runner = QueryRunner.for_path(db_path)
    admissions = recorded_traffic(runner, run, engine)
    if not admissions:
        where = f" on engine {engine!r}" if engine else ""
        why = "" if A.has_lookups(runner.sources(run)) else f" ({A.NO_LOOKUPS})"
        raise ValueError(f"run {run!r} has no admission{where} to export{why}")
    rows = trace_rows(admissions, block_tokens)
    directory = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".mooncake-", suffix=".jsonl", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, separators=(", ", ": ")) + "\n")
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return {
        "out": out_path,
        "rows": len(rows),
        "hash_ids": len({h for r in rows for h in r["hash_ids"]}),
        "prompt_tokens": sum(r["input_length"] for r in rows),
        "block_tokens": block_tokens,
        "run_id": run,
        "engine": engine,
    }


def run_mooncake_export(args: argparse.Namespace) -> int:
    if not args.run:
        raise UsageError("--format mooncake needs --run (the run to export)")
    block_tokens = 512 if args.block_tokens is None else args.block_tokens
    try:
        result = export_mooncake(args.db, args.run, args.out, engine=args.engine, block_tokens=block_tokens)
    except DatabaseUnavailable as exc:
        raise UsageError(f"--db: {exc}") from None
    except UnknownRun as exc:
        raise UsageError(f"--run: {exc}") from None
    except OSError as exc:
        raise unwritable("--out", args.out, exc) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"exported {result['rows']:,} admissions of run {args.run} ({result['prompt_tokens']:,} prompt tokens, "
          f"{result['hash_ids']:,} distinct hash ids of {result['block_tokens']} tokens) to {result['out']}")
    if result["block_tokens"] == 512:
        print(f"replay it: kvfabric replay --trace {result['out']} --policy lru --num-blocks N")
    return 0
