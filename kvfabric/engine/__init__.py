"""The engine: everything of KVFabric that runs inside vLLM's process, on its scheduler thread.

vLLM loads :mod:`.plugin` (``vllm.general_plugins``) -> each new Scheduler -> :mod:`.install` (``build_hook``):
  pool and manager calls (:mod:`.pool`, :mod:`.manager`; the frequent ones compiled: :mod:`.compiled`)
  -> one record per call in the :class:`~.recorder.Recorder`
  -> every 100 ms / 4096 records / last request: :mod:`.handover` -> the ring -> the forwarder process
  and, only when a setting changes vLLM's decisions, :mod:`.steering` (victims, admission seam, cache-aware hold).

* :mod:`.config`: the engine's settings (``HookSettings``), parsed once from the ``KVFABRIC_*`` table;
* :mod:`.probes`: what this vLLM's objects look like, checked once at install;
* :mod:`.signature`: wrappers with the exact signature of the vLLM method they wrap;
* :mod:`.hints`, :mod:`.families`: what a client said about a request, and its prefix family.

Who owns what: one Recorder per pool, written only by itself and the recording wrappers (steering and the
installation use its methods); one ``Installation`` per pool (the outlet, the metadata); steering owns the victim
index, the statistics keeper and the hold. No I/O on vLLM's paths: the outlet copies bytes into shared memory,
the forwarder process does the rest. Imports contract, lifecycle and policies; nothing imports the engine but
the top (sim, bench, demo, CLI).
"""
