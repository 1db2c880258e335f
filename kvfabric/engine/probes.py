"""vLLM compatibility probes: what this vLLM's objects look like, checked once at install, never per call.

The hooks branch on these answers instead of calling ``getattr`` on the hot path. Read-only: a probe that must
touch an object (a sentinel set on one block) restores it before it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def hash_is_a_field_property(blocks: list[Any]) -> bool:
    """Whether ``block_hash`` of vLLM's blocks is a property that returns the ``_block_hash`` field (checked on a
    block both ways: without its hash, and with a sentinel set and restored). Where it is (vLLM 0.26, 0.33), the
    hook reads the field: per block, the property costs a Python call and the field an attribute load."""
    if not blocks:
        return False
    blk = blocks[0]
    if not isinstance(getattr(type(blk), "block_hash", None), property) or not hasattr(blk, "_block_hash"):
        return False
    saved = blk._block_hash
    try:
        sentinel = object()
        blk._block_hash = sentinel
        return blk.block_hash is sentinel
    except Exception:
        return False
    finally:
        blk._block_hash = saved


def hash_attribute(blocks: list[Any]) -> str:
    """The attribute of vLLM's blocks to read a block's hash from: ``_block_hash`` where ``block_hash`` is only a
    property over it (:func:`hash_is_a_field_property`), else ``block_hash``."""
    return "_block_hash" if hash_is_a_field_property(blocks) else "block_hash"


def vllm_version() -> str:
    """The running vLLM's version ("unknown" where it cannot be imported)."""
    try:
        import vllm  # (here, not at module level: the engine's settings and tests load without vLLM)

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        return "unknown"


def flatten_blocks(blocks: Any) -> Sequence[Any]:
    """``touch`` takes a list of blocks (0.33) or a tuple of per-group lists (older releases)."""
    if blocks and isinstance(blocks[0], (list, tuple)):
        return [b for group in blocks for b in group]
    return blocks
