"""Kits the tests share (see ``tests/conftest.py``)."""
