"""The one compiled part, the victim index's core (kvfabric/policies/_order.c): optional, so an install without a
C compiler still succeeds and runs the Python index (kvfabric/policies/native_index.py says which is used)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvfabric.policies._order", ["kvfabric/policies/_order.c"], optional=True)])
