"""A streaming client for OpenAI-compatible ``/v1/completions``: one request in, timings and the answer out.

Per request it measures, on the client's monotonic clock: TTFT (request sent -> first chunk carrying output),
TPOT (mean gap between output tokens after the first) and E2E (sent -> end of stream), and reads the usage block
the server sends last (``stream_options.include_usage``): prompt, completion and *cached* prompt tokens
(``usage.prompt_tokens_details.cached_tokens``; vLLM reports it with ``--enable-prompt-tokens-details``).

vLLM extensions, sent unless ``vllm_extensions=False``: ``ignore_eos`` (answers have exactly ``max_tokens``
tokens, as the workload planned), ``return_token_ids`` (token prompts need the answer's token ids for the next
turn) and ``vllm_xargs`` (KVFabric's request hints, docs/design.md §3). The ``X-Request-Id`` header names the
request, so vLLM's request id (``cmpl-<id>-0-<random>``) and the collector's events can be joined with it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from kvfabric.bench.prompts import Reply

__all__ = ["CompletionClient", "RequestRecord"]


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds; ``start_s`` is relative to the start of the run."""

    index: int
    request_id: str
    component: str
    session: str
    turn: int
    family: str | None
    start_s: float
    max_tokens: int
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    output_chunks: int = 0
    ok: bool = False
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class CompletionClient:
    """Streams completions from ``endpoint`` (``http://host:port``, with or without ``/v1``)."""

    def __init__(
        self,
        endpoint: str,
        model: str,
        *,
        token_prompts: bool = True,
        vllm_extensions: bool = True,
        timeout_s: float = 600.0,
        max_connections: int = 256,
        api_key: str | None = None,
    ) -> None:
        base = endpoint.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.model = model
        self.token_prompts = token_prompts
        self.vllm_extensions = vllm_extensions
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            headers=headers,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    def body(self, prompt: list[int] | str, max_tokens: int, hints: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.vllm_extensions:
            body["ignore_eos"] = True
            if self.token_prompts:
                body["return_token_ids"] = True
            if hints:
                body["vllm_xargs"] = hints
        return body

    async def complete(
        self,
        record: RequestRecord,
        prompt: list[int] | str,
        hints: dict[str, Any] | None,
        t0: float,
    ) -> Reply:
        """Send one streamed completion; fill ``record`` in place; return the answer.

        Never raises for server or network errors: they land in ``record.error`` and ``Reply.ok`` is False.
        """
        body = self.body(prompt, record.max_tokens, hints)
        token_ids: list[int] = []
        text: list[str] = []
        first: float | None = None
        last: float | None = None
        usage: dict[str, Any] | None = None
        sent = time.monotonic()
        record.start_s = sent - t0
        try:
            async with self._http.stream(
                "POST", f"{self.base}/v1/completions", json=body, headers={"X-Request-Id": record.request_id}
            ) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:300]
                    raise _ServerError(f"HTTP {resp.status_code}: {detail}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        raise _ServerError(str(chunk["error"])[:300])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        ids = choice.get("token_ids") or []
                        piece = choice.get("text") or ""
                        if ids or piece:
                            now = time.monotonic()
                            if first is None:
                                first = now
                            last = now
                            record.output_chunks += 1
                            token_ids.extend(ids)
                            text.append(piece)
        except (_ServerError, httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
            record.error = str(exc) or type(exc).__name__
            record.e2e_s = time.monotonic() - sent
            return Reply(ok=False, error=record.error)
        end = time.monotonic()
        record.e2e_s = end - sent
        if first is not None:
            record.ttft_s = first - sent
        if usage is not None:
            record.prompt_tokens = usage.get("prompt_tokens")
            record.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens")
        n_out = record.completion_tokens if record.completion_tokens is not None else len(token_ids)
        if first is not None and last is not None and n_out and n_out > 1:
            record.tpot_s = (last - first) / (n_out - 1)
        if first is None:
            record.error = "stream ended without output"
            return Reply(ok=False, error=record.error)
        if self.token_prompts and not token_ids:
            record.error = ("the server returned no token ids: token prompts need vLLM's return_token_ids "
                            "(or use --prompt-format text)")
            return Reply(ok=False, error=record.error)
        record.ok = True
        return Reply(ok=True, token_ids=token_ids, text="".join(text))


class _ServerError(Exception):
    pass


async def discover_model(endpoint: str, timeout_s: float = 10.0) -> str:
    """The first model id the server lists at ``/v1/models``."""
    base = endpoint.rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        resp = await http.get(f"{base}/v1/models")
        resp.raise_for_status()
        data = resp.json().get("data") or []
        if not data:
            raise RuntimeError(f"{base}/v1/models lists no model")
        return str(data[0]["id"])
