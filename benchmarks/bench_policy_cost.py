"""Per-allocation cost of every eviction policy, from 10^4 to 10^6 blocks, on vLLM's real BlockPool.

A pool of N blocks is filled with cached blocks (every block holds a hash), then the benchmark repeats what the
scheduler does under memory pressure: ``get_new_blocks(64)`` (each block is an eviction, through the policy's
queue), ``cache_full_blocks`` (sealing, the hook's side table) and ``free_blocks`` (the blocks become candidates).
The figure is wall time per allocated block, the median of ``--repeats`` runs of ``--rounds`` rounds each.

``lru`` is vLLM without any hook. The other rows run the hook as a server would with ``KVFABRIC_EVICTION_POLICY``
set and lifecycle recording off (steering then keeps statistics only), plus ``+events`` rows with lifecycle
recording on (events go to the in-memory buffer, drained outside the timed region).

Usage: python benchmarks/bench_policy_cost.py [--sizes 10000,100000,1000000] [--out benchmarks/results/...md]

``--out X.md`` also writes ``X.json``: every configuration's µs per block at each size, with the command, machine,
date (UTC) and the 1-minute load average before the first configuration and after each one (wall times move with
what else runs on the machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

SIZES = (10_000, 100_000, 1_000_000)
BATCH = 64


class _FakeRequest:
    """What ``cache_full_blocks`` and the hook read from a request."""

    __slots__ = ("block_hashes", "num_computed_tokens", "num_prompt_tokens", "request_id", "sampling_params")

    def __init__(self, rid: str, hashes: list[bytes]) -> None:
        self.request_id = rid
        self.block_hashes = hashes
        self.sampling_params = None
        self.num_computed_tokens = 0
        self.num_prompt_tokens = len(hashes) * 16


class _Manager:
    """The two methods the hook wraps on a KVCacheManager (the benchmark drives the pool directly)."""

    def __init__(self, pool: Any) -> None:
        self.block_pool = pool

    def allocate_slots(self, *args: Any, **kwargs: Any) -> None:
        return None

    def free(self, *args: Any, **kwargs: Any) -> None:
        return None


def build(num_blocks: int, policy: str, events: bool) -> tuple[Any, Any]:
    from vllm.v1.core.block_pool import BlockPool

    from kvfabric.engine.config import load_hook_settings
    from kvfabric.engine.handover import NullOutlet
    from kvfabric.engine.install import build_hook

    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=16)
    if policy == "lru" and not events:
        return pool, None
    env = {"KVFABRIC_EVICTION_POLICY": policy, "KVFABRIC_SINK": "none", "KVFABRIC_ADMISSION_ANCHOR_BLOCKS": "0"}
    if events:
        env["KVFABRIC_LIFECYCLE"] = "1"
    settings = load_hook_settings(env)
    manager = _Manager(pool)
    inst = build_hook(manager, settings, block_size=16, engine="bench", outlet=NullOutlet())
    assert inst is not None
    return pool, inst


def _round(pool: Any, serial: int) -> None:
    blocks = pool.get_new_blocks(BATCH)
    hashes = [serial.to_bytes(8, "little") + i.to_bytes(24, "little") for i in range(BATCH)]
    pool.cache_full_blocks(_FakeRequest(f"r{serial}", hashes), blocks, 0, BATCH, 16, 0)
    pool.free_blocks(reversed(blocks))


def measure(num_blocks: int, policy: str, events: bool, rounds: int, repeats: int) -> float:
    """Median µs per allocated block."""
    pool, inst = build(num_blocks, policy, events)
    serial = 0
    for _ in range((num_blocks - 1) // BATCH + 2):  # every block cached: from now on each allocation evicts
        _round(pool, serial)
        serial += 1
        if inst is not None:
            inst.flush()
    samples = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(rounds):
            _round(pool, serial)
            serial += 1
        samples.append((time.perf_counter() - t0) / (rounds * BATCH) * 1e6)
        if inst is not None:
            inst.flush()
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write a markdown report here")
    args = parser.parse_args(argv)
    from kvfabric.policies import POLICY_NAMES

    sizes = [int(s) for s in args.sizes.split(",")]
    loads = [round(os.getloadavg()[0], 2)]
    rows: list[tuple[str, list[float]]] = []
    configs = [("lru", False)] + [(p, False) for p in POLICY_NAMES if p != "lru"]
    configs += [("lru", True), ("adaptive_aging", True)]
    for policy, events in configs:
        label = policy + (" +events" if events else "")
        times = [measure(n, policy, events, args.rounds, args.repeats) for n in sizes]
        rows.append((label, times))
        loads.append(round(os.getloadavg()[0], 2))
        print(f"{label:<24}" + "".join(f"{t:10.2f}" for t in times), flush=True)
    header = "| configuration | " + " | ".join(f"{n:,} blocks" for n in sizes) + " | max/min |"
    command = f"python benchmarks/bench_policy_cost.py {' '.join(sys.argv[1:] if argv is None else argv)}".strip()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        "# Per-allocation cost of the eviction policies",
        "",
        f"Command: `{command}`",
        f"Machine: {machine}, {date}; 1-minute load average {min(loads):.2f}-{max(loads):.2f} (before the first "
        "configuration and after each)",
        "",
        "Wall time per allocated block (µs), median of repeats: `get_new_blocks(64)` evicting 64 cached blocks,",
        "sealing them again (`cache_full_blocks`) and freeing them, on vLLM's real `BlockPool`. `lru` is vLLM with no",
        "hook; policy rows have the hook with lifecycle recording off (statistics only); `+events` rows record events.",
        "",
        header,
        "|" + "---|" * (len(sizes) + 2),
    ]
    for label, times in rows:
        lines.append(f"| {label} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {max(times) / min(times):.2f} |")
    report = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(report)
        data = {"command": command, "machine": machine, "date": date, "load_average_1m": loads,
                "sizes": sizes, "batch": BATCH, "rounds": args.rounds, "repeats": args.repeats,
                "configurations": [{"configuration": label, "us_per_block": [round(t, 3) for t in times],
                                    "max_over_min": round(max(times) / min(times), 3)} for label, times in rows]}
        with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
            fh.write(json.dumps(data, indent=1) + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
