"""The compiled parts, each a copy of a Python reference on vLLM's scheduler thread: the victim index's core and a
free's candidates (kvfabric/policies/_order.c; see native_index.py), and the recording of the four frequent pool
calls (kvfabric/hook/_recorder.c; see kvfabric/hook/compiled.py). Optional: an install without a C compiler still
succeeds and runs the Python code, as KVFABRIC_NATIVE=0 does."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvfabric.policies._order", ["kvfabric/policies/_order.c"], optional=True),
    Extension("kvfabric.hook._recorder", ["kvfabric/hook/_recorder.c"], optional=True),
])
