"""The operators' overview: what happens to the KV cache, per run and engine, beside vLLM's own metrics.

One panel (at least) per definition of docs/design.md §5 (prefix family, shared anchor / shared-anchor eviction ratio,
protected eviction ratio, rebuilt-from-eviction, regretful eviction, prefix hit rate, wasted prefill tokens),
built only from the metrics of docs/metrics.md and vLLM 0.33's own ``vllm:*`` metrics.

Why there is no "top families" table here: a family id is unbounded (one per system prompt, conversation or
document), so it is never a Prometheus label (docs/metrics.md keeps labels to ``run`` and ``engine``). Family-level
answers come from the collector's REST API (``/api/v1/families``), which this dashboard links to from a text panel,
from the cost panels and from the dashboard links, with the selected run filled in; Prometheus carries the
aggregate signals (events by type, rebuilt, regretful, wasted prefill per run and engine).

vLLM labels its metrics ``model_name`` and ``engine`` (the engine *index*, "0", "1"...), which is not KVFabric's
``engine`` label (``<host>/dp<rank>``): vLLM panels are filtered by ``$model`` instead.

``$host``: the collector's metrics carry no host label; a fleet runs one collector per host, so the host is the
collector's scrape target (Prometheus' ``instance`` label), and ``$engine`` lists the engines of the selected hosts.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models.dashboard import Dashboard

from kvfabric_dashboards.common import (
    DEFAULT_COLLECTOR_URL,
    OVERVIEW_UID,
    SHARED_ANCHOR_RATIO_ALERT,
    SHARED_ANCHOR_RATIO_WARN,
    PanelIds,
    Target,
    base_dashboard,
    dashboard_link,
    engine_variable,
    host_variable,
    markdown_panel,
    query_variable,
    row,
    stat_panel,
    timeseries_panel,
    url_link,
)

KV = 'run=~"$run", engine=~"$engine", instance=~"$host"'
"""Selector of every KVFabric analytics query (``run`` and ``engine`` are bounded: docs/metrics.md; ``instance`` is
the collector's scrape target, one per host)."""
VLLM = 'model_name=~"$model"'
"""Selector of every vLLM query."""
RATE = "$__rate_interval"
RANGE = "$__range"

FAMILIES_URL = "${collector_url}/api/v1/families?run=${run}"
SUMMARY_URL = "${collector_url}/api/v1/runs/${run}/summary"
EVICTIONS_URL = "${collector_url}/api/v1/evictions?run=${run}"
MISSES_URL = "${collector_url}/api/v1/runs/${run}/misses?bucket_s=60"
WHATIF_URL = "${collector_url}/api/v1/runs/${run}/whatif"
WHATIF_AGING_URL = "${collector_url}/api/v1/runs/${run}/whatif?policy=adaptive_aging"


def kv(metric: str, extra: str = "") -> str:
    """``metric{run=~"$run", engine=~"$engine"<extra>}``."""
    return f"{metric}{{{KV}{', ' + extra if extra else ''}}}"


def vllm(metric: str) -> str:
    """``metric{model_name=~"$model"}``."""
    return f"{metric}{{{VLLM}}}"


def ratio(numerator: str, denominator: str, window: str, by: str = "") -> str:
    """``sum(rate(num[w])) / sum(rate(den[w]))`` (``increase`` over ``$__range``), optionally ``sum by``."""
    fn = "increase" if window == RANGE else "rate"
    agg = f"sum by ({by}) " if by else "sum"
    return f"{agg}({fn}({numerator}[{window}])) / {agg}({fn}({denominator}[{window}]))"


def total(selector: str, window: str = RANGE, by: str = "") -> str:
    """``sum(increase(sel[$__range]))`` (or ``rate`` over another window), optionally ``sum by``."""
    fn = "increase" if window == RANGE else "rate"
    agg = f"sum by ({by}) " if by else "sum"
    return f"{agg}({fn}({selector}[{window}]))"


def quantile(q: float, bucket: str, window: str = RATE, by: str = "le") -> str:
    """The ``q`` quantile of a histogram's ``_bucket`` series, aggregated ``by`` (``le`` kept)."""
    return f"histogram_quantile({q}, sum by ({by}) (rate({bucket}[{window}])))"


# docs/design.md §5, restated where the operator reads it.
DEF_HIT_RATE = (
    "Prefix hit rate = hit tokens / prompt tokens over admissions (docs/design.md §5), counted once per admission by "
    "the hook (prefix_lookup events). vLLM's own hits/queries is charted beside it: on vLLM 0.33 both count at "
    "admission; vLLM 0.26 counts a query on every retry of a waiting request, so under memory pressure its ratio "
    "understates the true hit rate."
)
DEF_SHARED_ANCHOR = (
    "Shared anchor (trunk) block: a cached block used by at least 2 distinct requests (share_degree >= 2); a "
    "private tail was used by one request only. Shared-anchor eviction ratio = evicted shared-anchor blocks / "
    "evicted blocks: lower is better (a high ratio means the cache throws away what many requests reuse)."
)
DEF_PROTECTED = (
    "Protected eviction ratio = evictions of blocks the policy marked protected / evictions. Under LRU nothing is "
    "protected (0); under family_protect or shared_aware a rising ratio means the protected set no longer fits."
)
DEF_REBUILT = (
    "Rebuilt from eviction: a block hash that was evicted and later sealed again, i.e. its prefill was "
    "recomputed. Per-family counts and time-to-rebuild: collector REST /api/v1/families."
)
DEF_REGRETFUL = (
    "Regretful eviction: an evicted hash that a later lookup wanted within the regret window W (default 60 s): "
    "misses caused by eviction rather than by novel prompts."
)
DEF_WASTED = (
    "Wasted prefill tokens = block size x rebuilt blocks: prompt tokens computed again because their KV blocks had "
    "been evicted (the cost of bad eviction)."
)
DEF_FAMILY = (
    "Prefix family: requests that share their leading full blocks below the prefix everyone shares (id = hash of "
    "the block just below the request's widest branch point, or a kvfabric_family hint). Unbounded, so never a "
    "Prometheus label: per-family "
    "numbers are on the collector's REST API."
)

DEF_EVICTION_REASON = (
    "Why an evicted block lost its content (block_evicted.reason, docs/design.md §4): pressure = vLLM reused it for "
    "a new allocation (the cache is too small for the working set), connector = a KV connector evicted it "
    "(evict_blocks), reset = a prefix-cache reset dropped it, unknown = the hook did not say."
)
DEF_MISSES = (
    "Miss attribution (docs/design.md §5): every admission's prompt tokens split into hit, evicted (the engine had "
    "cached the block and lost it: a cost of the policy or the capacity), novel (never cached by this engine) and "
    "uncacheable (the block of the last prompt token, gate-refused or never computed blocks). It needs the run's "
    "whole history, so it is computed by the collector on demand, not exported as metrics."
)

MISSES_TEXT = f"""\
**Why were prompt tokens recomputed?** The collector splits every admission's prompt tokens into *hit*, *evicted*
(cached before, then lost: the policy's or the capacity's cost), *novel* (never seen by this engine) and
*uncacheable* (last-token block, gate, never computed), by family and time window:

* [Misses of run `${{run}}` by family and minute]({MISSES_URL}) (select one run above)
* One request's story: `${{collector_url}}/api/v1/requests/<request id>?run=${{run}}`

**What if** another policy or more KV memory had served the same traffic? The recorded run replayed offline, with
the optimum beside it:

* [Replay of `${{run}}` as it ran, and the optimum]({WHATIF_URL})
* [The same traffic under adaptive_aging]({WHATIF_AGING_URL}) (add `&num_blocks=N` for another capacity)

CLI: `kvfabric query misses --run R`, `kvfabric whatif --run R --policy P --num-blocks N`.
"""

FAMILIES_TEXT = f"""\
**Prefix families** are requests that share their leading full blocks: one per system prompt, template,
conversation or document (docs/design.md §5). There can be millions, so they are **never Prometheus labels**: the
metrics stop at `run` and `engine`, and every panel of this dashboard aggregates families.

Per-family answers (evictions, rebuilt-from-eviction, time to rebuild, wasted prefill, hit rate) come from the
collector's REST API, ranked by waste:

* [Families of run `${{run}}`]({FAMILIES_URL}) (select one run above)
* [Run summary of `${{run}}`]({SUMMARY_URL})
* [Evictions of `${{run}}`, newest first]({EVICTIONS_URL})
* [All families](${{collector_url}}/api/v1/families) · [API docs](${{collector_url}}/docs)

The collector's address as the browser sees it is the `collector_url` box at the top (default
`{DEFAULT_COLLECTOR_URL}`). Beside this panel: events by type, the aggregate signal of family activity
(admissions are `prefix_lookup` events).
"""


def build_overview() -> Dashboard:
    """The KVFabric overview dashboard (uid ``kvfabric-overview``)."""
    ids = PanelIds()
    d = base_dashboard(
        OVERVIEW_UID,
        "KVFabric / KV cache overview",
        "What happens to vLLM's KV cache blocks, per run and engine: prefix hit rate, evictions (shared anchor vs "
        "private tail, protected), rebuilt-from-eviction, regretful evictions and wasted prefill, beside vLLM's "
        "own KV usage, latency and preemption metrics.",
    )
    d = (
        d.with_variable(host_variable())
        .with_variable(query_variable(
            "run", "Run", 'label_values(kvfabric_events_total{instance=~"$host"}, run)',
            description="KVFABRIC_RUN_ID of the runs seen by the collectors of the selected hosts (beyond 64 runs "
                        "per collector: _other)",
        ))
        .with_variable(engine_variable(of_runs=True))
        .with_variable(query_variable(
            "model", "vLLM model", "label_values(vllm:num_requests_running, model_name)",
            description="vLLM's model_name label (vLLM panels only; vLLM has no run label)",
        ))
        .with_variable(
            dashboard.TextBoxVariable("collector_url")
            .label("Collector REST")
            .description("Base URL of the KVFabric collector's REST API, as your browser reaches it")
            .default_value(DEFAULT_COLLECTOR_URL)
        )
        .link(dashboard_link("KVFabric dashboards", "kvfabric"))
        .link(url_link("Families (REST)", FAMILIES_URL, "Per-family evictions, rebuilt and wasted prefill"))
        .link(url_link("Run summary (REST)", SUMMARY_URL, "The run summary the CLI and reports use"))
        .link(url_link("Misses (REST)", MISSES_URL, "Prompt tokens split into hit / evicted / novel / uncacheable"))
    )

    # ---- at a glance -------------------------------------------------------------------------------------------
    d = d.with_row(row(ids, "At a glance (selected time range)"))
    d = d.with_panel(stat_panel(
        ids, "Prefix hit rate", DEF_HIT_RATE,
        Target(ratio(kv("kvfabric_prefix_hit_tokens_total"), kv("kvfabric_prompt_tokens_total"), RANGE)),
        unit="percentunit", decimals=1, thresholds=((None, "red"), (0.2, "orange"), (0.5, "green")),
    ))
    d = d.with_panel(stat_panel(
        ids, "Shared-anchor eviction ratio", DEF_SHARED_ANCHOR,
        Target(ratio(kv("kvfabric_evicted_blocks_total", 'kind="shared_anchor"'),
                     kv("kvfabric_evicted_blocks_total"), RANGE)),
        unit="percentunit", decimals=1,
        thresholds=((None, "green"), (SHARED_ANCHOR_RATIO_WARN, "orange"), (SHARED_ANCHOR_RATIO_ALERT, "red")),
    ))
    d = d.with_panel(stat_panel(
        ids, "Protected eviction ratio", DEF_PROTECTED,
        Target(ratio(kv("kvfabric_protected_evictions_total"), kv("kvfabric_evicted_blocks_total"), RANGE)),
        unit="percentunit", decimals=1, thresholds=((None, "green"), (0.1, "orange"), (0.3, "red")),
    ))
    d = d.with_panel(stat_panel(
        ids, "Rebuilt-from-eviction blocks", DEF_REBUILT, Target(total(kv("kvfabric_rebuilt_blocks_total"))),
        decimals=0, no_value="0",
    ))
    d = d.with_panel(stat_panel(
        ids, "Regretful evictions", DEF_REGRETFUL, Target(total(kv("kvfabric_regretful_evictions_total"))),
        decimals=0, no_value="0",
    ))
    d = d.with_panel(stat_panel(
        ids, "Wasted prefill tokens", DEF_WASTED, Target(total(kv("kvfabric_wasted_prefill_tokens_total"))),
        decimals=0, no_value="0",
    ))
    d = d.with_panel(stat_panel(
        ids, "Evicted blocks", "Blocks evicted from the prefix cache (all kinds).",
        Target(total(kv("kvfabric_evicted_blocks_total"))), decimals=0, no_value="0",
    ))
    d = d.with_panel(stat_panel(
        ids, "Prompt tokens admitted", "Prompt tokens over admissions (prefix_lookup.prompt_tokens).",
        Target(total(kv("kvfabric_prompt_tokens_total"))), decimals=0, no_value="0",
    ))
    d = d.with_panel(stat_panel(
        ids, "vLLM prefix hit rate", "vLLM's own vllm:prefix_cache_hits / vllm:prefix_cache_queries (tokens).",
        Target(ratio(vllm("vllm:prefix_cache_hits_total"), vllm("vllm:prefix_cache_queries_total"), RANGE)),
        unit="percentunit", decimals=1,
    ))
    d = d.with_panel(stat_panel(
        ids, "KV cache usage (now)", "vLLM's vllm:kv_cache_usage_perc (a fraction of the KV pool), highest engine.",
        Target(f"max({vllm('vllm:kv_cache_usage_perc')})"),
        unit="percentunit", decimals=1, thresholds=((None, "green"), (0.9, "orange"), (0.98, "red")),
    ))
    d = d.with_panel(stat_panel(
        ids, "Preemptions (vLLM)", "vLLM's vllm:num_preemptions: requests preempted (their KV freed) for memory.",
        Target(total(vllm("vllm:num_preemptions_total"))), decimals=0, no_value="0",
        thresholds=((None, "green"), (1, "orange")),
    ))
    d = d.with_panel(stat_panel(
        ids, "Events lost by the hook's sink",
        "Events the hook had to drop (collector slow or down), since the collector started: loss is counted, "
        "never silent. Should be 0. A lifetime total on purpose: a run's counter is born with its first drops, "
        "which increase() over a range would not count.",
        Target(f"sum({kv('kvfabric_sink_dropped_events_total')}) or vector(0)"), decimals=0,
        thresholds=((None, "green"), (1, "red")),
    ))

    # ---- prefix hit rate ---------------------------------------------------------------------------------------
    d = d.with_row(row(ids, "Prefix hit rate"))
    d = d.with_panel(timeseries_panel(
        ids, "Prefix hit rate: KVFabric (per admission) vs vLLM", DEF_HIT_RATE,
        [
            Target(ratio(kv("kvfabric_prefix_hit_tokens_total"), kv("kvfabric_prompt_tokens_total"), RATE,
                         by="run"), "KVFabric {{run}}"),
            Target(ratio(vllm("vllm:prefix_cache_hits_total"), vllm("vllm:prefix_cache_queries_total"), RATE,
                         by="model_name"), "vLLM {{model_name}}"),
        ],
        unit="percentunit", width=12, min_value=0, max_value=1,
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Prompt tokens and prefix-cache hit tokens",
        "Prompt tokens admitted and the part served from the prefix cache, tokens per second (KVFabric), with "
        "vLLM's own prefix-cache query tokens for comparison.",
        [
            Target(total(kv("kvfabric_prompt_tokens_total"), RATE), "prompt tokens (KVFabric)"),
            Target(total(kv("kvfabric_prefix_hit_tokens_total"), RATE), "hit tokens (KVFabric)"),
            Target(total(vllm("vllm:prefix_cache_queries_total"), RATE), "queried tokens (vLLM)"),
        ],
        unit="suffix: tokens/s", width=12,
    ))

    # ---- KV cache and evictions --------------------------------------------------------------------------------
    d = d.with_row(row(ids, "KV cache and evictions"))
    d = d.with_panel(timeseries_panel(
        ids, "KV cache usage (vLLM)", "vllm:kv_cache_usage_perc per vLLM engine: the fraction of the KV pool in "
        "use. Evictions start when it nears 100%.",
        [Target(vllm("vllm:kv_cache_usage_perc"), "{{model_name}} engine {{engine}}")],
        unit="percentunit", min_value=0, max_value=1,
        thresholds=((None, "green"), (0.9, "orange")), threshold_line=True,
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Evicted blocks by kind", DEF_SHARED_ANCHOR,
        [Target(total(kv("kvfabric_evicted_blocks_total"), RATE, by="kind"), "{{kind}}")],
        unit="suffix: blocks/s", stacked=True,
        links=[("Evictions of the selected run (REST)", EVICTIONS_URL)],
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Shared-anchor and protected eviction ratios", f"{DEF_SHARED_ANCHOR} {DEF_PROTECTED}",
        [
            Target(ratio(kv("kvfabric_evicted_blocks_total", 'kind="shared_anchor"'),
                         kv("kvfabric_evicted_blocks_total"), RATE, by="run"), "shared anchor {{run}}"),
            Target(ratio(kv("kvfabric_protected_evictions_total"), kv("kvfabric_evicted_blocks_total"), RATE,
                         by="run"), "protected {{run}}"),
        ],
        unit="percentunit", min_value=0, max_value=1,
        thresholds=((None, "green"), (SHARED_ANCHOR_RATIO_ALERT, "red")), threshold_line=True,
    ))

    # ---- cost of eviction --------------------------------------------------------------------------------------
    d = d.with_row(row(ids, "Cost of eviction: rebuilt, regretful, wasted prefill"))
    d = d.with_panel(timeseries_panel(
        ids, "Rebuilt-from-eviction blocks per second", DEF_REBUILT,
        [Target(total(kv("kvfabric_rebuilt_blocks_total"), RATE, by="run, engine"), "{{run}} {{engine}}")],
        unit="suffix: blocks/s", links=[("Families ranked by waste (REST)", FAMILIES_URL)],
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Wasted prefill tokens per second",
        f"{DEF_WASTED} Right axis: wasted prefill as a share of prompt tokens.",
        [
            Target(total(kv("kvfabric_wasted_prefill_tokens_total"), RATE, by="run"), "wasted tokens/s {{run}}"),
            Target(ratio(kv("kvfabric_wasted_prefill_tokens_total"), kv("kvfabric_prompt_tokens_total"), RATE,
                         by="run"), "share of prompt tokens {{run}}"),
        ],
        unit="suffix: tokens/s", right_axis_ref="B", right_axis_unit="percentunit",
        links=[("Families ranked by waste (REST)", FAMILIES_URL)],
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Time to rebuild",
        "From a block's eviction to its rebuild (kvfabric_time_to_rebuild_seconds, from block_rebuilt.age_ns): "
        "short times mean the cache was just too small for a working set that came right back.",
        [Target(quantile(q, kv("kvfabric_time_to_rebuild_seconds_bucket")), f"p{int(q * 100)}")
         for q in (0.5, 0.9, 0.99)],
        unit="s",
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Regretful evictions per second", f"{DEF_REGRETFUL} Right axis: regretful evictions per evicted block.",
        [
            Target(total(kv("kvfabric_regretful_evictions_total"), RATE, by="run"), "regretful/s {{run}}"),
            Target(ratio(kv("kvfabric_regretful_evictions_total"), kv("kvfabric_evicted_blocks_total"), RATE,
                         by="run"), "per eviction {{run}}"),
        ],
        unit="suffix: evictions/s", right_axis_ref="B", right_axis_unit="percentunit",
    ))

    # ---- why tokens were recomputed ----------------------------------------------------------------------------
    d = d.with_row(row(ids, "Why tokens were recomputed: eviction causes, misses, what-if"))
    d = d.with_panel(timeseries_panel(
        ids, "Evicted blocks by reason", DEF_EVICTION_REASON,
        [Target(total(kv("kvfabric_evicted_blocks_by_reason_total"), RATE, by="reason"), "{{reason}}")],
        unit="suffix: blocks/s", width=12, height=10, stacked=True,
        links=[("Misses of the selected run (REST)", MISSES_URL)],
    ))
    d = d.with_panel(markdown_panel(ids, "Misses and what-if", DEF_MISSES, MISSES_TEXT, width=12, height=10))

    # ---- latency and preemptions (vLLM) ------------------------------------------------------------------------
    d = d.with_row(row(ids, "Latency and preemptions (vLLM's own metrics)"))
    d = d.with_panel(timeseries_panel(
        ids, "Time to first token (vLLM)",
        "Quantiles of vllm:time_to_first_token_seconds. Prefix-cache hits shorten prefill, so TTFT is where "
        "eviction quality shows up for users.",
        [Target(quantile(q, vllm("vllm:time_to_first_token_seconds_bucket")), f"p{int(q * 100)}")
         for q in (0.5, 0.9, 0.99)],
        unit="s",
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Time per output token (vLLM)",
        "Quantiles of vllm:request_time_per_output_token_seconds (per request, the metric that replaced "
        "vllm:time_per_output_token_seconds) and of vllm:inter_token_latency_seconds.",
        [
            Target(quantile(0.5, vllm("vllm:request_time_per_output_token_seconds_bucket")), "TPOT p50"),
            Target(quantile(0.99, vllm("vllm:request_time_per_output_token_seconds_bucket")), "TPOT p99"),
            Target(quantile(0.99, vllm("vllm:inter_token_latency_seconds_bucket")), "inter-token p99"),
        ],
        unit="s",
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Preemptions (vLLM) beside rebuilt blocks (KVFabric)",
        "Both recompute prefill: vLLM preempts running requests when blocks run out (vllm:num_preemptions), "
        "KVFabric counts cached blocks evicted and prefilled again (right axis).",
        [
            Target(total(vllm("vllm:num_preemptions_total"), RATE), "preemptions/s (vLLM)"),
            Target(total(kv("kvfabric_rebuilt_blocks_total"), RATE), "rebuilt blocks/s (KVFabric)"),
        ],
        unit="suffix: preemptions/s", right_axis_ref="B", right_axis_unit="suffix: blocks/s",
    ))

    # ---- prefix families and events ----------------------------------------------------------------------------
    d = d.with_row(row(ids, "Prefix families and events"))
    d = d.with_panel(markdown_panel(ids, "Prefix families", DEF_FAMILY, FAMILIES_TEXT, width=8, height=10))
    d = d.with_panel(timeseries_panel(
        ids, "Events by type",
        "Lifecycle events ingested per second, by type (kvfabric_events_total): prefix_lookup = admissions, "
        "block_sealed = new cached blocks, block_evicted, block_rebuilt ...",
        [Target(total(kv("kvfabric_events_total"), RATE, by="event"), "{{event}}")],
        unit="suffix: events/s", width=10, height=10, stacked=True,
    ))
    d = d.with_panel(timeseries_panel(
        ids, "Admission gate",
        "Blocks the admission gate kept out of the cache (KVFABRIC_ADMISSION_ANCHOR_BLOCKS): requests outside a "
        "known family cache only their leading blocks. Empty when the gate is off (LRU without the variable).",
        [Target(total(kv("kvfabric_admission_limited_blocks_total"), RATE, by="run, engine"),
                "{{run}} {{engine}}")],
        unit="suffix: blocks/s", width=6, height=10,
    ))
    return d.build()

