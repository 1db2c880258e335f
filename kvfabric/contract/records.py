"""Call records: what the engine writes on vLLM's scheduler thread, one compact tuple per vLLM call.

The scheduler thread pays for one tuple per ``allocate`` / ``touch`` / ``free`` / ``cache`` call, holding the
block ids (and, where a call makes or checks content, vLLM's raw block hashes) of that call, as vLLM's own
``BlockStored`` events carry lists per call. Turning records into per-block events, the side table and every
derived column (hit count, share degree, family of a block, rebuilt and regretful evictions) is the lifecycle
expander's work (:mod:`kvfabric.lifecycle.expander`), done in the forwarder process, off vLLM's GIL. This module is
the layout both sides agree on; it imports nothing.

A record is a plain tuple of ints, strings, bytes, floats, None and lists of those (``marshal`` serialises a
step's records in one C call). Its first item is the op code; layouts:

==============  =========================================================================================
op              fields after the op code
==============  =========================================================================================
``LOOKUP``      ts, step, request_id, family, prompt_tokens, num_blocks, hit_tokens, raw hashes from the hit on,
                tenant (the request's ``cache_salt``), lora (its LoRA adapter's name): None where it has none
``ADMITTED``    ts, step, request_id   (the lookup above was admitted: allocation succeeded)
``CANCELLED``   request_id             (the lookup above was not admitted: allocation returned None)
``ALLOCATED``   ts, step, request_id, block ids, victims   (``get_new_blocks``; each ref count is 1 after it;
                victims: the policy's choices among them, in the order they went, or None: vLLM's own order)
``TOUCHED``     ts, step, request_id, block ids, ref counts after
``FREED``       ts, step, request_id, block ids, ref counts after
``SEALED``      ts, step, request_id, family, start, id of block ``start-1`` (None at the root), block ids
                of ``blocks[start:end]``, their raw hashes (the request's of those positions where vLLM gave
                each block its position's hash, which it stores with the group id appended; else the blocks'
                own, None where the mask kept one uncached), the request's raw hash of block ``start-1`` (the
                parent when that block holds none)
``EVICTING``    ts, step, request_id, block ids, raw hashes (``evict_blocks``, before vLLM clears them)
``MOVED``       ts, step, request_id, source block id, destination block id   (``move_block_hashes``)
``RESET``       ts, step                (``reset_prefix_cache`` succeeded)
``DONE``        request_id              (``KVCacheManager.free``: the request left the manager)
``LIMITED``     ts, step, request_id, family, blocks not cached   (the admission gate narrowed a mask)
``SCORED``      block ids, retain scores, protected flags   (a policy ranked new candidates; or one score and
                one flag standing for every block: ``EvictionPolicy.report``'s uniform form)
``LOST``        ts, events                       (loss the producer counted: report it as ``sink_dropped``)
==============  =========================================================================================

Invariants: records are appended in the order vLLM made the calls, and nothing here reads or writes anything but
the record list (no I/O, no locks); ``ts`` is ``time.time_ns()`` taken once per call, as the events' ``ts_ns``.
"""

from __future__ import annotations

LOOKUP = 1
ADMITTED = 2
CANCELLED = 3
ALLOCATED = 4
TOUCHED = 5
FREED = 6
SEALED = 7
EVICTING = 8
RESET = 9
DONE = 10
LIMITED = 11
# (12 was RANKED: an allocation's victims now ride in its ALLOCATED record)
SCORED = 13
LOST = 14
MOVED = 15

#: How many events a record stands for, for counting loss when a record itself is lost (``block_evicted`` rows
#: inside a lost ``ALLOCATED`` record cannot be known: the count is a lower bound of one event per block).
BLOCK_LIST_AT = {ALLOCATED: 4, TOUCHED: 4, FREED: 4, SEALED: 7, EVICTING: 4}


def events_in(record: tuple) -> int:
    """Events a record would have produced at least (for loss accounting)."""
    at = BLOCK_LIST_AT.get(record[0])
    if at is None:
        return 1 if record[0] in (ADMITTED, LIMITED, RESET) else 0
    if record[0] == ALLOCATED and record[5]:
        return len(record[at]) + 1  # (and its eviction_candidates_ranked row)
    return len(record[at])


def expand_report(ids: list[int], scores: list[float] | float,
                  flags: list[bool] | bool) -> tuple[list[float], list[bool]]:
    """A ``SCORED`` record's scores and flags for ``ids`` as two lists, whichever form it came in (one per block,
    or one score and one flag standing for every block: ``EvictionPolicy.report``'s uniform form)."""
    if isinstance(scores, list):
        return scores, flags  # type: ignore[return-value]
    return [scores] * len(ids), [bool(flags)] * len(ids)
