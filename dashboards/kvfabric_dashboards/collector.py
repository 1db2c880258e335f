"""The collector's health: is it up, keeping up, losing nothing, and how big is it getting.

Built from the "Collector health" metrics of docs/metrics.md plus Prometheus' own per-target series (``up``,
``scrape_duration_seconds``, ``scrape_samples_scraped``) for the collector's job. Every collector of a fleet is a
scrape target, one per host, so the ``$host`` variable (Prometheus' ``instance`` label) picks collectors; ``$engine``
narrows the per-engine loss panels (sink drops) to engines of those hosts.
"""

from __future__ import annotations

from grafana_foundation_sdk.models.dashboard import Dashboard

from kvfabric_dashboards.common import (
    COLLECTOR_JOB,
    COLLECTOR_UID,
    INGEST_LAG_P99_TARGET_S,
    PanelIds,
    Target,
    base_dashboard,
    dashboard_link,
    engine_variable,
    host_variable,
    row,
    stat_panel,
    timeseries_panel,
)

H = 'instance=~"$host"'
E = 'engine=~"$engine"'
RATE = "$__rate_interval"
RANGE = "$__range"


def h(metric: str, extra: str = "") -> str:
    """``metric{instance=~"$host"<extra>}``."""
    return f"{metric}{{{H}{', ' + extra if extra else ''}}}"


def quantile_by_instance(q: float, bucket: str) -> str:
    """The ``q`` quantile of histogram ``bucket`` per collector instance."""
    return f"histogram_quantile({q}, sum by (instance, le) (rate({h(bucket)}[{RATE}])))"


JOB = f'job="{COLLECTOR_JOB}"'


def build_collector_health() -> Dashboard:
    """The KVFabric collector health dashboard (uid ``kvfabric-collector``)."""
    ids = PanelIds()
    d = base_dashboard(
        COLLECTOR_UID,
        "KVFabric / Collector health",
        "The KVFabric collector: up, ingest rate, insert latency, end-to-end lag, loss (sink drops, sequence gaps), "
        "bad streams, open streams, writer backlog and database size.",
    )
    d = (
        d.with_variable(host_variable())
        .with_variable(engine_variable(of_runs=False))
        .link(dashboard_link("KVFabric dashboards", "kvfabric"))
    )

    # ---- status ------------------------------------------------------------------------------------------------
    d = d.with_row(row(ids, "Status"))
    d = d.with_panel(stat_panel(
        ids, "Collector up", "Prometheus' scrape of the collector's /metrics (up), lowest over the selected "
        "collectors: DOWN means at least one is unreachable.",
        Target(f"min(up{{{JOB}, {H}}})"), mappings=(("0", "DOWN", "red"), ("1", "UP", "green")),
        thresholds=((None, "red"), (1, "green")), no_value="no target",
    ))
    d = d.with_panel(stat_panel(
        ids, "Open sink streams", "Connected hook streams (kvfabric_open_streams): one per engine streaming now.",
        Target(f"sum({h('kvfabric_open_streams')})"), decimals=0,
    ))
    d = d.with_panel(stat_panel(
        ids, "Rows ingested", "Rows written to DuckDB over the selected range (kvfabric_ingest_rows_total).",
        Target(f"sum(increase({h('kvfabric_ingest_rows_total')}[{RANGE}]))"), decimals=0, no_value="0",
    ))
    d = d.with_panel(stat_panel(
        ids, "Events lost by sinks", "Events the hooks' sinks dropped since the collector started (collector "
        "slow or down; kvfabric_sink_dropped_events_total). Should be 0. A lifetime total on purpose: a run's "
        "counter is born with its first drops, which increase() over a range would not count.",
        Target(f"sum({h('kvfabric_sink_dropped_events_total', E)}) or vector(0)"), decimals=0,
        thresholds=((None, "green"), (1, "red")),
    ))
    d = d.with_panel(stat_panel(
        ids, "Sequence gaps", "Batches missing according to per-stream sequence numbers, over the selected range "
        "(kvfabric_sequence_gaps_total): data lost between hook and collector. Should be 0.",
        Target(f"sum(increase({h('kvfabric_sequence_gaps_total')}[{RANGE}]))"), decimals=0,
        thresholds=((None, "green"), (1, "red")),
    ))
    d = d.with_panel(stat_panel(
        ids, "Database size", "Size of the DuckDB file and its WAL (kvfabric_db_size_bytes), all selected "
        "collectors.",
        Target(f"sum({h('kvfabric_db_size_bytes')})"), unit="bytes",
    ))
    d = d.with_panel(stat_panel(
        ids, "Storage", "Whether DuckDB accepts writes (kvfabric_storage_healthy), lowest over the selected "
        "collectors. FAILING (disk full, I/O error, database invalidated): ingest is held, /healthz answers 503 "
        "and the collector retries, reopening the database, until a write succeeds. docs/reliability.md.",
        Target(f"min({h('kvfabric_storage_healthy')})"), mappings=(("0", "FAILING", "red"), ("1", "OK", "green")),
        thresholds=((None, "red"), (1, "green")), no_value="no target",
    ))
    d = d.with_panel(stat_panel(
        ids, "Refused batches", "Batches refused for their content over the selected range "
        "(kvfabric_refused_batches_total: invalid UTF-8, over-long strings, unknown events, DuckDB refusals); "
        "their rows are counted, never stored. Should be 0.",
        Target(f"sum(increase({h('kvfabric_refused_batches_total')}[{RANGE}]))"), decimals=0,
        thresholds=((None, "green"), (1, "red")), no_value="0",
    ))

    # ---- ingest ------------------------------------------------------------------------------------------------
    d = d.with_row(row(ids, "Ingest"))
    d = d.with_panel(timeseries_panel(
        ids, "Rows and batches ingested", "Rows written to DuckDB and Arrow batches received per second "
        "(batches on the right axis).",
        [
            Target(f"sum by (instance) (rate({h('kvfabric_ingest_rows_total')}[{RATE}]))", "rows/s {{instance}}"),
            Target(f"sum by (instance) (rate({h('kvfabric_ingest_batches_total')}[{RATE}]))",
                   "batches/s {{instance}}"),
        ],
        unit="suffix: rows/s", right_axis_ref="B", right_axis_unit="suffix: batches/s",
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Insert latency", "Time of one coalesced DuckDB insert (kvfabric_insert_duration_seconds).",
        [
            Target(quantile_by_instance(q, "kvfabric_insert_duration_seconds_bucket"),
                   f"p{int(q * 100)} {{{{instance}}}}")
            for q in (0.5, 0.99)
        ],
        unit="s",
    ))
    d = d.with_panel(timeseries_panel(
        ids, "End-to-end lag", "Event timestamp in the scheduler to the commit of its row in DuckDB "
        f"(kvfabric_ingest_lag_seconds). Target: p99 <= {INGEST_LAG_P99_TARGET_S:g} s (docs/design.md §9), dashed.",
        [
            Target(quantile_by_instance(q, "kvfabric_ingest_lag_seconds_bucket"),
                   f"p{int(q * 100)} {{{{instance}}}}")
            for q in (0.5, 0.99)
        ],
        unit="s", thresholds=((None, "green"), (INGEST_LAG_P99_TARGET_S, "red")), threshold_line=True,
    ))

    # ---- loss and bad input ------------------------------------------------------------------------------------
    d = d.with_row(row(ids, "Loss and bad input"))
    d = d.with_panel(timeseries_panel(
        ids, "Events dropped by sinks, by run and engine", "Cumulative events dropped by each hook's sink since "
        "the collector started, from its sink_dropped rows (kvfabric_sink_dropped_events_total); empty when "
        "nothing was ever dropped. Cumulative on purpose: a run's counter is born with its first drops, which a "
        "rate() would show as 0.",
        [Target(f"sum by (run, engine) ({h('kvfabric_sink_dropped_events_total', E)})", "{{run}} {{engine}}")],
        unit="short",
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Sequence gaps per second", "Missing batches per second by collector (kvfabric_sequence_gaps_total).",
        [Target(f"sum by (instance) (rate({h('kvfabric_sequence_gaps_total')}[{RATE}]))", "{{instance}}")],
        unit="suffix: batches/s",
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Bad streams by reason", "Streams refused or cut (kvfabric_bad_streams_total): garbage, "
        "schema_version, schema_mismatch, oversized, handshake_timeout, truncated, slow_message, invalid_utf8, "
        "acks_not_read. Each has a log line (at most 5 per reason per 10 s).",
        [Target(f"sum by (reason) (rate({h('kvfabric_bad_streams_total')}[{RATE}]))", "{{reason}}")],
        unit="suffix: streams/s", stacked=True,
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Refused batches and connections", "Batches refused for their content "
        "(kvfabric_refused_batches_total), connections closed right after accept (kvfabric_connections_refused_"
        "total: connection_limit, peer_not_allowed) and resent batches not stored twice "
        "(kvfabric_duplicate_batches_total: a sink's replay after a collector restart; not a fault).",
        [
            Target(f"sum by (reason) (rate({h('kvfabric_refused_batches_total')}[{RATE}]))", "batch {{reason}}"),
            Target(f"sum by (reason) (rate({h('kvfabric_connections_refused_total')}[{RATE}]))",
                   "connection {{reason}}"),
            Target(f"sum(rate({h('kvfabric_duplicate_batches_total')}[{RATE}]))", "duplicate batches"),
        ],
        unit="suffix: /s",
    ))

    # ---- backlog and storage -----------------------------------------------------------------------------------
    d = d.with_row(row(ids, "Backlog, storage and scrape"))
    d = d.with_panel(timeseries_panel(
        ids, "Open streams and writer backlog", "Connected sink streams, and rows received but not yet "
        "committed (kvfabric_writer_queue_rows, right axis): a backlog that keeps growing means DuckDB cannot "
        "keep up.",
        [
            Target(f"sum by (instance) ({h('kvfabric_open_streams')})", "open streams {{instance}}"),
            Target(f"sum by (instance) ({h('kvfabric_writer_queue_rows')})", "queued rows {{instance}}"),
        ],
        unit="short", right_axis_ref="B", right_axis_unit="suffix: rows",
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Database size over time", "DuckDB file and WAL size per collector (kvfabric_db_size_bytes).",
        [Target(h("kvfabric_db_size_bytes"), "{{instance}}")], unit="bytes",
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Storage faults and receive memory", "Failed DuckDB write attempts per second "
        "(kvfabric_storage_errors_total: disk full, I/O error, invalidated database), and bytes held in partly "
        "received messages (kvfabric_ingest_buffered_bytes, right axis; bounded by --max-buffered-bytes).",
        [
            Target(f"sum by (instance) (rate({h('kvfabric_storage_errors_total')}[{RATE}]))",
                   "storage errors {{instance}}"),
            Target(f"sum by (instance) ({h('kvfabric_ingest_buffered_bytes')})", "buffered {{instance}}"),
        ],
        unit="suffix: /s", right_axis_ref="B", right_axis_unit="bytes",
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Scrape of /metrics", "Prometheus' own view of the collector target: scrape duration and samples "
        "per scrape (right axis). Samples grow with the number of runs and engines (bounded: 64 runs, then "
        "_other).",
        [
            Target(f"scrape_duration_seconds{{{JOB}, {H}}}", "scrape duration {{instance}}"),
            Target(f"scrape_samples_scraped{{{JOB}, {H}}}", "samples {{instance}}"),
        ],
        unit="s", right_axis_ref="B", right_axis_unit="short",
    ))
    return d.build()
