"""Runs the named SQL against a DuckDB connection and returns JSON-ready Python values.

One :class:`QueryRunner` serves the REST API (connections are cursors of the collector's own database: the
collector holds the file's write lock) and the CLI / reports (a read-only connection to a file no collector holds).

Invariants:
  * read-only: only the shipped SELECT statements run, each with all its parameters bound (no SQL is built from
    user input), and file connections are opened ``read_only=True``;
  * bounded: list queries take a ``limit`` (at most :data:`MAX_LIMIT`), and every statement is interrupted after
    ``timeout_s`` seconds (:class:`QueryTimeout`);
  * unknown runs raise :class:`UnknownRun` (REST: 404); unusable parameters raise :class:`BadParameter` (422);
  * a number the run's event source cannot give (lookups, on streams of vLLM's KV events) is null and named in
    the answer's ``unavailable``, never 0 (:mod:`kvfabric.queries.availability`).
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import duckdb

from kvfabric.contract import schema as S
from kvfabric.queries import availability as A
from kvfabric.queries import catalog
from kvfabric.queries import misses as M
from kvfabric.queries.params import BadParameter, Cursor, parse_block_hash

MAX_LIMIT = 10_000
DEFAULT_TIMEOUT_S = 30.0

Row = dict[str, Any]

SUMMARY_NUMBERS: tuple[str, ...] = (
    "prompt_tokens",
    "prefix_hit_tokens",
    "prefix_hit_rate",
    "evicted_blocks",
    "shared_anchor_eviction_ratio",
    "protected_eviction_ratio",
    "rebuilt_from_eviction_blocks",
    "regretful_evictions",
    "wasted_prefill_tokens",
    "requests",
    "events",
    "shared_anchor_evictions",
    "protected_evictions",
    "admission_limited_blocks",
    "sink_dropped_events",
    "sequence_gaps",
    "evicted_tokens",
    "novel_tokens",
    "uncacheable_tokens",
)
"""Summary fields compared by :meth:`QueryRunner.compare` (delta = b - a)."""


@dataclass(frozen=True)
class Dims:
    """The dimension filters of families, evictions and run summaries (None: any): the events' ``host``,
    ``tenant`` (vLLM's cache_salt) and ``lora`` (adapter name) columns, bound as SQL parameters."""

    host: str | None = None
    tenant: str | None = None
    lora: str | None = None

    def params(self) -> dict[str, str | None]:
        return {"host": self.host, "tenant": self.tenant, "lora": self.lora}


NO_DIMS = Dims()


class UnknownRun(LookupError):
    """No stream of this run was ever accepted."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"unknown run {run_id!r}")
        self.run_id = run_id


class NotFound(LookupError):
    """The thing asked for (a family in a run, a block hash) has no events."""


class QueryTimeout(RuntimeError):
    """A statement ran past the runner's time limit and was interrupted."""


class DatabaseUnavailable(RuntimeError):
    """The database file is missing or locked by a running collector."""


def _limit(value: int, name: str = "limit") -> int:
    if not 1 <= value <= MAX_LIMIT:
        raise BadParameter(f"{name} must be between 1 and {MAX_LIMIT}, got {value}")
    return value


def _window(since_ns: int | None, until_ns: int | None) -> None:
    if since_ns is not None and until_ns is not None and since_ns > until_ns:
        raise BadParameter(f"since_ns ({since_ns}) is after until_ns ({until_ns})")


def connect_read_only(db_path: str) -> duckdb.DuckDBPyConnection:
    """A read-only connection to a collector database that no collector is running on.

    DuckDB lets only one process open a file read-write, and a read-only open is refused while a collector holds
    it: query a live collector through its REST API (or a copy of the file).
    """
    if not os.path.exists(db_path):
        raise DatabaseUnavailable(f"no database at {db_path}")
    if os.path.isdir(db_path):
        raise DatabaseUnavailable(f"{db_path} is a directory, not a database file")
    try:
        return duckdb.connect(db_path, read_only=True)
    except duckdb.IOException as e:
        if "lock" in str(e).lower():
            raise DatabaseUnavailable(
                f"{db_path} is open in a running collector (DuckDB allows one writer process and no readers beside "
                f"it); query the collector's REST API, or copy the file and query the copy. ({e})"
            ) from e
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DatabaseUnavailable(f"{db_path} cannot be read as a DuckDB database ({first})") from e
    except duckdb.Error as e:  # e.g. a file of a newer DuckDB storage version
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DatabaseUnavailable(f"{db_path} cannot be opened ({first})") from e


def _refuse_older_file(con: duckdb.DuckDBPyConnection, error: Exception) -> None:
    """A file of an older schema version lacks columns the queries read: say how to upgrade it, not "Binder Error";
    a DuckDB file that is not a collector's lacks its tables: say so, not "Catalog Error"."""
    try:
        row = con.execute("SELECT value FROM kvfabric_meta WHERE key = 'schema_version'").fetchone()
    except duckdb.Error:
        if isinstance(error, duckdb.CatalogException):  # a table the collector always creates is missing
            raise DatabaseUnavailable(f"{_path_of(con)} is not a kvfabric collector database (it has no "
                                      "kvfabric_meta table)") from error
        return
    if row is not None and row[0] != str(S.SCHEMA_VERSION):
        raise DatabaseUnavailable(
            f"{_path_of(con)} holds schema version {row[0]} (this kvfabric reads {S.SCHEMA_VERSION}); open it once "
            f"with `kvfabric collector --db FILE` to upgrade it in place"
        ) from error


def _path_of(con: duckdb.DuckDBPyConnection) -> str:
    try:
        row = con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchone()
    except duckdb.Error:
        row = None
    return str(row[0]) if row and row[0] else "the database"


class QueryRunner:
    """The named analytics (see module docstring). ``connect`` returns a fresh connection per call."""

    def __init__(
        self, connect: Callable[[], duckdb.DuckDBPyConnection], *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self._connect = connect
        self._timeout_s = timeout_s

    @classmethod
    def for_path(cls, db_path: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> QueryRunner:
        """A runner over a database file, opened read-only for each call."""
        return cls(lambda: connect_read_only(db_path), timeout_s=timeout_s)

    # -- plumbing -------------------------------------------------------------------------------------------
    @contextmanager
    def _connection(self) -> Iterator[duckdb.DuckDBPyConnection]:
        con = self._connect()
        try:
            yield con
        finally:
            con.close()

    def _rows(self, con: duckdb.DuckDBPyConnection, name: str, **params: Any) -> list[Row]:
        wanted = catalog.parameters(name)
        if set(params) != wanted:  # a programming error, not a user one: fail loudly
            raise TypeError(f"query {name} takes {sorted(wanted)}, got {sorted(params)}")
        timer = threading.Timer(self._timeout_s, con.interrupt)
        timer.daemon = True
        timer.start()
        try:
            cur = con.execute(catalog.sql(name), params)
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]
        except duckdb.InterruptException as e:
            raise QueryTimeout(f"query {name} took longer than {self._timeout_s:g} s") from e
        except (duckdb.BinderException, duckdb.CatalogException) as e:
            _refuse_older_file(con, e)
            raise
        finally:
            timer.cancel()

    def _require_run(self, con: duckdb.DuckDBPyConnection, run: str) -> None:
        if not self._rows(con, "run_exists", run=run)[0]["found"]:
            raise UnknownRun(run)

    # -- the named queries ----------------------------------------------------------------------------------
    def runs(self) -> list[Row]:
        """Every run: engines, policies, first/last event time, events, streams, sequence gaps."""
        with self._connection() as con:
            return self._rows(con, "runs")

    def run_exists(self, run: str) -> bool:
        with self._connection() as con:
            return bool(self._rows(con, "run_exists", run=run)[0]["found"])

    def run_summary(
        self, run: str, host: str | None = None, tenant: str | None = None, lora: str | None = None
    ) -> Row:
        """The docs/design.md §5 summary of one run (fields: see sql/run_summary.sql), with the run's miss split
        and evictions by reason (:func:`kvfabric.queries.misses.summary_fields`). ``host``, ``tenant`` (cache_salt)
        and ``lora`` restrict it to those events (None: any)."""
        with self._connection() as con:
            self._require_run(con, run)
            return self._summary(con, run, Dims(host, tenant, lora))

    def _summary(self, con: duckdb.DuckDBPyConnection, run: str, dims: Dims = NO_DIMS) -> Row:
        row = self._rows(con, "run_summary", run=run, **dims.params())[0]
        split = []
        if A.has_lookups(row["sources"]):  # without lookups there is nothing to split (and nothing to scan for)
            split = self._rows(con, "misses", run=run, bucket_ns=M.ONE_WINDOW_NS, with_admissions=False,
                               **dims.params())
        row.update(M.summary_fields(split, self._rows(con, "eviction_reasons", run=run, **dims.params())))
        return A.apply(row, A.SUMMARY_LOOKUP_FIELDS)

    def _sources(self, con: duckdb.DuckDBPyConnection, run: str) -> list[str]:
        return A.normalised(r["source"] for r in self._rows(con, "run_sources", run=run))

    def sources(self, run: str) -> list[str]:
        """The event sources of ``run``'s streams (``plugin``, ``kv_events``; see
        :mod:`kvfabric.queries.availability`)."""
        with self._connection() as con:
            self._require_run(con, run)
            return self._sources(con, run)

    def families(
        self,
        run: str | None = None,
        limit: int = 100,
        host: str | None = None,
        tenant: str | None = None,
        lora: str | None = None,
    ) -> list[Row]:
        """Per (run, family) analytics, most wasted prefill first; every run when ``run`` is None; only the events
        of ``host``, ``tenant`` (cache_salt) and ``lora`` when given."""
        with self._connection() as con:
            if run is not None:
                self._require_run(con, run)
            rows = self._rows(con, "families", run=run, family=None, min_wasted_tokens=0, limit=_limit(limit),
                              **Dims(host, tenant, lora).params())
        return [_family(r) for r in rows]

    def top_waste_families(self, run: str, n: int = 10) -> list[Row]:
        """The ``n`` families of ``run`` that wasted the most prefill (only families that wasted some)."""
        with self._connection() as con:
            self._require_run(con, run)
            rows = self._rows(con, "families", run=run, family=None, min_wasted_tokens=1, limit=_limit(n, "n"),
                              **NO_DIMS.params())
        return [_family(r) for r in rows]

    def family_detail(self, run: str, family: str) -> Row:
        """One family of one run: its families row plus evictions and rebuilds by depth."""
        with self._connection() as con:
            self._require_run(con, run)
            rows = self._rows(con, "families", run=run, family=family, min_wasted_tokens=0, limit=1,
                              **NO_DIMS.params())
            if not rows:
                raise NotFound(f"family {family!r} has no lookups, evictions or rebuilds in run {run!r}")
            detail = _family(rows[0])
            detail["by_depth"] = self._rows(con, "family_depth", run=run, family=family)
            return detail

    def evictions(
        self,
        run: str | None = None,
        family: str | None = None,
        engine: str | None = None,
        since_ns: int | None = None,
        until_ns: int | None = None,
        limit: int = 1000,
        cursor: str | None = None,
        host: str | None = None,
        tenant: str | None = None,
        lora: str | None = None,
    ) -> Row:
        """One page of ``block_evicted`` rows, oldest first: ``{"items": [...], "next_cursor": str | None}``;
        ``host``, ``tenant`` (cache_salt) and ``lora`` filter like ``engine`` (None: any).

        ``next_cursor`` is None on the last page; pass it back unchanged (with the same filters) for the next.
        """
        _limit(limit)
        _window(since_ns, until_ns)
        after = Cursor.decode(cursor) if cursor else None
        with self._connection() as con:
            if run is not None:
                self._require_run(con, run)
            rows = self._rows(
                con, "evictions", run=run, family=family, engine=engine, since_ns=since_ns, until_ns=until_ns,
                after_ts=after.ts_ns if after else None, after_rowid=after.row_key if after else None,
                limit=limit + 1,  # one more than asked tells whether another page exists
                **Dims(host, tenant, lora).params(),
            )
        next_cursor = None
        if len(rows) > limit:
            rows = rows[:limit]
            next_cursor = Cursor(rows[-1]["ts_ns"], rows[-1]["row_key"]).encode()
        return {"items": rows, "next_cursor": next_cursor}

    def block_history(self, block_hash: str | int, run: str | None = None, limit: int = 1000) -> Row:
        """Every event of one block hash (printed forms: see :func:`parse_block_hash`), oldest first."""
        h = block_hash if isinstance(block_hash, int) else parse_block_hash(block_hash)
        with self._connection() as con:
            if run is not None:
                self._require_run(con, run)
            rows = self._rows(con, "block_history", block_hash=h, run=run, limit=_limit(limit))
        if not rows:
            raise NotFound(f"no events for block hash {block_hash!r}" + (f" in run {run!r}" if run else ""))
        return {"block_hash": h, "block_hash_hex": f"{h & 0xFFFFFFFFFFFFFFFF:016x}", "events": rows}

    def compare(self, a: str, b: str) -> Row:
        """Two runs' summaries side by side, and ``delta`` = b - a for every numeric summary field."""
        with self._connection() as con:
            self._require_run(con, a)
            self._require_run(con, b)
            sa = self._summary(con, a)
            sb = self._summary(con, b)
        # A number one run cannot give (unavailable) has no delta: a difference from nothing would read as a change.
        delta = {k: None if k in sa["unavailable"] or k in sb["unavailable"] else (sb[k] or 0) - (sa[k] or 0)
                 for k in SUMMARY_NUMBERS}
        return {"a": sa, "b": sb, "delta": delta}

    def rebuilt_exact(self, run: str) -> list[Row]:
        """Rebuilt-from-eviction recomputed from raw events per family (no bounded memory, unlike the hook)."""
        with self._connection() as con:
            self._require_run(con, run)
            return self._rows(con, "rebuilt_exact", run=run)

    def misses(self, run: str, bucket_s: float = M.DEFAULT_BUCKET_S) -> Row:
        """Miss attribution of one run (docs/design.md §5): ``totals``, ``items`` (one per family, most evicted
        tokens first), ``windows`` (``bucket_s`` seconds each from the run's first event) and
        ``evictions_by_reason``. At most :data:`MAX_LIMIT` windows."""
        bucket_ns = self._bucket_ns(bucket_s)
        with self._connection() as con:
            self._require_run(con, run)
            if not A.has_lookups(self._sources(con, run)):
                reasons = self._rows(con, "eviction_reasons", run=run, **NO_DIMS.params())
                return M.unavailable_response(run, bucket_s, reasons, A.NO_LOOKUPS)
            span = self._rows(con, "run_span", run=run)[0]
            if span["first_ts_ns"] is not None and (span["last_ts_ns"] - span["first_ts_ns"]) // bucket_ns >= MAX_LIMIT:
                raise BadParameter(f"bucket_s={bucket_s:g} cuts run {run!r} into more than {MAX_LIMIT} windows")
            rows = self._rows(con, "misses", run=run, bucket_ns=bucket_ns, with_admissions=False, **NO_DIMS.params())
            reasons = self._rows(con, "eviction_reasons", run=run, **NO_DIMS.params())
        return M.misses_response(run, bucket_s, rows, reasons)

    def admission_misses(self, run: str, limit: int = MAX_LIMIT) -> list[Row]:
        """The split of every admission of ``run`` (first ``limit``, in lookup order)."""
        _limit(limit)
        with self._connection() as con:
            self._require_run(con, run)
            rows = self._rows(con, "misses", run=run, bucket_ns=M.ONE_WINDOW_NS, with_admissions=True,
                              **NO_DIMS.params())
        return M.admission_rows(rows)[:limit]

    def request(self, request_id: str, run: str | None = None) -> Row:
        """One request's story (docs/design.md §5): per admission, its lookup, split and every prompt block."""
        if not request_id:
            raise BadParameter("request_id must not be empty")
        with self._connection() as con:
            if run is not None:
                self._require_run(con, run)
                if not A.has_lookups(self._sources(con, run)):
                    return {"request_id": request_id, "runs": [run], "admissions": [], "unavailable": A.NO_LOOKUPS}
            rows = self._rows(con, "request_story", request=request_id, run=run)
        if not rows:
            raise NotFound(f"request {request_id!r} has no admission" + (f" in run {run!r}" if run else ""))
        return M.story_response(request_id, rows)

    def lifetimes(self, run: str) -> Row:
        """How long blocks stayed cached before their eviction (sql/lifetimes.sql): ``totals`` for the run, ``items``
        per family (most evicted first); both sources answer it alike."""
        with self._connection() as con:
            self._require_run(con, run)
            rows = self._rows(con, "lifetimes", run=run)
        numbers = [{k: v for k, v in r.items() if k != "level"} for r in rows]
        totals = next((n for n, r in zip(numbers, rows, strict=True) if r["level"] == "run"), None)
        if totals is None:  # no eviction at all
            totals = {"family": None, "evicted_blocks": 0, "without_seal": 0, "mean_s": None, "p50_s": None,
                      "p90_s": None, "max_s": None}
        del totals["family"]
        items = [n for n, r in zip(numbers, rows, strict=True) if r["level"] == "family"]
        return {"run_id": run, "totals": totals, "items": items}

    def admission_chains(self, run: str) -> list[Row]:
        """The run's recorded traffic, one row per admission in lookup order (sql/admission_chains.sql)."""
        with self._connection() as con:
            self._require_run(con, run)
            return self._rows(con, "admission_chains", run=run)

    def run_engines(self, run: str) -> list[Row]:
        """The engines of ``run`` with their declared block size, pool size, policy and settings."""
        with self._connection() as con:
            self._require_run(con, run)
            return self._rows(con, "run_engines", run=run)

    def fleet(self, since_ns: int | None = None, until_ns: int | None = None, run: str | None = None) -> Row:
        """The fleet overview (sql/fleet.sql): ``{"since_ns", "until_ns", "totals", "engines"}``, ``engines`` one
        object per (host, engine) with events in the window (or, without a window, any stream), ordered by host and
        engine; ``totals`` sums their counts (ratios recomputed from the sums, ``ingest_lag_s`` their maximum) and
        adds ``hosts`` and ``engines`` (how many)."""
        _window(since_ns, until_ns)
        with self._connection() as con:
            if run is not None:
                self._require_run(con, run)
            rows = self._rows(con, "fleet", since_ns=since_ns, until_ns=until_ns, run=run)
        engines = [_fleet_engine(r) for r in rows]
        return {"since_ns": since_ns, "until_ns": until_ns, "totals": _fleet_totals(engines), "engines": engines}

    @staticmethod
    def _bucket_ns(bucket_s: float) -> int:
        if not M.MIN_BUCKET_S <= bucket_s <= 1e9:
            raise BadParameter(f"bucket_s must be between {M.MIN_BUCKET_S:g} and 1e9 seconds, got {bucket_s:g}")
        return round(bucket_s * 1e9)

    # -- dispatch by name (CLI) -----------------------------------------------------------------------------
    def run(self, name: str, **params: Any) -> Any:
        """Run the named query ``name`` (one of :data:`QUERY_NAMES`) with keyword parameters.

        ``run_summary`` without ``run`` returns the summary of every run. Unknown names raise KeyError.
        """
        if name not in QUERY_NAMES:
            raise KeyError(f"unknown query {name!r}; known: {', '.join(QUERY_NAMES)}")
        params = {k: v for k, v in params.items() if v is not None}
        if name == "run_summary" and "run" not in params:
            return [self.run_summary(r["run_id"], **params) for r in self.runs()]
        method = getattr(self, name)
        try:
            inspect.signature(method).bind(**params)
        except TypeError as e:  # a parameter missing or not taken: the caller's, not a fault inside the query
            raise BadParameter(f"query {name}: {e}") from None
        return method(**params)


def _family(row: Row) -> Row:
    """A families row made honest about its source: a family has no engine counters (they count per engine)."""
    return A.apply(row, A.FAMILY_LOOKUP_FIELDS, counters=False)


def _fleet_engine(row: Row) -> Row:
    """One fleet.sql row as the answer shows it (availability applied to the engine's sources)."""
    return A.apply(row, A.FLEET_LOOKUP_FIELDS, hit_fields=A.FLEET_HIT_FIELDS)


def _ratio(part: int | None, whole: int | None) -> float | None:
    """part / whole; 0 when whole is 0 (as the SQL answers), None when either is unknown."""
    if part is None or whole is None:
        return None
    return part / whole if whole else 0.0


def _fleet_totals(engines: list[Row]) -> Row:
    """The engines' counts summed, ratios recomputed from the sums, ``ingest_lag_s`` their maximum, and ``hosts``
    and ``engines`` (how many). A lookup number sums the engines that have one (a hit rate from engine counters
    included: ``prefix_hit_rate_from`` lists the origins); it is null, and named in ``unavailable``, when no
    engine has it."""

    def total(key: str) -> int | None:
        values = [e[key] for e in engines if e[key] is not None]
        if not values and engines and key in A.FLEET_LOOKUP_FIELDS:
            return None
        return sum(values)

    def extreme(key: str, pick: Any) -> Any:
        values = [e[key] for e in engines if e[key] is not None]
        return pick(values) if values else None

    t: Row = {"runs": sorted({r for e in engines for r in e["runs"]})}
    for key in ("requests", "prompt_tokens", "hit_tokens"):
        t[key] = total(key)
    t["prefix_hit_rate"] = _ratio(t["hit_tokens"], t["prompt_tokens"])
    t["evicted_blocks"] = total("evicted_blocks")
    t["shared_anchor_evictions"] = total("shared_anchor_evictions")
    t["shared_anchor_eviction_ratio"] = _ratio(t["shared_anchor_evictions"], t["evicted_blocks"])
    for key in ("rebuilt_blocks", "wasted_prefill_tokens", "events", "sink_dropped_events", "sequence_gaps"):
        t[key] = total(key)
    t["ingest_lag_s"] = extreme("ingest_lag_s", max)
    t["first_ts_ns"] = extreme("first_ts_ns", min)
    t["last_ts_ns"] = extreme("last_ts_ns", max)
    t["sources"] = A.normalised(s for e in engines for s in e["sources"])
    t["prefix_hit_rate_from"] = sorted({e["prefix_hit_rate_from"] for e in engines} - {None})
    t["unavailable"] = {k: A.NO_LOOKUPS for k in A.FLEET_LOOKUP_FIELDS if t[k] is None}
    t["hosts"] = len({e["host"] for e in engines})
    t["engines"] = len(engines)
    return t


QUERY_NAMES: tuple[str, ...] = (
    "runs",
    "run_summary",
    "families",
    "family_detail",
    "evictions",
    "block_history",
    "compare",
    "top_waste_families",
    "rebuilt_exact",
    "misses",
    "admission_misses",
    "request",
    "lifetimes",
    "fleet",
)
