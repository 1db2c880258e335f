"""Analyses over a collector database that need more than SQL: the recorded traffic of a run as block-hash chains
(:mod:`~kvfabric.analysis.traffic`) and its replay under another policy or capacity
(:mod:`~kvfabric.analysis.whatif`)."""
