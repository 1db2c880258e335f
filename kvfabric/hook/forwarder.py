"""The forwarder: a small child process that turns the hook's rows into Arrow and streams them to the collector.

Why a process: converting Python rows to Arrow costs ~1.7 µs a row, all of it holding the GIL that vLLM's
scheduler thread needs (measured on the H200 with a 0.5B model, converting in the EngineCore slowed the engine by
10-30%). Pickling the same rows costs ~0.1 µs, so the EngineCore only pickles and writes to a pipe; this process,
on another core, does the conversion, the socket, the reconnects and the backoff.

Protocol on stdin: frames of ``<u32 little-endian length><pickle>``; the first is the stream metadata (a dict),
every later one a list of rows in :data:`kvfabric.schema.EMIT_COLUMNS` order. End of input (the parent closed the
pipe or died) means: flush everything to the collector, then exit.

Loss stays counted end to end: the parent reports what it lost before the pipe as ``sink_dropped`` rows, and this
process reports what it loses after it (collector down past its buffer, failed writes) the same way, through the
same :class:`~kvfabric.hook.sinks.UnixArrowSink` logic. On stdout it acknowledges, every 100 ms, how many rows it
is done with; if it dies, the parent counts everything written but not acknowledged as lost.
"""

from __future__ import annotations

import argparse
import logging
import pickle
import struct
import sys
import threading
import time
from typing import BinaryIO

from kvfabric import schema as S
from kvfabric.hook.buffer import EventBuffer
from kvfabric.hook.sinks import UnixArrowSink

log = logging.getLogger("kvfabric.hook")

_LEN = struct.Struct("<I")
_ACK = struct.Struct("<Q")  # stdout: running count of rows accounted for (see accounted())


def write_frame(out: BinaryIO, obj: object) -> None:
    """Pickle ``obj`` and write it as one frame (the caller flushes)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_LEN.pack(len(data)) + data)


def read_frame(inp: BinaryIO) -> object | None:
    """The next frame's object, or None at end of input (a torn last frame counts as the end)."""
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    data = inp.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)  # our own parent process is the only writer of this pipe


def dropped_row_factory(meta: dict[str, str]) -> object:
    engine, run_id, policy = meta.get(S.META_ENGINE), meta.get(S.META_RUN_ID), meta.get(S.META_POLICY)

    def dropped_row(count: int) -> tuple:
        return (time.time_ns(), None, engine, run_id, S.SINK_DROPPED, *([None] * 14), policy, count, None)

    return dropped_row


def forward(
    inp: BinaryIO, socket_path: str, batch_events: int, flush_ms: int, buffer_events: int,
    acks: BinaryIO | None = None,
) -> int:
    meta = read_frame(inp)
    if not isinstance(meta, dict):
        log.error("kvfabric forwarder: no stream metadata on stdin; exiting")
        return 2
    # Room for one more whole frame (a batch plus the parent's sink_dropped row) beyond the backpressure bound,
    # so that this buffer itself never has to drop.
    buffer = EventBuffer(buffer_events + batch_events + 1, batch_events)
    # The parent made the stream id: reconnects of this process keep it, so the collector sees one stream.
    sink = UnixArrowSink(socket_path, buffer, meta, dropped_row_factory(meta),  # type: ignore[arg-type]
                         batch_events=batch_events, flush_ms=flush_ms)
    if acks is not None:
        sink.on_progress = lambda: _ack(sink, acks)  # acknowledge each delivered batch at once
    sink.start()
    stop = threading.Event()
    acker = threading.Thread(target=_ack_loop, args=(sink, acks, stop), name="kvfabric-forwarder-ack", daemon=True)
    if acks is not None:
        acker.start()
    append = buffer.append
    room = buffer_events
    try:
        while True:
            rows = read_frame(inp)
            if rows is None:
                break
            # Backpressure, never loss: while the collector is slow or away, stop reading. The pipe fills, the
            # parent's sink thread waits, and the parent's bounded buffer drops and counts (one place counts).
            while len(buffer) + len(rows) > room and len(buffer) > 0:  # type: ignore[arg-type]
                time.sleep(0.01)
            for row in rows:  # type: ignore[attr-defined]
                append(row)
    finally:
        sink.close(timeout=30.0)
        stop.set()
        if acks is not None:
            acker.join(5.0)
            _ack(sink, acks)
    return 0


def accounted(sink: UnixArrowSink) -> int:
    """Rows this process is done with: committed (acknowledged by the collector), or lost and reported in a
    committed row."""
    return sink.accounted_events()


def _ack(sink: UnixArrowSink, out: BinaryIO) -> None:
    try:
        out.write(_ACK.pack(accounted(sink)))
        out.flush()
    except (OSError, ValueError):
        pass  # the parent is gone; nothing to tell


def _ack_loop(sink: UnixArrowSink, out: BinaryIO | None, stop: threading.Event) -> None:
    """Tell the parent, every 100 ms, how many rows are accounted for: if this process dies, the parent counts
    the rest (in the pipe or in this buffer) as lost, so a crash here is never silent."""
    assert out is not None
    last = -1
    while not stop.wait(0.1):
        n = accounted(sink)
        if n != last:
            _ack(sink, out)
            last = n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfabric.hook.forwarder", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--batch-events", type=int, default=4096)
    ap.add_argument("--flush-ms", type=int, default=100)
    ap.add_argument("--buffer-events", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    return forward(sys.stdin.buffer, args.socket, args.batch_events, args.flush_ms, args.buffer_events,
                   acks=sys.stdout.buffer)


if __name__ == "__main__":
    sys.exit(main())
