"""The benchmark's traffic modes: seeded generators of *sessions* (conversations, single questions, forks).

A mode turns ``(params, seed)`` into an iterator of :class:`Session` objects, lazily (duration-bound runs draw as
many as they need). Everything random is drawn from ``random.Random`` seeded with strings when the session is
created, never while it runs, so the same seed gives the same sessions in every run and every arm of an A/B,
whatever the server's speed. Only the answers come from the server, and a next turn's prompt holds the previous
prompt plus the answer actually returned plus new user tokens (:class:`ConversationSession`).

Modes (parameters and defaults in each ``*Params`` class; ranges are inclusive ``[low, high]``):

``continuous``       long multi-turn conversations, each with a private history that grows turn by turn;
``random_topic``     sessions on a topic document drawn at random from a pool (shared prefixes, uniform popularity);
``persona_rotation`` sessions rotate through persona/template system prompts (``burst`` sessions per visit):
                     every family is revisited once per rotation, the pattern LRU handles worst when a rotation
                     does not fit in the cache;
``dataset``          rows of a Mooncake ``hash_ids`` trace (token prompts derived as in kvfabric/sim/workload.py),
                     one request each, arriving at their timestamps (``time_scale``);
``pressure``         hot families (shared prefixes, Zipf popularity) mixed with long cold one-off prompts;
                     ``hot_share = 0`` is pure cold traffic that shares nothing;
``multi_turn_fork``  a conversation trunk that forks into branches (regenerate / edit), each continuing on its own;
``document_qa``      questions on long documents drawn with Zipf popularity (RAG / chat-with-a-document): the
                     document is the shared prefix, family ``doc-<rank>``, rank 0 the most popular;
``returning_conversation``  long conversations visited in rotation: each session is one *visit* (a few turns) of a
                     conversation, and visit ``v`` of conversation ``c`` continues from the history (prompts and
                     answers) its visit ``v - 1`` ended with, after every other conversation has had its visit
                     ``v - 1``; sessions are yielded visit-major (all visits 0, then all visits 1, ...);
``agent_loop``       agents sharing a long system prompt + tool schema (one per agent kind), each appending its
                     action (the answer) and a tool output turn by turn; ``think_s`` is the tool's run time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from kvfabric.bench.prompts import Prompt, Reply, draw_tokens
from kvfabric.sim.tracecheck import TraceError, TraceScan, scan_trace
from kvfabric.sim.workload import iter_trace_workload

__all__ = [
    "MODES",
    "ConversationSession",
    "ModeError",
    "Session",
    "SessionContext",
    "make_sessions",
    "mode_params",
]


class ModeError(ValueError):
    """Bad mode name or parameters (the CLI turns it into exit status 2)."""


class SessionContext(Protocol):
    """What a running session may do: ask the server (``None`` once the run stops issuing) and wait."""

    async def ask(self, session: Session, turn: int, prompt: Prompt, max_tokens: int, last: bool) -> Reply | None: ...

    async def sleep(self, seconds: float) -> None: ...


class Session(Protocol):
    name: str
    family: str | None
    knows_session: bool
    #: Planned arrival in seconds from the run's start (trace timestamps), or None: whenever the runner starts it.
    start_s: float | None
    #: Requests the session will make if nothing stops it early.
    planned_requests: int

    async def run(self, ctx: SessionContext) -> None: ...


Range = tuple[int, int]


def _randint(rng: random.Random, r: Range) -> int:
    return rng.randint(r[0], r[1])


def _uniform(rng: random.Random, r: tuple[float, float]) -> float:
    return rng.uniform(r[0], r[1])


@dataclass(slots=True)
class ConversationSession:
    """``prefix + first`` is turn 0's prompt; turn ``t+1`` = turn ``t``'s prompt + its answer + ``users[t]``.

    ``turns[t] = (max_tokens, think_s before the turn)``; ``users`` has one entry fewer than ``turns``.
    ``on_done`` (multi_turn_fork) receives the final prompt (the history including the last answer).
    """

    name: str
    family: str | None
    prompt: Prompt
    turns: list[tuple[int, float]]
    users: list[tuple[int, ...]]
    start_s: float | None = None
    on_done: Callable[[Prompt], Awaitable[None]] | None = None
    #: Whether the client knows this session's extent (sends ``kvfabric_session``/``_end`` hints). Trace rows do
    #: not: a row's conversation may continue in a later row.
    knows_session: bool = True
    #: Whether the last turn ends the conversation (a fork's trunk does not: its branches continue it).
    ends: bool = True
    #: Turn number of the first turn (a returning conversation's later visit numbers on from its earlier ones).
    turn_offset: int = 0

    @property
    def planned_requests(self) -> int:
        return len(self.turns)

    async def run(self, ctx: SessionContext) -> None:
        prompt = self.prompt
        for t, (max_tokens, think_s) in enumerate(self.turns):
            if t and think_s > 0:
                await ctx.sleep(think_s)
            reply = await ctx.ask(self, self.turn_offset + t, prompt, max_tokens,
                                  self.ends and t == len(self.turns) - 1)
            if reply is None or not reply.ok:
                return  # stopped, or the server failed: a conversation cannot go on without its answer
            prompt = prompt.plus(reply)
            if t < len(self.users):
                prompt = prompt.plus(self.users[t])
        if self.on_done is not None:
            await self.on_done(prompt)


@dataclass(slots=True)
class ForkSession:
    """A trunk conversation, then ``branches`` conversations that all start from the trunk's full history."""

    name: str
    family: str | None
    trunk: ConversationSession
    branches: list[ConversationSession]
    start_s: float | None = None
    knows_session: bool = True

    @property
    def planned_requests(self) -> int:
        return self.trunk.planned_requests + sum(b.planned_requests for b in self.branches)

    async def run(self, ctx: SessionContext) -> None:
        history: list[Prompt] = []

        async def keep(prompt: Prompt) -> None:
            history.append(prompt)

        self.trunk.on_done = keep
        self.trunk.ends = False
        await self.trunk.run(ctx)
        if not history:
            return
        for b in self.branches:
            b.prompt = history[0].plus(*b.prompt.parts)
        await asyncio.gather(*(b.run(ctx) for b in self.branches))


# ------------------------------------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class _Params:
    """Base of every mode's parameters: built from a dict with unknown keys rejected and ranges checked."""

    #: Shared by every mode: output tokens per request (the server is asked to ignore EOS).
    max_tokens: Range = (16, 64)
    #: Seconds a user waits between two turns of one session (multi-turn modes).
    think_s: tuple[float, float] = (0.0, 0.0)

    RANGES: ClassVar[tuple[str, ...]] = ("max_tokens", "think_s")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, mode: str) -> _Params:
        raw = dict(raw or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            known = ", ".join(sorted(names))
            raise ModeError(f"mode {mode}: unknown parameter(s) {', '.join(unknown)} (known: {known})")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in raw:
                continue
            v = raw[f.name]
            default = f.default
            if isinstance(default, tuple):
                if isinstance(v, (int, float)):
                    v = (v, v)
                if not (isinstance(v, (list, tuple)) and len(v) == 2):
                    raise ModeError(f"mode {mode}: {f.name} must be a number or [low, high], not {v!r}")
                kind = float if isinstance(default[0], float) else int
                try:
                    lo, hi = kind(v[0]), kind(v[1])
                except (TypeError, ValueError):
                    raise ModeError(f"mode {mode}: {f.name} must hold numbers, not {v!r}") from None
                if lo < 0 or hi < lo:
                    raise ModeError(f"mode {mode}: {f.name} must satisfy 0 <= low <= high, not {v!r}")
                v = (lo, hi)
            elif not _scalar_ok(v, str(f.type)):
                hint = " (--param values are JSON; text that is not JSON stays text)" if isinstance(v, str) else ""
                raise ModeError(f"mode {mode}: {f.name} must be {_kind(str(f.type))}, not {v!r}{hint}")
            values[f.name] = v
        try:
            params = cls(**values)
        except TypeError as exc:
            raise ModeError(f"mode {mode}: {exc}") from None
        params.validate(mode)
        return params

    def validate(self, mode: str) -> None:
        if self.max_tokens[0] < 1:
            raise ModeError(f"mode {mode}: max_tokens must be >= 1")


def _scalar_ok(value: object, annotation: str) -> bool:
    """Whether ``value`` (parsed from JSON) fits a field annotated ``annotation`` (``int``, ``float``, ``str``,
    ``int | None``)."""
    kinds = {k.strip() for k in annotation.split("|")}
    if value is None:
        return "None" in kinds
    if isinstance(value, bool):
        return "bool" in kinds
    if isinstance(value, int):
        return bool(kinds & {"int", "float"})
    if isinstance(value, float):
        return "float" in kinds
    if isinstance(value, str):
        return "str" in kinds
    return False


def _kind(annotation: str) -> str:
    kinds = [k.strip() for k in annotation.split("|")]
    words = {"int": "an integer", "float": "a number", "str": "text", "bool": "true or false", "None": "null"}
    return " or ".join(words.get(k, k) for k in kinds)


def describe(params: type[_Params]) -> str:
    """``name=default`` for every parameter of a mode (JSON values, as ``--param`` takes them)."""

    return " ".join(
        f"{f.name}={json.dumps(list(f.default) if isinstance(f.default, tuple) else f.default, separators=(',', ':'))}"
        for f in dataclasses.fields(params)
    )


def _positive(mode: str, **values: float) -> None:
    for k, v in values.items():
        if not isinstance(v, (int, float)) or v <= 0:
            raise ModeError(f"mode {mode}: {k} must be a positive number, not {v!r}")


@dataclass(frozen=True)
class ContinuousParams(_Params):
    first_tokens: Range = (256, 1024)
    turns: Range = (4, 10)
    user_tokens: Range = (32, 256)
    max_tokens: Range = (32, 128)


@dataclass(frozen=True)
class RandomTopicParams(_Params):
    topics: int = 16
    topic_tokens: Range = (512, 1536)
    turns: Range = (1, 3)
    question_tokens: Range = (32, 128)

    def validate(self, mode: str) -> None:
        super().validate(mode)
        _positive(mode, topics=self.topics)


@dataclass(frozen=True)
class PersonaRotationParams(_Params):
    personas: int = 8
    persona_tokens: Range = (512, 1024)
    #: Consecutive sessions per persona visit before the rotation moves on.
    burst: int = 1
    turns: Range = (1, 2)
    question_tokens: Range = (32, 160)

    def validate(self, mode: str) -> None:
        super().validate(mode)
        _positive(mode, personas=self.personas, burst=self.burst)


@dataclass(frozen=True)
class PressureParams(_Params):
    hot_families: int = 4
    hot_prefix_tokens: Range = (1024, 2048)
    #: Share of sessions that go to a hot family (0: pure cold traffic, nothing shared).
    hot_share: float = 0.5
    #: Popularity of hot family i is proportional to 1 / (i + 1) ** hot_zipf.
    hot_zipf: float = 1.0
    suffix_tokens: Range = (16, 128)
    cold_tokens: Range = (1024, 3072)

    def validate(self, mode: str) -> None:
        super().validate(mode)
        if not 0.0 <= float(self.hot_share) <= 1.0:
            raise ModeError(f"mode {mode}: hot_share must be in [0, 1]")
        if self.hot_share > 0:
            _positive(mode, hot_families=self.hot_families)


@dataclass(frozen=True)
class ForkParams(_Params):
    first_tokens: Range = (512, 1024)
    trunk_turns: Range = (2, 3)
    branches: Range = (2, 4)
    branch_turns: Range = (1, 3)
    user_tokens: Range = (32, 128)


@dataclass(frozen=True)
class DocumentQAParams(_Params):
    documents: int = 24
    document_tokens: Range = (4096, 16384)
    #: Popularity of document rank i (0-based) is proportional to 1 / (i + 1) ** zipf (0: uniform).
    zipf: float = 1.0
    #: Instructions shared by every request, before the document (0: none).
    instructions_tokens: int = 0
    question_tokens: Range = (16, 64)
    #: Questions per session on the same document (follow-ups after the first).
    turns: Range = (1, 1)

    def validate(self, mode: str) -> None:
        super().validate(mode)
        _positive(mode, documents=self.documents)
        if not isinstance(self.zipf, (int, float)) or self.zipf < 0:
            raise ModeError(f"mode {mode}: zipf must be a number >= 0")
        if not isinstance(self.instructions_tokens, int) or self.instructions_tokens < 0:
            raise ModeError(f"mode {mode}: instructions_tokens must be an integer >= 0")
        if self.turns[0] < 1:
            raise ModeError(f"mode {mode}: turns must be >= 1")


@dataclass(frozen=True)
class ReturningConversationParams(_Params):
    conversations: int = 8
    #: Visits per conversation (the first included); sessions beyond conversations x visits are not drawn.
    visits: int = 4
    #: The conversation's first message (a pasted document, code, an earlier history).
    opening_tokens: Range = (6144, 10240)
    #: Turns per visit (back to back, think_s apart).
    turns_per_visit: Range = (2, 2)
    #: Each later user message (pasted content included).
    user_tokens: Range = (512, 2048)
    max_tokens: Range = (32, 128)

    def validate(self, mode: str) -> None:
        super().validate(mode)
        _positive(mode, conversations=self.conversations, visits=self.visits)
        if self.turns_per_visit[0] < 1:
            raise ModeError(f"mode {mode}: turns_per_visit must be >= 1")


@dataclass(frozen=True)
class AgentLoopParams(_Params):
    #: Agent kinds, each with its own system prompt + tool schema (shared by every agent of the kind).
    agent_kinds: int = 1
    system_tokens: Range = (6144, 8192)
    #: The agent's task (an issue, a question): private to the agent.
    task_tokens: Range = (256, 1024)
    #: Model calls per agent: the first on the task, each later one after a tool output.
    steps: Range = (6, 12)
    tool_output_tokens: Range = (256, 2048)
    #: The action (tool call) the model writes per step.
    max_tokens: Range = (64, 192)
    #: Seconds a tool runs between two steps of an agent.
    think_s: tuple[float, float] = (0.5, 3.0)

    def validate(self, mode: str) -> None:
        super().validate(mode)
        _positive(mode, agent_kinds=self.agent_kinds)
        if self.steps[0] < 1:
            raise ModeError(f"mode {mode}: steps must be >= 1")


@dataclass(frozen=True)
class DatasetParams(_Params):
    #: A Mooncake-format JSONL trace (``hash_ids``), relative to the working directory.
    path: str = ""
    #: Rows to use (from the top); None = all.
    limit: int | None = None
    #: Tokens per trace hash id (the Mooncake traces use 512).
    block_tokens: int = 512
    #: Longer prompts are cut to their first this many tokens (prefix kept, so sharing is kept); the run says how
    #: many rows were cut. null = no cap.
    max_input_tokens: int | None = 4096
    #: Arrival time = row timestamp x time_scale; 0 = ignore timestamps (the runner's concurrency/rate decide).
    time_scale: float = 1.0
    max_tokens: Range = (1, 64)  # a row asks for min(output_length, high) tokens

    def validate(self, mode: str) -> None:
        super().validate(mode)
        if not self.path:
            raise ModeError("mode dataset: the trace `path` parameter is required (e.g. ../shared/traces/x.jsonl)")
        if not Path(self.path).is_file():
            raise ModeError(f"mode dataset: no trace file at {self.path!r}")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ModeError("mode dataset: limit must be a positive integer")
        _positive(mode, block_tokens=self.block_tokens)
        if self.max_input_tokens is not None:
            _positive(mode, max_input_tokens=self.max_input_tokens)
        if not isinstance(self.time_scale, (int, float)) or self.time_scale < 0:
            raise ModeError("mode dataset: time_scale must be >= 0")
        self.scan()  # a malformed row is refused now, naming its line, not in the middle of the run

    def scan(self) -> TraceScan:
        """The trace's rows checked (:func:`kvfabric.sim.tracecheck.scan_trace`), once per parameter set."""
        if self not in _SCANS:
            try:
                _SCANS[self] = scan_trace(self.path, self.limit, max_input_tokens=self.max_input_tokens,
                                          block_tokens=self.block_tokens)
            except TraceError as exc:
                raise ModeError(f"mode dataset: {exc}") from None
        return _SCANS[self]


_SCANS: dict[DatasetParams, TraceScan] = {}
_ANNOUNCED: set[DatasetParams] = set()


# ------------------------------------------------------------------------------------------------ generators


def _rng(seed: int | str, *keys: object) -> random.Random:
    # String seeds are hashed with SHA-512 by random.seed: stable across processes and PYTHONHASHSEED.
    return random.Random("/".join(str(k) for k in (seed, *keys)))


def _conversation(rng: random.Random, name: str, family: str, prompt: Prompt, turns: Range, user_tokens: Range,
                  p: _Params) -> ConversationSession:
    n = _randint(rng, turns)
    plan = [(_randint(rng, p.max_tokens), _uniform(rng, p.think_s)) for _ in range(n)]
    users = [tuple(draw_tokens(rng, _randint(rng, user_tokens))) for _ in range(n - 1)]
    return ConversationSession(name=name, family=family, prompt=prompt, turns=plan, users=users)


def _continuous(p: ContinuousParams, seed: int | str) -> Iterator[Session]:
    i = 0
    while True:
        rng = _rng(seed, "continuous", i)
        first = draw_tokens(rng, _randint(rng, p.first_tokens))
        yield _conversation(rng, f"conv-{i}", f"conv-{i}", Prompt().plus(first), p.turns, p.user_tokens, p)
        i += 1


def _random_topic(p: RandomTopicParams, seed: int | str) -> Iterator[Session]:
    docs_rng = _rng(seed, "random_topic", "docs")
    docs = [tuple(draw_tokens(docs_rng, _randint(docs_rng, p.topic_tokens))) for _ in range(p.topics)]
    i = 0
    while True:
        rng = _rng(seed, "random_topic", i)
        t = rng.randrange(p.topics)
        prompt = Prompt().plus(docs[t], draw_tokens(rng, _randint(rng, p.question_tokens)))
        yield _conversation(rng, f"topic-{t}.s{i}", f"topic-{t}", prompt, p.turns, p.question_tokens, p)
        i += 1


def _persona_rotation(p: PersonaRotationParams, seed: int | str) -> Iterator[Session]:
    docs_rng = _rng(seed, "persona_rotation", "personas")
    personas = [tuple(draw_tokens(docs_rng, _randint(docs_rng, p.persona_tokens))) for _ in range(p.personas)]
    i = 0
    while True:
        rng = _rng(seed, "persona_rotation", i)
        k = (i // p.burst) % p.personas
        prompt = Prompt().plus(personas[k], draw_tokens(rng, _randint(rng, p.question_tokens)))
        yield _conversation(rng, f"persona-{k}.s{i}", f"persona-{k}", prompt, p.turns, p.question_tokens, p)
        i += 1


def _pressure(p: PressureParams, seed: int | str) -> Iterator[Session]:
    docs_rng = _rng(seed, "pressure", "hot")
    hot = [tuple(draw_tokens(docs_rng, _randint(docs_rng, p.hot_prefix_tokens))) for _ in range(p.hot_families)]
    weights = [1.0 / (j + 1) ** float(p.hot_zipf) for j in range(p.hot_families)]
    i = 0
    while True:
        rng = _rng(seed, "pressure", i)
        one = [(_randint(rng, p.max_tokens), 0.0)]
        if hot and rng.random() < float(p.hot_share):
            k = rng.choices(range(p.hot_families), weights)[0]
            prompt = Prompt().plus(hot[k], draw_tokens(rng, _randint(rng, p.suffix_tokens)))
            yield ConversationSession(f"hot-{k}.s{i}", f"hot-{k}", prompt, one, [])
        else:
            prompt = Prompt().plus(draw_tokens(rng, _randint(rng, p.cold_tokens)))
            yield ConversationSession(f"cold.s{i}", "cold", prompt, one, [])
        i += 1


def _fork(p: ForkParams, seed: int | str) -> Iterator[Session]:
    i = 0
    while True:
        rng = _rng(seed, "multi_turn_fork", i)
        family = f"fork-{i}"
        first = draw_tokens(rng, _randint(rng, p.first_tokens))
        trunk = _conversation(rng, f"{family}.trunk", family, Prompt().plus(first), p.trunk_turns, p.user_tokens, p)
        branches = []
        for b in range(_randint(rng, p.branches)):
            # A branch starts with a new user message on top of the trunk's history (filled in when the trunk ends).
            opening = draw_tokens(rng, _randint(rng, p.user_tokens))
            branches.append(_conversation(rng, f"{family}.b{b}", family, Prompt().plus(opening), p.branch_turns,
                                          p.user_tokens, p))
        yield ForkSession(name=family, family=family, trunk=trunk, branches=branches)
        i += 1


def _zipf_weights(n: int, s: float) -> list[float]:
    """Weights of ranks ``0..n-1`` under a Zipf law of exponent ``s`` (rank ``i`` -> ``1 / (i + 1) ** s``)."""
    return [1.0 / (i + 1) ** float(s) for i in range(n)]


def _document_qa(p: DocumentQAParams, seed: int | str) -> Iterator[Session]:
    docs_rng = _rng(seed, "document_qa", "docs")
    instructions = tuple(draw_tokens(docs_rng, p.instructions_tokens))
    docs = [tuple(draw_tokens(docs_rng, _randint(docs_rng, p.document_tokens))) for _ in range(p.documents)]
    weights = _zipf_weights(p.documents, p.zipf)
    i = 0
    while True:
        rng = _rng(seed, "document_qa", i)
        k = rng.choices(range(p.documents), weights)[0]
        prompt = Prompt().plus(instructions, docs[k], draw_tokens(rng, _randint(rng, p.question_tokens)))
        yield _conversation(rng, f"doc-{k}.s{i}", f"doc-{k}", prompt, p.turns, p.question_tokens, p)
        i += 1


@dataclass(slots=True)
class _History:
    """A returning conversation's state between visits: the history its last visit ended with, and whether that
    visit is over (``done``, set even when it stopped early; ``prompt`` is then None and later visits end at once)."""

    prompt: Prompt | None
    done: asyncio.Event | None = None


@dataclass(slots=True)
class VisitSession:
    """Visit ``visit`` of a returning conversation: waits for the previous visit to end, continues its history.

    Invariant: the first turn's prompt is exactly the previous visit's final prompt (its last answer included)
    plus ``opening``; the visit's own later turns follow :class:`ConversationSession`'s rule. Requests carry the
    *conversation* as their session (``conv-<c>``, one ``kvfabric_session`` hint across visits, ``_end`` only on the
    last turn of the last visit) and turn numbers counted across visits (``first_turn`` onwards): a visit ``v > 0``'s
    first request is the conversation's return.
    """

    name: str
    family: str
    visit: int
    first_turn: int
    opening: tuple[int, ...]
    turns: list[tuple[int, float]]
    users: list[tuple[int, ...]]
    before: _History
    after: _History
    last_visit: bool
    start_s: float | None = None
    knows_session: bool = True

    @property
    def planned_requests(self) -> int:
        return len(self.turns)

    async def run(self, ctx: SessionContext) -> None:
        history: list[Prompt] = []
        try:
            if self.before.done is not None:
                await self.before.done.wait()
            if self.before.prompt is None:
                return  # the previous visit failed or was stopped: this conversation cannot go on

            async def keep(prompt: Prompt) -> None:
                history.append(prompt)

            conv = ConversationSession(name=self.family, family=self.family,
                                       prompt=self.before.prompt.plus(self.opening), turns=self.turns,
                                       users=self.users, on_done=keep, ends=self.last_visit,
                                       turn_offset=self.first_turn)
            await conv.run(ctx)
        finally:
            self.after.prompt = history[0] if history else None
            if self.after.done is not None:
                self.after.done.set()


def _returning_conversation(p: ReturningConversationParams, seed: int | str) -> Iterator[Session]:
    # One _History per (conversation, visit boundary); events are made lazily (inside the running loop).
    states: list[list[_History]] = []
    turns_so_far = [0] * p.conversations
    for c in range(p.conversations):
        rng = _rng(seed, "returning_conversation", c, "opening")
        first = _History(Prompt().plus(draw_tokens(rng, _randint(rng, p.opening_tokens))))
        states.append([first] + [_History(None) for _ in range(p.visits)])
    for v in range(p.visits):
        for c in range(p.conversations):
            rng = _rng(seed, "returning_conversation", c, v)
            n = _randint(rng, p.turns_per_visit)
            plan = [(_randint(rng, p.max_tokens), _uniform(rng, p.think_s)) for _ in range(n)]
            users = [tuple(draw_tokens(rng, _randint(rng, p.user_tokens))) for _ in range(n - 1)]
            opening = tuple(draw_tokens(rng, _randint(rng, p.user_tokens))) if v else ()
            before, after = states[c][v], states[c][v + 1]
            if after.done is None:
                after.done = _event()
            yield VisitSession(name=f"conv-{c}.v{v}", family=f"conv-{c}", visit=v, first_turn=turns_so_far[c],
                               opening=opening, turns=plan, users=users, before=before, after=after,
                               last_visit=v == p.visits - 1)
            turns_so_far[c] += n


def _event() -> asyncio.Event:
    # asyncio.Event binds no loop until awaited (Python >= 3.10), so sessions can be drawn outside a running loop.
    return asyncio.Event()


def _agent_loop(p: AgentLoopParams, seed: int | str) -> Iterator[Session]:
    sys_rng = _rng(seed, "agent_loop", "system")
    systems = [tuple(draw_tokens(sys_rng, _randint(sys_rng, p.system_tokens))) for _ in range(p.agent_kinds)]
    i = 0
    while True:
        rng = _rng(seed, "agent_loop", i)
        k = i % p.agent_kinds
        prompt = Prompt().plus(systems[k], draw_tokens(rng, _randint(rng, p.task_tokens)))
        session = _conversation(rng, f"agent-{i}", f"agent-kind-{k}", prompt, p.steps, p.tool_output_tokens, p)
        session.name = f"agent-kind-{k}.a{i}"
        yield session
        i += 1


def _dataset(p: DatasetParams, seed: int | str) -> Iterator[Session]:
    scan = p.scan()
    if scan.over_cap and p not in _ANNOUNCED:
        _ANNOUNCED.add(p)
        print(f"dataset mode: {scan.over_cap:,} of {scan.rows:,} rows of {p.path} are longer than max_input_tokens="
              f"{p.max_input_tokens} and are cut to their first {p.max_input_tokens} tokens (longest "
              f"{scan.longest_input:,}); max_input_tokens=N raises the cap, null removes it", file=sys.stderr,
              flush=True)
    cap = p.max_tokens[1]
    seed_int = seed if isinstance(seed, int) else int.from_bytes(str(seed).encode()[:8], "little")
    for arrival_s, rid, prompt, out, _extra in iter_trace_workload(
        p.path, p.limit, cap, p.block_tokens, seed_int, max_input_tokens=p.max_input_tokens
    ):
        row = rid.rsplit("/", 1)[-1]
        start = arrival_s * float(p.time_scale) if p.time_scale else None
        yield ConversationSession(f"row-{row}", None, Prompt().plus(prompt), [(max(p.max_tokens[0], out), 0.0)], [],
                                  start_s=start, knows_session=False)


@dataclass(frozen=True)
class _Mode:
    params: type[_Params]
    sessions: Callable[[Any, int | str], Iterator[Session]]
    summary: str = field(default="")


MODES: dict[str, _Mode] = {
    "continuous": _Mode(ContinuousParams, _continuous, "long multi-turn conversations with growing private histories"),
    "random_topic": _Mode(RandomTopicParams, _random_topic, "sessions on topic documents drawn at random (shared)"),
    "persona_rotation": _Mode(PersonaRotationParams, _persona_rotation,
                              "sessions rotating through persona/template system prompts"),
    "dataset": _Mode(DatasetParams, _dataset, "rows of a hash_ids trace (Mooncake format) at their timestamps; "
                                                  "prompts cut to max_input_tokens (announced)"),
    "pressure": _Mode(PressureParams, _pressure, "hot shared families mixed with long cold one-off prompts"),
    "multi_turn_fork": _Mode(ForkParams, _fork, "a conversation trunk forking into branches"),
    "document_qa": _Mode(DocumentQAParams, _document_qa,
                         "questions on long documents with Zipf popularity (RAG, chat with a document)"),
    "returning_conversation": _Mode(ReturningConversationParams, _returning_conversation,
                                    "long conversations visited in rotation, each visit continuing its history"),
    "agent_loop": _Mode(AgentLoopParams, _agent_loop,
                        "agents sharing a system prompt + tool schema, appending tool outputs step by step"),
}


def mode_params(mode: str, raw: dict[str, Any] | None) -> _Params:
    """Validated parameters of ``mode`` (raises :class:`ModeError`)."""
    if mode not in MODES:
        raise ModeError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    return MODES[mode].params.from_dict(raw, mode)


def make_sessions(mode: str, raw: dict[str, Any] | None, seed: int | str) -> Iterator[Session]:
    """The (possibly endless) session iterator of ``mode`` with parameters ``raw`` and ``seed``."""
    params = mode_params(mode, raw)
    return MODES[mode].sessions(params, seed)
