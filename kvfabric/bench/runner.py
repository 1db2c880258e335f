"""Runs a scenario's traffic against a server: sessions, concurrency, arrivals, bounds, progress, results.

Every traffic component draws its sessions from its mode (seeded by the scenario seed and the component's index)
and runs at most ``concurrency`` of them at once; with a ``rate`` sessions arrive as a seeded Poisson process
(open loop, they queue for a free slot), with trace timestamps (``dataset``) they arrive at those, otherwise a new
session starts as soon as one ends (closed loop). The run stops issuing when a component has used its
``sessions``/``requests`` bound, when the whole run reaches ``max_requests``, or when ``duration_s`` has passed;
requests already sent always complete (they are bounded by ``max_tokens``), so every record is whole.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tqdm import tqdm

from kvfabric.bench.client import CompletionClient, RequestRecord
from kvfabric.bench.modes import Session, make_sessions
from kvfabric.bench.prompts import Prompt, PromptFormat, Reply
from kvfabric.bench.scenario import Scenario, Traffic
from kvfabric.bench.stats import percentile

__all__ = ["BenchResult", "count_planned_requests", "run_scenario", "summarize"]


@dataclass
class BenchResult:
    scenario: Scenario
    run_id: str | None
    endpoint: str
    model: str
    started_at: str
    wall_s: float
    records: list[RequestRecord]
    stopped_by: str
    settings: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return summarize(self.records, self.wall_s)

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "scenario": self.scenario.as_dict(),
            "started_at": self.started_at,
            "wall_s": self.wall_s,
            "stopped_by": self.stopped_by,
            "settings": self.settings,
            "summary": self.summary(),
            "by_traffic": {
                name: summarize([r for r in self.records if r.component == name], self.wall_s)
                for name in dict.fromkeys(r.component for r in self.records)
            },
            "requests": [r.as_dict() for r in self.records],
        }


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Client-side numbers of a run: throughput, latency percentiles, cached tokens the server reported."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    out = sum(r.completion_tokens or 0 for r in ok)
    return {
        "requests": len(records),
        "requests_ok": len(ok),
        "requests_failed": len(records) - len(ok),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens": out,
        "output_tokens_per_s": out / wall_s if wall_s > 0 else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_tokens_reported": len(reported) == len(ok) and bool(ok),
        "client_hit_rate": cached / prompt if prompt and reported else None,
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p99_s": percentile(tpot, 0.99),
        "e2e_p50_s": percentile(e2e, 0.5),
        "e2e_p99_s": percentile(e2e, 0.99),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def _seed_of(scenario: Scenario, index: int, traffic: Traffic) -> str:
    return f"{scenario.seed}/{index}/{traffic.name}"


def count_planned_requests(scenario: Scenario, max_requests: int | None = None) -> int | None:
    """Requests the scenario will issue if nothing fails and no time bound hits (None when unbounded)."""
    total = 0
    for i, t in enumerate(scenario.traffic):
        if t.sessions is None:
            if t.requests is None:
                if t.mode != "dataset":
                    return None
                n = sum(s.planned_requests for s in make_sessions(t.mode, t.params, _seed_of(scenario, i, t)))
            else:
                n = t.requests
        else:
            sessions = itertools.islice(make_sessions(t.mode, t.params, _seed_of(scenario, i, t)), t.sessions)
            n = sum(s.planned_requests for s in sessions)
            if t.requests is not None:
                n = min(n, t.requests)
        total += n
    return min(total, max_requests) if max_requests is not None else total


class _Run:
    """Shared state of one run: bounds, counters, records; the :class:`SessionContext` sessions talk to."""

    def __init__(self, scenario: Scenario, client: CompletionClient, *, duration_s: float | None,
                 max_requests: int | None, id_prefix: str, on_record: Callable[[RequestRecord], None]) -> None:
        self.scenario = scenario
        self.client = client
        self.fmt = PromptFormat(scenario.prompt_format)
        self.duration_s = duration_s
        self.max_requests = max_requests
        self.id_prefix = id_prefix
        self.on_record = on_record
        self.t0 = time.monotonic()
        self.issued = 0
        self.records: list[RequestRecord] = []
        self.stopped_by = "completed"
        self._stopping = False

    def stop(self, why: str) -> None:
        if not self._stopping:
            self._stopping = True
            self.stopped_by = why

    @property
    def stopping(self) -> bool:
        if not self._stopping and self.duration_s is not None and time.monotonic() - self.t0 >= self.duration_s:
            self.stop("duration")
        return self._stopping


class _Component:
    """One traffic component's view of the run (its own bounds), handed to its sessions as their context."""

    def __init__(self, run: _Run, traffic: Traffic) -> None:
        self.run = run
        self.traffic = traffic
        self.issued = 0

    def exhausted(self) -> bool:
        t = self.traffic
        return t.requests is not None and self.issued >= t.requests

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def ask(self, session: Session, turn: int, prompt: Prompt, max_tokens: int, last: bool) -> Reply | None:
        run = self.run
        if run.stopping or self.exhausted():
            return None
        if run.max_requests is not None and run.issued >= run.max_requests:
            run.stop("max_requests")
            return None
        index = run.issued
        run.issued += 1
        self.issued += 1
        record = RequestRecord(
            index=index,
            request_id=f"{run.id_prefix}-{index:06d}",
            component=self.traffic.name,
            session=session.name,
            turn=turn,
            family=session.family,
            start_s=0.0,
            max_tokens=max_tokens,
        )
        hints: dict[str, Any] | None = None
        if run.scenario.hints:
            hints = {}
            if session.family:
                hints["kvfabric_family"] = session.family
            if session.knows_session:
                hints["kvfabric_session"] = session.name
                if last:
                    hints["kvfabric_session_end"] = 1
            hints = hints or None
        reply = await run.client.complete(record, run.fmt.render(prompt), hints, run.t0)
        run.records.append(record)
        run.on_record(record)
        return reply


async def _drive(run: _Run, index: int, traffic: Traffic) -> None:
    comp = _Component(run, traffic)
    seed = _seed_of(run.scenario, index, traffic)
    sessions = make_sessions(traffic.mode, traffic.params, seed)
    if traffic.sessions is not None:
        sessions = itertools.islice(sessions, traffic.sessions)
    arrivals = random.Random(f"{seed}/arrivals")
    slots = asyncio.Semaphore(traffic.concurrency)
    tasks: set[asyncio.Task[None]] = set()
    next_arrival = traffic.start_after_s

    async def one(session: Session) -> None:
        try:
            await session.run(comp)
        finally:
            slots.release()

    for session in sessions:
        if run.stopping or comp.exhausted():
            break
        if session.start_s is not None:
            due: float | None = traffic.start_after_s + session.start_s
        elif traffic.rate:
            next_arrival += arrivals.expovariate(traffic.rate)
            due = next_arrival
        else:
            due = traffic.start_after_s or None
        if due is not None:
            while not run.stopping:
                wait = run.t0 + due - time.monotonic()
                if wait <= 0:
                    break
                await asyncio.sleep(min(wait, 0.5))
            if run.stopping:
                break
        await slots.acquire()
        if run.stopping or comp.exhausted():
            slots.release()
            break
        task = asyncio.create_task(one(session))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*list(tasks))


async def run_scenario(
    scenario: Scenario,
    client: CompletionClient,
    *,
    run_id: str | None = None,
    endpoint: str = "",
    duration_s: float | None = None,
    max_requests: int | None = None,
    progress: bool = True,
    desc: str = "requests",
) -> BenchResult:
    """Run every traffic component side by side until its bounds (see the module docstring)."""

    total = None if duration_s is not None else count_planned_requests(scenario, max_requests)
    bar = tqdm(total=total, unit="req", desc=desc, disable=not progress, dynamic_ncols=True, leave=True)
    failures = 0

    def on_record(record: RequestRecord) -> None:
        nonlocal failures
        failures += 0 if record.ok else 1
        bar.update(1)
        if failures:
            bar.set_postfix(failed=failures, refresh=False)

    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    prefix = (run_id or "bench").replace("/", "_")
    run = _Run(scenario, client, duration_s=duration_s, max_requests=max_requests, id_prefix=prefix,
               on_record=on_record)
    try:
        await asyncio.gather(*(_drive(run, i, t) for i, t in enumerate(scenario.traffic)))
    finally:
        bar.close()
    wall = time.monotonic() - run.t0
    run.records.sort(key=lambda r: r.index)
    return BenchResult(
        scenario=scenario,
        run_id=run_id,
        endpoint=endpoint,
        model=client.model,
        started_at=started_at,
        wall_s=wall,
        records=run.records,
        stopped_by=run.stopped_by,
        settings={"duration_s": duration_s, "max_requests": max_requests, "prompt_format": scenario.prompt_format,
                  "hints": scenario.hints, "vllm_extensions": client.vllm_extensions},
    )
