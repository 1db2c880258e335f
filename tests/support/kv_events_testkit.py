"""Kit for the KV-event source's tests: vLLM's real publisher on free ports, a workload of KV-event batches with
evictions, rebuilds and resets, a ZMQ proxy that drops, mangles or injects messages between publisher and
collector, and the rows a collector must have stored for given batches (computed with the converter, batch by
batch, the way the collector's subscriber applies it).

Imports vLLM (its ``ZmqEventPublisher`` and event structs): tests using it are marked ``vllm``.
"""

from __future__ import annotations

import hashlib
import random
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import duckdb
import httpx
import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from kvfabric.contract import schema as S
from kvfabric.kvevents.convert import Converter
from kvfabric.kvevents.wire import decode_batch
from support.collector_testkit import wait_until

_ENCODER = msgspec.msgpack.Encoder()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Publisher:
    """vLLM's ``ZmqEventPublisher`` bound on ``tcp://*:port`` (PUB) and ``tcp://*:replay_port`` (ROUTER), and
    every batch given to it, in publish order (= its seq)."""

    pub: ZmqEventPublisher
    port: int
    replay_port: int
    published: list[KVEventBatch] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def publish(self, batches: Iterable[KVEventBatch]) -> None:
        for b in batches:
            self.pub.publish(b)
            self.published.append(b)

    def drained(self, timeout: float = 10.0) -> None:
        """Wait until the publisher's thread has sent everything given to it."""
        wait_until(lambda: self.pub._event_queue.unfinished_tasks == 0, timeout, "publisher queue drained")

    def payloads(self) -> list[bytes]:
        """What went on the wire for each seq (vLLM's publisher encodes the batch object as given)."""
        return [_ENCODER.encode(b) for b in self.published]

    def shutdown(self) -> None:
        self.pub.shutdown()


@contextmanager
def publisher(*, buffer_steps: int = 10_000, hwm: int = 100_000, topic: str = "",
              ports: tuple[int, int] | None = None) -> Iterator[Publisher]:
    port, replay_port = ports or (free_port(), free_port())
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}",
                            buffer_steps=buffer_steps, hwm=hwm, topic=topic)
    p = Publisher(pub, port, replay_port)
    try:
        yield p
    finally:
        p.shutdown()


def block_hash(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[-8:], "big")


def workload(n_batches: int, *, seed: int = 0, capacity: int = 48, families: int = 5, reset_every: int = 0,
             blocks: int = 6, t0: float | None = None) -> list[KVEventBatch]:
    """Batches an LRU cache of ``capacity`` blocks would publish: requests of ``families`` prefix families (two
    shared blocks, then one of a few tails), hits refreshing their prefix, misses storing new blocks (the cache
    salt on each family's root), evictions one ``BlockRemoved`` per block as vLLM emits them, and an
    ``AllBlocksCleared`` every ``reset_every`` batches. Evicted chains come back, so blocks are rebuilt."""
    rng = random.Random(seed)
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    ts = time.time() if t0 is None else t0
    for i in range(n_batches):
        events: list[object] = []
        if reset_every and i and i % reset_every == 0:
            events.append(AllBlocksCleared())
            cache.clear()
        for _ in range(rng.randint(1, 3)):
            fam = rng.randrange(families)
            tail = rng.randrange(4)
            length = rng.randint(2, blocks)
            chain = [block_hash(fam, d) if d < 2 else block_hash(fam, tail, d) for d in range(length)]
            hit = 0
            while hit < length and chain[hit] in cache:
                cache.move_to_end(chain[hit])
                hit += 1
            new = chain[hit:]
            if not new:
                continue
            while len(cache) + len(new) > capacity:
                gone, _ = cache.popitem(last=False)
                events.append(BlockRemoved(block_hashes=[gone], medium="GPU"))
            extra = [(f"tenant-{fam % 2}",)] + [None] * (len(new) - 1) if hit == 0 else None
            events.append(BlockStored(block_hashes=new, parent_block_hash=chain[hit - 1] if hit else None,
                                      token_ids=list(range(16 * len(new))), block_size=16, lora_id=None,
                                      medium="GPU", lora_name=None, extra_keys=extra))
            for h in new:
                cache[h] = None
        ts += 0.001
        out.append(KVEventBatch(ts=ts, events=events))
    return out


# ---- between publisher and collector ---------------------------------------------------------------------------

class Proxy:
    """A ZMQ forwarder: SUB connected to the publisher's PUB, PUB bound for the collector. ``drop(seq)`` True
    drops a message; ``mangle(seq, frames)`` may return other frames; :meth:`inject` sends frames of its own."""

    def __init__(self, upstream: str, *, drop: Callable[[int], bool] = lambda _seq: False,
                 mangle: Callable[[int, list[bytes]], list[bytes]] | None = None) -> None:
        self.port = free_port()
        self.upstream = upstream
        self.drop = drop
        self.mangle = mangle
        self.forwarded: list[int] = []
        self.dropped: list[int] = []
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(f"tcp://127.0.0.1:{self.port}")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def __enter__(self) -> Proxy:
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pub.close(0)
        self._context.term()

    def inject(self, frames: list[bytes]) -> None:
        with self._lock:
            self._pub.send_multipart(frames)

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.upstream)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sub.poll(50):
                    continue
                frames = sub.recv_multipart()
                seq = int.from_bytes(frames[1], "big")
                if self.drop(seq):
                    self.dropped.append(seq)
                    continue
                if self.mangle is not None:
                    frames = self.mangle(seq, frames)
                with self._lock:
                    self._pub.send_multipart(frames)
                self.forwarded.append(seq)
        finally:
            sub.close(0)


# ---- what must be stored ---------------------------------------------------------------------------------------

def expected_rows(payloads: list[bytes], segments: Iterable[Iterable[int]], *, engine: str, run_id: str = "default",
                  host: str | None = None) -> list[tuple]:
    """``(seq, *row)`` in EMIT_COLUMNS order for the seqs of each segment, each segment converted from a fresh
    state (a segment = what one collector process applied in order)."""
    host = socket.gethostname() if host is None else host
    out = []
    for seqs in segments:
        conv = Converter(engine=engine, run_id=run_id, host=host)
        for seq in seqs:
            out += [(seq, *row) for row in conv.convert(decode_batch(payloads[seq])).rows()]
    return out


def stored_rows(db_path: str, engine: str) -> list[tuple]:
    """The engine's stored event rows, ``(seq, *row)`` in EMIT_COLUMNS order, in stream then storage order."""
    cols = ", ".join(f'"{c}"' for c in S.COLUMNS)
    with duckdb.connect(db_path, read_only=True) as con:
        return con.execute(f"SELECT {cols} FROM events WHERE engine = ? AND event <> ? ORDER BY rowid",
                           [engine, S.PREFIX_CACHE_COUNTERS]).fetchall()


def streams(db_path: str) -> list[dict[str, object]]:
    with duckdb.connect(db_path, read_only=True) as con:
        table = con.execute("SELECT * FROM streams ORDER BY first_seen_ns").to_arrow_table()
    return table.to_pylist()


def kv_health(http_url: str) -> dict[str, object]:
    (entry,) = httpx.get(http_url + "/healthz", timeout=5).json()["kv_events"]
    return entry


def wait_placed(http_url: str, last_seq: int, timeout: float = 20.0, stream_id: str | None = None) -> dict:
    """Until the subscriber has placed ``last_seq`` (of ``stream_id`` if given) and the writer has committed
    everything queued."""
    def done() -> dict | None:
        body = httpx.get(http_url + "/healthz", timeout=5).json()
        (entry,) = body["kv_events"]
        ok = entry.get("last_seq") == last_seq and body["writer_queue_rows"] == 0  # (null fields are left out)
        return entry if ok and (stream_id is None or entry.get("stream_id") == stream_id) else None

    return wait_until(done, timeout, f"seq {last_seq} placed and committed")
