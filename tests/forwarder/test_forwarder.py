"""How records leave vLLM's process: the shared-memory ring, the forwarder child, and the loss accounting.

The ring is checked against a reference queue under random message sizes (wrap-around included); the forwarder
end to end through vLLM's real KVCacheManager and a real collector process: every event the in-process expansion
makes arrives with the same values, a killed forwarder is restarted and its loss counted, and a ring that cannot
take a step's records counts the loss and reports it as ``sink_dropped``.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import duckdb
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.collector_testkit import collector_files, wait_until
from support.pools import BLOCK, bare_manager, traffic
from vllm.v1.core.kv_cache_manager import KVCacheManager

from kvfabric.contract import schema as S
from kvfabric.contract.ring import W_ACCOUNTED, W_READ, W_SENT, Ring
from kvfabric.engine.config import load_hook_settings
from kvfabric.engine.handover import LocalOutlet, RingOutlet, TeeOutlet
from kvfabric.engine.install import Installation, build_hook

# ------------------------------------------------------------------------------------------------------ the ring


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.one_of(st.integers(0, 300), st.just(-1)), max_size=200), capacity=st.integers(64, 1024))
def test_ring_is_a_bounded_fifo_that_never_overwrites(ops: list[int], capacity: int) -> None:
    """Writes of n bytes (or reads, -1) in any order: what comes out is what went in, in order; a write that
    does not fit is refused whole and changes nothing."""
    producer = Ring.create(capacity)
    consumer = Ring(os.dup(producer.fd), capacity)
    model: collections.deque[bytes] = collections.deque()
    serial = 0
    try:
        for n in ops:
            if n < 0:
                got = consumer.read()
                assert got == (model.popleft() if model else None)
                continue
            serial += 1
            payload = bytes([serial % 251]) * n
            used = producer.used()
            if producer.write(payload):
                model.append(payload)
            else:
                assert producer.used() == used  # refused: nothing written
                # An empty ring always takes a message of up to half its size (wrap padding included).
                assert not (used == 0 and 2 * (n + 4) <= capacity)
        while model:
            assert consumer.read() == model.popleft()
        assert consumer.read() is None
        assert producer.word(W_READ) == producer.word(0)  # everything written was consumed
    finally:
        consumer.close()
        producer.close()


# ------------------------------------------------------------------------------------------- through vLLM's pool


def make_manager(num_blocks: int, sock: str, run_id: str, outlet: Any = None,
                 batch_events: int = 64, flush_ms: int = 20) -> tuple[KVCacheManager, Installation]:
    manager = bare_manager(num_blocks)
    settings_ = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": f"unix://{sock}",
                                    "KVFABRIC_RUN_ID": run_id, "KVFABRIC_BATCH_EVENTS": str(batch_events),
                                    "KVFABRIC_FLUSH_MS": str(flush_ms)})
    inst = build_hook(manager, settings_, block_size=BLOCK, engine="test", outlet=outlet)
    assert inst is not None
    return manager, inst


def stored_rows(db: str, run_id: str) -> list[dict[str, Any]]:
    con = duckdb.connect(db, read_only=True)
    try:
        cur = con.execute("SELECT * FROM events WHERE run_id = ? ORDER BY seq, ts_ns", [run_id])
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    finally:
        con.close()


def wait_run_rows(url: str, run_id: str, n: int) -> None:
    def enough() -> bool:
        runs = {r["run_id"]: r for r in httpx.get(f"{url}/api/v1/runs").json()}
        return run_id in runs and runs[run_id]["events"] >= n

    wait_until(enough, timeout=30, what=f"{n} events of {run_id} stored")


def test_forwarder_delivers_exactly_what_the_expansion_makes() -> None:
    """Every row the in-process expansion makes from the records arrives through ring, forwarder and socket with
    the same values (a tee runs both on the same records)."""
    with collector_files() as files:
        proc = files.process()
        proc.start()
        try:
            manager, inst = make_manager(14, files.socket_path, "tee", outlet="tee")
            assert isinstance(inst.outlet, TeeOutlet) and isinstance(inst.outlet.remote, RingOutlet)
            traffic(manager, inst, 60)
            local = [dict(zip(S.EMIT_COLUMNS, r, strict=True)) for r in inst.drain()]
            inst.close()
            assert inst.outlet.remote.lost_events == 0  # type: ignore[attr-defined]
            assert inst.outlet.remote.expanded_events == len(local)  # type: ignore[attr-defined]
            wait_run_rows(files.http_url, "tee", len(local))
        finally:
            proc.stop()
        rows = stored_rows(files.db_path, "tee")
    kinds = collections.Counter(r["event"] for r in local)
    assert kinds[S.BLOCK_EVICTED] > 0 and kinds[S.BLOCK_REBUILT] > 0 and kinds[S.PREFIX_LOOKUP] == 60
    assert len(rows) == len(local)
    for got, want in zip(rows, local, strict=True):
        assert {k: got[k] for k in S.EMIT_COLUMNS} == want


def test_a_killed_forwarder_is_restarted_and_its_loss_counted() -> None:
    with collector_files() as files:
        proc = files.process()
        proc.start()
        try:
            # Batches go out at the sink's first round (once the collector's HELLO is in: on a loaded machine
            # that can come after some of the traffic below) and at close, never in between (flush_ms). A batch
            # sent and not yet acknowledged when a forwarder dies is counted lost even if the collector commits
            # it (docs/reliability.md §1): the only over-count allowed, and the ring's header says how many events
            # it can be (W_SENT - W_ACCOUNTED). An acknowledgement, though, is read as it arrives, however long
            # the flush interval: wait until nothing is in flight, then kill, and the count must be exact.
            manager, inst = make_manager(14, files.socket_path, "kill", batch_events=1_000_000, flush_ms=600_000)
            outlet = inst.outlet
            assert isinstance(outlet, RingOutlet) and outlet.wait_ready()
            traffic(manager, inst, 20)
            assert outlet.proc is not None
            wait_until(lambda: outlet.ring.word(W_SENT) == outlet.ring.word(W_ACCOUNTED), timeout=10,
                       what="every batch the first forwarder sent acknowledged")
            first = outlet.proc.pid
            os.kill(first, 9)
            outlet.proc.wait()
            in_flight = outlet.ring.word(W_SENT) - outlet.ring.word(W_ACCOUNTED)  # its last words
            # The producer notices within a second (it checks on the child once a second, at a hand-over),
            # counts what the dead one held, and restarts it after a backoff; records wait in the ring meanwhile.
            for k in range(8):
                traffic(manager, inst, 5, start=20 + 5 * k)
                time.sleep(0.4)
            assert outlet.spawns == 2 and outlet.proc is not None and outlet.proc.pid != first
            inst.close()
            wait_run_rows(files.http_url, "kill", 1)
            time.sleep(1.0)  # the collector commits what it has (coalescing: 100 ms)
        finally:
            proc.stop()
        rows = stored_rows(files.db_path, "kill")
    delivered = [r for r in rows if r["event"] != S.SINK_DROPPED]
    reported = sum(r["count"] for r in rows if r["event"] == S.SINK_DROPPED)
    # Every row the forwarders made (the restarted one's sink_dropped report included) is either stored or
    # counted lost, and the count reached the collector. Counted twice (stored and lost) at most what the killed
    # one had in flight: 0, unless its sink's first round sent a batch between the wait above and the kill.
    assert 0 <= len(rows) + outlet.lost_events - outlet.expanded_events <= in_flight
    assert reported == outlet.lost_events
    assert any(r["request_id"] == "q59" for r in delivered)  # the stream went on after the restart
    assert len({r["event"] for r in delivered}) > 3


def test_a_full_ring_counts_its_loss_and_reports_it() -> None:
    with collector_files() as files:
        proc = files.process()
        proc.start()
        try:
            manager, inst = make_manager(14, files.socket_path, "full")
            outlet = inst.outlet
            assert isinstance(outlet, RingOutlet) and outlet.wait_ready()
            # Stop the consumer and keep it from being restarted: the ring fills, and records must be refused.
            assert outlet.proc is not None
            outlet.proc.kill()
            outlet.proc.wait()
            outlet._next_spawn = float("inf")
            outlet._next_check = float("inf")
            for size in (65_536, 1024, 16, 0):  # junk nobody will read: only the space matters
                while outlet.ring.write(b"x" * size):
                    pass
            traffic(manager, inst, 10)
            assert outlet.lost_events > 0 and outlet.unreported == outlet.lost_events
            lost = outlet.lost_events
            # Drain the junk as a consumer would, then let the forwarder come back.
            outlet.ring.take_over_reading()
            while outlet.ring.read() is not None:
                pass
            outlet._next_spawn = outlet._next_check = 0.0
            for k in range(6):
                traffic(manager, inst, 2, start=10 + 2 * k)
                time.sleep(0.4)
            assert outlet.spawns == 2 and outlet.unreported == 0
            inst.close()
            wait_run_rows(files.http_url, "full", 1)
            time.sleep(1.0)
        finally:
            proc.stop()
        rows = stored_rows(files.db_path, "full")
    assert sum(r["count"] for r in rows if r["event"] == S.SINK_DROPPED) == lost


def test_local_outlet_keeps_rows_until_drained() -> None:
    manager = bare_manager(20)
    inst = build_hook(manager, load_hook_settings({"KVFABRIC_LIFECYCLE": "1"}), block_size=BLOCK, outlet="local")
    assert inst is not None and isinstance(inst.outlet, LocalOutlet)
    traffic(manager, inst, 3)
    rows = inst.drain()
    assert len(rows) > 0 and inst.drain() == []
    with pytest.raises(TypeError):
        from kvfabric.engine.handover import NullOutlet

        NullOutlet().drain()
