"""The forwarder: a child process that turns the hook's call records into events and ships them.

vLLM's scheduler thread only copies each step's records (``marshal``, one C call) into a shared-memory ring
(:mod:`kvfabric.hook.ring`). This process, on another core and with its own GIL, reads the ring, expands records
into per-block event rows with the side table (:class:`~kvfabric.hook.lifecycle.Lifecycle`), converts them to
Arrow and streams them to the collector over its Unix socket (or appends JSONL), with reconnects and backoff
(:mod:`kvfabric.hook.sinks`).

Start-up: ``--ring-fd`` is the ring's memfd, inherited from the parent; ``--metadata`` the stream metadata. A
``unix://`` sink connects at once and says who it is (schema metadata, answered by the collector's HELLO) before
the engine has any request: that is how ``kvfabric status`` lists an engine that is on but idle.
Shutdown: when the parent sets the ring's closing word (or dies), drain the ring, flush the sink, exit.

Loss stays counted end to end: the parent reports what it could not hand over (a full ring) as ``LOST`` records,
this process reports what it cannot deliver as ``sink_dropped`` rows, and it publishes in the ring's header how
many events it expanded and how many are accounted for (delivered, or lost and reported), so that if it dies the
parent counts the difference.
"""

from __future__ import annotations

import argparse
import json
import logging
import marshal
import os
import sys
import threading
import time
from collections.abc import Callable

from kvfabric.hook.buffer import EventBuffer
from kvfabric.hook.outlets import lifecycle_from_metadata
from kvfabric.hook.ring import W_ACCOUNTED, W_CLOSING, W_CONSUMER, W_EXPANDED, Ring
from kvfabric.hook.sinks import JsonlSink, Sink, UnixArrowSink

log = logging.getLogger("kvfabric.hook")

POLL_S = 0.005  # an empty ring is polled every 5 ms: events reach the sink within a step or two


def accounted(sink: Sink) -> int:
    """Rows this process is done with: delivered (committed, where the sink knows), or lost and reported."""
    fn = getattr(sink, "accounted_events", None)
    if callable(fn):
        return int(fn())
    return sink.sent_events + sink.reported_lost


def publish_accounting(ring: Ring, sink: Sink) -> Callable[[], None]:
    """Publish in the ring's header how many events ``sink`` has accounted for: after every batch it delivers (from
    its thread, ``Sink.on_progress``) and whenever the returned function is called (the main loop). A forwarder
    killed while busy, its loop never idle, then leaves its parent a count that is at most one unacknowledged
    window behind, so events the collector committed are not counted lost. The lock keeps each read of the count
    and its write together, so the two threads never publish an older count over a newer one."""
    lock = threading.Lock()

    def publish() -> None:
        with lock:
            ring.set_word(W_ACCOUNTED, accounted(sink))

    sink.on_progress = publish
    return publish


def forward(ring: Ring, sink_spec: str, metadata: dict[str, str], batch_events: int, flush_ms: int,
            buffer_events: int) -> int:
    ring.set_word(W_CONSUMER, os.getpid())
    parent = os.getppid()
    # Room for one whole step beyond the backpressure bound, so that this buffer itself never has to drop.
    buffer = EventBuffer(buffer_events + 1_000_000, batch_events)
    lifecycle = lifecycle_from_metadata(metadata, buffer.append)

    def dropped_row(count: int) -> tuple:
        return lifecycle.dropped_row(count, time.time_ns())

    sink: Sink
    if sink_spec.startswith("jsonl://"):
        sink = JsonlSink(sink_spec[len("jsonl://"):], buffer, metadata, dropped_row, batch_events=batch_events,
                         flush_ms=flush_ms)
    else:
        sink = UnixArrowSink(sink_spec[len("unix://"):], buffer, metadata, dropped_row,
                             batch_events=batch_events, flush_ms=flush_ms)
    publish = publish_accounting(ring, sink)
    # The sink's first round runs at once, not after a flush interval: it connects and waits for the collector's
    # HELLO with nothing to send yet, so the collector lists this engine before its first request
    # (GET /api/v1/engines, kvfabric status); it then holds the connection while the engine idles.
    buffer.wakeup.set()
    sink.start()
    undecodable = 0
    try:
        while True:
            data = ring.read()
            if data is None:
                publish()
                if ring.word(W_CLOSING) or os.getppid() != parent:
                    break  # drained: the parent is closing, or gone
                time.sleep(POLL_S)
                continue
            try:
                records = marshal.loads(data)
            except (ValueError, EOFError, TypeError):
                undecodable += 1
                buffer.append(dropped_row(1))  # one message lost; at least one event: counted, not guessed
                continue
            lifecycle.apply(records)
            ring.set_word(W_EXPANDED, lifecycle.events + undecodable)
            # Backpressure, never a second place that drops: while the collector is slow or away, stop reading.
            # The ring fills, and the parent counts what it cannot hand over.
            while len(buffer) > buffer_events:
                publish()
                if os.getppid() != parent and ring.word(W_CLOSING) == 0:
                    break
                time.sleep(0.01)
    finally:
        sink.close(timeout=30.0)
        publish()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfabric.hook.forwarder", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ring-fd", type=int, required=True)
    ap.add_argument("--ring-capacity", type=int, required=True)
    ap.add_argument("--sink", required=True, help="unix:///path/to.sock or jsonl:///path")
    ap.add_argument("--metadata", required=True, help="the stream metadata, a JSON object")
    ap.add_argument("--batch-events", type=int, default=4096)
    ap.add_argument("--flush-ms", type=int, default=100)
    ap.add_argument("--buffer-events", type=int, default=1_000_000)
    ap.add_argument("--nice", type=int, default=10, help="scheduling niceness added to this process (default 10)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if args.nice:
        try:
            # Background work: where cores are short, vLLM's engine loop gets them first. The ring absorbs a
            # backlog; if it fills, the loss is counted (docs/reliability.md), never a stall of the scheduler.
            os.nice(args.nice)
        except OSError:
            pass
    ring = Ring(args.ring_fd, args.ring_capacity)
    return forward(ring, args.sink, json.loads(args.metadata), args.batch_events, args.flush_ms, args.buffer_events)


if __name__ == "__main__":
    sys.exit(main())
