"""The lifecycle: call records in, a block's story out (the side table and one event row per block operation).

records (:mod:`kvfabric.contract.records`) -> :class:`~.expander.Expander` -> event rows (``emit``)
                                             \\-> :class:`~.side_table.SideTable` (per-block statistics)

* :mod:`.expander`: the expander, in the forwarder process (or in-process for replays and tests: the engine's
  ``LocalOutlet``); it owns its side table, the memory of recently evicted digests and the live requests' families;
* :mod:`.keeper`: the statistics keeper, the same side-table logic without rows, on vLLM's scheduler thread when a
  policy reads statistics (steering creates and owns the one keeper per pool);
* :mod:`.side_table`: per-block statistics in columns, changed only by the expander, the keeper and the offline
  replay (its first line names them).

No vLLM object, no I/O, no thread of its own: whoever calls ``apply`` owns the instance. Imports only
:mod:`kvfabric.contract`.
"""
