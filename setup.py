"""The compiled parts, each a copy of a Python reference on vLLM's scheduler thread: the victim index's core
(kvfabric/policies/_order.c; see native_index.py), the recording of the four frequent pool calls and a free's
steering candidates (kvfabric/engine/_recorder.c; see kvfabric/engine/compiled.py), and the shared-memory ring's
acquire/release ordering (kvfabric/contract/_ring.c; see kvfabric/contract/ring.py). Optional: an install without
a C compiler still succeeds and runs the Python code, as KVFABRIC_NATIVE=0 does (the ring's Python ordering only
where the CPU keeps stores in order: x86-64)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvfabric.policies._order", ["kvfabric/policies/_order.c"], optional=True),
    Extension("kvfabric.engine._recorder", ["kvfabric/engine/_recorder.c"], optional=True),
    Extension("kvfabric.contract._ring", ["kvfabric/contract/_ring.c"], optional=True),
])
