"""The one compiled part, a copy of Python references on vLLM's scheduler thread: the victim index's core and a
free's candidates (kvfabric/policies/_order.c; see native_index.py). Optional: an install without a C compiler
still succeeds and runs the Python code, as KVFABRIC_NATIVE=0 does."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvfabric.policies._order", ["kvfabric/policies/_order.c"], optional=True)])
