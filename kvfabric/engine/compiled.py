"""The engine's compiled part (``kvfabric/engine/_recorder.c``); the Python code it copies stays the reference.

* :data:`Hook`: a compiled stand-in for one of vLLM's ``BlockPool`` methods that records as the Python hook of
  :func:`kvfabric.engine.pool.hook_pool` does, and passes every call it is not sure of to that hook;
* :data:`columns`: the pass the compiled hooks read a call's blocks with (one list per field, as the Python
  hooks' list comprehensions build them), exposed for the tests;
* :data:`freed_candidates`: one free's steering candidates in one pass
  (:func:`kvfabric.engine.steering.victims.freed_candidates_py` is its reference).

All exist only where the install built the extension (:data:`BUILT`; ``setup.py`` builds it as optional, so an
install without a C compiler runs the Python code). ``KVFABRIC_NATIVE=0`` (``HookSettings.native``) makes the engine
use the Python code even where they are built. Tests compare the two, call by call and record by record.
"""

from __future__ import annotations

try:
    from kvfabric.engine._recorder import Hook, columns, freed_candidates
except ImportError:  # (no C compiler at install time)
    Hook = None  # type: ignore[assignment,misc]
    columns = None  # type: ignore[assignment]
    freed_candidates = None  # type: ignore[assignment]

BUILT = Hook is not None
"""Whether the install built the compiled part."""
