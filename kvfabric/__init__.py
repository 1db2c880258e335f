"""KVFabric: see and steer what happens to an LLM server's KV cache."""

__version__ = "0.1.0"
