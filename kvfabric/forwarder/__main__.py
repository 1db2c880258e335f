"""``python -m kvfabric.forwarder``: the forwarder process, started by the engine's ``RingOutlet``
(:mod:`kvfabric.engine.handover`) with the ring's memfd and the stream metadata on its command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import kvfabric.forwarder as forwarder
from kvfabric.contract.ring import Ring
from kvfabric.forwarder.loop import forward


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfabric.forwarder", description=forwarder.__doc__,
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
