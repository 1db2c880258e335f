"""The metrics, dashboards and alert rules against a REAL Prometheus scraping a REAL collector.

One module-scoped stack, all on loopback, every process killed at the end:

* ``python -m kvfabric.collector`` on a temporary socket, database and free port;
* vLLM's real ``Scheduler`` (through the CPU harness) with the KVFabric hook streaming to that collector: a paced
  demo workload under memory pressure (run ``prom-main``), then a tiny run with a 64-event sink buffer so that the
  hook really drops events (run ``prom-drops``);
* vLLM's own Prometheus metrics: vLLM's real ``PrometheusStatLogger`` fed with the scheduler's real
  ``SchedulerStats`` and per-request outputs, exactly as vLLM's frontend (``OutputProcessor``) feeds it, and served
  on a free port, so the dashboards' ``vllm:*`` queries run against the real metric names, types and labels;
* ``prometheus`` (the Debian package) with a copy of deploy/prometheus/prometheus.yml (targets rewritten, 1 s
  scrape and evaluation) and deploy/'s alert rules loaded.

Then every PromQL expression of every dashboard panel and every alert rule is evaluated through the HTTP API, and
the numbers are compared with what the collector reports over REST.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.prometheus, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
DEPLOY_PROMETHEUS = REPO / "deploy" / "prometheus"
PROMETHEUS_CONFIG = DEPLOY_PROMETHEUS / "prometheus.yml"
RULES_DIR = DEPLOY_PROMETHEUS / "rules"
RULE_TESTS = DEPLOY_PROMETHEUS / "tests"
DASHBOARD_JSON = REPO / "dashboards" / "json"

COLLECTOR_JOB = "kvfabric-collector"
VLLM_JOB = "vllm"
MAIN_RUN = "prom-main"
DROPS_RUN = "prom-drops"
MAIN_ENGINE = "prom-host/dp0"
DROPS_ENGINE = "prom-host/dp1"
NUM_BLOCKS = 320  # small pool: the workload below evicts ~2k blocks and rebuilds hundreds
PACING_POINTS = (0.2, 0.45, 0.7)  # pause the workload at these fractions of its arrivals until Prometheus scraped

# Expressions allowed to return no data in this test, with the reason. Keyed by (dashboard uid, panel title,
# refId). Everything else must return at least one sample, and at least one finite value.
ALLOWED_EMPTY: dict[tuple[str, str, str], str] = {
    ("kvfabric-overview", "Admission gate", "A"): (
        "kvfabric_admission_limited_blocks_total only has series for runs with the admission gate on (a non-LRU "
        "policy or KVFABRIC_ADMISSION_ANCHOR_BLOCKS); both runs here are LRU, observe-only. The counter itself "
        "is compared with REST (admission_limited_blocks == 0) in test_counters_match_rest."
    ),
}

# For each alert: the part of its expression that must return data on a healthy system (the alert expression
# itself is empty unless the alert fires). The signal must appear verbatim in the rule's expr.
ALERT_SIGNALS: dict[str, str] = {
    "KVFabricCollectorDown": 'up{job="kvfabric-collector"}',
    "KVFabricCollectorMissing": 'up{job="kvfabric-collector"}',
    "KVFabricSinkDropping": "sum by (instance, run, engine) (increase(kvfabric_sink_dropped_events_total[5m]))",
    "KVFabricSequenceGaps": "sum by (instance) (increase(kvfabric_sequence_gaps_total[10m]))",
    "KVFabricIngestLagHigh": (
        "histogram_quantile(0.99, sum by (instance, le) (rate(kvfabric_ingest_lag_seconds_bucket[5m])))"
    ),
    "KVFabricWriterBacklog": "min_over_time(kvfabric_writer_queue_rows[10m])",
    "KVFabricBadStreams": "sum by (instance, reason) (increase(kvfabric_bad_streams_total[15m]))",
    "KVFabricSharedAnchorEvictionsHigh": (
        'sum by (run, engine) (rate(kvfabric_evicted_blocks_total{kind="shared_anchor"}[5m])) '
        "/ sum by (run, engine) (rate(kvfabric_evicted_blocks_total[5m]))"
    ),
    "KVFabricRebuiltRateHigh": (
        "sum by (run, engine) (rate(kvfabric_rebuilt_blocks_total[5m])) "
        '/ sum by (run, engine) (rate(kvfabric_events_total{event="block_sealed"}[5m]))'
    ),
    "VLLMMetricsDown": 'up{job="vllm"}',
}

# Alerts that must not be active (pending or firing) on this healthy stack.
MUST_BE_QUIET = ("KVFabricCollectorDown", "KVFabricCollectorMissing", "KVFabricSequenceGaps", "VLLMMetricsDown",
                 "KVFabricBadStreams", "KVFabricWriterBacklog")


# ---------------------------------------------------------------------------------------------------- helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return int(resp.status)


def _poll(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    """Call ``check`` until it returns something truthy (returned) or ``timeout`` passes (AssertionError)."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (OSError, urllib.error.URLError, ValueError, KeyError) as e:  # not up yet
            last_error = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last_error!r})")


class ChildProcess:
    """A child process with its output in a log file; :meth:`stop` sends SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"--- {self.name} log ({self.log_path}) ---\n" + "\n".join(text)


class Prometheus:
    """Thin client of Prometheus' HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        body = _get(f"{self.url}/api/v1/{path}?{query}", timeout=10)
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query at now; raises AssertionError on a PromQL error (with the expression)."""
        try:
            data = self.api("query", query=expr)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"PromQL error {e.code} for {expr!r}: {e.read().decode(errors='replace')}") from e
        assert data["resultType"] in ("vector", "scalar"), data
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict[str, Any]]:
        try:
            data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=step)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"PromQL error {e.code} for {expr!r}: {e.read().decode(errors='replace')}") from e
        return list(data["result"])

    def value(self, expr: str) -> float | None:
        """The single value of ``expr`` (None when it returns nothing)."""
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, f"{expr!r} returned {len(result)} series: {result}"
        return float(result[0]["value"][1])


def _values(result: list[dict[str, Any]]) -> list[float]:
    out = []
    for series in result:
        if "value" in series:
            out.append(float(series["value"][1]))
        for _, v in series.get("values", []):
            out.append(float(v))
    return out


# ------------------------------------------------------------------------------ vLLM's own metrics, for real


class VllmMetricsBridge:
    """Feeds vLLM's real ``PrometheusStatLogger`` from a scheduler, as vLLM's ``OutputProcessor`` does.

    The harness runs vLLM's Scheduler without the engine frontend that normally turns ``EngineCoreOutputs`` into
    ``IterationStats``; this does that part with vLLM's own classes (``IterationStats``, ``RequestStateStats``,
    ``LoRARequestStates``), so every ``vllm:*`` series comes from vLLM's code with vLLM's names and labels.
    """

    def __init__(self, scheduler: Any) -> None:
        from vllm.v1.metrics.loggers import PrometheusStatLogger
        from vllm.v1.metrics.stats import LoRARequestStates

        self.scheduler = scheduler
        self.logger = PrometheusStatLogger(scheduler.vllm_config, engine_indexes=[0])
        self.logger.log_engine_initialized()
        self._lora = LoRARequestStates(log_stats=True)
        self._added: dict[str, tuple[float, int, int | None]] = {}  # arrival (wall clock), prompt, max_tokens
        self._states: dict[str, Any] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        original_add, original_update = scheduler.add_request, scheduler.update_from_output

        def add_request(request: Any, *args: Any, **kwargs: Any) -> Any:
            self._added[request.request_id] = (time.time(), request.num_prompt_tokens, request.max_tokens)
            return original_add(request, *args, **kwargs)

        def update_from_output(*args: Any, **kwargs: Any) -> Any:
            outputs = original_update(*args, **kwargs)
            self._record(outputs)
            return outputs

        scheduler.add_request = add_request  # per instance: the class and other schedulers are untouched
        scheduler.update_from_output = update_from_output

    def _record(self, outputs: dict[int, Any]) -> None:
        from vllm.v1.metrics.stats import IterationStats, RequestStateStats

        for engine_index, eco in outputs.items():
            iteration = IterationStats()
            for out in eco.outputs:
                rid = out.request_id
                arrival, prompt_tokens, max_tokens = self._added[rid]
                state = self._states.get(rid)
                if state is None:
                    state = self._states[rid] = RequestStateStats(arrival_time=arrival)
                prefilling = state.num_generation_tokens == 0  # OutputProcessor: until the first token
                iteration.update_from_output(out, eco.timestamp, prefilling, state, self._lora, None)
                if out.finish_reason is not None:
                    iteration.update_from_finished_request(out.finish_reason, rid, prompt_tokens, max_tokens, state)
                    del self._states[rid]
            stats = eco.scheduler_stats
            if stats is not None:
                self.prefix_queries += stats.prefix_cache_stats.queries
                self.prefix_hits += stats.prefix_cache_stats.hits
            self.logger.record(scheduler_stats=stats, iteration_stats=iteration, engine_idx=engine_index)


# ------------------------------------------------------------------------------------------------- the stack


@dataclass
class RunRecord:
    """What the hook says it did for one run."""

    run_id: str
    engine: str
    rows_sent: int
    events_lost: int
    engine_summary: dict[str, Any]


@dataclass
class Stack:
    prom: Prometheus
    collector_url: str
    started: float  # wall clock when Prometheus started
    runs: dict[str, RunRecord]
    vllm_queries: int
    vllm_hits: int
    logs: list[ChildProcess] = field(default_factory=list)

    def window(self) -> str:
        """A range covering everything this test scraped (what ``$__rate_interval``/``$__range`` stand for)."""
        return f"{math.ceil(time.time() - self.started) + 5}s"

    def rest(self, path: str) -> Any:
        return _get(f"{self.collector_url}{path}")

    def summary(self, run: str) -> dict[str, Any]:
        return dict(self.rest(f"/api/v1/runs/{run}/summary"))


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.fail(f"{binary} is not installed: `apt-get install -y --no-install-recommends prometheus` "
                    "(scripts/test.sh does it), or deselect with -m 'not prometheus'")
    return path


def _prometheus_config(tmp: Path, collector_port: int, vllm_port: int) -> Path:
    """deploy/prometheus/prometheus.yml with loopback targets, 1 s intervals and deploy/'s rules (absolute)."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["scrape_timeout"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    config["rule_files"] = [str(RULES_DIR / "*.yml")]
    targets = {COLLECTOR_JOB: f"127.0.0.1:{collector_port}", VLLM_JOB: f"127.0.0.1:{vllm_port}"}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(targets) <= set(jobs), f"deploy/prometheus/prometheus.yml must define jobs {sorted(targets)}"
    for name, target in targets.items():
        jobs[name]["static_configs"] = [{"targets": [target]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _scraped_totals(prom: Prometheus) -> tuple[float, float]:
    """(rows the collector committed, vLLM prefix-cache query tokens), as Prometheus last scraped them."""
    rows = prom.value(f'sum(kvfabric_ingest_rows_total{{job="{COLLECTOR_JOB}"}})') or 0.0
    queries = prom.value(f'sum(vllm:prefix_cache_queries_total{{job="{VLLM_JOB}"}})') or 0.0
    return rows, queries


def _scraped_progress(prom: Prometheus) -> tuple[float, float]:
    """(rows the collector committed, vLLM scheduler steps with stats), as Prometheus last scraped them."""
    rows = prom.value(f'sum(kvfabric_ingest_rows_total{{job="{COLLECTOR_JOB}"}})') or 0.0
    steps = prom.value(f'sum(vllm:iteration_tokens_total_count{{job="{VLLM_JOB}"}})') or 0.0
    return rows, steps


def _run_workload(engine: Any, items: list[Any], prom: Prometheus | None) -> None:
    """Run ``items`` through ``engine``; with ``prom``, pause at PACING_POINTS until Prometheus scraped growth of
    both the collector's rows and vLLM's counters, so rates over the run see several distinct samples."""
    engine.add_workload(items)
    if prom is None:
        engine.run_until_done()
        return
    horizon = max(item[0] for item in items)
    pauses = [horizon * f for f in PACING_POINTS]
    state = {"seen": _scraped_progress(prom)}

    def progress(_: Any) -> None:
        if pauses and engine.clock_s >= pauses[0]:
            pauses.pop(0)
            before = state["seen"]
            state["seen"] = _poll(
                "Prometheus to scrape the workload's progress",
                lambda: (lambda now: now if now[0] > before[0] and now[1] > before[1] else None)(
                    _scraped_progress(prom)),
                timeout=20, interval=0.1,
            )

    engine.run_until_done(progress)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Collector + Prometheus + vLLM's scheduler with the hook (two runs) + vLLM's metrics; all torn down after."""
    prometheus_bin = _require("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus-stack")
    collector_port, prometheus_port, vllm_port = _free_port(), _free_port(), _free_port()
    sock = str(tmp / "kvfabric.sock")
    collector_url = f"http://127.0.0.1:{collector_port}"
    prom = Prometheus(f"http://127.0.0.1:{prometheus_port}")
    children: list[ChildProcess] = []
    with contextlib.ExitStack() as cleanup, pytest.MonkeyPatch.context() as mp:
        try:
            collector = ChildProcess(
                "collector",
                [sys.executable, "-m", "kvfabric.collector", "--db", str(tmp / "kv.duckdb"), "--socket", sock,
                 "--host", "127.0.0.1", "--port", str(collector_port)],
                tmp / "collector.log",
                env={k: v for k, v in os.environ.items() if k != "KVFABRIC_API_TOKEN"},
            )
            children.append(collector)
            cleanup.callback(collector.stop)
            config = _prometheus_config(tmp, collector_port, vllm_port)
            started = time.time()
            server = ChildProcess(
                "prometheus",
                [prometheus_bin, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prometheus_port}", "--log.level=warn"],
                tmp / "prometheus.log",
            )
            children.append(server)
            cleanup.callback(server.stop)
            _poll("the collector's /healthz", lambda: collector.alive() and os.path.exists(sock)
                  and _get(f"{collector_url}/healthz"), timeout=60)
            _poll("Prometheus /-/ready", lambda: server.alive() and _status(f"{prom.url}/-/ready") == 200,
                  timeout=30)

            pytest.importorskip("vllm", reason="needs the [vllm] extra")
            # vLLM's real scheduler with the hook streaming to the collector (settings are read per scheduler).
            for var in [k for k in os.environ if k.startswith("KVFABRIC_")]:
                mp.delenv(var)
            mp.setenv("HF_HUB_OFFLINE", "1")
            mp.setenv("VLLM_NO_USAGE_STATS", "1")
            mp.setenv("KVFABRIC_LIFECYCLE", "1")
            mp.setenv("KVFABRIC_SINK", f"unix://{sock}")
            mp.setenv("KVFABRIC_RUN_ID", MAIN_RUN)
            mp.setenv("KVFABRIC_ENGINE_ID", MAIN_ENGINE)
            from prometheus_client import start_http_server
            from vllm.v1.core.sched.scheduler import Scheduler

            from kvfabric.engine.plugin import wrap_scheduler_class
            from kvfabric.sim.harness import SimulatedEngine
            from kvfabric.sim.workload import demo_workload

            wrap_scheduler_class(Scheduler)  # what register() does when KVFabric is on (idempotent)
            engine = SimulatedEngine.create(NUM_BLOCKS)
            installation = getattr(engine.scheduler, "_kvfabric", None)
            assert installation is not None, "the KVFabric hook did not install itself on the scheduler"
            # The forwarder child starts with the engine; in a real server vLLM's own start-up (weights, memory
            # profiling, CUDA graphs) takes far longer than its ~1 s of imports. Here traffic starts at once, so
            # wait for it: the lag asserted below is the steady-state lag, not a child process's start-up.
            assert installation.outlet.wait_ready()
            bridge = VllmMetricsBridge(engine.scheduler)
            http_server, _ = start_http_server(vllm_port, addr="127.0.0.1")
            cleanup.callback(http_server.server_close)
            cleanup.callback(http_server.shutdown)
            _poll("Prometheus to scrape both targets",
                  lambda: prom.value(f'min(up{{job=~"{COLLECTOR_JOB}|{VLLM_JOB}"}})') == 1.0
                  and prom.value(f'count(up{{job=~"{COLLECTOR_JOB}|{VLLM_JOB}"}})') == 2.0, timeout=30)
            items = demo_workload(
                7, duration_s=12.0, template_requests=80, num_conversations=5, unique_requests=24,
                family_prefix_blocks=(8, 20), unique_prompt_tokens=(300, 800),
            )
            _run_workload(engine, items, prom)
            installation.close()
            out = installation.outlet
            runs = {MAIN_RUN: RunRecord(MAIN_RUN, MAIN_ENGINE, out.delivered_events, out.lost_events,
                                        engine.summary())}

            # A second engine whose buffers hold 64 events (a 3 KiB ring): it must drop, count and report loss.
            mp.setenv("KVFABRIC_RUN_ID", DROPS_RUN)
            mp.setenv("KVFABRIC_ENGINE_ID", DROPS_ENGINE)
            mp.setenv("KVFABRIC_BUFFER_EVENTS", "64")
            engine2 = SimulatedEngine.create(NUM_BLOCKS)
            installation2 = getattr(engine2.scheduler, "_kvfabric", None)
            assert installation2 is not None and installation2.outlet.buffer_events == 64
            _run_workload(engine2, demo_workload(8, duration_s=4.0, template_requests=16, num_conversations=2,
                                                 unique_requests=4, family_prefix_blocks=(4, 8),
                                                 unique_prompt_tokens=(200, 400)), None)
            installation2.close()
            out2 = installation2.outlet
            runs[DROPS_RUN] = RunRecord(DROPS_RUN, DROPS_ENGINE, out2.delivered_events, out2.lost_events,
                                        engine2.summary())

            def ingested() -> bool:
                listed = {r["run_id"]: int(r["events"]) for r in _get(f"{collector_url}/api/v1/runs")}
                return all(listed.get(r.run_id, -1) >= r.rows_sent for r in runs.values())

            _poll("the collector to store every row sent", ingested, timeout=30)
            total_rows = sum(r.rows_sent for r in runs.values())
            _poll("Prometheus to scrape the final counters",
                  lambda: _scraped_totals(prom) == (float(total_rows), float(bridge.prefix_queries)), timeout=30)
            # One more scrape of everything: a series born in the last scrape has one sample, and rate() needs two.
            _poll("a second sample of every run's series",
                  lambda: min(len(m["values"]) for m in prom.api(
                      "query", query=f'{{job="{COLLECTOR_JOB}", run=~".+"}}[5m]')["result"]) >= 2,
                  timeout=15)
            stack = Stack(prom, collector_url, started, runs, bridge.prefix_queries, bridge.prefix_hits, children)
        except Exception as e:  # pytest's skip/fail outcomes pass through untouched
            logs = "\n".join(c.tail() for c in children)
            raise AssertionError(f"setting up the Prometheus stack failed: {e!r}\n{logs}") from e
        yield stack


# ----------------------------------------------------------------------------------------- dashboard queries


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str
    instant: bool


def _dashboards() -> list[dict[str, Any]]:
    files = sorted(DASHBOARD_JSON.glob("*.json"))
    assert files, f"no dashboards in {DASHBOARD_JSON}"
    return [json.loads(f.read_text()) for f in files]


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep their panels inside


def dashboard_queries() -> list[PanelQuery]:
    out = []
    for d in _dashboards():
        for panel in _panels(d):
            for target in panel.get("targets", []):
                out.append(PanelQuery(d["uid"], panel["title"], target["refId"], target["expr"],
                                      bool(target.get("instant"))))
    return out


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace ``$name`` and ``${name}`` (longest names first) as Grafana would; fail on leftovers."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


def grafana_regex_escape(value: str) -> str:
    """A variable value as Grafana interpolates it into a PromQL regex matcher: regex metacharacters get a
    backslash, itself escaped for the PromQL string literal."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)


def _grafana_variables(stack: Stack, run: str = ".*", engine: str = ".*") -> dict[str, str]:
    """What Grafana would send: "All" is the regex ``.*`` (allValue); windows cover the whole test."""
    window = stack.window()
    return {
        "run": run, "engine": engine, "model": ".*", "host": ".*",
        "__rate_interval": window, "__range": window, "__interval": "1s",
        "collector_url": stack.collector_url,
    }


GRAFANA_RATE_INTERVAL = "4s"
"""What Grafana computes for ``$__rate_interval`` on a short range with a 1 s scrape: 4 x scrape interval."""


def _check_returns_data(stack: Stack, q: PanelQuery, variables: dict[str, str]) -> str | None:
    """None if ``q`` returns a finite value, else the problem. Instant evaluation at the end of the test with
    windows covering the whole test; range targets are also rendered as Grafana would draw them (a range query
    over the test, step 1 s, ``$__rate_interval`` = 4 s) and need at least one finite point."""
    expr = substitute(q.expr, variables)
    result = stack.prom.query(expr)
    if not result:
        return f"{q.dashboard} / {q.panel} / {q.ref_id}: no data for {expr}"
    if not any(math.isfinite(v) for v in _values(result)):
        return f"{q.dashboard} / {q.panel} / {q.ref_id}: only NaN/Inf for {expr}: {result}"
    if not q.instant:
        drawn = substitute(q.expr, variables | {"__rate_interval": GRAFANA_RATE_INTERVAL})
        ranged = stack.prom.query_range(drawn, stack.started, time.time())
        if not any(math.isfinite(v) for v in _values(ranged)):
            return f"{q.dashboard} / {q.panel} / {q.ref_id}: no finite point over the test range for {drawn}"
    return None


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 40, f"only {len(queries)} queries found in the dashboards"
    problems = []
    for q in queries:
        key = (q.dashboard, q.panel, q.ref_id)
        problem = _check_returns_data(stack, q, _grafana_variables(stack))
        if key in ALLOWED_EMPTY:
            # An allowed-empty query must still be valid PromQL (query() raised otherwise); it may be empty.
            continue
        if problem:
            problems.append(problem)
    assert not problems, "dashboard queries without data:\n" + "\n".join(problems)
    stale = set(ALLOWED_EMPTY) - {(q.dashboard, q.panel, q.ref_id) for q in queries}
    assert not stale, f"ALLOWED_EMPTY names queries that no longer exist: {stale}"


def test_dashboard_queries_filtered_to_one_run(stack: Stack) -> None:
    """With $run and $engine set to one run (regex-escaped, as Grafana does), the overview's KVFabric queries keep
    their data and return only that run's series."""
    variables = _grafana_variables(stack, run=grafana_regex_escape(MAIN_RUN), engine=grafana_regex_escape(MAIN_ENGINE))
    problems, checked = [], 0
    for q in dashboard_queries():
        if "$run" not in q.expr or (q.dashboard, q.panel, q.ref_id) in ALLOWED_EMPTY:
            continue
        if "kvfabric_sink_dropped_events_total" in q.expr and "vector(0)" not in q.expr:
            continue  # this run dropped nothing, so it has no sink-drop series (the drops run is checked below)
        checked += 1
        problem = _check_returns_data(stack, q, variables)
        if problem:
            problems.append(problem)
            continue
        for series in stack.prom.query(substitute(q.expr, variables)):
            assert series["metric"].get("run", MAIN_RUN) == MAIN_RUN, (q, series)
            assert series["metric"].get("engine", MAIN_ENGINE) == MAIN_ENGINE, (q, series)
    assert checked >= 20
    assert not problems, f"queries without data for run {MAIN_RUN}:\n" + "\n".join(problems)


def test_sink_drop_panels_show_the_hooks_loss(stack: Stack) -> None:
    """The loss stats of both dashboards equal what the hook says it dropped (and 0 for the run that did not)."""
    lost = stack.runs[DROPS_RUN].events_lost
    stats = [q for q in dashboard_queries() if q.panel in ("Events lost by the hook's sink", "Events lost by sinks")]
    assert len(stats) == 2
    for q in stats:
        for run, engine, expected in ((DROPS_RUN, DROPS_ENGINE, lost), (MAIN_RUN, MAIN_ENGINE, 0)):
            expr = substitute(q.expr, _grafana_variables(stack, run=grafana_regex_escape(run),
                                                        engine=grafana_regex_escape(engine)))
            if "$run" not in q.expr and "$engine" not in q.expr:  # every run and engine of the collector
                expected = lost
            assert stack.prom.value(expr) == expected, (q.dashboard, run, expr)


def test_template_variables_list_the_runs_engines_and_models(stack: Stack) -> None:
    """The label_values() queries behind $run, $engine, $model and $host, as Grafana runs them."""
    found: dict[str, list[str]] = {}
    for d in _dashboards():
        for var in d["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"])
            assert m, f"{d['uid']}: variable {var['name']} is not a label_values() query: {var['query']}"
            selector, label = m.group(1), m.group(2)
            selector = substitute(selector, _grafana_variables(stack))
            values = stack.prom.api(f"label/{label}/values", **{"match[]": selector})
            found[var["name"]] = list(values)
    assert {MAIN_RUN, DROPS_RUN} <= set(found["run"])
    assert {MAIN_ENGINE, DROPS_ENGINE} <= set(found["engine"])
    assert len(found["model"]) == 1 and found["model"][0]  # vLLM's served model name
    assert found["host"]  # the collector target


def test_text_panel_links_resolve_on_the_collector(stack: Stack) -> None:
    """Family-level answers live on REST: every collector link of the dashboards answers with JSON."""
    links: set[str] = set()
    for d in _dashboards():
        urls = [link.get("url", "") for link in d.get("links", [])]
        for panel in _panels(d):
            urls += re.findall(r"\]\(([^)]+)\)", panel.get("options", {}).get("content", ""))
            urls += [link.get("url", "") for link in panel.get("links", [])]
        links |= {u for u in urls if u.startswith("${collector_url}")}
    assert any("/api/v1/families" in u for u in links), links
    for url in sorted(links):
        resolved = substitute(url, _grafana_variables(stack, run=MAIN_RUN))
        if resolved.endswith("/docs"):
            assert _status(resolved) == 200, resolved
            continue
        body = _get(resolved)
        items = body["items"] if isinstance(body, dict) and "items" in body else body
        assert items, f"{resolved} returned nothing: {body}"


# --------------------------------------------------------------------------------------------- alert rules


def _rule_groups() -> list[dict[str, Any]]:
    groups = []
    for path in sorted(RULES_DIR.glob("*.yml")):
        groups += yaml.safe_load(path.read_text())["groups"]
    return groups


def test_promtool_check_config_and_rules() -> None:
    promtool = _require("promtool")
    for argv in ([promtool, "check", "config", str(PROMETHEUS_CONFIG)],
                 [promtool, "check", "rules", *map(str, sorted(RULES_DIR.glob("*.yml")))]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout}\n{done.stderr}"


def test_promtool_rule_unit_tests() -> None:
    """Every alert fires on its synthetic bad case at the time its `for:` says, and not on healthy series."""
    promtool = _require("promtool")
    files = sorted(RULE_TESTS.glob("*.yml"))
    assert files
    done = subprocess.run([promtool, "test", "rules", *map(str, files)], capture_output=True, text=True,
                          timeout=60, cwd=RULE_TESTS)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    tested = set(re.findall(r"alertname:\s*(\w+)", "".join(f.read_text() for f in files)))
    alerts = {r["alert"] for g in _rule_groups() for r in g["rules"] if "alert" in r}
    assert alerts <= tested, f"alerts without a promtool unit test: {sorted(alerts - tested)}"


def _squash(text: str) -> str:
    return " ".join(text.split())


def test_every_alert_rule_evaluates_on_real_data(stack: Stack) -> None:
    rules = {r["alert"]: r for g in _rule_groups() for r in g["rules"] if "alert" in r}
    assert set(rules) == set(ALERT_SIGNALS), "ALERT_SIGNALS must name exactly the alerts of deploy/"

    # Prometheus loaded them all and evaluates them without error.
    def evaluated() -> list[dict[str, Any]] | None:
        loaded = [r for g in stack.prom.api("rules")["groups"] for r in g["rules"]]
        return loaded if all(r.get("lastEvaluation", "").startswith("2") for r in loaded) else None

    loaded = _poll("every rule to be evaluated", evaluated, timeout=15)
    assert {r["name"] for r in loaded if r["type"] == "alerting"} == set(rules)
    bad = [(r["name"], r.get("health"), r.get("lastError")) for r in loaded if r.get("health") != "ok"]
    assert not bad, f"rules failing to evaluate: {bad}"

    problems = []
    for name, rule in rules.items():
        expr = rule["expr"]
        stack.prom.query(expr)  # valid PromQL on this server (empty unless firing)
        signal_expr = ALERT_SIGNALS[name]
        assert _squash(signal_expr) in _squash(expr), f"{name}: signal {signal_expr!r} is not part of {expr!r}"
        result = stack.prom.query(signal_expr)
        if not result or not any(math.isfinite(v) for v in _values(result)):
            problems.append(f"{name}: no data for {signal_expr}: {result}")
    assert not problems, "\n".join(problems)


def test_sink_drop_alert_goes_pending_and_healthy_alerts_stay_quiet(stack: Stack) -> None:
    """The drops run really dropped events: its alert is pending (for: 1m) with the run's labels."""
    def sink_alert() -> list[dict[str, Any]]:
        return [a for a in stack.prom.api("alerts")["alerts"] if a["labels"]["alertname"] == "KVFabricSinkDropping"]

    alerts = _poll("KVFabricSinkDropping to become active", sink_alert, timeout=15)
    assert [a["labels"]["run"] for a in alerts] == [DROPS_RUN]
    assert alerts[0]["labels"]["engine"] == DROPS_ENGINE
    assert alerts[0]["state"] in ("pending", "firing")
    assert float(alerts[0]["value"]) > 0
    active = {a["labels"]["alertname"] for a in stack.prom.api("alerts")["alerts"]}
    assert not active & set(MUST_BE_QUIET), f"alerts active on a healthy stack: {active & set(MUST_BE_QUIET)}"


# ----------------------------------------------------------------------------------- values versus REST


def _sum(stack: Stack, metric: str, run: str, extra: str = "") -> float:
    value = stack.prom.value(f'sum({metric}{{run="{run}"{", " + extra if extra else ""}}})')
    return 0.0 if value is None else value


@pytest.mark.parametrize("run", [MAIN_RUN, DROPS_RUN])
def test_counters_match_rest(stack: Stack, run: str) -> None:
    """Every per-run counter Prometheus scraped equals what the collector's REST summary computes in SQL."""
    s = stack.summary(run)
    expected = {
        ("kvfabric_events_total", ""): s["events"],
        ("kvfabric_prompt_tokens_total", ""): s["prompt_tokens"],
        ("kvfabric_prefix_hit_tokens_total", ""): s["prefix_hit_tokens"],
        ("kvfabric_evicted_blocks_total", ""): s["evicted_blocks"],
        ("kvfabric_evicted_blocks_total", 'kind="shared_anchor"'): s["shared_anchor_evictions"],
        ("kvfabric_evicted_blocks_total", 'kind="private_tail"'): s["evicted_blocks"] - s["shared_anchor_evictions"],
        ("kvfabric_protected_evictions_total", ""): s["protected_evictions"],
        ("kvfabric_rebuilt_blocks_total", ""): s["rebuilt_from_eviction_blocks"],
        ("kvfabric_regretful_evictions_total", ""): s["regretful_evictions"],
        ("kvfabric_wasted_prefill_tokens_total", ""): s["wasted_prefill_tokens"],
        ("kvfabric_admission_limited_blocks_total", ""): s["admission_limited_blocks"],
        ("kvfabric_sink_dropped_events_total", ""): s["sink_dropped_events"],
    }
    got = {key: _sum(stack, key[0], run, key[1]) for key in expected}
    assert got == {k: float(v) for k, v in expected.items()}
    by_type = {r["metric"]["event"]: float(r["value"][1])
               for r in stack.prom.query(f'sum by (event) (kvfabric_events_total{{run="{run}"}})')
               if float(r["value"][1])}  # every event type's series exists from the stream's start, at 0
    assert by_type == {k: float(v) for k, v in s["events_by_type"].items() if v}

    # The derived ratios of docs/metrics.md, on raw counters, equal the REST ratios (REST says 0 for 0/0).
    sel = f'run="{run}"'
    for num, den, key in (
        (f"sum(kvfabric_prefix_hit_tokens_total{{{sel}}})", f"sum(kvfabric_prompt_tokens_total{{{sel}}})",
         "prefix_hit_rate"),
        (f'sum(kvfabric_evicted_blocks_total{{{sel}, kind="shared_anchor"}})',
         f"sum(kvfabric_evicted_blocks_total{{{sel}}})", "shared_anchor_eviction_ratio"),
        (f"sum(kvfabric_protected_evictions_total{{{sel}}})", f"sum(kvfabric_evicted_blocks_total{{{sel}}})",
         "protected_eviction_ratio"),
    ):
        if not stack.prom.value(den):
            assert s[key] == 0, key
            continue
        assert stack.prom.value(f"({num}) / ({den})") == pytest.approx(s[key], abs=1e-9), key
    # Only the engine of this run carries its series.
    engines = {r["metric"]["engine"] for r in stack.prom.query(f'kvfabric_events_total{{run="{run}"}}')}
    assert engines == {stack.runs[run].engine}


def test_the_workload_exercised_what_the_dashboards_show(stack: Stack) -> None:
    """Guards against a vacuous pass: the main run had pressure, the drops run lost events, nothing else lost."""
    main, drops = stack.summary(MAIN_RUN), stack.summary(DROPS_RUN)
    assert main["evicted_blocks"] > 100 and main["rebuilt_from_eviction_blocks"] > 0
    assert main["wasted_prefill_tokens"] == main["block_size"] * main["rebuilt_from_eviction_blocks"]
    assert 0 < main["prefix_hit_rate"] < 1 and main["regretful_evictions"] > 0
    assert stack.runs[MAIN_RUN].events_lost == 0 and main["sink_dropped_events"] == 0
    assert stack.runs[DROPS_RUN].events_lost > 0
    assert drops["sink_dropped_events"] == stack.runs[DROPS_RUN].events_lost
    assert _sum(stack, "kvfabric_sink_dropped_events_total", DROPS_RUN) == stack.runs[DROPS_RUN].events_lost


def test_collector_health_metrics(stack: Stack) -> None:
    prom = stack.prom
    rows_sent = sum(r.rows_sent for r in stack.runs.values())
    assert prom.value("sum(kvfabric_ingest_rows_total)") == rows_sent
    rest_rows = sum(int(r["events"]) for r in stack.rest("/api/v1/runs"))
    assert rest_rows == rows_sent
    assert prom.value("sum(kvfabric_ingest_batches_total)") >= 2
    assert prom.value("sum(kvfabric_sequence_gaps_total)") == 0
    assert prom.value("sum(kvfabric_bad_streams_total)") == 0
    assert prom.value("kvfabric_up") == 1
    assert prom.value("kvfabric_db_size_bytes") > 0
    assert prom.value(f"max_over_time(kvfabric_open_streams[{stack.window()}])") >= 1  # seen while streaming
    assert prom.value("kvfabric_insert_duration_seconds_count") >= 1
    assert prom.value("kvfabric_ingest_lag_seconds_count") >= 1
    # The lag is measured in seconds and its p99 is a real, small number. The 1 s p99 target itself is a
    # performance goal (benchmarks/, not a timed test): on a loaded 2-core machine a fresh clone's run saw 1.42 s.
    # 10 s still catches a unit error (ns or ms read as s) or a lag that grows without bound.
    p99 = prom.value(f"histogram_quantile(0.99, sum by (le) (rate(kvfabric_ingest_lag_seconds_bucket"
                     f"[{stack.window()}])))")
    assert 0 < p99 < 10.0


def test_vllm_metrics_agree_with_kvfabric(stack: Stack) -> None:
    """vLLM 0.33 counts prefix-cache queries at admission, as the hook does: vLLM's own counters equal
    KVFabric's per-admission token counts for the same run (docs/design.md §5)."""
    prom = stack.prom
    main = stack.summary(MAIN_RUN)
    assert prom.value("sum(vllm:prefix_cache_queries_total)") == stack.vllm_queries
    assert prom.value("sum(vllm:prefix_cache_hits_total)") == stack.vllm_hits
    assert stack.vllm_queries == main["prompt_tokens"] == stack.runs[MAIN_RUN].engine_summary["admitted_tokens"]
    assert stack.vllm_hits == main["prefix_hit_tokens"]
    assert prom.value("sum(vllm:time_to_first_token_seconds_count)") == stack.runs[MAIN_RUN].engine_summary[
        "finished"]
    assert prom.value("sum(vllm:num_preemptions_total)") == stack.runs[MAIN_RUN].engine_summary["preemptions"]
    assert 0 < prom.value("max_over_time(vllm:kv_cache_usage_perc[1h])") <= 1
