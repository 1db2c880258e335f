"""Pool hooks: instance attributes on one vLLM ``BlockPool`` that record each call in the :class:`Recorder`.

Runs on vLLM's scheduler thread. vLLM's original method always runs, with the same arguments, and its result or
exception is returned or raised unchanged; the recording runs in a ``try`` whose failure turns the recorder off.
``free_blocks`` materialises its iterable once (callers pass ``reversed(...)``) and hands vLLM the list. The four
frequent methods get compiled copies (:mod:`kvfabric.engine.compiled`) where built; these Python hooks are the
reference, the fallback and the path of every call the compiled ones are not sure of.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvfabric.contract import records as R
from kvfabric.engine import compiled
from kvfabric.engine.probes import flatten_blocks, hash_attribute
from kvfabric.engine.recorder import HANDOVER_RECORDS, Recorder


def hook_pool(pool: Any, r: Recorder, native: bool = False) -> None:
    """Record ``pool``'s calls in ``r``: instance attributes wrap the bound methods of this one pool object.

    Why instance attributes and not a subclass swapped into ``pool.__class__``: on CPython 3.11 assigning
    ``__class__`` turns the object's attribute storage into a plain dict, and every ``self.x`` in vLLM's own pool
    methods then takes the slower lookup (``get_usage`` slower: ``benchmarks/results/hook_layout.md``); the
    scheduler reads the pool many times per step. Adding attributes keeps the object's shared-key layout, so
    vLLM's code runs as fast as unhooked.

    With ``native`` (and the extension built: :mod:`kvfabric.engine.compiled`), the four frequent methods get
    compiled hooks that record as these Python ones do, and pass them every call they are not sure of. A
    ``SEALED`` record takes its hashes from the request (one slice) where vLLM gave each block the request's hash
    of its position: that hash and the block's differ only past their first 8 bytes (vLLM appends the group id),
    which is all a digest reads (``schema.hash64``).
    """
    # Blocks carry a .pool field (0.33+): a free may hand over other pools' blocks, which their own hook records.
    own = pool if bool(pool.blocks) and hasattr(pool.blocks[0], "pool") else None
    get_new_blocks = pool.get_new_blocks
    evict_blocks = pool.evict_blocks
    touch = pool.touch
    free_blocks = pool.free_blocks
    unpin_blocks = getattr(pool, "unpin_blocks", None)  # 0.33+; vLLM 0.26's pool has none
    cache_full_blocks = pool.cache_full_blocks
    move_block_hashes = getattr(pool, "move_block_hashes", None)
    reset_prefix_cache = pool.reset_prefix_cache
    hash_block_size = getattr(pool, "hash_block_size", None)
    hash_name = hash_attribute(pool.blocks)
    hash_field = hash_name == "_block_hash"  # (the Python hooks branch on it: an attribute load, not getattr)

    def kvfabric_get_new_blocks(num_blocks: int, *args: Any, **kwargs: Any) -> list[Any]:
        blocks = get_new_blocks(num_blocks, *args, **kwargs)
        if r.on:
            try:
                # (The victims steering chose inside this call ride in its record: no record of their own.)
                victims = r.victims
                r.victims = None
                r.add((R.ALLOCATED, r.clock(), r.step, r.rid, [b.block_id for b in blocks], victims))
            except Exception:
                r.failed("recording an allocation")
        return blocks

    def kvfabric_evict_blocks(block_ids: Any, *args: Any, **kwargs: Any) -> None:
        # Evictions by get_new_blocks are seen in the ALLOCATED record (the side table knows each block's digest);
        # this is the other door, used by KV connectors. Recorded before vLLM clears the hashes.
        if r.on:
            try:
                all_blocks = pool.blocks
                n = len(all_blocks)
                ids = [b for b in block_ids if 0 <= b < n]
                r.add((R.EVICTING, r.clock(), r.step, r.rid, ids, [all_blocks[b].block_hash for b in ids]))
            except Exception:
                r.failed("recording an eviction")
        evict_blocks(block_ids, *args, **kwargs)

    def record_refs(op: int, rid: str | None, blocks: Any, where: str, *, flatten: bool = False,
                    owner: Any = None) -> None:
        """One record of the blocks whose ref counts a call moved: their ids and ref counts after it (only of
        ``owner``'s blocks when given)."""
        try:
            if flatten:
                blocks = flatten_blocks(blocks)
            if owner is not None:
                blocks = [b for b in blocks if b.pool is owner]
            r.add((op, r.clock(), r.step, rid, [b.block_id for b in blocks], [b.ref_cnt for b in blocks]))
        except Exception:
            r.failed(where)

    def kvfabric_touch(blocks: Any, *args: Any, **kwargs: Any) -> None:
        touch(blocks, *args, **kwargs)
        if r.on:
            record_refs(R.TOUCHED, r.rid, blocks, "recording a touch", flatten=True)

    def kvfabric_free_blocks(ordered_blocks: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        blocks = list(ordered_blocks)
        free_blocks(blocks, *args, **kwargs)
        if r.on:
            record_refs(R.FREED, r.rid, blocks, "recording a free", owner=own)

    def kvfabric_unpin_blocks(blocks: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        assert unpin_blocks is not None
        blocks = list(blocks)
        unpin_blocks(blocks, *args, **kwargs)
        if r.on:
            record_refs(R.FREED, None, blocks, "recording an unpin")

    def kvfabric_cache_full_blocks(
        request: Any,
        blocks: list[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        gate = r.gate
        mask = kwargs.get("block_mask", args[0] if args else None)
        if gate is not None and r.on and num_cached_blocks < num_full_blocks:
            # The admission gate narrows vLLM's own mask (docs/design.md §3: a masked block is never cached).
            # Its mask() never raises: on any internal error vLLM's own mask stands.
            kwargs.pop("block_mask", None)
            args = ()
            mask = kwargs["block_mask"] = gate.mask(r, request, num_cached_blocks, num_full_blocks, mask)
        cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                          *args, **kwargs)
        if num_cached_blocks >= num_full_blocks or not r.on:
            return
        try:
            start, end = num_cached_blocks, num_full_blocks
            parent_raw = None
            prev = None
            hashes = request.block_hashes if (hash_block_size or block_size) == block_size else None
            if start > 0:
                prev = blocks[start - 1].block_id
                if hashes is not None and start - 1 < len(hashes):
                    parent_raw = hashes[start - 1]
            sealed = blocks[start:end]
            ids = [b.block_id for b in sealed]
            if hashes is not None and mask is None and len(hashes) >= end:
                # (Every block got its position's hash; a null block's is dropped by the id, as vLLM skips it.)
                raws = hashes[start:end]
            else:  # (some blocks masked, or hashes of another block size: read what vLLM stored)
                raws = [b._block_hash for b in sealed] if hash_field else [b.block_hash for b in sealed]
            r.add((R.SEALED, r.clock(), r.step, request.request_id, r.family_of(request), start, prev, ids, raws,
                   parent_raw))
        except Exception:
            r.failed("recording a seal")

    def kvfabric_move_block_hashes(src_block: Any, dst_block: Any, *args: Any, **kwargs: Any) -> None:
        # The prefix cache keeps a private copy: src's identity moves to dst. Seen as an eviction of src's content
        # and a seal of it in dst would be wrong (no prefill is recomputed), so the move is recorded.
        assert move_block_hashes is not None
        move_block_hashes(src_block, dst_block, *args, **kwargs)
        if r.on:
            try:
                r.add((R.MOVED, r.clock(), r.step, r.rid, src_block.block_id, dst_block.block_id))
            except Exception:
                r.failed("recording a hash move")

    def kvfabric_reset_prefix_cache(*args: Any, **kwargs: Any) -> bool:
        ok = reset_prefix_cache(*args, **kwargs)
        if ok and r.on:
            try:
                r.add((R.RESET, r.clock(), r.step))
            except Exception:
                r.failed("recording a reset")
        return ok

    hooks = {
        "get_new_blocks": kvfabric_get_new_blocks,
        "evict_blocks": kvfabric_evict_blocks,
        "touch": kvfabric_touch,
        "free_blocks": kvfabric_free_blocks,
        "unpin_blocks": kvfabric_unpin_blocks,
        "cache_full_blocks": kvfabric_cache_full_blocks,
        "move_block_hashes": kvfabric_move_block_hashes,
        "reset_prefix_cache": kvfabric_reset_prefix_cache,
    }
    ops = {"get_new_blocks": R.ALLOCATED, "touch": R.TOUCHED, "free_blocks": R.FREED,
           "cache_full_blocks": R.SEALED}
    fast = native and compiled.Hook is not None
    for name, fn in hooks.items():
        original = getattr(pool, name, None)
        if original is None:  # not in this vLLM (unpin_blocks before 0.33): nothing to wrap
            continue
        fn.__wrapped__ = original  # type: ignore[attr-defined]  # its own name stays (profiles)
        if fast and name in ops:
            fn = compiled.Hook(name, original, fn, r, own, hash_name, hash_block_size, HANDOVER_RECORDS, ops[name])
        setattr(pool, name, fn)
    pool._kvfabric = r
