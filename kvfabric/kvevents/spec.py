"""What ``--kv-events SPEC`` and ``--engine-metrics [ENGINE=]URL`` say, parsed and checked.

``SPEC`` is ``tcp://HOST:PORT[,replay=tcp://HOST:PORT][,engine=NAME][,run=RUN][,topic=T][,metrics=URL][,host=H]
[,hwm=N]``: the publisher's PUB address (vLLM binds ``tcp://*:5557`` by default; the collector connects to the
engine's host), its replay ROUTER, and how the stream's rows are labelled. Every mistake is one
:class:`SpecError` line that names the spec and the part at fault (the collector turns it into a usage error,
exit status 2).

Defaults: ``engine`` ``kv-events@HOST:PORT`` (vLLM gives each data-parallel rank its own port, base + rank, so
the address already tells ranks apart), ``run`` ``default`` (the plugin's ``KVFABRIC_RUN_ID`` default), ``host`` the
endpoint's host (this machine's name when that is a loopback address), ``topic`` any (vLLM's default topic is
empty), ``hwm`` :data:`~kvfabric.ingest.defaults.KV_EVENTS_RCVHWM` messages.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvfabric.contract.protocol import MAX_LABEL_CHARS
from kvfabric.ingest import defaults as D

KEYS = ("replay", "engine", "run", "topic", "metrics", "host", "hwm")
DEFAULT_RUN = "default"


class SpecError(ValueError):
    """A ``--kv-events`` or ``--engine-metrics`` value that cannot be used; the message is one line."""


@dataclass(frozen=True)
class KvEventsSpec:
    """One engine's (or data-parallel rank's) KV-event stream. Invariant: every field is checked (addresses are
    ``tcp://HOST:PORT`` with a port in 1..65535, labels are non-empty, printable and at most
    :data:`~kvfabric.contract.protocol.MAX_LABEL_CHARS` characters)."""

    endpoint: str
    replay: str | None
    engine: str
    run_id: str
    host: str
    topic: str | None  # None: any topic (ZMQ subscriptions are prefixes, so a given topic is also checked exactly)
    metrics_url: str | None
    hwm: int
    text: str  # as given, for messages

    @property
    def endpoint_address(self) -> tuple[str, int]:
        return _split_tcp(self.endpoint, self.text, "the endpoint")


@dataclass(frozen=True)
class EngineMetricsSpec:
    """An engine's Prometheus endpoint whose prefix-cache counters become ``prefix_cache_counters`` rows."""

    url: str
    engine: str
    run_id: str
    host: str


def parse_spec(text: str) -> KvEventsSpec:
    """``--kv-events`` value -> :class:`KvEventsSpec`; raises :class:`SpecError`."""
    shown = text.strip()
    parts = [p.strip() for p in shown.split(",")]
    if not parts or not parts[0]:
        raise SpecError(f"--kv-events {text!r}: give the publisher's address, tcp://HOST:PORT")
    endpoint = parts[0]
    if "=" in endpoint.split("://", 1)[0]:
        raise SpecError(f"--kv-events {text!r}: the first part must be the publisher's address tcp://HOST:PORT, "
                        f"got {endpoint!r}")
    host, port = _split_tcp(endpoint, shown, "the endpoint")
    options: dict[str, str] = {}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            raise SpecError(f"--kv-events {text!r}: {part!r} is not KEY=VALUE (keys: {', '.join(KEYS)})")
        if key not in KEYS:
            raise SpecError(f"--kv-events {text!r}: unknown key {key!r} (keys: {', '.join(KEYS)})")
        if key in options:
            raise SpecError(f"--kv-events {text!r}: {key}= given twice")
        options[key] = value.strip()
    replay = options.get("replay")
    if replay is not None:
        _split_tcp(replay, shown, "replay=")
    engine = _label(options.get("engine", f"kv-events@{_hostport(host, port)}"), shown, "engine=")
    run_id = _label(options.get("run", DEFAULT_RUN), shown, "run=")
    node = _label(options.get("host", _machine(host)), shown, "host=")
    metrics_url = options.get("metrics")
    if metrics_url is not None:
        _check_url(metrics_url, f"--kv-events {text!r}: metrics=")
    hwm = D.KV_EVENTS_RCVHWM
    if "hwm" in options:
        try:
            hwm = int(options["hwm"])
        except ValueError:
            hwm = -1
        if not 1 <= hwm <= 10_000_000:
            raise SpecError(f"--kv-events {text!r}: hwm={options['hwm']!r} must be an integer in 1..10000000 "
                            "(messages the collector's SUB socket holds before ZMQ drops)")
    topic = options.get("topic")
    return KvEventsSpec(endpoint=endpoint, replay=replay, engine=engine, run_id=run_id, host=node, topic=topic,
                        metrics_url=metrics_url, hwm=hwm, text=shown)


def parse_engine_metrics(text: str) -> tuple[str | None, str]:
    """``--engine-metrics [ENGINE=]URL`` -> (engine or None, url); raises :class:`SpecError`."""
    shown = text.strip()
    engine: str | None = None
    head, sep, rest = shown.partition("=")
    if sep and "://" not in head:
        engine = _label(head.strip(), shown, "ENGINE=", flag="--engine-metrics")
        shown_url = rest.strip()
    else:
        shown_url = shown
    _check_url(shown_url, f"--engine-metrics {text!r}:")
    return engine, shown_url


def engine_metrics_targets(specs: Sequence[KvEventsSpec], flags: Iterable[str]) -> list[EngineMetricsSpec]:
    """Every engine-metrics endpoint to scrape: the specs' ``metrics=`` and the ``--engine-metrics`` flags. A flag
    without ``ENGINE=`` belongs to the one ``--kv-events`` engine (an error when there are several); an engine is
    scraped once. Run and host are those of the engine's spec (else ``default`` and the URL's host)."""
    by_engine = {s.engine: s for s in specs}
    targets: dict[str, EngineMetricsSpec] = {}

    def add(engine: str, url: str, where: str) -> None:
        if engine in targets:
            raise SpecError(f"{where}: engine {engine!r} already has an engine-metrics URL ({targets[engine].url})")
        spec = by_engine.get(engine)
        host = spec.host if spec is not None else _machine(urlsplit(url).hostname or "")
        targets[engine] = EngineMetricsSpec(url=url, engine=engine, run_id=spec.run_id if spec else DEFAULT_RUN,
                                            host=host)

    for s in specs:
        if s.metrics_url is not None:
            add(s.engine, s.metrics_url, f"--kv-events {s.text!r}")
    for flag in flags:
        engine, url = parse_engine_metrics(flag)
        if engine is None:
            if len(specs) != 1:
                raise SpecError(f"--engine-metrics {flag!r}: name the engine (ENGINE=URL): "
                                f"{len(specs)} --kv-events engines are configured")
            engine = specs[0].engine
        add(engine, url, f"--engine-metrics {flag!r}")
    return list(targets.values())


def check_unique(specs: Sequence[KvEventsSpec]) -> None:
    """Two specs of one engine label would write one stream from two publishers: refused."""
    seen: dict[str, str] = {}
    for s in specs:
        if s.engine in seen:
            raise SpecError(f"--kv-events {s.text!r}: engine {s.engine!r} is already the engine of "
                            f"{seen[s.engine]!r} (give each publisher its own engine=)")
        seen[s.engine] = s.text


# ---- parts -----------------------------------------------------------------------------------------------------

def _split_tcp(address: str, text: str, what: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise SpecError(f"--kv-events {text!r}: {what} {address!r} is not tcp://HOST:PORT")
    rest = address[len("tcp://"):]
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port_text = rest.rpartition(":")
    if not host or not port_text:
        raise SpecError(f"--kv-events {text!r}: {what} {address!r} is not tcp://HOST:PORT")
    if host == "*" or host in ("0.0.0.0", "::"):
        raise SpecError(f"--kv-events {text!r}: {what} {address!r} is a bind address: give the engine's host "
                        "(vLLM binds tcp://*:PORT; the collector connects to HOST:PORT)")
    try:
        port = int(port_text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise SpecError(f"--kv-events {text!r}: {what} {address!r} has no port in 1..65535")
    return host, port


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _machine(host: str) -> str:
    """The ``host`` column of an endpoint's rows: the endpoint's host, or this machine's name for a loopback one
    (the engine runs here; the plugin would have written this name)."""
    name = host.strip("[]")
    try:
        loopback = ipaddress.ip_address(name).is_loopback
    except ValueError:
        loopback = name == "localhost"
    return socket.gethostname() if loopback or not name else name


def _label(value: str, text: str, what: str, *, flag: str = "--kv-events") -> str:
    if not value:
        raise SpecError(f"{flag} {text!r}: {what} is empty")
    if len(value) > MAX_LABEL_CHARS:
        raise SpecError(f"{flag} {text!r}: {what} is {len(value)} characters (at most {MAX_LABEL_CHARS})")
    if not value.isprintable():
        raise SpecError(f"{flag} {text!r}: {what} {value[:40]!r} holds control characters")
    return value


def _check_url(url: str, where: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpecError(f"{where} {url!r} is not an http(s)://HOST[:PORT]/metrics URL")
