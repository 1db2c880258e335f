"""``kvfabric sim-serve``: vLLM's real OpenAI server on CPU with the simulated executor, the hook loaded through its
entry point, streaming to a real collector process.

The executor's output rule is checked on vLLM's own ``SchedulerOutput`` objects; the server is checked as a client
sees it (deterministic answers, cached tokens, preemption under a tiny pool) and as the collector sees it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.collector_testkit import collector_files
from support.sim_serve_testkit import sim_server

pytestmark = pytest.mark.vllm

RUN_ID = "sim-serve-test"


# ------------------------------------------------------------------------------------------------ the executor


def _executor(monkeypatch: pytest.MonkeyPatch, latency: str = "zero", scale: str = "1") -> Any:
    from kvfabric.sim.executor import LATENCY_ENV, LATENCY_SCALE_ENV, SimulatedExecutor

    monkeypatch.setenv(LATENCY_ENV, latency)
    monkeypatch.setenv(LATENCY_SCALE_ENV, scale)
    ex = SimulatedExecutor.__new__(SimulatedExecutor)  # no VllmConfig needed for the step logic
    ex._init_executor()
    return ex


def _step(new: list[tuple[str, list[int], int]] = (), cached: list[tuple[str, int, int]] = (),
          resumed: set[str] = frozenset(), scheduled: dict[str, int] | None = None,
          prefill: dict[str, list[int]] | None = None) -> Any:
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    news = [NewRequestData(req_id=r, prompt_token_ids=p, mm_features=[], sampling_params=None, pooling_params=None,
                           block_ids=([],), num_computed_tokens=k, lora_request=None,
                           prefill_token_ids=(prefill or {}).get(r)) for r, p, k in new]
    cr = CachedRequestData(
        req_ids=[r for r, _, _ in cached], resumed_req_ids=set(resumed), new_token_ids=[[] for _ in cached],
        all_token_ids={}, new_block_ids=[None for _ in cached], num_computed_tokens=[k for _, k, _ in cached],
        num_output_tokens=[o for _, _, o in cached],
    )
    scheduled = scheduled or {}
    return SchedulerOutput(scheduled_new_reqs=news, scheduled_cached_reqs=cr, num_scheduled_tokens=scheduled,
                           total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
                           scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])


def test_executor_samples_when_a_step_reaches_all_known_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfabric.sim.executor import answer_token, prompt_digest

    ex = _executor(monkeypatch)
    prompt = list(range(1000, 1040))
    d = prompt_digest(prompt)

    def run(so: Any) -> list[list[int]]:
        assert ex.execute_model(so) is None  # the output comes with sample_tokens, as from the GPU runner
        return ex.sample_tokens(None).sampled_token_ids

    # A chunked prefill: the first chunk stops short (nothing sampled), the second completes the prompt.
    assert run(_step(new=[("a", prompt, 0)], scheduled={"a": 32})) == [[]]
    assert run(_step(cached=[("a", 32, 0)], scheduled={"a": 8})) == [[answer_token(d, 0)]]
    assert run(_step(cached=[("a", 40, 1)], scheduled={"a": 1})) == [[answer_token(d, 1)]]
    # Preempted, then resumed with a prefix hit of 16: re-prefill samples only once it has caught up with the
    # 40 prompt + 2 output tokens the scheduler says it has, and then the next answer token.
    assert run(_step(cached=[("a", 16, 2)], resumed={"a"}, scheduled={"a": 10})) == [[]]
    assert run(_step(cached=[("a", 26, 2)], scheduled={"a": 16})) == [[answer_token(d, 2)]]
    # vLLM's v2 runner path re-sends a resumed request as new, with its prompt and outputs as prefill tokens.
    assert run(_step(new=[("a", prompt, 16)], prefill={"a": [*prompt, 1, 2, 3]}, scheduled={"a": 27})) == [
        [answer_token(d, 3)]]
    # Nothing scheduled: execute_model itself returns the (empty) output, which the async engine reads directly.
    empty = ex.execute_model(_step())
    assert empty is not None and empty.req_ids == []


def test_executor_spends_the_modelled_step_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfabric.sim.latency import StepWork, get_latency_model

    ex = _executor(monkeypatch, latency="llama", scale="2")
    prompt = list(range(1000, 1512))
    expected = 2 * get_latency_model("llama").step_seconds(
        StepWork(prefill_chunks=[(512, 0)], admitted_prompt_tokens=512))
    t0 = time.monotonic()
    future = ex.execute_model(_step(new=[("b", prompt, 0)], scheduled={"b": 512}), non_block=True)
    assert future.result() is None
    out = ex.sample_tokens(None, non_block=True).result()
    assert time.monotonic() - t0 >= expected
    assert len(out.sampled_token_ids[0]) == 1
    assert ex.busy_seconds == pytest.approx(expected)


# ------------------------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    log_dir = tmp_path_factory.mktemp("sim-serve")
    # The server idles between tests: the hook's forwarder connects at engine start and sends its schema with the
    # first events, so the collector must wait longer than its default 10 s handshake (see kvfabric ab).
    with collector_files() as files, files.process(handshake_timeout_s=3600.0) as collector:
        with sim_server(log_dir, "--kv-blocks", "66", "--max-model-len", "1024", "--latency-scale", "0",
                        "--policy", "adaptive_aging", "--collector-socket", files.socket_path,
                        "--run-id", RUN_ID) as server:
            yield {"url": server.url, "collector": collector.http_url, "server": server}


def _complete(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int = 1) -> list[Any]:
    """Stream completions through the benchmark's client; returns the records and replies in prompt order."""
    from kvfabric.bench.client import CompletionClient, RequestRecord

    async def main() -> list[Any]:
        client = CompletionClient(url, "llama-3-8b")
        sem = asyncio.Semaphore(concurrency)
        t0 = time.monotonic()

        async def one(i: int, p: list[int]) -> Any:
            async with sem:
                rec = RequestRecord(index=i, request_id=f"t-{i}", component="t", session="s", turn=0, family=None,
                                    start_s=0.0, max_tokens=max_tokens)
                reply = await client.complete(rec, p, None, t0)
                return rec, reply

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_answers_are_the_executors_tokens_and_prefixes_are_cached(served: dict[str, Any]) -> None:
    from kvfabric.sim.executor import answer_token, prompt_digest

    prompt = list(range(2000, 2100))  # 100 tokens: 6 full blocks of 16
    [(rec, reply)] = _complete(served["url"], [prompt], 5)
    assert reply.ok, rec.error
    assert reply.token_ids == [answer_token(prompt_digest(prompt), i) for i in range(5)]
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens) == (100, 5, 0)
    assert rec.ttft_s is not None and rec.e2e_s >= rec.ttft_s
    # The same 96 leading tokens again: vLLM serves the six full blocks from its prefix cache and says so.
    [(rec2, reply2)] = _complete(served["url"], [[*prompt, 7, 8, 9]], 3)
    assert reply2.ok and rec2.cached_tokens == 96


def test_preemption_under_a_tiny_pool_keeps_answers_exact(served: dict[str, Any]) -> None:
    from kvfabric.sim.executor import answer_token, prompt_digest

    # Eight requests of 40 prompt tokens all fit at admission, but each grows to 340 tokens (22 blocks) and the
    # pool has 65: vLLM must preempt running requests and resume them later.
    url = served["url"]
    before = _collector_totals(served["collector"])
    preempted_before = _vllm_counter(url, "vllm:num_preemptions_total")
    prompts = [list(range(10_000 + 1000 * i, 10_040 + 1000 * i)) for i in range(8)]
    results = _complete(url, prompts, 300, concurrency=8)
    for p, (rec, reply) in zip(prompts, results, strict=True):
        assert reply.ok, rec.error
        assert reply.token_ids == [answer_token(prompt_digest(p), i) for i in range(300)]
        assert rec.cached_tokens == 0  # vLLM reports the first admission's hit: these prompts share nothing
    deadline = time.monotonic() + 10  # vLLM's counters reach /metrics with the engine's next stats
    while _vllm_counter(url, "vllm:num_preemptions_total") == preempted_before and time.monotonic() < deadline:
        time.sleep(0.2)
    preempted = _vllm_counter(url, "vllm:num_preemptions_total") - preempted_before
    assert preempted > 0
    # The collector counts every admission: each preemption adds one (the resumed request is admitted again, with
    # whatever of its own blocks survived as its hit). This is why its hit tokens can exceed the client's.
    after = _collector_totals(served["collector"])
    assert after[0] - before[0] == 8 + preempted


def _vllm_counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _collector_totals(collector: str) -> tuple[int, int, int]:
    """(admissions, prompt tokens, hit tokens) of the run once the hook's events stopped arriving (2 s still)."""
    from kvfabric.bench.analytics import fetch_run, run_events

    last, since = -1, time.monotonic()
    while time.monotonic() - since < 2.0:
        n = run_events(collector, RUN_ID)
        if n != last:
            last, since = n, time.monotonic()
        time.sleep(0.25)
    if last == 0:
        return 0, 0, 0
    s = fetch_run(collector, RUN_ID)["summary"]
    assert s["policies"] == ["adaptive_aging"] and s["sink_dropped_events"] == 0
    return s["requests"], s["prompt_tokens"], s["prefix_hit_tokens"]


def test_the_hook_streams_the_servers_events_to_the_collector(served: dict[str, Any]) -> None:
    url, collector = served["url"], served["collector"]
    before = _collector_totals(collector)
    vllm_before = (_vllm_counter(url, "vllm:prefix_cache_queries_total"),
                   _vllm_counter(url, "vllm:prefix_cache_hits_total"))
    [(rec, reply)] = _complete(url, [list(range(3000, 3064))], 2)
    [(rec2, reply2)] = _complete(url, [[*range(3000, 3064), 5]], 2)
    assert reply.ok and reply2.ok and (rec.cached_tokens, rec2.cached_tokens) == (0, 64)
    after = _collector_totals(collector)
    # Exactly these two admissions reached the collector from the EngineCore's hook, with vLLM's own numbers.
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (2, 64 + 65, 64)
    assert _vllm_counter(url, "vllm:prefix_cache_queries_total") - vllm_before[0] == 64 + 65
    assert _vllm_counter(url, "vllm:prefix_cache_hits_total") - vllm_before[1] == 64


def test_first_contact_text_chat_and_docs_work_by_default(served: dict[str, Any]) -> None:
    """What a person tries first against a default sim-serve: a clean start, a typed text prompt, a chat, /docs."""
    url = served["url"]
    log = Path(served["server"].log_path).read_text(errors="replace")
    assert "Traceback" not in log and "warmup failed" not in log and "regex pattern" not in log
    # Any text is accepted (byte fallback), and the benchmark's pseudo-words are one token each.
    from kvfabric.sim.tokenizer import word

    r = httpx.post(f"{url}/v1/completions", timeout=30, json={
        "model": "llama-3-8b", "prompt": "Hello, world! Grüße", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].strip(), r.text
    words = " ".join(word(i) for i in range(4000, 4032))
    r = httpx.post(f"{url}/v1/completions", timeout=30, json={"model": "llama-3-8b", "prompt": words, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == 32
    # Chat through the built-in template; the next turn (history + the answer as returned) hits the cache for the
    # whole first turn's full blocks.
    messages = [{"role": "system", "content": "You answer in pseudo-words."},
                {"role": "user", "content": words + " " + words}]
    r1 = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                    json={"model": "llama-3-8b", "messages": messages, "max_tokens": 8})
    assert r1.status_code == 200, r1.text
    answer, used = r1.json()["choices"][0]["message"]["content"], r1.json()["usage"]
    assert len(answer.split()) == 8
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    r2 = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                    json={"model": "llama-3-8b", "messages": messages, "max_tokens": 2})
    cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 16 * ((used["prompt_tokens"] + used["completion_tokens"] - 1) // 16)
    # /docs: vLLM's offline Swagger UI, its script and style served by this server.
    docs = httpx.get(f"{url}/docs", timeout=10).text
    for asset in ("/static/swagger-ui-bundle.js", "/static/swagger-ui.css"):
        assert f'"{asset}"' in docs and httpx.get(f"{url}{asset}", timeout=10).status_code == 200


def test_without_a_tokenizer_chat_and_text_get_a_400_that_says_what_to_send() -> None:
    import logging

    from fastapi.testclient import TestClient
    from starlette.responses import JSONResponse

    from kvfabric.sim.serve import TokenIdsOnly, _NoChatWarmupWarning

    async def vllm(scope: Any, receive: Any, send: Any) -> None:  # stands in for vLLM's app: echoes the body
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await JSONResponse({"got": body.decode()})(scope, receive, send)

    client = TestClient(TokenIdsOnly(vllm))
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/v1/completions", {"prompt": ["a", "b"]})):
        r = client.post(path, json={"model": "m", **body})
        assert r.status_code == 400 and "--tokenizer none" in r.json()["error"]["message"], path
        assert '{"prompt": [1001, 1002]}' in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1001, 1002]})
    assert r.status_code == 200 and r.json()["got"] == '{"model":"m","prompt":[1001,1002]}'
    # vLLM's chat warmup fails without a tokenizer: expected, so its warning (with a traceback) is not shown.
    keep = _NoChatWarmupWarning().filter
    assert not keep(logging.LogRecord("vllm.renderers.base", logging.WARNING, "", 0, "Chat template warmup failed",
                                      None, None))
    assert keep(logging.LogRecord("vllm.renderers.base", logging.WARNING, "", 0, "something else", None, None))


def test_bad_options_exit_2_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    proc = subprocess.run([sys.executable, "-m", "kvfabric.cli", "sim-serve", "--kv-blocks", "8"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "cannot hold one request" in proc.stderr
    with socket.socket() as busy:  # an address in use: named, before vLLM is even imported
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "kvfabric.cli", "sim-serve", "--port", str(port)],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"kvfabric sim-serve: cannot listen on 127.0.0.1:{port}: ")
