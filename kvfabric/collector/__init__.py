"""The collector process: config, wiring of ingest + API, lifecycle, child-process helpers, export, queries.

Public entry points (used by ``kvfabric.cli``):

* :class:`CollectorConfig`, :func:`add_arguments`, :func:`config_from_args` - settings and their flags;
* :class:`Collector` - ``start()``/``stop()`` in-process, ``serve_forever()`` as a process;
* :func:`main` - ``python -m kvfabric.collector``;
* :class:`CollectorProcess`, :func:`wait_ready` - run one as a child process;
* :func:`export_parquet`, :func:`run_named_query` - offline access to a database file.
"""

from kvfabric.collector.config import CollectorConfig, add_arguments, config_from_args
from kvfabric.collector.export import export_parquet
from kvfabric.collector.main import main
from kvfabric.collector.process import CollectorProcess, wait_ready
from kvfabric.collector.query import run_named_query
from kvfabric.collector.service import Collector
from kvfabric.queries import QUERY_NAMES

__all__ = [
    "QUERY_NAMES",
    "Collector",
    "CollectorConfig",
    "CollectorProcess",
    "add_arguments",
    "config_from_args",
    "export_parquet",
    "main",
    "run_named_query",
    "wait_ready",
]
