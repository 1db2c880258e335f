"""Decoded KV-event batches -> event rows of the plugin's schema (docs/design.md §4, "vLLM's KV events").

vLLM says per block only that its content was stored (``BlockStored``: hashes, parent hash, LoRA, extra keys),
removed (``BlockRemoved``) or that the whole prefix cache was cleared (``AllBlocksCleared``); each store and each
removal is one *copy* of a hash (vLLM can hold a block's content twice: two requests computing one prefix at once,
or one copy per KV-cache group). :class:`Converter` turns that into the plugin's block life story:

  * BlockStored -> one ``block_sealed`` per hash (``parent_hash`` the previous hash of the list, the event's
    ``parent_block_hash`` for the first); a hash whose digest is in the evicted memory also gets ``block_rebuilt``
    (``age_ns``: since its eviction), and leaves that memory: exactly the plugin expander's rule
    (:meth:`kvfabric.lifecycle.expander.Expander._sealed`), so both sources flag the same rebuilds on one run;
  * BlockRemoved -> one ``block_evicted`` per hash (``reason`` and ``age_ns`` null: this source knows neither),
    the digest remembered as evicted at the batch's time;
  * AllBlocksCleared -> one ``block_evicted`` (``reason`` ``reset``) per live copy, each remembered as evicted,
    then ``cache_reset``.

Derived columns: ``depth`` = the parent's depth + 1 (0 without a parent, null when the parent is not known:
stored before this collector listened, or forgotten); ``family`` = :func:`~kvfabric.contract.schema.family_of_hash`
of the chain's root (the block without a parent; null when the chain is not known back to it); ``tenant`` = the
root block's ``cache_salt`` as :func:`~kvfabric.kvevents.wire.cache_salt` reads it, inherited by the chain (vLLM
hashes the salt into the root, so every block below it has the same); ``lora`` = the event's ``lora_name``;
``branch_factor`` = distinct children stored under the hash while it is remembered. Rows of a block carry what was
known when it was stored. Events of another medium than the GPU pool (``CPU``, ``STORAGE``: offloading tiers) are
skipped and counted; ``medium`` null counts as the GPU pool.

Invariants (the only code that changes the converter's state is :meth:`Converter.convert`):
  * rows come out in the order of the events and of the hashes inside each event, in
    :data:`~kvfabric.contract.schema.EMIT_COLUMNS` order, every one with the batch's ``ts_ns`` and ``dp_rank``;
  * every map is bounded (oldest forgotten first): ``evicted`` by ``evicted_memory`` (the expander's default),
    ``known`` by ``known_memory``, ``live`` by ``live_memory`` (a live hash forgotten loses only its reset rows,
    counted in :attr:`Converter.forgotten_live`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from kvfabric.contract import schema as S
from kvfabric.ingest import defaults as D
from kvfabric.kvevents import wire

_MASK = (1 << 64) - 1
_SIGN = 1 << 63
_WRAP = 1 << 64
_GPU = "GPU"
_NO = None


def digest(block_hash: wire.BlockHash) -> int:
    """:func:`kvfabric.contract.schema.hash64` of a published hash: for bytes
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) exactly the plugin's digest of the same block; for an int (vLLM's
    default), the int as a signed 64-bit value (not the plugin's digest: vLLM publishes other bytes of the hash)."""
    if type(block_hash) is int:
        v = block_hash & _MASK
        return v - _WRAP if v >= _SIGN else v
    d = S.hash64(block_hash)
    assert d is not None
    return d


@dataclass
class ConvertedBatch:
    """The rows of one batch, column by column (the varying columns; the rest are the stream's constants)."""

    ts_ns: int
    dp_rank: int
    engine: str
    run_id: str
    host: str | None
    policy: str | None
    event: list[str] = field(default_factory=list)
    block_hash: list[int | None] = field(default_factory=list)
    parent_hash: list[int | None] = field(default_factory=list)
    family: list[str | None] = field(default_factory=list)
    depth: list[int | None] = field(default_factory=list)
    branch_factor: list[int | None] = field(default_factory=list)
    age_ns: list[int | None] = field(default_factory=list)
    reason: list[str | None] = field(default_factory=list)
    tenant: list[str | None] = field(default_factory=list)
    lora: list[str | None] = field(default_factory=list)
    block_size: int = 0  # the first stored block's size in this batch; 0 when it stored none
    events: dict[str, int] = field(default_factory=dict)  # KV events by kind (wire.EVENT_KINDS)
    skipped_medium: int = 0  # events of another medium (offloading tiers), skipped

    def __len__(self) -> int:
        return len(self.event)

    def add(self, event: str, block_hash: int | None, info: list[Any] | None, age_ns: int | None = None,
            reason: str | None = None) -> None:
        """One row; ``info`` is the block's known entry (see :class:`Converter`), None when nothing is known."""
        self.event.append(event)
        self.block_hash.append(block_hash)
        self.age_ns.append(age_ns)
        self.reason.append(reason)
        if info is None:
            for column in (self.parent_hash, self.family, self.depth, self.branch_factor, self.tenant, self.lora):
                column.append(None)
            return
        depth, family, tenant, lora, children, parent = info
        self.parent_hash.append(parent)
        self.family.append(family)
        self.depth.append(depth)
        self.branch_factor.append(children)
        self.tenant.append(tenant)
        self.lora.append(lora)

    def rows(self) -> list[tuple]:
        """The rows as tuples in :data:`~kvfabric.contract.schema.EMIT_COLUMNS` order."""
        n = len(self.event)
        c: dict[str, list[Any]] = {
            "ts_ns": [self.ts_ns] * n, "engine": [self.engine] * n, "run_id": [self.run_id] * n,
            "event": self.event, "block_hash": self.block_hash, "parent_hash": self.parent_hash,
            "family": self.family, "depth": self.depth, "branch_factor": self.branch_factor,
            "policy": [self.policy] * n,
            "age_ns": self.age_ns, "reason": self.reason, "host": [self.host] * n, "dp_rank": [self.dp_rank] * n,
            "tenant": self.tenant, "lora": self.lora,
        }
        none = [None] * n
        return list(zip(*(c.get(name, none) for name in S.EMIT_COLUMNS), strict=True))

    def record_batch(self, seq: int) -> pa.RecordBatch:
        """The rows as one record batch of :data:`~kvfabric.contract.schema.EVENT_SCHEMA` with ``seq``."""
        n = len(self.event)
        varying: dict[str, list[Any]] = {
            "event": self.event, "block_hash": self.block_hash, "parent_hash": self.parent_hash,
            "family": self.family, "depth": self.depth, "branch_factor": self.branch_factor, "age_ns": self.age_ns,
            "reason": self.reason, "tenant": self.tenant, "lora": self.lora,
        }
        constant: dict[str, Any] = {
            "seq": seq, "ts_ns": self.ts_ns, "engine": self.engine, "run_id": self.run_id, "policy": self.policy,
            "host": self.host, "dp_rank": self.dp_rank,
        }
        arrays = []
        for f in S.EVENT_SCHEMA:
            if f.name in varying:
                arrays.append(pa.array(varying[f.name], f.type))
            elif constant.get(f.name) is not None:
                arrays.append(pa.repeat(pa.scalar(constant[f.name], f.type), n))
            else:
                arrays.append(pa.nulls(n, f.type))
        return pa.RecordBatch.from_arrays(arrays, schema=S.EVENT_SCHEMA)


class Converter:
    """One stream's block life state machine (module docstring). ``known`` maps a digest to
    ``[depth, family, tenant, lora, children, parent]``; ``live`` to its copies in the cache; ``evicted`` to the
    ``ts_ns`` of its latest eviction (insertion order = eviction order, as in the expander)."""

    def __init__(
        self,
        *,
        engine: str,
        run_id: str,
        host: str | None = None,
        policy: str | None = None,
        evicted_memory: int = D.KV_EVENTS_EVICTED_MEMORY,
        known_memory: int = D.KV_EVENTS_KNOWN_MEMORY,
        live_memory: int = D.KV_EVENTS_LIVE_MEMORY,
    ) -> None:
        self.engine = engine
        self.run_id = run_id
        self.host = host
        self.policy = policy
        self.evicted_memory = evicted_memory
        self.known_memory = known_memory
        self.live_memory = live_memory
        self.known: OrderedDict[int, list[Any]] = OrderedDict()
        self.live: dict[int, int] = {}
        self.evicted: OrderedDict[int, int] = OrderedDict()
        self.forgotten_live = 0  # live hashes dropped over live_memory (their reset rows cannot be written)
        self.rows = 0

    def convert(self, batch: wire.DecodedBatch) -> ConvertedBatch:
        """Apply one batch; return its rows."""
        out = ConvertedBatch(ts_ns=ts_to_ns(batch.ts), dp_rank=batch.data_parallel_rank or 0, engine=self.engine,
                             run_id=self.run_id, host=self.host, policy=self.policy)
        counts: dict[str, int] = {}
        kind_of = wire.KIND
        for ev in batch.events:
            kind = kind_of[type(ev)]
            counts[kind] = counts.get(kind, 0) + 1
            if kind == wire.STORED:
                self._stored(ev, out)
            elif kind == wire.REMOVED:
                self._removed(ev, out)
            else:
                self._cleared(out)
        out.events = counts
        self.rows += len(out)
        return out

    # ---- handlers ----------------------------------------------------------------------------------------------

    def _stored(self, ev: Any, out: ConvertedBatch) -> None:
        if ev.medium is not None and ev.medium != _GPU:
            out.skipped_medium += 1
            return
        if not out.block_size and ev.block_size > 0:
            out.block_size = ev.block_size
        known = self.known
        live = self.live
        evicted = self.evicted
        lora = ev.lora_name
        ts = out.ts_ns
        add = out.add
        if ev.parent_block_hash is None:
            parent: int | None = None
            depth: int | None = -1
            family: str | None = None
            tenant = wire.cache_salt(ev.extra_keys, 0, lora)
        else:
            parent = digest(ev.parent_block_hash)
            pinfo = known.get(parent)
            depth, family, tenant = (pinfo[0], pinfo[1], pinfo[2]) if pinfo is not None else (None, None, None)
        for raw in ev.block_hashes:
            h = digest(raw)
            if parent is None:
                family = S.family_of_hash(h)
            d = None if depth is None else depth + 1
            info = known.get(h)
            if info is None:
                if parent is not None and (pinfo := known.get(parent)) is not None:
                    pinfo[4] += 1  # a child never seen before: the parent's branch factor grows
                info = known[h] = [d, family, tenant, lora, 0, parent]
                if len(known) > self.known_memory:
                    known.popitem(last=False)
            else:
                known.move_to_end(h)
                # A block's chain is its identity: what was learnt before stays (it may be unknown from here now).
                if d is not None:
                    info[0], info[1], info[2] = d, family, tenant
                info[3] = lora
                if info[5] is None:
                    info[5] = parent
            n = live.get(h)
            if n is None and len(live) >= self.live_memory:
                del live[next(iter(live))]
                self.forgotten_live += 1
            live[h] = (n or 0) + 1
            add(S.BLOCK_SEALED, h, info)
            gone = evicted.pop(h, None) if evicted else None
            if gone is not None:
                add(S.BLOCK_REBUILT, h, info, ts - gone)
            parent, depth, family, tenant = h, info[0], info[1], info[2]

    def _removed(self, ev: Any, out: ConvertedBatch) -> None:
        if ev.medium is not None and ev.medium != _GPU:
            out.skipped_medium += 1
            return
        known = self.known
        live = self.live
        ts = out.ts_ns
        for raw in ev.block_hashes:
            h = digest(raw)
            n = live.get(h)
            if n is not None:
                if n > 1:
                    live[h] = n - 1
                else:
                    del live[h]
            out.add(S.BLOCK_EVICTED, h, known.get(h))
            self._forget(h, ts)

    def _cleared(self, out: ConvertedBatch) -> None:
        known = self.known
        ts = out.ts_ns
        for h, copies in self.live.items():
            info = known.get(h)
            for _ in range(copies):
                out.add(S.BLOCK_EVICTED, h, info, reason=S.EVICT_RESET)
            self._forget(h, ts)
        self.live.clear()
        out.add(S.CACHE_RESET, None, None)

    def _forget(self, h: int, ts: int) -> None:
        """Remember ``h`` as evicted at ``ts`` (the latest eviction moves it to the end: forgotten last)."""
        evicted = self.evicted
        evicted[h] = ts
        evicted.move_to_end(h)
        if len(evicted) > self.evicted_memory:
            evicted.popitem(last=False)


def ts_to_ns(ts: float) -> int:
    """A batch's ``ts`` (seconds since the epoch, vLLM's ``time.time()``) as the rows' ``ts_ns``; the one rounding
    used everywhere (the subscriber compares replayed batches with stored ones by it)."""
    return int(ts * 1e9)
