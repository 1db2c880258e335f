"""``kvfabric learn``: fit the ``learned`` policy's reuse model on recorded traffic (a trace or a collector run)."""
