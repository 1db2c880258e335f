"""One ``--kv-events`` spec's thread: subscribe, keep the sequence whole, convert, hand batches to the writer.

Sockets: a SUB connected to the publisher's PUB (receive high-water mark ``hwm``: past it ZMQ drops, and the hole
shows as a gap), its monitor (connected / disconnected), and per replay request a DEALER to the replay ROUTER
(:mod:`.replay`). ZMQ reconnects to a publisher that went away by itself; the monitor tells this thread, which logs
it, shows it in /healthz and ``kvfabric_kv_events_connected``, and re-checks who is there when it is back.

The sequence (this thread's state; ``expected`` = the next seq to place in the current stream):
  * live seq == expected: placed (stored, or refused when undecodable);
  * live seq > expected: a hole; a replay from ``expected`` fills it (again while each attempt brings something and
    a reply skipped a seq: frames the replay path dropped); what the publisher no longer holds is lost, counted
    (``replay_unavailable``; ``gap`` without a replay socket; ``joined_late`` before a stream's first batch);
  * live seq < expected: already placed through a replay, skipped;
  * live seq not above the last live seq: the publisher restarted (its sequence starts at 0 again): the stream
    ends and a new one starts, filled from seq 0 by a replay of what the new publisher still holds.
A garbage or truncated message never moves this state except when it sits exactly at ``expected`` (then it is
refused and counted): a corrupted seq cannot open a false hole or a false restart.

Who is there (on first contact, after every reconnect, and after a collector restart, where the newest committed
stream of the engine and run is the candidate): a replay from the last placed (or committed) seq A. If the
publisher still holds A with a timestamp not after the one placed, it is the same incarnation and the replay
continues from A + 1 (a restarted collector resumes without loss or duplicate); a later timestamp is a restarted
publisher; an answer that starts after A (the buffer moved on) cannot tell and is taken as the same publisher; no
batch at all >= A means it has not reached A: the next live seq, not above A, says restart. Without a replay socket
only the live sequence decides.

Nothing here blocks the publisher: it is another process, and its PUB socket drops rather than wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvfabric.ingest import defaults as D
from kvfabric.ingest.metrics import KV_LOSS_GAP, KV_LOSS_JOINED_LATE, KV_LOSS_REASONS, KV_LOSS_REPLAY
from kvfabric.ingest.queue import QueueClosed
from kvfabric.ingest.store import StreamState
from kvfabric.kvevents.convert import Converter, ts_to_ns
from kvfabric.kvevents.replay import ReplayTimeout, replay
from kvfabric.kvevents.spec import KvEventsSpec
from kvfabric.kvevents.stream import KvStream, Labels, SubscriberContext, event_stream_id, is_event_stream
from kvfabric.kvevents.wire import TOPIC, DecodedBatch, Message, WireError, decode_batch, split_message

log = logging.getLogger("kvfabric.kvevents")

# How a replay request ended.
DONE = "done"  # the end marker came
TIMEOUT = "timeout"  # the replay socket stopped answering
DROPPED = "dropped"  # a reply skipped a seq the publisher held (dropped on the way): ask again
RESTART = "restart"  # the publisher holds the anchor seq with a later timestamp: another incarnation
EMPTY = "empty"  # the end marker came first: the publisher holds nothing from the requested seq on
_DRAIN = 1000  # live messages read per poll before the monitor and the stop flag are looked at again


class KvEventsSubscriber:
    """See the module docstring. ``start``/``stop`` from the pipeline; :meth:`status` from the HTTP thread."""

    def __init__(self, spec: KvEventsSpec, ctx: SubscriberContext, *,
                 replay_timeout_s: float = D.KV_EVENTS_REPLAY_TIMEOUT_S) -> None:
        self.spec = spec
        self.ctx = ctx
        self.replay_timeout_s = replay_timeout_s
        self._topic = spec.topic.encode() if spec.topic is not None else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._zmq: zmq.Context | None = None
        # -- this thread's state --
        self.stream: KvStream | None = None
        self.converter: Converter | None = None
        self.candidate: StreamState | None = None  # the committed stream a restarted collector may continue
        self.expected = 0
        self.anchor: tuple[int, int | None] | None = None  # (seq, ts_ns) of the last placed batch
        self.last_live: int | None = None
        self._need_sync = False
        self._clipped = 0  # the converter's count already logged
        # -- read by /healthz (plain values, written by this thread only) --
        self.connected = False
        self.ever_connected = False
        self.since_ns = time.time_ns()  # of the current connected / disconnected state
        self.reconnects = 0
        self.restarts = 0
        self.replays = 0
        self.decode_errors = 0
        self.batches = 0
        self.rows = 0
        self.lost: dict[str, int] = dict.fromkeys(KV_LOSS_REASONS, 0)
        self.last_batch_ns: int | None = None
        self.lag_s: float | None = None
        self.failed: str | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.ctx.metrics.open_kv_events(self.spec.engine)
        self._thread = threading.Thread(target=self._run, name=f"kvfabric-kv-events:{self.spec.engine}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the message at hand (what is placed stays queued for the writer). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("kv-events %s: subscriber did not stop within %.1f s", self.spec.engine, timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def status(self, authorized: bool = False) -> dict[str, Any]:
        """One entry of /healthz's ``kv_events`` (addresses only for callers with the token)."""
        stream = self.stream
        state = "connected" if self.connected else "disconnected" if self.ever_connected else "waiting"
        body: dict[str, Any] = {
            "engine": self.spec.engine, "state": "failed" if self.failed else state, "since_ns": self.since_ns,
            "stream_id": stream.stream_id if stream is not None else None,
            "last_seq": self.expected - 1 if stream is not None else None,
            "batches": self.batches, "rows": self.rows, "lost": sum(self.lost.values()),
            "lost_by_reason": dict(self.lost), "decode_errors": self.decode_errors, "replays": self.replays,
            "reconnects": self.reconnects, "restarts": self.restarts, "last_batch_ns": self.last_batch_ns,
            "lag_s": self.lag_s,
        }
        if self.failed:
            body["problem"] = self.failed
        if authorized:
            body["endpoint"] = self.spec.endpoint
            body["replay"] = self.spec.replay
        return body

    # -- the thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        context = self._zmq = zmq.Context(1)
        sub = context.socket(zmq.SUB)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            self.candidate = self._newest_committed()
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self.spec.hwm)
            sub.setsockopt(zmq.RECONNECT_IVL, D.KV_EVENTS_RECONNECT_MS[0])
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, D.KV_EVENTS_RECONNECT_MS[1])
            sub.setsockopt(zmq.SUBSCRIBE, self._topic or b"")
            sub.connect(self.spec.endpoint)
            log.info("kv-events %s: subscribing to %s (replay %s)%s", self.spec.engine, self.spec.endpoint,
                     self.spec.replay or "none",
                     f"; resuming stream {self.candidate.stream_id!r} after seq {self.candidate.last_seq}"
                     if self.candidate is not None else "")
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(200))
                if monitor in ready:
                    self._on_monitor(monitor)
                if self._need_sync:
                    self._sync()
                if sub in ready:
                    self._drain(sub)
        except QueueClosed:
            pass  # the collector is stopping: what was not queued is replayed by the next one
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            log.exception("kv-events %s: subscriber died", self.spec.engine)
        finally:
            if self.stream is not None:
                self.stream.closed(by_collector=True, why="the collector stopped")
            self.ctx.metrics.kv_connected.labels(self.spec.engine).set(0)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            context.term()

    def _newest_committed(self) -> StreamState | None:
        """The engine's newest committed event stream of this run holding a batch (a collector restart continues
        it if its publisher is still the same)."""
        streams = [st for st in self.ctx.committed_streams(self.spec.engine, self.spec.run_id)
                   if is_event_stream(st.stream_id, self.spec.engine) and st.last_seq >= 0]
        return max(streams, key=lambda st: st.first_seen_ns, default=None)

    def _drain(self, sub: zmq.Socket) -> None:
        for _ in range(_DRAIN):
            if self._stop.is_set():
                return
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_live(frames, time.time_ns())

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        engine = self.spec.engine
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                if self.ever_connected:
                    self.reconnects += 1
                    self.ctx.metrics.kv_reconnects.labels(engine).inc()
                    log.info("kv-events %s: the publisher at %s is back (reconnect %d); checking it is the same "
                             "one", engine, self.spec.endpoint, self.reconnects)
                    if self.stream is not None:
                        self.stream.reconnected()
                else:
                    log.info("kv-events %s: connected to %s", engine, self.spec.endpoint)
                self.ever_connected = self.connected = True
                self.since_ns = time.time_ns()
                self.ctx.metrics.kv_connected.labels(engine).set(1)
                self._need_sync = self.spec.replay is not None
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.since_ns = time.time_ns()
                self.ctx.metrics.kv_connected.labels(engine).set(0)
                log.warning("kv-events %s: the publisher at %s went away after seq %d; ZMQ reconnects (every %.1f "
                            "s at most) and the stream resumes through a replay", engine, self.spec.endpoint,
                            self.expected - 1, D.KV_EVENTS_RECONNECT_MS[1] / 1000)
                if self.stream is not None:
                    self.stream.closed(by_collector=False, why="the publisher went away")

    # -- live messages --------------------------------------------------------------------------------------
    def _on_live(self, frames: list[bytes], received_ns: int) -> None:
        try:
            msg = split_message(frames)
        except WireError as e:
            self._bad(e)
            return
        if self._topic is not None and msg.topic != self._topic:
            self._bad(WireError(TOPIC, f"topic {msg.topic[:40]!r}, expected {self._topic!r}"))
            return
        seq = msg.seq
        back = self.stream is not None and self.last_live is not None and seq <= self.last_live
        if self.stream is not None and not back and seq < self.expected:
            self.last_live = seq  # placed already, through a replay
            return
        try:
            batch = decode_batch(msg.payload)
        except WireError as e:
            self._bad(e)
            if self.stream is not None and not back and seq == self.expected:
                self._refuse(seq, e)
                self.last_live = seq
            return
        if self.stream is None:
            self._decide(seq)
        elif back:
            self._restarted(f"seq {seq} after {self.last_live}")
        self.last_live = seq
        if seq > self.expected:
            self._fill(seq)
        if seq == self.expected:
            self._place(seq, batch, received_ns, live=True)

    def _decide(self, seq: int) -> None:
        """The first live batch decides who is there when no replay could: the committed stream continues when
        the sequence is past it, else the engine restarted while this collector was away."""
        candidate, self.candidate = self.candidate, None
        if candidate is not None and seq > candidate.last_seq:
            self._adopt(candidate)
            return
        if candidate is not None:
            self._count_restart(f"seq {seq}, not after the stored stream's {candidate.last_seq}")
        self._begin()

    # -- replays --------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        """Contact (first, after a reconnect, after a collector restart): who is there, and what we missed."""
        self._need_sync = False
        if self.stream is None and self.candidate is None:
            self._begin()
        if self.stream is None:
            assert self.candidate is not None
            verify: tuple[int, int | None] | None = (self.candidate.last_seq, self.candidate.last_ts_ns)
        else:
            verify = self.anchor
        start = verify[0] if verify is not None else self.expected
        outcome = self._replay(start, verify)
        if outcome == RESTART:
            self._restarted("the replay holds the last placed seq with a later timestamp")
            self._replay_from_expected()
        elif outcome == DROPPED:
            self._replay_from_expected()
        elif outcome == EMPTY and verify is not None:
            # The publisher that placed seq A holds A or later; one holding only earlier seqs restarted since.
            self._replay(0, None, first=lambda: self._restarted(f"it holds nothing from seq {start} on"))

    def _fill(self, upto: int) -> None:
        """A live ``upto`` past ``expected``: replay the hole; lose what cannot be had."""
        if self.spec.replay is None:
            self._skip(upto, KV_LOSS_GAP)
            return
        self._replay_from_expected(upto)
        if self.expected < upto:
            self._skip(upto, KV_LOSS_REPLAY)

    def _replay_from_expected(self, upto: int | None = None) -> None:
        """Replay from ``expected`` (up to ``upto`` excluded: the live socket holds the rest), asking again while
        a reply skipped a seq."""
        for _ in range(D.KV_EVENTS_REPLAY_ATTEMPTS):
            if upto is not None and self.expected >= upto:
                return
            if self._replay(self.expected, None, limit=upto) != DROPPED:
                return

    def _replay(self, start: int, verify: tuple[int, int | None] | None,
                first: Callable[[], None] | None = None, limit: int | None = None) -> str:
        """One replay request from ``start``; places what comes in order. ``verify``: the anchor (seq, ts_ns) to
        recognise the publisher by (``start`` is then its seq); ``first``: called before the first frame is
        placed; ``limit``: the first seq not wanted (the rest of the answer is abandoned)."""
        assert self.spec.replay is not None and self._zmq is not None
        self.replays += 1
        self.ctx.metrics.kv_replays.labels(self.spec.engine).inc()
        previous: int | None = None
        try:
            for msg in replay(self._zmq, self.spec.replay, start, self.replay_timeout_s, self._bad):
                if self._stop.is_set():
                    return DONE
                if self._topic is not None and msg.topic != self._topic:
                    self._bad(WireError(TOPIC, f"replayed topic {msg.topic[:40]!r}, expected {self._topic!r}"))
                    continue
                if first is not None:
                    first()
                    first = None
                seq = msg.seq
                if verify is not None:
                    anchor_seq, anchor_ts = verify
                    verify = None
                    if seq == anchor_seq:
                        if not self._same_publisher(msg, anchor_ts):
                            return RESTART
                        self._confirm()
                        previous = seq
                        continue  # placed (or committed) already
                    self._confirm()  # the buffer moved past the anchor: cannot tell; the same publisher
                if limit is not None and seq >= limit:
                    return DONE if previous is not None else EMPTY
                if seq < self.expected:
                    previous = seq
                    continue
                if seq > self.expected:
                    if previous is not None:
                        return DROPPED  # the publisher held the seqs in between: they were dropped on the way
                    self._skip(seq, KV_LOSS_REPLAY)  # its buffer starts after the hole
                previous = seq
                self._place_message(msg)
        except ReplayTimeout as e:
            self.ctx.log(logging.WARNING, f"kv-replay:{self.spec.engine}", "kv-events %s: replay from seq %d "
                         "failed: %s", self.spec.engine, start, e)
            return TIMEOUT
        return DONE if previous is not None else EMPTY

    def _same_publisher(self, msg: Message, anchor_ts: int | None) -> bool:
        if anchor_ts is None:
            return True
        try:
            ts = decode_batch(msg.payload).ts
        except WireError:
            return True  # (the anchor was refused as undecodable too: nothing to compare)
        return ts_to_ns(ts) <= anchor_ts

    def _confirm(self) -> None:
        """The replay says the committed candidate's publisher is the one there: continue its stream."""
        if self.stream is None and self.candidate is not None:
            candidate, self.candidate = self.candidate, None
            self._adopt(candidate)

    # -- streams --------------------------------------------------------------------------------------------
    def _labels(self) -> Labels:
        s = self.spec
        return Labels(engine=s.engine, run_id=s.run_id, host=s.host, peer=f"kv-events {s.endpoint}",
                      settings={"source": "kv_events", "endpoint": s.endpoint, "replay": s.replay, "topic": s.topic})

    def _begin(self) -> None:
        """A new stream (a publisher incarnation this collector has not stored before), from seq 0."""
        self.stream = KvStream(self.ctx, event_stream_id(self.spec.engine), self._labels())
        self.converter = self._converter()
        self.expected = 0
        self.anchor = None
        self.last_live = None
        log.info("kv-events %s: new stream %r", self.spec.engine, self.stream.stream_id)

    def _adopt(self, committed: StreamState) -> None:
        """Continue a stream this collector (or the lake's other collectors) stored up to ``last_seq``."""
        resume = self.ctx.resume_seq(committed.stream_id)
        self.stream = KvStream(self.ctx, committed.stream_id, self._labels(), resumed=committed)
        self.converter = self._converter()
        self.expected = resume + 1
        self.anchor = (resume, committed.last_ts_ns)
        self.last_live = resume
        log.info("kv-events %s: continuing stream %r after seq %d", self.spec.engine, committed.stream_id, resume)

    def _converter(self) -> Converter:
        return Converter(engine=self.spec.engine, run_id=self.spec.run_id, host=self.spec.host,
                         max_string_bytes=self.ctx.max_string_bytes)

    def _restarted(self, why: str) -> None:
        self.candidate = None
        if self.stream is not None:
            self.stream.closed(by_collector=False, why=f"the publisher restarted ({why})")
        self._count_restart(why)
        self._begin()

    def _count_restart(self, why: str) -> None:
        self.restarts += 1
        self.ctx.metrics.kv_restarts.labels(self.spec.engine).inc()
        log.warning("kv-events %s: the publisher at %s restarted (%s): a new stream", self.spec.engine,
                    self.spec.endpoint, why)

    # -- placing --------------------------------------------------------------------------------------------
    def _place_message(self, msg: Message) -> None:
        try:
            batch = decode_batch(msg.payload)
        except WireError as e:
            self._bad(e)
            self._refuse(msg.seq, e)
            return
        self._place(msg.seq, batch, time.time_ns(), live=False)

    def _place(self, seq: int, batch: DecodedBatch, received_ns: int, *, live: bool) -> None:
        assert self.stream is not None and self.converter is not None and seq == self.expected
        converted = self.converter.convert(batch)
        m = self.ctx.metrics
        engine = self.spec.engine
        for kind, n in converted.events.items():
            m.kv_events.labels(engine, kind).inc(n)
        if batch.unknown_events:
            m.kv_skipped.labels(engine, "unknown_type").inc(batch.unknown_events)
        if converted.skipped_medium:
            m.kv_skipped.labels(engine, "medium").inc(converted.skipped_medium)
        if self.converter.clipped > self._clipped:
            self._clipped = self.converter.clipped
            self.ctx.log(logging.WARNING, f"kv-clipped:{engine}", "kv-events %s: %d tenant or LoRA value(s) over "
                         "the %d-byte string cap stored as null", engine, self._clipped, self.ctx.max_string_bytes)
        self.stream.learn(block_size=converted.block_size, dp_rank=converted.dp_rank)
        self.rows += self.stream.put(seq, converted.record_batch(seq), converted.ts_ns, received_ns)
        self.expected = seq + 1
        self.anchor = (seq, converted.ts_ns)
        self.batches += 1
        self.last_batch_ns = received_ns
        m.kv_batches.labels(engine, "live" if live else "replay").inc()
        if live:
            self.lag_s = max(0.0, (received_ns - converted.ts_ns) / 1e9)
            m.kv_lag.labels(engine).observe(self.lag_s)

    def _refuse(self, seq: int, e: WireError) -> None:
        assert self.stream is not None and seq == self.expected
        self.stream.refuse(seq, f"{e.reason}: {e}")
        self.expected = seq + 1
        self.anchor = (seq, None)
        self.ctx.metrics.kv_batches.labels(self.spec.engine, "live").inc()

    def _skip(self, upto: int, reason: str) -> None:
        """Seqs ``expected..upto-1`` will never come: lost, counted."""
        assert self.stream is not None
        if upto <= self.expected:
            return
        if self.stream.fresh:
            reason = KV_LOSS_JOINED_LATE
        n = self.stream.lose(self.expected, upto - 1, reason)
        self.lost[reason] += n
        self.expected = upto

    def _bad(self, e: WireError) -> None:
        self.decode_errors += 1
        self.ctx.metrics.kv_decode_errors.labels(self.spec.engine, e.reason).inc()
        self.ctx.log(logging.WARNING, f"kv-bad:{self.spec.engine}:{e.reason}", "kv-events %s: message dropped "
                     "(%s: %s)", self.spec.engine, e.reason, e)
