"""The plugin and vLLM's KV events, side by side on one run of ``kvfabric sim-serve`` (vLLM's real OpenAI server on
CPU): the plugin streams to the collector's socket, and ``--kv-events-config`` has vLLM's real ``ZmqEventPublisher``
publish the same engine's KV events, which the same collector subscribes to (``--kv-events``), with the engine's
/metrics scraped for its prefix-cache counters. ``KVFABRIC_FAMILY_DEPTH=0`` makes the plugin name a family by its
chain's first block (the kv-events rule) and ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` makes vLLM publish the
hashes the plugin digests, so the two sources must agree exactly on evictions, rebuilt-from-eviction and every
family's evictions and rebuilds (docs/kv-events.md)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import duckdb
import httpx
import pytest
from support.collector_testkit import collector_files, free_port, wait_until
from support.sim_serve_testkit import sim_server

from kvfabric.queries import availability as A

pytestmark = pytest.mark.vllm

PLUGIN_RUN, KV_RUN = "sbs-plugin", "sbs-kv"
FAMILIES, ROUNDS, PER_ROUND = 6, 4, 2
PREFIX_TOKENS, TAIL_TOKENS, MAX_TOKENS = 96, 64, 8  # 6 shared blocks + 4 own blocks per request; the pool has 65


def workload() -> list[list[int]]:
    """Rounds over six families (a 96-token prefix each) with requests of their own 64-token tails: ten blocks per
    request plus its answer, 36 prefix blocks among them, on a pool of 65: each round evicts what the previous one
    cached, and the next prefills it again."""
    prompts = []
    for r in range(ROUNDS):
        for f in range(FAMILIES):
            prefix = list(range(10_000 + 1000 * f, 10_000 + 1000 * f + PREFIX_TOKENS))
            for k in range(PER_ROUND):
                start = 50_000 + 1000 * (r * FAMILIES * PER_ROUND + f * PER_ROUND + k)
                prompts.append([*prefix, *range(start, start + TAIL_TOKENS)])
    return prompts


def _complete(url: str, prompts: list[list[int]], concurrency: int = 2) -> list[Any]:
    from kvfabric.bench.client import CompletionClient, RequestRecord

    async def main() -> list[Any]:
        client = CompletionClient(url, "llama-3-8b")
        sem = asyncio.Semaphore(concurrency)
        t0 = time.monotonic()

        async def one(i: int, p: list[int]) -> Any:
            async with sem:
                rec = RequestRecord(index=i, request_id=f"sbs-{i}", component="sbs", session="s", turn=0,
                                    family=None, start_s=0.0, max_tokens=MAX_TOKENS)
                return rec, await client.complete(rec, p, None, t0)

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await client.aclose()

    return asyncio.run(main())


def _settled(url: str, run_id: str, quiet_s: float = 3.0, timeout: float = 120.0) -> dict[str, int]:
    """The run's stored events by type once nothing new arrived for ``quiet_s`` (the engine idles after the
    workload: whatever either source still had in flight has landed; a batch the subscriber missed would have
    been replayed by then, or counted lost)."""
    last: dict[str, int] | None = None
    since = deadline = time.monotonic()
    deadline += timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/api/v1/runs/{run_id}/summary", timeout=30)
        now = r.json()["events_by_type"] if r.status_code == 200 else {}
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.25)
    raise AssertionError(f"run {run_id} kept changing for {timeout:.0f} s")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    log_dir = tmp_path_factory.mktemp("side-by-side")
    pub, replay = free_port(), free_port()
    kv_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                 "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    env = {"KVFABRIC_FAMILY_DEPTH": "0", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}
    with collector_files() as files:
        # The engine first: the collector scrapes its /metrics from the start, and the plugin's forwarder waits
        # for the collector's socket (it reconnects with a backoff of at most 5 s).
        with sim_server(log_dir, "--kv-blocks", "66", "--max-model-len", "1024", "--latency-scale", "0",
                        "--collector-socket", files.socket_path, "--run-id", PLUGIN_RUN, "--",
                        "--kv-events-config", json.dumps(kv_config), env=env) as server:
            spec = (f"tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{replay},engine=sbs-engine-kv,run={KV_RUN},"
                    f"metrics={server.url}/metrics")
            with files.process(handshake_timeout_s=3600.0, kv_events=(spec,)) as collector:
                wait_until(lambda: _subscribed(collector.http_url), 30, "the kv-events subscriber connected")
                results = _complete(server.url, workload())
                assert all(reply.ok for _, reply in results), [rec.error for rec, reply in results if not reply.ok]
                for run in (PLUGIN_RUN, KV_RUN):
                    _settled(collector.http_url, run)
                # The engine's counters arrive by scrape (every few seconds): until the last one is stored, the
                # run's prompt tokens lag behind what vLLM's /metrics says.
                queries = _vllm_counter(server.url, "vllm:prefix_cache_queries_total")
                wait_until(lambda: _summary(collector.http_url, KV_RUN)["prompt_tokens"] == queries, 30,
                           "the engine's last counters scraped")
                answers = {run: {
                    "summary": httpx.get(f"{collector.http_url}/api/v1/runs/{run}/summary", timeout=30).json(),
                    "families": httpx.get(f"{collector.http_url}/api/v1/families",
                                          params={"run": run, "limit": 1000}, timeout=30).json(),
                    "lifetimes": httpx.get(f"{collector.http_url}/api/v1/runs/{run}/lifetimes", timeout=30).json(),
                } for run in (PLUGIN_RUN, KV_RUN)}
            yield {"db": files.db_path, "answers": answers}


def _summary(url: str, run_id: str) -> dict[str, Any]:
    return httpx.get(f"{url}/api/v1/runs/{run_id}/summary", timeout=30).json()


def _vllm_counter(url: str, name: str, quiet_s: float = 2.0) -> float:
    """A counter of vLLM's /metrics once it stopped moving (the engine's stats reach it a little after a step)."""
    last, since = -1.0, time.monotonic()
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        value = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
        if value != last:
            last, since = value, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return value
        time.sleep(0.25)


def _subscribed(url: str) -> bool:
    entries = httpx.get(f"{url}/healthz", timeout=10).json().get("kv_events") or []
    return any(e["engine"] == "sbs-engine-kv" and e["state"] == "connected" for e in entries)


def test_both_sources_agree_on_evictions_and_rebuilds(served: dict[str, Any]) -> None:
    p, k = (served["answers"][run]["summary"] for run in (PLUGIN_RUN, KV_RUN))
    assert p["evicted_blocks"] > 0 and p["rebuilt_from_eviction_blocks"] > 0
    assert k["evicted_blocks"] == p["evicted_blocks"]
    assert k["rebuilt_from_eviction_blocks"] == p["rebuilt_from_eviction_blocks"]
    assert k["wasted_prefill_tokens"] == p["wasted_prefill_tokens"]
    assert k["sequence_gaps"] == 0 and k["sink_dropped_events"] == 0 and p["sink_dropped_events"] == 0
    print(f"\nside by side: evicted {k['evicted_blocks']} (both), rebuilt {k['rebuilt_from_eviction_blocks']} "
          f"(both), wasted prefill {k['wasted_prefill_tokens']} tokens; hit rate: plugin {p['prefix_hit_rate']:.4f} "
          f"({p['prefix_hit_tokens']}/{p['prompt_tokens']}), engine counters {k['prefix_hit_rate']:.4f}")


def test_every_family_has_the_same_evictions_and_rebuilds(served: dict[str, Any]) -> None:
    def by_family(run: str) -> dict[str, tuple[int, int]]:
        return {f["family"]: (f["evicted_blocks"], f["rebuilt_blocks"]) for f in served["answers"][run]["families"]}

    plugin, kv = by_family(PLUGIN_RUN), by_family(KV_RUN)
    assert len(plugin) >= FAMILIES and sum(e for e, _ in plugin.values()) > 0
    assert kv == plugin


def test_every_eviction_pairs_with_its_seal_in_both(served: dict[str, Any]) -> None:
    p, k = (served["answers"][run]["lifetimes"] for run in (PLUGIN_RUN, KV_RUN))
    evicted = served["answers"][KV_RUN]["summary"]["evicted_blocks"]
    assert p["totals"]["evicted_blocks"] == k["totals"]["evicted_blocks"] == evicted
    assert p["totals"]["without_seal"] == k["totals"]["without_seal"] == 0
    assert {f["family"]: f["evicted_blocks"] for f in p["items"]} == {f["family"]: f["evicted_blocks"]
                                                                      for f in k["items"]}


def test_the_same_blocks_are_evicted(served: dict[str, Any]) -> None:
    con = duckdb.connect(served["db"], read_only=True)
    try:
        rows = dict(con.execute(
            "SELECT run_id, list(block_hash ORDER BY block_hash) FROM events WHERE event = 'block_evicted' "
            "AND run_id IN (?, ?) GROUP BY run_id", [PLUGIN_RUN, KV_RUN]).fetchall())
    finally:
        con.close()
    assert rows[KV_RUN] == rows[PLUGIN_RUN]


def test_the_kv_events_run_says_what_it_cannot_tell_and_takes_the_engines_counters(served: dict[str, Any]) -> None:
    p, k = (served["answers"][run]["summary"] for run in (PLUGIN_RUN, KV_RUN))
    assert k["sources"] == ["kv_events"] and p["sources"] == ["plugin"]
    assert k["requests"] is None and k["regretful_evictions"] is None and "requests" in k["unavailable"]
    assert p["prefix_hit_rate_from"] == A.FROM_LOOKUPS and p["unavailable"] == {}
    # vLLM 0.33 counts its prefix-cache queries and hits at admission, as the plugin counts its lookups; with no
    # preemption in this workload the two agree to the token.
    assert k["prefix_hit_rate_from"] == A.FROM_COUNTERS and k["prefix_hit_tokens"] > 0
    assert (k["prompt_tokens"], k["prefix_hit_tokens"]) == (p["prompt_tokens"], p["prefix_hit_tokens"])
