"""Test helpers for the collector: hand-made event streams with exactly known analytics, and a real collector
process on a private socket, database file and free port.

The golden workload (:func:`golden_streams`) is written out row by row so that the expected numbers in the tests
are plain arithmetic a reader can check, not the output of a second implementation:

run ``runA`` (policy lru, block size 16; engines e0 on host h0 and e1 on host h1 (dp rank 1), one stream each)
    famX on e0: 4 lookups, prompt 100+200+300+400 = 1000, hits 0+100+150+250 = 500, regret 0+1+0+2 = 3;
                6 evictions, share_degree 1,2,3,1,2,0 (3 shared anchors), protected F,T,F,F,T,F (2);
                3 rebuilt, ages 1, 2, 3 s
    famY on e1 (every row with LoRA adapter loraY): 2 lookups, prompt 64+36 = 100, hits 0+10 = 10, regret 0+1 = 1;
                4 evictions, share_degree 1,1,2,1 (1 shared), protected F,F,F,T (1); 1 rebuilt, age 4 s
    tenants (cache_salt) of the lookups: famX t1, t1, t2, t2; famY t1, none (t1: prompt 364, hits 100)
    => prompt 1100, hits 510, evicted 10, shared ratio 0.4, protected ratio 0.3, rebuilt 4, regretful 4,
       wasted 4 x 16 = 64 (famX 48, famY 16); plus noise events, one sink_dropped (count 5) and one
       cache_admission_limited (count 7) on e0.
run ``runB`` (policy family_protect, block size 32; engine e0 on host h0)
    famX: 2 lookups, prompt 100+100, hits 80+90; 2 evictions, share 1,1, both protected; 1 rebuilt, age 2 s
    => prompt 200, hits 170, rate 0.85, evicted 2, shared ratio 0, protected ratio 1, rebuilt 1, wasted 32.
Block ``HASH_STORY`` (runA, e0) lives sealed -> touched -> freed -> evicted -> rebuilt -> sealed: 6 events.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pyarrow as pa
from prometheus_client.parser import text_string_to_metric_families

from kvfabric.collector import CollectorConfig, CollectorProcess
from kvfabric.contract import schema as S

T0 = 1_700_000_000_000_000_000
HASH_STORY = 0x1234_5678_9ABC_DEF0
NS = 1_000_000_000


def meta(
    stream_id: str,
    run_id: str,
    engine: str,
    *,
    block_size: int = 16,
    num_blocks: int = 1000,
    policy: str = "lru",
    version: int | str = S.SCHEMA_VERSION,
    host: str | None = None,
    dp_rank: int | None = None,
) -> dict[str, str]:
    """Stream metadata as a sink sends it (``host`` and ``dp_rank``, optional keys, only when given)."""
    optional = {S.META_HOST: host, S.META_DP_RANK: None if dp_rank is None else str(dp_rank)}
    return {
        **{k: v for k, v in optional.items() if v is not None},
        S.META_SCHEMA_VERSION: str(version),
        S.META_STREAM_ID: stream_id,
        S.META_ENGINE: engine,
        S.META_RUN_ID: run_id,
        S.META_BLOCK_SIZE: str(block_size),
        S.META_NUM_BLOCKS: str(num_blocks),
        S.META_POLICY: policy,
        S.META_VLLM_VERSION: "0.33.0",
        S.META_SETTINGS: json.dumps({"policy": policy}),
    }


def batch(rows: list[dict[str, Any]], seq: int) -> pa.RecordBatch:
    """One record batch of ``rows`` (dicts naming any subset of the columns; the rest are null)."""
    cols = [pa.array([seq] * len(rows), pa.int64())]
    for f in list(S.EVENT_SCHEMA)[1:]:
        cols.append(pa.array([r.get(f.name) for r in rows], f.type))
    return pa.RecordBatch.from_arrays(cols, schema=S.EVENT_SCHEMA)


def stream_bytes(stream_meta: dict[str, str], batches: Iterable[pa.RecordBatch], *, end: bool = True) -> bytes:
    """The exact bytes of one Arrow IPC stream (with the end-of-stream marker unless ``end`` is False)."""
    sink = pa.BufferOutputStream()
    writer = pa.ipc.new_stream(sink, S.stream_schema(stream_meta))
    for b in batches:
        writer.write_batch(b)
    if end:
        writer.close()
    return sink.getvalue().to_pybytes()


def send_bytes(socket_path: str, data: bytes, *, refused_ok: bool = False) -> None:
    """Connect, write ``data``, close. ``refused_ok``: the collector may hang up before all is written."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(socket_path)
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            if not refused_ok:
                raise


def send_stream(socket_path: str, stream_meta: dict[str, str], batches: Iterable[pa.RecordBatch]) -> None:
    """One connection carrying one complete stream."""
    send_bytes(socket_path, stream_bytes(stream_meta, batches))


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class CollectorFiles:
    """Where one test collector keeps its things (socket under a short /tmp path: sun_path is 108 bytes)."""

    root: str
    db_path: str
    socket_path: str
    log_path: str
    port: int = field(default_factory=free_port)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self, **overrides: Any) -> CollectorConfig:
        return CollectorConfig(
            db_path=self.db_path, socket_path=self.socket_path, port=self.port, **overrides
        )

    def process(self, **overrides: Any) -> CollectorProcess:
        return CollectorProcess(self.config(**overrides), log_path=self.log_path, ready_timeout=30.0)

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


@contextmanager
def collector_files() -> Iterator[CollectorFiles]:
    root = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")
    try:
        yield CollectorFiles(
            root=root,
            db_path=os.path.join(root, "events.duckdb"),
            socket_path=os.path.join(root, "s", "kvf.sock"),
            log_path=os.path.join(root, "collector.log"),
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------ golden workload


def _rows_runA_e0() -> list[dict[str, Any]]:
    base = {"run_id": "runA", "engine": "e0", "policy": "lru", "host": "h0", "dp_rank": 0}
    rows: list[dict[str, Any]] = []
    t = T0

    def add(**kw: Any) -> None:
        nonlocal t
        t += kw.pop("dt", 1000)
        rows.append({**base, "ts_ns": t, "step": len(rows), **kw})

    for i, (p, h, c) in enumerate([(100, 0, 0), (200, 100, 1), (300, 150, 0), (400, 250, 2)]):
        add(event="prefix_lookup", request_id=f"a{i}", family="famX", prompt_tokens=p, hit_tokens=h, count=c,
            tenant="t1" if i < 2 else "t2")
    add(event="block_allocated", request_id="a0", block_id=1, family="famX")
    add(event="block_sealed", request_id="a0", block_id=1, block_hash=HASH_STORY, family="famX", depth=0)
    add(event="block_touched", request_id="a1", block_id=1, block_hash=HASH_STORY, family="famX", hit_count=1)
    add(event="block_freed", block_id=1, block_hash=HASH_STORY, family="famX", ref_count=0)
    # Six evictions; the first three share one timestamp (pagination must still return each exactly once).
    shares = [1, 2, 3, 1, 2, 0]
    protected = [False, True, False, False, True, False]
    for i, (sd, pr) in enumerate(zip(shares, protected, strict=True)):
        h = HASH_STORY if i == 0 else 1000 + i
        add(event="block_evicted", block_id=1 if i == 0 else 10 + i, block_hash=h, family="famX", depth=i,
            share_degree=sd, protected=pr, age_ns=5 * NS, dt=0 if 0 < i < 3 else 1000)
    for i, age in enumerate([1, 2, 3]):
        h = HASH_STORY if i == 0 else 1000 + i
        add(event="block_rebuilt", request_id="a3", block_id=20 + i, block_hash=h, family="famX", depth=i,
            age_ns=age * NS)
    add(event="block_sealed", request_id="a3", block_id=20, block_hash=HASH_STORY, family="famX", depth=0)
    add(event="sink_dropped", count=5)
    add(event="cache_admission_limited", request_id="a3", family="famX", count=7)
    add(event="ref_count_changed", block_id=20, ref_count=2)
    return rows


def _rows_runA_e1() -> list[dict[str, Any]]:
    base = {"run_id": "runA", "engine": "e1", "policy": "lru", "host": "h1", "dp_rank": 1, "lora": "loraY"}
    rows: list[dict[str, Any]] = []
    t = T0 + 500  # interleaves with e0 in time

    def add(**kw: Any) -> None:
        nonlocal t
        t += kw.pop("dt", 1000)
        rows.append({**base, "ts_ns": t, "step": len(rows), **kw})

    for i, (p, h, c) in enumerate([(64, 0, 0), (36, 10, 1)]):
        add(event="prefix_lookup", request_id=f"b{i}", family="famY", prompt_tokens=p, hit_tokens=h, count=c,
            tenant="t1" if i == 0 else None)
    for i, (sd, pr) in enumerate(zip([1, 1, 2, 1], [False, False, False, True], strict=True)):
        add(event="block_evicted", block_id=30 + i, block_hash=2000 + i, family="famY", depth=i, share_degree=sd,
            protected=pr, age_ns=NS)
    add(event="block_rebuilt", request_id="b1", block_id=40, block_hash=2000, family="famY", depth=0, age_ns=4 * NS)
    add(event="eviction_candidates_ranked", count=12)
    add(event="cache_reset")
    return rows


def _rows_runB_e0() -> list[dict[str, Any]]:
    base = {"run_id": "runB", "engine": "e0", "policy": "family_protect", "host": "h0", "dp_rank": 0}
    rows: list[dict[str, Any]] = []
    t = T0 + 10 * NS

    def add(**kw: Any) -> None:
        nonlocal t
        t += 1000
        rows.append({**base, "ts_ns": t, "step": len(rows), **kw})

    for i, (p, h) in enumerate([(100, 80), (100, 90)]):
        add(event="prefix_lookup", request_id=f"c{i}", family="famX", prompt_tokens=p, hit_tokens=h, count=0)
    for i in range(2):
        add(event="block_evicted", block_id=50 + i, block_hash=3000 + i, family="famX", depth=i, share_degree=1,
            protected=True, age_ns=NS)
    add(event="block_rebuilt", request_id="c1", block_id=60, block_hash=3000, family="famX", depth=0, age_ns=2 * NS)
    add(event="block_sealed", request_id="c1", block_id=60, block_hash=3000, family="famX", depth=0)
    return rows


@dataclass(frozen=True)
class GoldenStream:
    meta: dict[str, str]
    rows: list[dict[str, Any]]
    batch_rows: int = 5

    def batches(self) -> list[pa.RecordBatch]:
        return [
            batch(self.rows[i : i + self.batch_rows], seq)
            for seq, i in enumerate(range(0, len(self.rows), self.batch_rows))
        ]


def golden_streams() -> list[GoldenStream]:
    return [
        GoldenStream(meta("sA0", "runA", "e0", block_size=16, host="h0", dp_rank=0), _rows_runA_e0()),
        GoldenStream(meta("sA1", "runA", "e1", block_size=16, host="h1", dp_rank=1), _rows_runA_e1()),
        GoldenStream(meta("sB0", "runB", "e0", block_size=32, policy="family_protect", host="h0", dp_rank=0),
                     _rows_runB_e0()),
    ]


def send_golden(socket_path: str) -> int:
    """Send the golden workload (one connection per stream); returns the number of rows sent."""
    total = 0
    for g in golden_streams():
        send_stream(socket_path, g.meta, g.batches())
        total += len(g.rows)
    return total


@contextmanager
def golden_database() -> Iterator[str]:
    """The path of a collector database of the golden workload (runA: engines e0, e1; runB: e0), written by a real
    collector and committed; the collector has stopped, so the file can be opened read-only. Removed afterwards."""
    with collector_files() as files:
        with files.process():
            total = send_golden(files.socket_path)
            wait_until(lambda: sum(r["events"] for r in httpx.get(files.http_url + "/api/v1/runs").json()) == total,
                       what="golden committed")
        yield files.db_path


def bulk_batches(run_id: str, engine: str, n_batches: int, rows: int, *, first_seq: int = 0) -> list[pa.RecordBatch]:
    """Volume without analytics meaning: ``block_touched`` rows (numbers only count rows)."""
    out = []
    for k in range(n_batches):
        seq = first_seq + k
        n = rows
        cols: dict[str, pa.Array] = {
            "seq": pa.array([seq] * n, pa.int64()),
            "ts_ns": pa.array(range(T0 + seq * n, T0 + seq * n + n), pa.int64()),
            "engine": pa.array([engine] * n, pa.string()),
            "run_id": pa.array([run_id] * n, pa.string()),
            "event": pa.array(["block_touched"] * n, pa.string()),
            "block_id": pa.array(range(n), pa.int32()),
        }
        arrays = [cols.get(f.name, pa.nulls(n, f.type)) for f in S.EVENT_SCHEMA]
        out.append(pa.RecordBatch.from_arrays(arrays, schema=S.EVENT_SCHEMA))
    return out


# ------------------------------------------------------------------------------------------------- metrics


def scrape(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text -> {(sample name, labels): value}."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """One sample's value, 0 when absent (a labelled counter that never moved has no sample)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


# ------------------------------------------------------------------------------- hook-shaped event scripts


class EventScript:
    """Rows of one engine's stream written the way the hook emits them, for workloads whose miss attribution is
    known by hand (tests/collector/test_misses.py, tests/collector/test_whatif.py,
    tests/collector/test_export_mooncake.py).

    Every call appends rows at the current step, 1 µs apart; :meth:`step` starts the next scheduler step and
    :meth:`at` moves the clock to ``T0 + seconds``. :meth:`admit` writes one admission as ``allocate_slots``
    produces it: touches of the hit blocks, allocations, seals of the blocks it computes now, then the
    ``prefix_lookup`` row (its ``depth`` = full prompt blocks, the length of ``chain`` given).
    """

    def __init__(self, run_id: str, engine: str, *, block_size: int = 4, policy: str = "lru") -> None:
        self.run_id = run_id
        self.engine = engine
        self.block_size = block_size
        self.policy = policy
        self.rows: list[dict[str, Any]] = []
        self.t = T0
        self.current_step = 1

    def _add(self, **kw: Any) -> None:
        self.t += 1000
        self.rows.append({"run_id": self.run_id, "engine": self.engine, "policy": self.policy, "ts_ns": self.t,
                          "step": self.current_step, **kw})

    def step(self, n: int = 1) -> EventScript:
        self.current_step += n
        return self

    def at(self, seconds: float) -> EventScript:
        self.t = max(self.t, T0 + int(seconds * NS))
        return self

    def admit(self, rid: str, family: str | None, prompt_tokens: int, chain: list[int], *, hit_blocks: int = 0,
              seal: Iterable[int] | None = None, allocate: int | None = None, limited: int = 0,
              hit_tokens: int | None = None) -> None:
        """``chain``: the request's block hashes by depth; ``hit_blocks``: how many leading ones hit; ``seal``:
        the depths it computes and caches in this step (default: every full block past the hit)."""
        for d in range(hit_blocks):
            self._add(event="block_touched", request_id=rid, block_hash=chain[d], depth=d, family=family,
                      ref_count=1, hit_count=1)
        depths = list(range(hit_blocks, len(chain))) if seal is None else list(seal)
        for _ in range(len(depths) if allocate is None else allocate):
            self._add(event="block_allocated", request_id=rid, ref_count=1)
        for d in depths:
            self._add(event="block_sealed", request_id=rid, block_hash=chain[d], depth=d, family=family,
                      ref_count=1, hit_count=0, share_degree=1)
        if limited:
            self._add(event="cache_admission_limited", request_id=rid, family=family, count=limited)
        hit = hit_blocks * self.block_size if hit_tokens is None else hit_tokens
        self._add(event="prefix_lookup", request_id=rid, family=family, prompt_tokens=prompt_tokens, hit_tokens=hit,
                  depth=len(chain), count=0)

    def seal(self, rid: str, family: str | None, chain: list[int], depths: Iterable[int]) -> None:
        """A later chunk (or decode) of ``rid`` seals ``depths``."""
        for d in depths:
            self._add(event="block_allocated", request_id=rid, ref_count=1)
            self._add(event="block_sealed", request_id=rid, block_hash=chain[d], depth=d, family=family,
                      ref_count=1, hit_count=0, share_degree=1)

    def free(self, rid: str, chain: list[int], depths: Iterable[int]) -> None:
        """``KVCacheManager.free(rid)``: its blocks, tail first."""
        for d in sorted(depths, reverse=True):
            self._add(event="block_freed", request_id=rid, block_hash=chain[d], depth=d, ref_count=0)

    def evict(self, block_hash: int, reason: str | None, *, by: str | None = None, family: str | None = None,
              depth: int | None = None, share_degree: int = 1) -> None:
        self._add(event="block_evicted", request_id=by, block_hash=block_hash, family=family, depth=depth,
                  ref_count=0, share_degree=share_degree, age_ns=NS, reason=reason)

    def reset(self, cached: Iterable[int]) -> None:
        """A prefix-cache reset: one ``block_evicted`` (reason reset) per cached block, then ``cache_reset``."""
        for h in cached:
            self.evict(h, "reset")
        self._add(event="cache_reset")

    def stream(self, stream_id: str, *, num_blocks: int = 1000, batch_rows: int = 7) -> GoldenStream:
        return GoldenStream(
            meta(stream_id, self.run_id, self.engine, block_size=self.block_size, num_blocks=num_blocks,
                 policy=self.policy),
            self.rows, batch_rows,
        )


def send_scripts(socket_path: str, streams: Iterable[GoldenStream]) -> int:
    """Send each stream on its own connection; returns the rows sent."""
    total = 0
    for g in streams:
        send_stream(socket_path, g.meta, g.batches())
        total += len(g.rows)
    return total


def wait_rows(http_url: str, run_id: str, rows: int, timeout: float = 20.0) -> None:
    """Until the collector has committed ``rows`` rows of ``run_id``."""
    import httpx

    def have() -> bool:
        runs = httpx.get(http_url + "/api/v1/runs", timeout=5).json()
        items = runs["items"] if isinstance(runs, dict) else runs
        return any(r["run_id"] == run_id and r["events"] >= rows for r in items)

    wait_until(have, timeout, what=f"{rows} rows of {run_id} committed")


# ------------------------------------------------------------------------------------------- hostile peers


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def declared_message(body_bytes: int, run_id: str = "r", engine: str = "e0") -> bytes:
    """The header (continuation marker, length, flatbuffer metadata) of a record-batch message whose body is
    declared ``body_bytes`` long: what a peer sends to make the collector expect a large body it never sends.

    Built from a real one-row batch by rewriting the Message table's ``bodyLength`` field (flatbuffers: the root
    table's vtable gives the field's offset; bodyLength is field 3 of Message, an int64)."""
    msg = batch([{"ts_ns": 1, "event": "cache_reset", "run_id": run_id, "engine": engine}], seq=0).serialize()
    data = bytearray(msg.to_pybytes())
    meta_len = int.from_bytes(data[4:8], "little")
    fb = 8  # the flatbuffer starts after the marker and the length
    table = fb + int.from_bytes(data[fb : fb + 4], "little")
    vtable = table - int.from_bytes(data[table : table + 4], "little", signed=True)
    field_off = int.from_bytes(data[vtable + 4 + 2 * 3 : vtable + 6 + 2 * 3], "little")
    assert field_off, "bodyLength is absent from the vtable"
    pos = table + field_off
    assert int.from_bytes(data[pos : pos + 8], "little") == len(data) - 8 - meta_len  # it is the body length
    data[pos : pos + 8] = body_bytes.to_bytes(8, "little")
    return bytes(data[: 8 + meta_len])


def schema_bytes(stream_meta: dict[str, str]) -> bytes:
    """Just the schema message of a stream (what a peer sends before going quiet)."""
    return S.stream_schema(stream_meta).serialize().to_pybytes()


def hook_row(i: int, run_id: str, engine: str, ts_ns: int | None = None) -> tuple:
    """A row as the hook emits it (kvfabric.contract.schema.EMIT_COLUMNS order): a block_allocated of block ``i``."""
    values: list[object] = [None] * len(S.EMIT_COLUMNS)
    values[S.EMIT_COLUMNS.index("ts_ns")] = ts_ns if ts_ns is not None else time.time_ns()
    values[S.EMIT_COLUMNS.index("event")] = S.BLOCK_ALLOCATED
    values[S.EMIT_COLUMNS.index("engine")] = engine
    values[S.EMIT_COLUMNS.index("run_id")] = run_id
    values[S.EMIT_COLUMNS.index("block_id")] = i
    return tuple(values)


def hook_dropped_row(run_id: str, engine: str) -> Callable[[int], tuple]:
    def dropped(n: int) -> tuple:
        values: list[object] = [None] * len(S.EMIT_COLUMNS)
        values[S.EMIT_COLUMNS.index("ts_ns")] = time.time_ns()
        values[S.EMIT_COLUMNS.index("event")] = S.SINK_DROPPED
        values[S.EMIT_COLUMNS.index("engine")] = engine
        values[S.EMIT_COLUMNS.index("run_id")] = run_id
        values[S.EMIT_COLUMNS.index("count")] = n
        return tuple(values)

    return dropped


def hook_sink(socket_path: str, run_id: str, engine: str = "e0", *, capacity: int = 1_000_000,
              batch_events: int = 100, flush_ms: int = 20, **kwargs: Any) -> Any:
    """The hook's own UnixArrowSink (protocol 2) with a fresh buffer, started."""
    from kvfabric.forwarder.buffer import EventBuffer
    from kvfabric.forwarder.sinks import UnixArrowSink

    m = {k: v for k, v in meta("ignored", run_id, engine).items() if k != S.META_STREAM_ID}
    buffer = EventBuffer(capacity=capacity, wake_at=batch_events)
    sink = UnixArrowSink(socket_path, buffer, m, hook_dropped_row(run_id, engine), batch_events=batch_events,
                         flush_ms=flush_ms, **kwargs)
    sink.start()
    return sink


def stored(db_or_url: str, run_id: str) -> int:
    """Events of ``run_id`` stored, through the REST API of a live collector (``http://...``)."""
    import httpx

    runs = httpx.get(db_or_url + "/api/v1/runs", timeout=10).json()
    return next((r["events"] for r in runs if r["run_id"] == run_id), 0)
