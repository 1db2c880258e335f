"""``kvfabric status``: which engines a running collector hears from, before any request reaches them.

Reads ``GET /api/v1/engines`` (and ``/healthz``) of the collector at ``--url``. An engine appears as soon as vLLM
has built its scheduler with KVFabric on: the hook's forwarder connects and says who it is then, not at the first
request (kvfabric/ingest/engines.py explains the states).

Exit status: 0 when at least one engine is connected or idle (KVFabric is on somewhere and this collector hears
it), 1 when none is, 2 when no collector answers at the URL or it refuses the request (one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import httpx

from kvfabric import settings as settings_table
from kvfabric.argtypes import positive_float
from kvfabric.collector.columns import aligned
from kvfabric.ingest import defaults as D
from kvfabric.usage import UsageError

DEFAULT_URL = f"http://{D.HTTP_HOST}:{D.HTTP_PORT}"
TOKEN_ENV = "KVFABRIC_API_TOKEN"

_COLUMNS = (("ENGINE", "engine"), ("STATE", "state"), ("HOST", "host"), ("VLLM", "vllm_version"),
            ("POLICY", "policy"), ("RUN", "run_id"), ("CONNECTED SINCE", "since"), ("EVENTS", "events"))


def configure(parser: argparse.ArgumentParser) -> None:
    """``kvfabric status [--url URL] [--token T] [--format table|json]``."""
    parser.add_argument("--url", default=DEFAULT_URL, help="the collector's HTTP address (default: %(default)s)")
    parser.add_argument("--token", default=None,
                        help=f"bearer token, when the collector has one (default: ${TOKEN_ENV})")
    parser.add_argument("--format", choices=["table", "json"], default="table", help="output (default: table)")
    parser.add_argument("--timeout", type=positive_float, default=5.0, help="seconds to wait for the collector")


def fetch(url: str, token: str | None, timeout: float) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the collector's /healthz body or None, its engines). Raises :class:`UsageError` for anything the user can
    fix: nothing listening, a wrong token, a server that is not a collector of this version."""

    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url {url!r} is not an HTTP address (e.g. {DEFAULT_URL})")
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(timeout=timeout, headers=headers) as client:
            response = client.get(f"{base}/api/v1/engines")
            health: dict[str, Any] | None = None
            if response.status_code == 200:
                try:
                    health = client.get(f"{base}/healthz").json()
                except (httpx.HTTPError, ValueError):
                    health = None  # the list is the answer; health is context
    except httpx.InvalidURL as exc:
        raise UsageError(f"--url {url!r} is not an HTTP address ({exc})") from exc
    except httpx.HTTPError as exc:
        raise UsageError(f"no collector answers at {base}: {exc or type(exc).__name__} (start one with `kvfabric "
                         "collector`, or give its address with --url)") from exc
    if response.status_code == 401:
        raise UsageError(f"the collector at {base} wants a bearer token: pass --token or set ${TOKEN_ENV}")
    if response.status_code == 404:
        raise UsageError(f"{base} lists no engines (GET /api/v1/engines: 404): not a KVFabric collector, or an "
                         "older one")
    if response.status_code != 200:
        raise UsageError(f"the collector at {base} answered {response.status_code} to GET /api/v1/engines: "
                         f"{response.text[:200]}")
    try:
        engines = response.json()
    except ValueError as exc:
        raise UsageError(f"{base} answered GET /api/v1/engines with something other than JSON") from exc
    if not isinstance(engines, list):
        raise UsageError(f"{base} answered GET /api/v1/engines with something other than a list")
    return health, engines


def _since(ns: object, now: float) -> str:
    if not isinstance(ns, int):
        return "-"
    seconds = max(0, int(now - ns / 1e9))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{stamp} ({seconds // size}{unit} ago)"
    return f"{stamp} ({seconds}s ago)"


def _cell(engine: dict[str, Any], key: str, now: float) -> str:
    if key == "since":
        return _since(engine.get("connected_since_ns"), now)
    value = engine.get(key)
    return "?" if value is None else str(value)  # (a field an older hook did not send)


def render(url: str, health: dict[str, Any] | None, engines: list[dict[str, Any]]) -> str:
    """The table ``kvfabric status`` prints (a header line, then one row per engine, or what to check)."""
    live = [e for e in engines if e.get("state") in ("connected", "idle")]
    status = f", {health.get('status')}" if health and health.get("status") else ""
    lines = [f"collector {url.rstrip('/')}{status}: {len(live)} engine{'s' if len(live) != 1 else ''} "
             f"connected" + (f" ({len(engines) - len(live)} disconnected)" if len(engines) > len(live) else "")]
    if not engines:
        lines.append("no engine has connected since this collector started. Is vLLM running with "
                     "KVFABRIC_LIFECYCLE=1, and is KVFABRIC_SINK this collector's socket (the default, for the "
                     "same user)? vLLM's log has a line 'KVFabric ... recording on' when the plugin is on.")
        return "\n".join(lines)
    now = time.time()
    lines += aligned([title for title, _ in _COLUMNS], [[_cell(e, key, now) for _, key in _COLUMNS] for e in engines])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    token = args.token if args.token is not None else (str(settings_table.read(TOKEN_ENV)) or None)
    health, engines = fetch(args.url, token, args.timeout)
    if args.format == "json":
        print(json.dumps({"collector": args.url.rstrip("/"), "health": health, "engines": engines}, indent=2))
    else:
        print(render(args.url, health, engines))
    return 0 if any(e.get("state") in ("connected", "idle") for e in engines) else 1
