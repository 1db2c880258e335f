"""Type stub of the engine's compiled part (kvfabric/engine/_recorder.c; see compiled.py)."""

from collections.abc import Callable, Sequence
from typing import Any

def columns(blocks: Sequence[Any], names: tuple[str, ...], pool: Any = None) -> tuple[list[Any], ...]: ...

class Hook:
    __wrapped__: Callable[..., Any]
    slow: Callable[..., Any]
    __name__: str
    def __init__(self, method: str, original: Callable[..., Any], slow: Callable[..., Any], recorder: Any,
                 owner: Any, hash_name: str, hash_block_size: int | None, handover_records: int, op: int) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

def freed_candidates(ids: list[int], refs: list[int], blocks: list[Any], field: str, null: int, chain: bool,
                     names: list[Any] | None, hash64: Callable[[Any], Any]) -> tuple[list[int], list[int] | None]: ...
