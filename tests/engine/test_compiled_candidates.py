"""The engine's compiled free path (``freed_candidates`` in kvfabric/engine/_recorder.c) against its Python
reference (``kvfabric.engine.steering.victims.freed_candidates_py``), on random frees and on bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.engine import compiled

pytestmark = pytest.mark.skipif(not compiled.BUILT, reason="the engine's compiled part is not built")


class Block:
    """Stands for vLLM's KVCacheBlock: only the attribute the free path reads."""

    def __init__(self, h: object) -> None:
        self._block_hash = h


HASHES = st.one_of(st.none(), st.binary(min_size=0, max_size=40), st.integers(-(2**70), 2**70))


@settings(max_examples=400, deadline=None)
@given(hashes=st.lists(HASHES, min_size=1, max_size=12), data=st.data())
def test_the_compiled_free_path_picks_and_names_what_the_python_one_does(hashes: list[object],
                                                                         data: st.DataObject) -> None:
    """``compiled.freed_candidates`` against ``victims.freed_candidates_py``: the same candidates, parent links and
    digests (schema.hash64 of vLLM's hash: bytes of any length, ints, None) for any free."""
    from kvfabric.contract import schema as S
    from kvfabric.engine._recorder import freed_candidates
    from kvfabric.engine.steering.victims import freed_candidates_py

    n = len(hashes)
    blocks = [Block(h) for h in hashes]
    ids = data.draw(st.permutations(range(n)))
    refs = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    null = data.draw(st.integers(-1, n - 1))
    chain = data.draw(st.booleans())
    named = data.draw(st.booleans())
    names_py: list[object] | None = ["?"] * n if named else None
    names_c: list[object] | None = ["?"] * n if named else None
    got_py = freed_candidates_py(list(ids), refs, blocks, "_block_hash", null, chain, names_py, S.hash64)
    got_c = freed_candidates(list(ids), refs, blocks, "_block_hash", null, chain, names_c, S.hash64)
    assert got_c == got_py and names_c == names_py
    assert all(refs[ids.index(b)] == 0 and hashes[b] is not None for b in got_c[0])


def test_the_compiled_free_path_refuses_bad_input() -> None:
    from kvfabric.contract import schema as S
    from kvfabric.engine._recorder import freed_candidates

    blocks = [Block(b"12345678"), Block(None)]
    for args, exc in [(([0, 1], [0], blocks, "_block_hash", 0, True, None, S.hash64), ValueError),
                      (([2], [0], blocks, "_block_hash", 0, True, None, S.hash64), IndexError),
                      (([0], [0], blocks, "no_such_field", 0, True, None, S.hash64), AttributeError),
                      (([0], [0], blocks, "_block_hash", 0, True, [None], S.hash64), None),
                      (([0], [0], blocks, "_block_hash", 0, True, (None,), S.hash64), TypeError),
                      (([0], [0], (blocks[0],), "_block_hash", 0, True, None, S.hash64), TypeError)]:
        if exc is None:
            assert freed_candidates(*args) == ([0], [-1])
        else:
            with pytest.raises(exc):
                freed_candidates(*args)

