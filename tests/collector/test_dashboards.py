"""The Grafana dashboards: generated JSON == committed JSON, SDK round trip, structure, metric names, provisioning.

No Grafana server runs in this project's test machines; what Grafana would load is checked here, and every query
is evaluated against a real Prometheus in tests/collector/test_prometheus.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS_DIR = REPO / "dashboards"
JSON_DIR = DASHBOARDS_DIR / "json"
PROVISIONING = DASHBOARDS_DIR / "provisioning"
METRICS_DOC = REPO / "docs" / "metrics.md"
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"

PROMETHEUS_REF = {"type": "prometheus", "uid": "${datasource}"}
QUERY_PANEL_TYPES = {"timeseries", "stat"}
GRAFANA_BUILTINS = {"__rate_interval", "__range", "__interval", "__all"}
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _build_module() -> Any:
    spec = importlib.util.spec_from_file_location("kvfabric_dashboards_build", DASHBOARDS_DIR / "build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dashboards() -> dict[str, dict[str, Any]]:
    files = sorted(JSON_DIR.glob("*.json"))
    assert files, f"no dashboards in {JSON_DIR}"
    return {f.name: json.loads(f.read_text(encoding="utf-8")) for f in files}


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            yield panel, target


def _selector_metrics(expr: str) -> set[str]:
    """Metric names used as selectors (every selector in these dashboards carries a ``{...}`` matcher)."""
    return set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr)) - {"by", "without", "on", "ignoring"}


def documented_metrics() -> set[str]:
    """Metric family names of docs/metrics.md (the collector's contract), with histogram series names."""
    names = set(re.findall(r"^\| `(kvfabric_[a-z0-9_]+)`", METRICS_DOC.read_text(), re.M))
    assert len(names) >= 20, names
    return names | {n + s for n in names for s in HISTOGRAM_SUFFIXES}


def vllm_metrics() -> set[str]:
    """Series names vLLM 0.33 exposes, read from its source without importing vLLM (counters gain ``_total``)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed (the [vllm] extra)")
    source = (Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py").read_text()
    names: set[str] = set()
    for kind, name in re.findall(r"(_counter_cls|_gauge_cls|_histogram_cls)\(\s*name=\"(vllm:[a-z0-9_]+)\"",
                                 source):
        if kind == "_counter_cls":
            names.add(name + "_total")
        elif kind == "_histogram_cls":
            names |= {name + s for s in HISTOGRAM_SUFFIXES}
        else:
            names.add(name)
    assert "vllm:prefix_cache_queries_total" in names, "the vLLM metrics source changed shape"
    return names


# ------------------------------------------------------------------------------------------- generation


def test_committed_json_is_exactly_the_generator_output() -> None:
    """`python dashboards/build.py --check` (the one regeneration command) agrees, byte for byte."""
    done = subprocess.run([sys.executable, str(DASHBOARDS_DIR / "build.py"), "--check"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, f"regenerate with `python dashboards/build.py`:\n{done.stdout}{done.stderr}"
    build = _build_module()
    rendered = build.render_all()
    assert set(rendered) == {p.name for p in JSON_DIR.glob("*.json")}
    for name, text in rendered.items():
        assert (JSON_DIR / name).read_text(encoding="utf-8") == text, name
        assert build.render(name) == text, f"{name}: generation is not deterministic"


def test_check_detects_a_stale_file(tmp_path: Path) -> None:
    build = _build_module()
    build.write(tmp_path)
    assert build.check(tmp_path) == []
    first = sorted(tmp_path.glob("*.json"))[0]
    first.write_text(first.read_text().replace('"title"', '"titel"', 1))
    (tmp_path / "orphan.json").write_text("{}")
    problems = build.check(tmp_path)
    assert any("differs" in p for p in problems) and any("orphan.json" in p for p in problems)


@pytest.mark.parametrize("name", sorted(p.name for p in JSON_DIR.glob("*.json")))
def test_round_trip_through_the_sdk(name: str) -> None:
    """Loading the JSON with grafana-foundation-sdk and serialising it again loses nothing."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()  # typed panel options and Prometheus queries, as the SDK decodes them
    text = (JSON_DIR / name).read_text(encoding="utf-8")
    model = Dashboard.from_json(json.loads(text))
    again = json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    assert again == text
    assert model.schema_version is not None and model.schema_version >= 39  # Grafana 11 schema


# ------------------------------------------------------------------------------------------- structure


@pytest.mark.parametrize("name", sorted(p.name for p in JSON_DIR.glob("*.json")))
def test_panels_datasources_and_targets(name: str) -> None:
    d = _dashboards()[name]
    assert d["uid"] and d["title"].startswith("KVFabric / ") and "kvfabric" in d["tags"]
    ids = [p["id"] for p in _panels(d)]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    titles = [p["title"] for p in _panels(d) if p["type"] != "row"]
    assert len(titles) == len(set(titles)), "panel titles identify panels (tests, allow-lists): keep them unique"
    cells: set[tuple[int, int]] = set()
    for panel in _panels(d):
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] >= 1, (panel["title"], g)
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        assert panel["title"], panel
        if panel["type"] == "row":
            continue
        assert panel.get("description"), f"{panel['title']}: operators need a description"
        if panel["type"] == "text":
            assert "targets" not in panel and "datasource" not in panel
            continue
        assert panel["type"] in QUERY_PANEL_TYPES, panel["type"]
        assert panel["datasource"] == PROMETHEUS_REF, panel["title"]
        targets = panel.get("targets", [])
        assert targets, f"{panel['title']} has no query"
        ref_ids = [t["refId"] for t in targets]
        assert len(set(ref_ids)) == len(ref_ids) and all(ref_ids), ref_ids
        for t in targets:
            assert t["datasource"] == PROMETHEUS_REF
            assert t["expr"].strip() and t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert "[5m]" not in t["expr"], "use $__rate_interval or $__range, not fixed windows"
            if panel["type"] == "stat":
                assert t.get("instant") is True, f"{panel['title']}: a stat shows one value: instant query"
    datasource_vars = [v for v in d["templating"]["list"] if v["name"] == "datasource"]
    assert datasource_vars and datasource_vars[0]["type"] == "datasource" and datasource_vars[0]["query"] == \
        "prometheus"


@pytest.mark.parametrize("name", sorted(p.name for p in JSON_DIR.glob("*.json")))
def test_every_variable_used_is_defined(name: str) -> None:
    d = _dashboards()[name]
    defined = {v["name"] for v in d["templating"]["list"]} | GRAFANA_BUILTINS
    text = json.dumps(d["panels"]) + json.dumps(d.get("links", [])) + json.dumps(d["templating"])
    used = set(re.findall(r"\$\{?(\w+)", text))
    assert used <= defined, f"undefined variables: {used - defined}"
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"] == PROMETHEUS_REF
            assert var["multi"] and var["includeAll"] and var["allValue"] == ".*"
            assert re.fullmatch(r"label_values\(.+,\s*\w+\)", var["query"]), var["query"]


def test_every_metric_exists_in_the_collector_or_vllm() -> None:
    """Dashboards may only use the collector's documented metrics (docs/metrics.md, which the collector's registry
    exposes), vLLM 0.33's own metrics and Prometheus' per-target series."""
    from kvfabric.ingest.metrics import CollectorMetrics

    documented = documented_metrics()
    served = {m.name for m in CollectorMetrics(max_label_runs=4).registry.collect()}
    # A registry names counters without _total and histograms without suffixes.
    assert {n for n in documented if not n.endswith(HISTOGRAM_SUFFIXES)} <= \
        {n for s in served for n in (s, s + "_total")}, "docs/metrics.md names a metric the collector lacks"
    known = documented | vllm_metrics() | PROMETHEUS_SYNTHETIC
    used: set[str] = set()
    for d in _dashboards().values():
        for _, target in _targets(d):
            used |= _selector_metrics(target["expr"])
        for var in d["templating"]["list"]:
            m = re.match(r"label_values\(([a-zA-Z_:][a-zA-Z0-9_:]*)", var.get("query", "") or "")
            if m:
                used.add(m.group(1))
    assert used, "no metric found"
    assert used <= known, f"unknown metric names: {sorted(used - known)}"


def test_overview_has_a_panel_for_every_design_definition() -> None:
    """docs/design.md §5: prefix family, shared anchor / shared-anchor eviction ratio, protected eviction ratio,
    rebuilt-from-eviction, regretful eviction, prefix hit rate, wasted prefill tokens; plus vLLM's own metrics."""
    d = _dashboards()["kvfabric-overview.json"]
    panels = {p["title"]: p for p in _panels(d) if p["type"] != "row"}
    exprs = {title: " ".join(t["expr"] for t in p.get("targets", [])) for title, p in panels.items()}
    required = {
        "Prefix hit rate": ("kvfabric_prefix_hit_tokens_total", "kvfabric_prompt_tokens_total"),
        "Shared-anchor eviction ratio": ('kind="shared_anchor"', "kvfabric_evicted_blocks_total"),
        "Protected eviction ratio": ("kvfabric_protected_evictions_total", "kvfabric_evicted_blocks_total"),
        "Rebuilt-from-eviction blocks": ("kvfabric_rebuilt_blocks_total",),
        "Regretful evictions": ("kvfabric_regretful_evictions_total",),
        "Wasted prefill tokens": ("kvfabric_wasted_prefill_tokens_total",),
        "Evicted blocks by kind": ("by (kind)",),
        "Events by type": ("by (event)", "kvfabric_events_total"),
        "KV cache usage (vLLM)": ("vllm:kv_cache_usage_perc",),
        "Time to first token (vLLM)": ("vllm:time_to_first_token_seconds_bucket",),
        "Time per output token (vLLM)": ("vllm:request_time_per_output_token_seconds_bucket",),
        "Preemptions (vLLM) beside rebuilt blocks (KVFabric)": ("vllm:num_preemptions_total",
                                                                  "kvfabric_rebuilt_blocks_total"),
        "Prefix hit rate: KVFabric (per admission) vs vLLM": ("vllm:prefix_cache_hits_total",
                                                               "vllm:prefix_cache_queries_total"),
    }
    for title, needles in required.items():
        assert title in panels, f"missing panel {title!r}"
        for needle in needles:
            assert needle in exprs[title], f"{title}: {needle!r} not in {exprs[title]!r}"
    # Prefix families: not a Prometheus label; the panel explains it and links to the REST families endpoint.
    families = panels["Prefix families"]
    assert families["type"] == "text"
    assert "${collector_url}/api/v1/families?run=${run}" in families["options"]["content"]
    # Every KVFabric analytics query is scoped by $run and $engine; vLLM queries by $model.
    for _, target in _targets(d):
        for metric in _selector_metrics(target["expr"]):
            if metric.startswith("kvfabric_"):
                assert f'{metric}{{run=~"$run", engine=~"$engine"' in target["expr"], target["expr"]
            elif metric.startswith("vllm:"):
                assert f'{metric}{{model_name=~"$model"}}' in target["expr"], target["expr"]


@pytest.mark.parametrize("name", sorted(p.name for p in JSON_DIR.glob("*.json")))
def test_host_and_engine_variables_exist_and_scope_the_queries(name: str) -> None:
    """Every dashboard picks hosts (collector scrape targets: one collector per host) and engines, and every query of
    the collector's metrics is scoped by the host; per-engine series also by the engine."""
    d = _dashboards()[name]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    host, engine = variables["host"], variables["engine"]
    assert host["type"] == "query" and host["query"] == 'label_values(up{job="kvfabric-collector"}, instance)'
    assert engine["type"] == "query" and engine["query"].startswith('label_values(kvfabric_events_total{instance=~'
                                                                    '"$host"')
    assert engine["query"].endswith(", engine)")
    names = list(variables)
    assert names.index("host") < names.index("engine"), "engine's values depend on the host: host first"
    per_engine = {"kvfabric_events_total", "kvfabric_sink_dropped_events_total", "kvfabric_prompt_tokens_total"}
    scoped = engine_scoped = 0
    for panel, target in _targets(d):
        for metric in _selector_metrics(target["expr"]):
            if not metric.startswith("kvfabric_") and metric not in PROMETHEUS_SYNTHETIC:
                continue
            for selector in re.findall(re.escape(metric) + r"\{([^}]*)\}", target["expr"]):
                assert 'instance=~"$host"' in selector, (panel["title"], target["expr"])
                scoped += 1
                if metric in per_engine:
                    assert 'engine=~"$engine"' in selector, (panel["title"], target["expr"])
                    engine_scoped += 1
    assert scoped >= 10 and engine_scoped >= 1


def test_collector_dashboard_covers_collector_health() -> None:
    d = _dashboards()["kvfabric-collector.json"]
    exprs = " ".join(t["expr"] for _, t in _targets(d))
    for metric in ("kvfabric_ingest_rows_total", "kvfabric_insert_duration_seconds_bucket",
                   "kvfabric_ingest_lag_seconds_bucket", "kvfabric_sink_dropped_events_total",
                   "kvfabric_sequence_gaps_total", "kvfabric_open_streams", "kvfabric_db_size_bytes",
                   "kvfabric_writer_queue_rows", "kvfabric_bad_streams_total", 'up{job="kvfabric-collector"'):
        assert metric in exprs, metric


# ------------------------------------------------------------------------------------------- provisioning


def test_datasource_provisioning() -> None:
    config = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    assert config["apiVersion"] == 1
    [ds] = config["datasources"]
    assert ds["type"] == "prometheus" and ds["uid"] == "prometheus" and ds["isDefault"] is True
    assert ds["url"] == "http://prometheus:9090" and ds["access"] == "proxy"
    scrape_interval = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["global"]["scrape_interval"]
    assert ds["jsonData"]["timeInterval"] == scrape_interval, "$__rate_interval needs the real scrape interval"


def test_dashboard_provisioning() -> None:
    config = yaml.safe_load((PROVISIONING / "dashboards" / "kvfabric.yml").read_text())
    assert config["apiVersion"] == 1
    [provider] = config["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards/kvfabric"
    assert provider["allowUiUpdates"] is False  # the JSON is generated: UI edits would be lost anyway
    compose = yaml.safe_load((REPO / "deploy" / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"../dashboards/json:{provider['options']['path']}:ro" in mounts
