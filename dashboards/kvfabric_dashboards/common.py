"""Shared pieces of the KVFabric dashboards: datasource, variables, panel factories.

Conventions every dashboard follows (the tests check them on the generated JSON):

* every panel that queries data uses the Prometheus datasource through the ``$datasource`` variable, on the panel
  and on each target, so one JSON works against any provisioned Prometheus;
* every target has a non-empty, unique ``refId`` and a PromQL ``expr``; rates use ``$__rate_interval`` and
  "over the selected range" stats use ``$__range``, so Grafana picks windows that fit the scrape interval;
* panel ids are unique and assigned in layout order, so regenerating gives byte-identical JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, text, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import text as text_models

DATASOURCE_VAR = "datasource"
PROMETHEUS = dashboard_models.DataSourceRef(type_val="prometheus", uid="${" + DATASOURCE_VAR + "}")
"""Datasource of every query panel: the dashboard's ``$datasource`` variable (type prometheus)."""

COLLECTOR_JOB = "kvfabric-collector"
"""Prometheus ``job`` of the collector's scrape config (deploy/prometheus/prometheus.yml uses exactly this)."""
VLLM_JOB = "vllm"
"""Prometheus ``job`` of vLLM's own /metrics (deploy/prometheus/prometheus.yml)."""

DEFAULT_COLLECTOR_URL = "http://localhost:8321"
"""Where an operator's browser reaches the collector's REST API (a dashboard text box; change it per site)."""

OVERVIEW_UID = "kvfabric-overview"
COLLECTOR_UID = "kvfabric-collector"
TAGS = ["kvfabric", "vllm", "kv-cache"]

# Thresholds shared with the alert rules in deploy/prometheus/rules/kvfabric.rules.yml.
SHARED_ANCHOR_RATIO_WARN = 0.3
SHARED_ANCHOR_RATIO_ALERT = 0.5
INGEST_LAG_P99_TARGET_S = 1.0  # docs/design.md §9: end-to-end lag p99 <= 1 s


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel: the expression and its legend."""

    expr: str
    legend: str = ""
    instant: bool = False


class PanelIds:
    """Hands out panel ids in layout order (deterministic output, unique ids)."""

    def __init__(self) -> None:
        self._next = 1

    def take(self) -> int:
        value = self._next
        self._next += 1
        return value


def datasource_variable() -> dashboard.DatasourceVariable:
    """``$datasource``: any Prometheus datasource (the provisioned one is the default)."""
    return dashboard.DatasourceVariable(DATASOURCE_VAR).label("Prometheus").type("prometheus")


def query_variable(name: str, label: str, query: str, *, description: str, include_all: bool = True
                   ) -> dashboard.QueryVariable:
    """A multi-value label variable fed by ``label_values(...)``, with "All" meaning the regex ``.*``."""
    var = (
        dashboard.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(PROMETHEUS)
        .query(query)
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(include_all)
        .allow_custom_value(False)
    )
    if include_all:
        var = var.all_value(".*").current(
            dashboard_models.VariableOption(selected=True, text="All", value="$__all")
        )
    return var


HOST_VAR = "host"
ENGINE_VAR = "engine"


def host_variable() -> dashboard.QueryVariable:
    """``$host``: the collector scrape targets (Prometheus' ``instance`` label). The collector's metrics have no host
    label; a fleet runs one collector per host, so a target stands for its host."""
    return query_variable(
        HOST_VAR, "Host", f'label_values(up{{job="{COLLECTOR_JOB}"}}, instance)',
        description="Host, as its collector's scrape target (one collector per vLLM host; engines that share a "
                    "collector share its host)",
    )


def engine_variable(*, of_runs: bool) -> dashboard.QueryVariable:
    """``$engine``: KVFabric's ``engine`` label on the selected hosts (and runs, ``of_runs``: a ``$run`` variable)."""
    selector = 'instance=~"$host", run=~"$run"' if of_runs else 'instance=~"$host"'
    return query_variable(
        ENGINE_VAR, "Engine", f"label_values(kvfabric_events_total{{{selector}}}, engine)",
        description="KVFabric engine label: KVFABRIC_ENGINE_ID or <host>/dp<rank>, on the selected hosts",
    )


def _targets(targets: Sequence[Target]) -> list[cogbuilder.Builder[prometheus.Dataquery]]:
    out: list[cogbuilder.Builder[prometheus.Dataquery]] = []
    for index, t in enumerate(targets):
        q = (
            prometheus.Dataquery()
            .datasource(PROMETHEUS)
            .ref_id(chr(ord("A") + index))
            .expr(t.expr)
            .legend_format(t.legend or "__auto")
        )
        out.append(q.instant() if t.instant else q.range())
    return out


def _thresholds(steps: Sequence[tuple[float | None, str]]) -> dashboard.ThresholdsConfig:
    return (
        dashboard.ThresholdsConfig()
        .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
        .steps([dashboard_models.Threshold(value=v, color=c) for v, c in steps])
    )


GREEN_ONLY: tuple[tuple[float | None, str], ...] = ((None, "green"),)


def timeseries_panel(
    ids: PanelIds,
    title: str,
    description: str,
    targets: Sequence[Target],
    *,
    unit: str = "short",
    width: int = 8,
    height: int = 8,
    stacked: bool = False,
    thresholds: Sequence[tuple[float | None, str]] = GREEN_ONLY,
    threshold_line: bool = False,
    min_value: float | None = None,
    max_value: float | None = None,
    right_axis_ref: str | None = None,
    right_axis_unit: str | None = None,
    links: Sequence[tuple[str, str]] = (),
) -> timeseries.Panel:
    """A time series panel; ``right_axis_ref`` moves one query (by refId) to a right-hand axis, with its own
    ``right_axis_unit`` if given; ``links`` are (title, url) panel links."""
    panel = (
        timeseries.Panel()
        .id(ids.take())
        .title(title)
        .description(description)
        .datasource(PROMETHEUS)
        .targets(_targets(targets))
        .unit(unit)
        .span(width)
        .height(height)
        .line_width(1)
        .fill_opacity(25 if stacked else 10)
        .show_points(common_models.VisibilityMode.NEVER)
        .thresholds(_thresholds(thresholds))
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common_models.LegendDisplayMode.TABLE if len(targets) > 1 else
                          common_models.LegendDisplayMode.LIST)
            .placement(common_models.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["mean", "max", "lastNotNull"] if len(targets) > 1 else [])
        )
        .tooltip(common_builders.VizTooltipOptions().mode(common_models.TooltipDisplayMode.MULTI)
                 .sort(common_models.SortOrder.DESCENDING))
    )
    if stacked:
        panel = panel.stacking(common_builders.StackingConfig().mode(common_models.StackingMode.NORMAL))
    if threshold_line:
        panel = panel.thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(common_models.GraphThresholdsStyleMode.DASHED)
        )
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    if right_axis_ref is not None:
        props = [dashboard_models.DynamicConfigValue(id_val="custom.axisPlacement", value="right")]
        if right_axis_unit is not None:
            props.append(dashboard_models.DynamicConfigValue(id_val="unit", value=right_axis_unit))
        panel = panel.override_by_query(right_axis_ref, props)
    if links:
        panel = panel.links([_link(title_, url) for title_, url in links])
    return panel


def stat_panel(
    ids: PanelIds,
    title: str,
    description: str,
    target: Target,
    *,
    unit: str = "short",
    width: int = 4,
    height: int = 4,
    thresholds: Sequence[tuple[float | None, str]] = GREEN_ONLY,
    decimals: int | None = None,
    mappings: Sequence[tuple[str, str, str]] = (),
    no_value: str | None = None,
) -> stat.Panel:
    """A single-number panel (one instant query); ``mappings`` are (value, text, color)."""
    panel = (
        stat.Panel()
        .id(ids.take())
        .title(title)
        .description(description)
        .datasource(PROMETHEUS)
        .targets(_targets([replace(target, instant=True)]))
        .unit(unit)
        .span(width)
        .height(height)
        .thresholds(_thresholds(thresholds))
        .color_mode(common_models.BigValueColorMode.VALUE)
        .graph_mode(common_models.BigValueGraphMode.NONE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if decimals is not None:
        panel = panel.decimals(decimals)
    if no_value is not None:
        panel = panel.no_value(no_value)
    if mappings:
        panel = panel.mappings([
            dashboard_models.ValueMap(options={
                value: dashboard_models.ValueMappingResult(text=label, color=color, index=i)
                for i, (value, label, color) in enumerate(mappings)
            })
        ])
    return panel


def markdown_panel(ids: PanelIds, title: str, description: str, content: str, *, width: int = 8,
                   height: int = 8) -> text.Panel:
    """A text panel (Grafana interpolates dashboard variables in its markdown)."""
    return (
        text.Panel()
        .id(ids.take())
        .title(title)
        .description(description)
        .mode(text_models.TextMode.MARKDOWN)
        .content(content)
        .span(width)
        .height(height)
    )


def row(ids: PanelIds, title: str) -> dashboard.Row:
    """An (expanded) row header; the panels added after it belong to it."""
    return dashboard.Row(title).id(ids.take())


def _link(title: str, url: str) -> dashboard.DashboardLink:
    """A link to a URL, opened in a new tab."""
    return dashboard.DashboardLink(title).type(dashboard_models.DashboardLinkType.LINK).url(url).target_blank(True)


def url_link(title: str, url: str, tooltip: str = "") -> dashboard.DashboardLink:
    """A dashboard-level link to a URL (variables are interpolated by Grafana)."""
    link = _link(title, url).icon("external link")
    return link.tooltip(tooltip) if tooltip else link


def dashboard_link(title: str, tag: str) -> dashboard.DashboardLink:
    """A dashboard-level link to the other KVFabric dashboards (by tag), keeping time range and variables."""
    return (
        dashboard.DashboardLink(title)
        .type(dashboard_models.DashboardLinkType.DASHBOARDS)
        .tags([tag])
        .as_dropdown(False)
        .include_vars(False)
        .keep_time(True)
        .icon("dashboard")
    )


def base_dashboard(uid: str, title: str, description: str) -> dashboard.Dashboard:
    """Common settings: tags, browser time zone, last hour, 30 s refresh, shared crosshair, read-only in the UI."""
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .timezone("browser")
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .readonly()
        .with_variable(datasource_variable())
    )
