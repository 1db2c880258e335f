"""Why the hook wraps instances the way it does: the cost of each way on CPython, side by side.

    python benchmarks/bench_hook_layout.py [--out benchmarks/results/hook_layout.md]

1. A vLLM ``BlockPool`` read by vLLM's own code (``get_usage``, which the scheduler calls every step): plain, with
   KVFabric's instance attributes (``kvfabric.engine.install.hook_pool``), and with its ``__class__`` swapped for a
   subclass (the hook's former way: CPython 3.11 then keeps the object's attributes in a plain dict).
2. Forwarding a call with vLLM's ``allocate_slots`` arguments: direct, through a wrapper generated with the exact
   signature (``kvfabric.engine.signature``), and through a ``*args, **kwargs`` wrapper.

Each figure is the best of 7 timings of 200,000 calls (ns per call), the variants interleaved.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import timeit
from pathlib import Path
from typing import Any


def _best_ns(fn: Any, number: int = 200_000, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


def pool_reads() -> dict[str, float]:
    from kvfabric.engine.config import load_hook_settings
    from kvfabric.engine.handover import NullOutlet
    from kvfabric.engine.install import Installation
    from kvfabric.engine.pool import hook_pool
    from kvfabric.engine.recorder import Recorder
    from kvfabric.sim.harness import build_scheduler

    pools = {name: build_scheduler(640, load_plugins=False).kv_cache_manager.block_pool
             for name in ("plain", "instance attributes (KVFabric)", "__class__ swapped")}
    settings = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none"})
    recorder = Recorder(settings, True, 16)
    Installation(recorder, NullOutlet(), {}, 640, 16)
    hook_pool(pools["instance attributes (KVFabric)"], recorder)
    swapped = pools["__class__ swapped"]
    swapped.__class__ = type("SwappedBlockPool", (type(swapped),), {})
    return {name: _best_ns(pool.get_usage) for name, pool in pools.items()}


def forwarding_costs() -> dict[str, float]:
    from kvfabric.engine import signature

    class Manager:
        def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                           new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                           delay_cache_blocks: bool = False) -> int:
            return num_new_tokens

    class Context:
        rid: str | None = None

    class Request:
        request_id = "r"
        num_computed_tokens = 64

    original = Manager().allocate_slots
    ctx = Context()
    exact = signature.request_context_wrapper(original, ctx, original, "exact")

    star = signature.generic_wrapper(original, ctx, original)

    req = Request()
    return {
        "direct call": _best_ns(lambda: original(req, 1, num_lookahead_tokens=0, delay_cache_blocks=False)),
        "exact-signature wrapper (KVFabric)": _best_ns(
            lambda: exact(req, 1, num_lookahead_tokens=0, delay_cache_blocks=False)),
        "*args, **kwargs wrapper": _best_ns(lambda: star(req, 1, num_lookahead_tokens=0, delay_cache_blocks=False)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/hook_layout.md")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    reads = pool_reads()
    calls = forwarding_costs()
    lines = [
        "# How the hook attaches, and what each way costs (CPU)",
        "",
        "Command: `python benchmarks/bench_hook_layout.py`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}  ",
        "Best of 7 timings of 200,000 calls each, ns per call.",
        "",
        "`BlockPool.get_usage()` (vLLM's own code; the scheduler calls it every step):",
        "",
        "| pool | ns | vs plain |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v:.0f} | {v / reads['plain']:.2f}x |" for k, v in reads.items()]
    lines += ["", "A call with `allocate_slots`' arguments (made for every running request in every step):", "",
              "| call | ns | added ns |", "|---|---|---|"]
    lines += [f"| {k} | {v:.0f} | {v - calls['direct call']:.0f} |" for k, v in calls.items()]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
