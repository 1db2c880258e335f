"""The lake backend: the collector's tables in DuckLake (catalog in PostgreSQL, a DuckDB or SQLite file; data as
Parquet in a folder or on S3), written by many collectors at once. See docs/fleet.md."""

from kvfabric.lake.connect import LakeUnavailable, connect_lake, is_commit_conflict, use_lake
from kvfabric.lake.extensions import MissingExtension, load_extensions
from kvfabric.lake.location import LAKE_ALIAS, LakeLocation

__all__ = [
    "LAKE_ALIAS",
    "LakeLocation",
    "LakeUnavailable",
    "MissingExtension",
    "connect_lake",
    "is_commit_conflict",
    "load_extensions",
    "use_lake",
]
