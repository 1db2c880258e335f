"""Steering: the parts of the engine that change vLLM's decisions (eviction order, admission, scheduling order).

``build_hook`` -> :func:`~.attach.attach_steering`, only when ``settings.steers`` (a policy other than ``lru``, the
admission gate, or cache-aware scheduling); plain ``lru`` never reaches this package.

* :mod:`.victims`: the policy's victims handed out by vLLM's own free list (the victim index follows the recorder's
  ``FREED`` / ``TOUCHED`` records through the statistics keeper);
* :mod:`.admission`: the admission gate's vLLM seam (the gate's decision is :mod:`kvfabric.policies.admission`);
* :mod:`.hold`: the cache-aware hold of a waiting request;
* :mod:`.attach`: wires them to one pool, and puts the freeing request's context where :mod:`.victims` reads it
  (an observer of the engine's one ``KVCacheManager.free`` wrapper, :mod:`kvfabric.engine.manager`).

All on vLLM's scheduler thread. Steering owns the index, the keeper, the gate and the hold (``pool
._kvfabric_steering``); it reaches the recorder only through the Recorder's methods. Every failure is counted and
logged once, and vLLM's own order takes over where needed: protection is an order, never a veto.
"""
