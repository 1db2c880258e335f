"""The ring under real concurrency: a producer process and a consumer process, each pinned to its own core where
the machine has two, pass tens of thousands of messages of varying sizes (the data area wraps hundreds of times,
with wrap markers and with fewer than 4 bytes left at the end), with both orderings of kvfabric/contract/ring.py.
Every message must arrive once, in order, byte for byte (each carries its serial number and a CRC32, and the
consumer regenerates the expected bytes). Also: where no ordering is correct the ring refuses to start, and the
hook then sends nothing, saying why in one line.

The single-process model check (random sizes against a reference queue) is in tests/forwarder/test_forwarder.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvfabric.contract import ring as ring_module
from kvfabric.contract.ring import W_CLOSING, W_READ, W_WRITE, Ring, RingUnavailable
from kvfabric.engine.handover import NullOutlet, make_outlet

CAPACITY = 4093  # odd on purpose: message starts land on every alignment, and the end leaves 0-3 bytes too
SECONDS = 1.5  # the producer's budget; each test takes about twice that

# One end of the stress test, run as its own process: ``producer`` or ``consumer``, the ring's fd, its ordering,
# the CPU to pin to (-1: none), the seed, the time budget. Both draw the same message sequence from the seed.
END = r"""
import json, os, random, struct, sys, time, zlib
from kvfabric.contract.ring import W_CLOSING, Ring
role, fd, ordering, cpu, seed, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \
    int(sys.argv[5]), float(sys.argv[6])
if cpu >= 0:
    os.sched_setaffinity(0, {cpu})
ring = Ring(fd, int(sys.argv[7]), ordering)
rng = random.Random(seed)

def message(serial):
    size = rng.choice((0, 1, 3, 4, 5, 7, 8)) if rng.random() < 0.3 else rng.randrange(9, 1500)
    body = rng.randbytes(size)
    return struct.pack("=QI", serial, zlib.crc32(body)) + body

deadline = time.monotonic() + seconds
stats = {"messages": 0, "full": 0, "wraps": 0, "bad": 0, "cpus": sorted(os.sched_getaffinity(0))}
if role == "producer":
    serial = 0
    while time.monotonic() < deadline:
        payload = message(serial)
        before = ring._write
        while not ring.write(payload):
            stats["full"] += 1
        if (ring._write - 1) // ring.capacity != before // ring.capacity:
            stats["wraps"] += 1
        serial += 1
    ring.set_word(W_CLOSING, 1)  # release: after the last message
    stats["messages"] = serial
else:
    serial = 0
    while True:
        data = ring.read()
        if data is None:
            if ring.word(W_CLOSING):  # acquire: every message before it is published; read them, then stop
                data = ring.read()
                if data is None:
                    break
            else:
                continue
        want = message(serial)
        got_serial, crc = struct.unpack_from("=QI", data)
        if data != want or got_serial != serial or zlib.crc32(data[12:]) != crc:
            stats["bad"] += 1
        serial += 1
    stats["messages"] = serial
print(json.dumps(stats))
"""


def two_cpus() -> tuple[int, int]:
    """Two distinct CPUs this process may run on, or (-1, -1) where it has only one."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return -1, -1
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else (-1, -1)


def usable_orderings() -> list[str]:
    return [o for o in ring_module.ORDERINGS if (o == "compiled" and ring_module.COMPILED)
            or (o == "python" and ring_module.TSO)]


@pytest.mark.parametrize("ordering", ring_module.ORDERINGS)
def test_a_producer_and_a_consumer_on_two_cores_lose_and_corrupt_nothing(ordering: str) -> None:
    if ordering not in usable_orderings():
        pytest.skip(f"the {ordering} ordering is not available on this machine")
    ring = Ring.create(CAPACITY, ordering)
    cpu_p, cpu_c = two_cpus()
    try:
        ends = {}
        for role, cpu in (("consumer", cpu_c), ("producer", cpu_p)):
            ends[role] = subprocess.Popen(
                [sys.executable, "-c", END, role, str(ring.fd), ordering, str(cpu), "7", str(SECONDS),
                 str(CAPACITY)],
                pass_fds=(ring.fd,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = {}
        for role, proc in ends.items():
            stdout, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 0, stderr
            out[role] = json.loads(stdout)
    finally:
        for proc in ends.values():
            if proc.poll() is None:
                proc.kill()
        ring.close()
    produced, consumed = out["producer"], out["consumer"]
    assert consumed["bad"] == 0
    assert consumed["messages"] == produced["messages"] > 10_000
    assert produced["wraps"] > 100  # the data area went round many times
    assert produced["full"] > 0 or cpu_p < 0  # the producer caught up with the consumer: the bound was exercised
    if cpu_p >= 0:
        assert produced["cpus"] == [cpu_p] and consumed["cpus"] == [cpu_c]


def test_every_kind_of_wrap_keeps_messages_whole() -> None:
    """In one process: a message that leaves exactly 0, 1, 2, 3 and 4+ bytes at the end of the data area, for
    each ordering (the stress test above hits these by chance; here each is forced)."""
    for ordering in usable_orderings():
        for tail in range(0, 9):
            producer = Ring.create(64, ordering)
            consumer = Ring(os.dup(producer.fd), 64, ordering)
            try:
                first = bytes(64 - 4 - tail)  # leaves ``tail`` bytes after it
                assert producer.write(first) and consumer.read() == first
                second = b"\x01\x02\x03" * 5
                assert producer.write(second) and consumer.read() == second
                assert consumer.read() is None
                assert producer.word(W_WRITE) == producer.word(W_READ) == consumer.word(W_WRITE)
            finally:
                consumer.close()
                producer.close()


def test_without_a_correct_ordering_the_ring_refuses_and_the_hook_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Off x86-64 and without the compiled part, plain stores may be seen out of order: no ring, one log line,
    no events (rather than a consumer that reads bytes not yet there)."""
    monkeypatch.setattr(ring_module, "TSO", False)
    monkeypatch.setattr(ring_module, "COMPILED", False)
    with pytest.raises(RingUnavailable, match="not x86-64"):
        Ring.create(1024)
    with pytest.raises(RingUnavailable):
        Ring.create(1024, "python")
    assert issubclass(RingUnavailable, OSError)
    settings = SimpleNamespace(lifecycle=True, sink="jsonl:///nonexistent/never-written.jsonl",
                               batch_events=16, flush_ms=100, buffer_events=1000)
    with caplog.at_level(logging.WARNING, logger="kvfabric.engine"):
        outlet = make_outlet(None, settings, {})
    assert isinstance(outlet, NullOutlet)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "reinstall KVFabric with a C compiler" in lines[0], lines


def test_the_closing_word_and_the_positions_use_the_rings_ordering() -> None:
    """Both orderings read and write the same header layout: a ring written with one is read with the other."""
    orderings = usable_orderings()
    producer = Ring.create(256, orderings[0])
    consumer = Ring(os.dup(producer.fd), 256, orderings[-1])
    try:
        assert producer.write(b"hello")
        producer.set_word(W_CLOSING, 1)
        assert consumer.word(W_CLOSING) == 1 and consumer.read() == b"hello" and consumer.read() is None
        assert producer.word(W_READ) == 9
    finally:
        consumer.close()
        producer.close()
