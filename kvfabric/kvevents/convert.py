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
    ``known`` by ``known_memory`` (the most recently stored kept), ``live`` by ``live_memory`` (a live hash
    forgotten loses only its reset rows, counted in :attr:`Converter.forgotten_live`);
  * every string is valid UTF-8 (msgspec decodes only that) and at most ``max_string_bytes`` long: a row written
    here needs no further check before the writer takes it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
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


Info = tuple[int | None, str | None, str | None, str | None, int, int | None]
"""What is known of a digest: (depth, family, tenant, lora, children, parent). Immutable: a row keeps the entry
that was current when it was written."""
UNKNOWN: Info = (None, None, None, None, None, None)  # type: ignore[assignment]
Row = tuple[str, int | None, Info, int | None, str | None]
"""(event, block_hash, info, age_ns, reason): one row, the rest of its columns being the stream's constants."""


@dataclass
class ConvertedBatch:
    """The rows of one batch (:data:`Row`s), turned into columns only when asked for."""

    ts_ns: int
    dp_rank: int
    engine: str
    run_id: str
    host: str | None
    policy: str | None
    items: list[Row] = field(default_factory=list)
    block_size: int = 0  # the first stored block's size in this batch; 0 when it stored none
    events: dict[str, int] = field(default_factory=dict)  # KV events by kind (wire.EVENT_KINDS)
    skipped_medium: int = 0  # events of another medium (offloading tiers), skipped
    aged: bool = False  # a row has age_ns (a rebuild)
    reasoned: bool = False  # a row has a reason (a reset)

    def __len__(self) -> int:
        return len(self.items)

    def columns(self) -> dict[str, Sequence[Any]]:
        """The varying columns, by name (two transpositions in C: the rows, then their known entries)."""
        if not self.items:
            return dict.fromkeys(("event", "block_hash", "depth", "family", "tenant", "lora", "branch_factor",
                                  "parent_hash", "age_ns", "reason"), ())
        event, block_hash, infos, age_ns, reason = zip(*self.items, strict=True)
        depth, family, tenant, lora, branch, parent = zip(*infos, strict=True)
        return {"event": event, "block_hash": block_hash, "depth": depth, "family": family, "tenant": tenant,
                "lora": lora, "branch_factor": branch, "parent_hash": parent, "age_ns": age_ns, "reason": reason}

    def constants(self) -> dict[str, Any]:
        return {"ts_ns": self.ts_ns, "engine": self.engine, "run_id": self.run_id, "policy": self.policy,
                "host": self.host, "dp_rank": self.dp_rank}

    def rows(self) -> list[tuple]:
        """The rows as tuples in :data:`~kvfabric.contract.schema.EMIT_COLUMNS` order."""
        n = len(self.items)
        c = self.columns() | {name: [v] * n for name, v in self.constants().items()}
        none = [None] * n
        return list(zip(*(c.get(name, none) for name in S.EMIT_COLUMNS), strict=True))

    def record_batch(self, seq: int) -> pa.RecordBatch:
        """The rows as one record batch of :data:`~kvfabric.contract.schema.EVENT_SCHEMA` with ``seq``."""
        n = len(self.items)
        varying = self.columns()
        constant = self.constants() | {"seq": seq}
        arrays = []
        for f in S.EVENT_SCHEMA:
            if f.name in varying and (f.name not in _SPARSE or getattr(self, _SPARSE[f.name])):
                arrays.append(pa.array(varying[f.name], f.type))
            elif constant.get(f.name) is not None:
                arrays.append(pa.repeat(pa.scalar(constant[f.name], f.type), n))
            else:
                arrays.append(pa.nulls(n, f.type))
        return pa.RecordBatch.from_arrays(arrays, schema=S.EVENT_SCHEMA)


_SPARSE = {"age_ns": "aged", "reason": "reasoned"}
"""Columns null on most rows, built only when a row has one."""


class Converter:
    """One stream's block life state machine (module docstring). ``known`` maps a digest to its :data:`Info`;
    ``live`` to its copies in the cache; ``evicted`` to the ``ts_ns`` of its latest eviction (insertion order =
    eviction order, as in the expander). ``max_string_bytes``: a tenant or LoRA name longer than that (UTF-8) is
    left null (the collector's cap on any stored string), counted in :attr:`clipped`."""

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
        max_string_bytes: int = D.MAX_STRING_BYTES,
    ) -> None:
        self.engine = engine
        self.run_id = run_id
        self.host = host
        self.policy = policy
        self.evicted_memory = evicted_memory
        self.known_memory = known_memory
        self.live_memory = live_memory
        self.max_string_bytes = max_string_bytes
        self.known: OrderedDict[int, Info] = OrderedDict()
        self.live: dict[int, int] = {}
        self.evicted: OrderedDict[int, int] = OrderedDict()
        self.forgotten_live = 0  # live hashes dropped over live_memory (their reset rows cannot be written)
        self.clipped = 0  # tenant or LoRA values over max_string_bytes, left null
        self.rows = 0

    def convert(self, batch: wire.DecodedBatch) -> ConvertedBatch:
        """Apply one batch; return its rows."""
        out = ConvertedBatch(ts_ns=ts_to_ns(batch.ts), dp_rank=batch.data_parallel_rank or 0, engine=self.engine,
                             run_id=self.run_id, host=self.host, policy=self.policy)
        counts = dict.fromkeys(wire.EVENT_KINDS, 0)
        kind_of = wire.KIND
        events = batch.events
        i, n = 0, len(events)
        while i < n:
            kind = kind_of[type(events[i])]
            if kind == wire.REMOVED:  # vLLM sends one per evicted block: a run of them is taken in one loop
                j = i + 1
                while j < n and kind_of[type(events[j])] == wire.REMOVED:
                    j += 1
                self._removed(events[i:j], out)
                counts[kind] += j - i
                i = j
                continue
            counts[kind] += 1
            if kind == wire.STORED:
                self._stored(events[i], out)
            else:
                self._cleared(out)
            i += 1
        out.events = {k: v for k, v in counts.items() if v}
        self.rows += len(out)
        return out

    # ---- handlers ----------------------------------------------------------------------------------------------

    def _text(self, value: str | None) -> str | None:
        if value is not None and len(value) * 4 > self.max_string_bytes and \
                len(value.encode("utf-8", "surrogatepass")) > self.max_string_bytes:
            self.clipped += 1
            return None
        return value

    def _stored(self, ev: Any, out: ConvertedBatch) -> None:
        if ev.medium is not None and ev.medium != _GPU:
            out.skipped_medium += 1
            return
        if not out.block_size and ev.block_size > 0:
            out.block_size = ev.block_size
        known = self.known
        live = self.live
        evicted = self.evicted
        append = out.items.append
        lora = self._text(ev.lora_name)
        ts = out.ts_ns
        if ev.parent_block_hash is None:
            parent: int | None = None
            depth: int | None = -1
            family: str | None = None
            tenant = self._text(wire.cache_salt(ev.extra_keys, 0, ev.lora_name))
        else:
            parent = digest(ev.parent_block_hash)
            depth, family, tenant = known.get(parent, UNKNOWN)[:3]
        for raw in ev.block_hashes:
            if type(raw) is int:  # (digest() inlined: the one call per hash this loop would make)
                h = raw & _MASK
                if h >= _SIGN:
                    h -= _WRAP
            else:
                h = digest(raw)
            if parent is None:
                family = S.family_of_hash(h)
            d = None if depth is None else depth + 1
            info = known.pop(h, None)
            if info is None:
                if parent is not None and (p := known.get(parent)) is not None:
                    known[parent] = (*p[:4], p[4] + 1, p[5])  # a child never seen before: a wider branch
                info = (d, family, tenant, lora, 0, parent)
                if len(known) >= self.known_memory:
                    known.popitem(last=False)
            elif d is not None:  # what was learnt before stays when this chain is not known back to its root
                info = (d, family, tenant, lora, info[4], parent)
            else:
                info = (*info[:3], lora, info[4], info[5] if info[5] is not None else parent)
            known[h] = info  # (re-inserted: the most recently stored is forgotten last)
            n = live.get(h)
            if n is None and len(live) >= self.live_memory:
                del live[next(iter(live))]
                self.forgotten_live += 1
            live[h] = (n or 0) + 1
            append((S.BLOCK_SEALED, h, info, None, None))
            gone = evicted.pop(h, None) if evicted else None
            if gone is not None:
                append((S.BLOCK_REBUILT, h, info, ts - gone, None))
                out.aged = True
            parent, depth, family, tenant = h, info[0], info[1], info[2]

    def _removed(self, events: list[Any], out: ConvertedBatch) -> None:
        known = self.known
        live = self.live
        evicted = self.evicted
        append = out.items.append
        ts = out.ts_ns
        for ev in events:
            if ev.medium is not None and ev.medium != _GPU:
                out.skipped_medium += 1
                continue
            for raw in ev.block_hashes:
                if type(raw) is int:
                    h = raw & _MASK
                    if h >= _SIGN:
                        h -= _WRAP
                else:
                    h = digest(raw)
                n = live.get(h)
                if n is not None:
                    if n > 1:
                        live[h] = n - 1
                    else:
                        del live[h]
                append((S.BLOCK_EVICTED, h, known.get(h, UNKNOWN), None, None))
                if h in evicted:
                    evicted.move_to_end(h)
                evicted[h] = ts
        while len(evicted) > self.evicted_memory:
            evicted.popitem(last=False)

    def _cleared(self, out: ConvertedBatch) -> None:
        known = self.known
        ts = out.ts_ns
        append = out.items.append
        for h, copies in self.live.items():
            info = known.get(h, UNKNOWN)
            for _ in range(copies):
                append((S.BLOCK_EVICTED, h, info, None, S.EVICT_RESET))
            self._forget(h, ts)
        out.reasoned = out.reasoned or bool(self.live)
        self.live.clear()
        append((S.CACHE_RESET, None, UNKNOWN, None, None))

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
