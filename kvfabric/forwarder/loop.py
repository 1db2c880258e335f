"""The forwarder's loop: read the ring, expand each message's records into event rows (the lifecycle expander),
append them to the buffer the sink thread drains; publish the accounting words of the ring's header."""

from __future__ import annotations

import logging
import marshal
import os
import threading
import time
from collections.abc import Callable

from kvfabric.contract.ring import W_ACCOUNTED, W_CLOSING, W_CONSUMER, W_EXPANDED, W_SENT, Ring
from kvfabric.forwarder.buffer import EventBuffer
from kvfabric.forwarder.sinks import JsonlSink, Sink, UnixArrowSink
from kvfabric.lifecycle.expander import expander_from_metadata

log = logging.getLogger("kvfabric.forwarder")

POLL_S = 0.005  # an empty ring is polled every 5 ms: events reach the sink within a step or two


def accounted(sink: Sink) -> int:
    """Rows this process is done with: delivered (committed, where the sink knows), or lost and reported."""
    fn = getattr(sink, "accounted_events", None)
    if callable(fn):
        return int(fn())
    return sink.sent_events + sink.reported_lost


def handed(sink: Sink) -> int:
    """Rows handed to the destination: accounted for, or sent and not yet confirmed (at least ``accounted``)."""
    fn = getattr(sink, "handed_events", None)
    if callable(fn):
        return int(fn())
    return accounted(sink)


def publish_accounting(ring: Ring, sink: Sink) -> Callable[[], None]:
    """Publish in the ring's header how many events ``sink`` has accounted for (``W_ACCOUNTED``) and handed to the
    destination (``W_SENT``): before every batch it sends and after every acknowledgement it reads (from its
    thread, ``Sink.on_progress``; it reads acknowledgements as they arrive, even while it idles between flushes)
    and whenever the returned function is called (the main loop). A forwarder killed, busy or idle, then leaves its
    parent a count behind only by the batches sent and not yet acknowledged, and says how many events those hold
    (``W_SENT - W_ACCOUNTED``): the only events counted lost that the collector may have stored. The lock keeps
    each read of the counts and its write together, so the two threads never publish an older count over a newer
    one."""
    lock = threading.Lock()

    def publish() -> None:
        with lock:
            done = accounted(sink)
            ring.set_word(W_SENT, max(done, handed(sink)))
            ring.set_word(W_ACCOUNTED, done)

    sink.on_progress = publish
    return publish


def forward(ring: Ring, sink_spec: str, metadata: dict[str, str], batch_events: int, flush_ms: int,
            buffer_events: int) -> int:
    ring.set_word(W_SENT, 0)  # (a dead forwarder's count; the parent resets the words it reads after a death)
    ring.set_word(W_CONSUMER, os.getpid())
    parent = os.getppid()
    # Room for one whole step beyond the backpressure bound, so that this buffer itself never has to drop.
    buffer = EventBuffer(buffer_events + 1_000_000, batch_events)
    # A message's rows are staged, counted in W_EXPANDED, and only then offered to the sink: the header never
    # says a row was accounted for before it says the row was expanded (a forwarder killed in between would
    # leave its parent counting fewer events made than the collector stored).
    staged: list[tuple] = []
    expander = expander_from_metadata(metadata, staged.append)

    def dropped_row(count: int) -> tuple:
        return expander.dropped_row(count, time.time_ns())

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
                ring.set_word(W_EXPANDED, expander.events + undecodable)
                buffer.append(dropped_row(1))  # one message lost; at least one event: counted, not guessed
                continue
            try:
                expander.apply(records)
            finally:
                ring.set_word(W_EXPANDED, expander.events + undecodable)
                buffer.extend(staged)
                staged.clear()
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
