"""What every test folder shares: ``tests/`` itself is on ``sys.path`` (pytest puts a rootdir conftest's folder
there), so any test imports its kits as ``support.<kit>`` (:mod:`support.collector_testkit`: a real collector and
scripted streams; :mod:`support.index_testkit`: victim-index owners and forests; :mod:`support.sim_serve_testkit`: a
simulated vLLM server; :mod:`support.import_graph`: the import-graph reader). Test folders follow the package's
cut: contract, lifecycle, engine, forwarder, policies, collector, sim, bench; cross-cutting tests stay at the top.
Fixtures shared across folders live here (``golden_db``), or in a kit registered below as a plugin
(:mod:`support.lake_testkit`: ``postgres``, ``moto_s3``, ``lake_location``, which start nothing until a test asks); a
test module imports kits, never another test module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest_plugins = ["support.lake_testkit"]


@pytest.fixture(scope="module")
def golden_db() -> Iterator[str]:
    """A collector database of the golden workload (:func:`support.collector_testkit.golden_database`), one per test
    module that asks for it."""
    # (the kit imports the collector: only for the modules that use this fixture, not for every test session)
    from support.collector_testkit import golden_database

    with golden_database() as path:
        yield path
