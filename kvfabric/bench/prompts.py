"""Prompts as token ids or as text, built the same way from the same seeded draws.

A workload draws *token ids* (from a seeded ``random.Random``) and keeps the answers the server returned; a
:class:`PromptFormat` turns both into what goes on the wire:

* ``tokens``: a list of token ids (``/v1/completions`` accepts one; servers started with ``--skip-tokenizer-init``
  need it). Answers are the token ids the server returned (vLLM: ``"return_token_ids": true``), so a next turn's
  prompt holds exactly the tokens the model produced and vLLM's block hashes see the whole previous turn as a prefix.
* ``text``: one pseudo-word per drawn token id (:func:`kvfabric.sim.tokenizer.word`, a fixed, seed-independent
  vocabulary) and the answer's text as returned. Prefix sharing then holds up to the server's tokenizer merging
  across a boundary.

Invariant: a prompt is a concatenation of *parts*; equal parts in equal order give equal wire prompts, in both
formats. That is what makes prefixes shared.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvfabric.sim.harness import TOKEN_ID_HIGH, TOKEN_ID_LOW
from kvfabric.sim.tokenizer import word

__all__ = ["FORMATS", "Prompt", "PromptFormat", "Reply", "draw_tokens"]

FORMATS = ("tokens", "text")

def draw_tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` token ids, uniform in the simulator's range (inside every bundled vocabulary, no special tokens)."""
    return [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(n)]


@dataclass(slots=True)
class Reply:
    """What the server answered to one request (the parts a workload needs to build the next turn)."""

    ok: bool
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Prompt:
    """An immutable sequence of parts: drawn token ids (``list``/``tuple`` of int) or server answers (:class:`Reply`).

    ``num_drawn`` counts the drawn tokens (a text prompt's length in pseudo-words before the answers).
    """

    parts: tuple[tuple[int, ...] | Reply, ...] = ()

    def plus(self, *parts: list[int] | tuple[int, ...] | Reply) -> Prompt:
        return Prompt(self.parts + tuple(p if isinstance(p, Reply) else tuple(p) for p in parts))

    @property
    def num_drawn(self) -> int:
        return sum(len(p) for p in self.parts if not isinstance(p, Reply))

    def approx_tokens(self) -> int:
        """Drawn tokens plus answer tokens (exact for token prompts)."""
        return sum(len(p.token_ids) if isinstance(p, Reply) else len(p) for p in self.parts)


class PromptFormat:
    """Renders a :class:`Prompt` for the wire (see the module docstring)."""

    def __init__(self, name: str) -> None:
        if name not in FORMATS:
            raise ValueError(f"unknown prompt format {name!r} (known: {', '.join(FORMATS)})")
        self.name = name

    @property
    def tokens(self) -> bool:
        return self.name == "tokens"

    def render(self, prompt: Prompt) -> list[int] | str:
        if self.tokens:
            out: list[int] = []
            for p in prompt.parts:
                out.extend(p.token_ids if isinstance(p, Reply) else p)
            return out
        pieces: list[str] = []
        for p in prompt.parts:
            if isinstance(p, Reply):
                pieces.append(p.text)
            elif p:
                pieces.append(" " + " ".join(word(t) for t in p))
        return "".join(pieces).lstrip(" ")
