"""A stand-in collector for the forwarder's sinks: :class:`StreamServer` (protocol 2 on a Unix socket), event rows
(:func:`row`, :func:`dropped_row`) and a stream's metadata (:data:`META`). Shared by ``tests/forwarder/``'s
``test_sinks.py`` and ``test_sink_failures.py`` (a test module imports kits, never another test module).
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pyarrow as pa

from kvfabric.contract import protocol as P
from kvfabric.contract import schema as S

__all__ = ["META", "StreamServer", "dropped_row", "row", "wait_for"]


def row(i: int, event: str = S.BLOCK_ALLOCATED, *, engine: str | None = None, run_id: str | None = None) -> tuple:
    """Event ``i`` as the forwarder emits it: block ``i`` at ``1000 + i`` ns (engine and run only where given)."""
    values: list[object] = [None] * len(S.EMIT_COLUMNS)
    values[S.EMIT_COLUMNS.index("ts_ns")] = 1_000 + i
    values[S.EMIT_COLUMNS.index("event")] = event
    values[S.EMIT_COLUMNS.index("engine")] = engine
    values[S.EMIT_COLUMNS.index("run_id")] = run_id
    values[S.EMIT_COLUMNS.index("block_id")] = i
    return tuple(values)


def dropped_row(n: int) -> tuple:
    values: list[object] = [None] * len(S.EMIT_COLUMNS)
    values[S.EMIT_COLUMNS.index("ts_ns")] = 1
    values[S.EMIT_COLUMNS.index("event")] = S.SINK_DROPPED
    values[S.EMIT_COLUMNS.index("count")] = n
    return tuple(values)


class StreamServer:
    """A minimal protocol-2 receiver on a Unix socket: HELLO with the stream's committed position, then one
    COMMITTED per batch, deduplicating on (stream id, seq) like the collector.

    ``max_batches_per_conn``: hang up after that many batches of a connection, the last one *not* acknowledged
    (a collector that dies between reading a batch and committing it). ``close_at_once``: accept and close without
    a word (a collector at its connection limit). ``ack``: False never acknowledges a batch.
    """

    def __init__(self, path: str, max_batches_per_conn: int | None = None, *, ack: bool = True) -> None:
        self.path = path
        self.max_batches = max_batches_per_conn
        self.ack = ack
        self.close_at_once = False
        self.accepted = 0
        self.streams: list[dict[str, str]] = []
        self.batches: list[pa.RecordBatch] = []  # stored (deduplicated)
        self.received = 0  # batches read, duplicates included
        self.committed: dict[str, int] = {}
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.close_at_once:
                conn.close()
                continue
            f = conn.makefile("rb")
            with conn, f:
                try:
                    reader = pa.ipc.open_stream(f)
                except pa.ArrowInvalid:
                    continue
                meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
                self.streams.append(meta)
                sid = meta[S.META_STREAM_ID]
                conn.sendall(P.encode_ack(P.HELLO, self.committed.get(sid, -1)))
                n = 0
                try:
                    for batch in reader:
                        n += 1
                        self.received += 1
                        if self.max_batches is not None and n >= self.max_batches:
                            break  # hang up with this batch unacknowledged (never stored)
                        seq = batch.column("seq")[0].as_py()
                        if seq > self.committed.get(sid, -1):
                            self.batches.append(batch)
                            self.committed[sid] = seq
                        if self.ack:
                            conn.sendall(P.encode_ack(P.COMMITTED, seq))
                except (pa.ArrowInvalid, OSError):
                    pass

    def close(self) -> None:
        self.sock.close()
        os.unlink(self.path)

    def rows(self) -> list[dict]:
        return [r for b in self.batches for r in b.to_pylist()]


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


META = {S.META_SCHEMA_VERSION: str(S.SCHEMA_VERSION), S.META_ENGINE: "e", S.META_RUN_ID: "r",
        S.META_BLOCK_SIZE: "16", S.META_NUM_BLOCKS: "10", S.META_POLICY: "lru"}
