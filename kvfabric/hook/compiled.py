"""The hook's compiled parts (``kvfabric/hook/_recorder.c``); the Python hooks they copy stay the reference.

* :data:`Hook`: a compiled stand-in for one of vLLM's ``BlockPool`` methods that records as the Python hook of
  :func:`kvfabric.hook.install.hook_pool` does, and passes every call it is not sure of to that hook;
* :data:`columns`: the pass the compiled hooks read a call's blocks with (one list per field, as the Python
  hooks' list comprehensions build them), exposed for the tests.

Both exist only where the install built the extension (:data:`BUILT`; ``setup.py`` builds it as optional, so an
install without a C compiler runs the Python code). ``KVFABRIC_NATIVE=0`` (``HookSettings.native``) makes the hook
use the Python code even where they are built. Tests compare the two, call by call and record by record.
"""

from __future__ import annotations

try:
    from kvfabric.hook._recorder import Hook, columns
except ImportError:  # (no C compiler at install time)
    Hook = None  # type: ignore[assignment,misc]
    columns = None  # type: ignore[assignment]

BUILT = Hook is not None
"""Whether the install built the compiled parts."""
