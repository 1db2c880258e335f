"""Checks a Mooncake ``hash_ids`` trace (``shared/traces/README.md``) before anything replays it.

The readers (:func:`kvfabric.sim.workload.iter_trace_workload`, :func:`kvfabric.sim.offline.load_trace`) take rows
as they come; a row without ``timestamp`` there is a ``KeyError`` deep in a replay. :func:`scan_trace` reads the
rows a command will use once, up front, and refuses the first malformed one with a :class:`TraceError` naming the
file and line, what is wrong and what a row holds. It also counts what the command should announce (rows a prompt
cap will cut). One pass of ``json.loads``: milliseconds for the shared traces, small beside any replay.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

ROW_FIELDS = "timestamp (ms), input_length, output_length, hash_ids"


class TraceError(ValueError):
    """A trace row that cannot be used; the message starts with ``FILE:LINE:``."""


@dataclass(frozen=True)
class TraceScan:
    """What :func:`scan_trace` found in the rows it read."""

    rows: int
    longest_input: int
    over_cap: int
    """Rows whose ``input_length`` exceeds the cap given (0 without one)."""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def scan_trace(path: str | Path, limit: int | None = None, *, skip: int = 0, max_input_tokens: int | None = None,
               block_tokens: int | None = None) -> TraceScan:
    """Check rows ``skip`` to ``skip + limit`` of ``path`` (blank lines ignored). Raises :class:`TraceError` for the
    first malformed row (not JSON, not an object, a field missing or of the wrong type, fewer hash ids than the
    prompt needs at ``block_tokens`` tokens each), OSError when the file cannot be read."""
    rows = longest = over = 0
    seen = 0
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            seen += 1
            if seen <= skip:
                continue
            if limit is not None and rows >= limit:
                break
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not a JSON object ({exc.msg}); each row holds {ROW_FIELDS}") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: not a JSON object; each row holds {ROW_FIELDS}")
            missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
            if missing:
                raise TraceError(f"{where}: the row has no {', '.join(missing)} (each row holds {ROW_FIELDS})")
            if not _number(row["timestamp"]):
                raise TraceError(f"{where}: timestamp must be a number of ms, not {row['timestamp']!r}")
            for key in ("input_length", "output_length"):
                if not _count(row[key]):
                    raise TraceError(f"{where}: {key} must be an integer >= 0, not {row[key]!r}")
            ids = row["hash_ids"]
            if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
                raise TraceError(f"{where}: hash_ids must be a list of integers")
            length = row["input_length"]
            used = length if max_input_tokens is None else min(length, max_input_tokens)
            if block_tokens is not None and math.ceil(used / block_tokens) > len(ids):
                raise TraceError(f"{where}: {len(ids)} hash ids of {block_tokens} tokens cannot cover {used} prompt "
                                 "tokens")
            rows += 1
            longest = max(longest, length)
            if max_input_tokens is not None and length > max_input_tokens:
                over += 1
    return TraceScan(rows=rows, longest_input=longest, over_cap=over)
