"""vLLM's own KV-event publisher on the simulated engine: what ``--kv-events-config`` gives a real server.

:func:`kv_events_config` builds vLLM's ``KVEventsConfig`` for a ZMQ publisher; handed to
:func:`kvfabric.sim.harness.build_scheduler`, the real ``Scheduler`` creates the real ``ZmqEventPublisher`` from
it and publishes one ``KVEventBatch`` per step that changed the cache, as in a server. :func:`count_published`
counts what that publisher sends, so a caller knows when a subscriber has received everything; the count is taken
on the scheduler's thread, in the call vLLM makes, and never changes a batch.

vLLM 0.33 binds the publishing socket only for an endpoint with a wildcard host (``tcp://*:PORT``) or an
``ipc://`` path and otherwise connects it; the replay socket it always binds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # vLLM is an optional extra; import it only where it is used.
    from vllm.config import KVEventsConfig


@dataclass
class Published:
    """What one publisher was handed: batches (each gets the next sequence number) and block events in them."""

    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0


def kv_events_config(endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                     buffer_steps: int = 10_000) -> KVEventsConfig:
    """vLLM's configuration for a ZMQ publisher on ``endpoint`` (replays on ``replay_endpoint``), as
    ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`` would give it."""
    from vllm.config import KVEventsConfig  # vLLM: only when an engine is built

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                          replay_endpoint=replay_endpoint, topic=topic, buffer_steps=buffer_steps)


def count_published(scheduler: Any) -> Published:
    """Count every batch ``scheduler``'s KV-event publisher publishes from now on (this instance only)."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # vLLM: only when counting

    publisher = scheduler.kv_event_publisher
    publish = publisher.publish
    counts = Published()

    def counting(batch: Any) -> None:
        counts.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                counts.stored_blocks += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                counts.removed_blocks += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                counts.cleared += 1
        publish(batch)

    publisher.publish = counting  # the scheduler calls it through the instance: only this engine is counted
    return counts
