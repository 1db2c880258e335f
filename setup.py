"""The compiled parts, each a copy of a Python reference on vLLM's scheduler thread: the victim index's core and a
free's candidates (kvfabric/policies/_order.c; see native_index.py), the recording of the four frequent pool
calls (kvfabric/hook/_recorder.c; see kvfabric/hook/compiled.py), and the shared-memory ring's acquire/release
ordering (kvfabric/hook/_ring.c; see kvfabric/hook/ring.py). Optional: an install without a C compiler still
succeeds and runs the Python code, as KVFABRIC_NATIVE=0 does (the ring's Python ordering only where the CPU keeps
stores in order: x86-64)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvfabric.policies._order", ["kvfabric/policies/_order.c"], optional=True),
    Extension("kvfabric.hook._recorder", ["kvfabric/hook/_recorder.c"], optional=True),
    Extension("kvfabric.hook._ring", ["kvfabric/hook/_ring.c"], optional=True),
])
