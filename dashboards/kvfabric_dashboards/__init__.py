"""KVFabric's Grafana dashboards as code (grafana-foundation-sdk, Grafana 11.6).

Each module builds one dashboard; :data:`DASHBOARDS` maps the JSON file name written under ``dashboards/json/`` to
the function that builds it. ``python dashboards/build.py`` regenerates every file; the test suite checks that
the committed JSON is exactly what the generator writes, and evaluates every PromQL expression against a real
Prometheus scraping a real collector.
"""

from __future__ import annotations

from collections.abc import Callable

from grafana_foundation_sdk.models.dashboard import Dashboard

from kvfabric_dashboards.collector import build_collector_health
from kvfabric_dashboards.overview import build_overview

DASHBOARDS: dict[str, Callable[[], Dashboard]] = {
    "kvfabric-overview.json": build_overview,
    "kvfabric-collector.json": build_collector_health,
}
"""File name under ``dashboards/json/`` -> builder of that dashboard."""

__all__ = ["DASHBOARDS"]
