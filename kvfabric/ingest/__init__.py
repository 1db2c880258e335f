"""Ingest: the Unix-socket Arrow stream server, validation, and the single DuckDB writer.

receiver (:mod:`.server`, :mod:`.connection`, :mod:`.source`, :mod:`.validate`) -> bounded queue (:mod:`.queue`)
-> writer (:mod:`.writer`, :mod:`.store`); :mod:`.pipeline` wires them, :mod:`.metrics` counts what happens.
"""

from kvfabric.ingest.metrics import CollectorMetrics
from kvfabric.ingest.pipeline import IngestPipeline, IngestSettings

__all__ = ["CollectorMetrics", "IngestPipeline", "IngestSettings"]
