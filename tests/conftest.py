"""What every test folder shares: ``tests/`` itself is on ``sys.path`` (pytest puts a rootdir conftest's folder
there), so any test imports its kits as ``support.<kit>`` (:mod:`support.collector_testkit`: a real collector and
scripted streams; :mod:`support.index_testkit`: victim-index owners and forests; :mod:`support.sim_serve_testkit`: a
simulated vLLM server; :mod:`support.import_graph`: the import-graph reader). Test folders follow the package's
cut: contract, lifecycle, engine, forwarder, policies, collector, sim, bench; cross-cutting tests stay at the top.
"""
