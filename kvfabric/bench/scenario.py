"""Scenario files: named, seeded workloads with the KV capacity that makes them a pressure test.

A scenario is a TOML file (``kvfabric/bench/scenarios/*.toml`` ships the bundled ones; ``--scenario`` takes a
bundled name or a path)::

    name = "template_family_revisit"
    description = "what the traffic is"
    shows = "what an A/B on it is meant to show"
    expect = "difference"            # or "no_difference": what a good policy should produce against LRU
    seed = 0
    prompt_format = "tokens"         # or "text"
    hints = true                     # send KVFabric's request hints (vllm_xargs)
    ttft_slo_ms = 2000.0             # optional: the TTFT SLO (ms) a request must meet to count toward goodput

    [server]                          # what the server must look like for the scenario to mean anything
    model = "llama-3-8b"
    kv_blocks = 1024                  # the capacity that makes it a pressure test ...
    capacity = "why: working set vs pool, in blocks"   # ... and why
    max_model_len = 8192
    latency_scale = 1.0

    [[traffic]]                       # one or more traffic components, run side by side
    name = "templates"
    mode = "persona_rotation"         # a mode of kvfabric/bench/modes.py
    sessions = 200                    # bound by sessions (deterministic content) ...
    requests = 400                    # ... and/or by requests
    concurrency = 4                   # sessions in flight at once
    rate = 2.0                        # optional: Poisson session arrivals per second (open loop)
    start_after_s = 0.0
    [traffic.params]                  # the mode's parameters
    personas = 8

A ``dataset`` traffic's ``path`` that is a bare file name not found in the current directory names a trace slice
shipped in ``kvfabric/bench/traces/`` (its README says where each comes from); any other path is read as given.

Bad files raise :class:`ScenarioError` with one line saying what is wrong.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvfabric.bench.modes import MODES, ModeError, mode_params
from kvfabric.bench.prompts import FORMATS

__all__ = ["FULL_TRACES_URL", "Scenario", "ScenarioError", "ServerSpec", "Traffic", "bundled_scenarios",
           "bundled_traces", "load_scenario", "single_mode_scenario"]

#: Where the full Mooncake traces are (the bundled slices are their first rows).
FULL_TRACES_URL = "https://github.com/kvcache-ai/Mooncake/tree/main/FAST25-release/traces"


class ScenarioError(ValueError):
    """A scenario that cannot be run, with a one-line reason."""


@dataclass(frozen=True)
class Traffic:
    """One traffic component: a mode, its parameters and its bounds."""

    name: str
    mode: str
    params: dict[str, Any] = field(default_factory=dict)
    sessions: int | None = None
    requests: int | None = None
    concurrency: int = 4
    rate: float | None = None
    start_after_s: float = 0.0


@dataclass(frozen=True)
class ServerSpec:
    """The server a scenario is sized for (``kvfabric ab`` starts it so; ``kvfabric bench`` only reports it)."""

    model: str = "llama-3-8b"
    kv_blocks: int = 4096
    block_size: int = 16
    max_model_len: int = 8192
    latency_scale: float = 1.0
    capacity: str = ""


@dataclass(frozen=True)
class Scenario:
    name: str
    traffic: tuple[Traffic, ...]
    description: str = ""
    shows: str = ""
    expect: str = ""
    seed: int = 0
    prompt_format: str = "tokens"
    hints: bool = True
    server: ServerSpec = field(default_factory=ServerSpec)
    source: str = ""
    #: The TTFT SLO in milliseconds that goodput counts requests against; ``None`` when the scenario states none.
    #: When set it is a finite number > 0.
    ttft_slo_ms: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The scenario as plans and results record it. A bundled trace slice is named by its bare file name (what
        the scenario file says, and what loading resolves again), never by where this machine installed it, so a
        record reads the same from any checkout and an A/B resumes on another machine."""
        d = asdict(self)
        for t in d["traffic"]:
            path = t["params"].get("path") if t["mode"] == "dataset" else None
            if isinstance(path, str) and _resolve_trace({"path": Path(path).name}).get("path") == path:
                t["params"]["path"] = Path(path).name
        return d


def _scenario_dir() -> Any:
    return resources.files("kvfabric.bench") / "scenarios"


def bundled_scenarios() -> list[str]:
    """Names of the scenarios shipped with the package."""
    return sorted(p.name.removesuffix(".toml") for p in _scenario_dir().iterdir() if p.name.endswith(".toml"))


def _trace_dir() -> Any:
    return resources.files("kvfabric.bench") / "traces"


def bundled_traces() -> list[str]:
    """File names of the trace slices shipped with the package (``kvfabric/bench/traces/*.jsonl``)."""
    return sorted(p.name for p in _trace_dir().iterdir() if p.name.endswith(".jsonl"))


def _resolve_trace(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with a bare ``path`` that is not a file here but a bundled trace slice made that slice's path."""
    path = params.get("path")
    if not isinstance(path, str) or not path or Path(path).is_file() or Path(path).name != path:
        return params
    bundled = _trace_dir() / path
    return {**params, "path": str(bundled)} if bundled.is_file() else params


def _int(raw: dict[str, Any], key: str, where: str, default: int | None, minimum: int = 1) -> int | None:
    v = raw.get(key, default)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ScenarioError(f"{where}: {key} must be an integer >= {minimum}, not {v!r}")
    return v


def _float(raw: dict[str, Any], key: str, where: str, default: float | None, minimum: float = 0.0) -> float | None:
    v = raw.get(key, default)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < minimum:
        raise ScenarioError(f"{where}: {key} must be a number >= {minimum}, not {v!r}")
    return float(v)


def _traffic(raw: dict[str, Any], index: int, where: str) -> Traffic:
    known = {"name", "mode", "params", "sessions", "requests", "concurrency", "rate", "start_after_s"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ScenarioError(f"{where}: traffic {index}: unknown key(s) {', '.join(unknown)}")
    mode = raw.get("mode")
    if mode not in MODES:
        raise ScenarioError(f"{where}: traffic {index}: mode must be one of {', '.join(MODES)}, not {mode!r}")
    params = raw.get("params") or {}
    if not isinstance(params, dict):
        raise ScenarioError(f"{where}: traffic {index}: params must be a table")
    if mode == "dataset":
        params = _resolve_trace(params)
    try:
        mode_params(mode, params)
    except ModeError as exc:
        hint = ""
        if mode == "dataset" and params.get("path") and not Path(str(params["path"])).is_file():
            hint = (f" (bundled trace slices: {', '.join(bundled_traces())}; the full Mooncake traces: "
                    f"{FULL_TRACES_URL})")
        raise ScenarioError(f"{where}: traffic {index}: {exc}{hint}") from None
    rate = _float(raw, "rate", where, None)
    t = Traffic(
        name=str(raw.get("name") or f"{mode}-{index}"),
        mode=mode,
        params=dict(params),
        sessions=_int(raw, "sessions", where, None),
        requests=_int(raw, "requests", where, None),
        concurrency=_int(raw, "concurrency", where, 4) or 4,
        rate=rate if rate else None,
        start_after_s=_float(raw, "start_after_s", where, 0.0) or 0.0,
    )
    return t


def scenario_from_dict(raw: dict[str, Any], where: str = "scenario") -> Scenario:
    known = {"name", "description", "shows", "expect", "seed", "prompt_format", "hints", "server", "traffic",
             "ttft_slo_ms"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}")
    traffic_raw = raw.get("traffic")
    if not isinstance(traffic_raw, list) or not traffic_raw:
        raise ScenarioError(f"{where}: needs at least one [[traffic]] table")
    traffic = tuple(_traffic(t, i, where) for i, t in enumerate(traffic_raw))
    names = [t.name for t in traffic]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{where}: traffic names must be unique: {names}")
    fmt = raw.get("prompt_format", "tokens")
    if fmt not in FORMATS:
        raise ScenarioError(f"{where}: prompt_format must be one of {', '.join(FORMATS)}")
    expect = raw.get("expect", "")
    if expect not in ("", "difference", "no_difference"):
        raise ScenarioError(f"{where}: expect must be 'difference' or 'no_difference'")
    srv_raw = raw.get("server") or {}
    srv_known = {"model", "kv_blocks", "block_size", "max_model_len", "latency_scale", "capacity"}
    if set(srv_raw) - srv_known:
        raise ScenarioError(f"{where}: [server]: unknown key(s) {', '.join(sorted(set(srv_raw) - srv_known))}")
    server = ServerSpec(
        model=str(srv_raw.get("model", "llama-3-8b")),
        kv_blocks=_int(srv_raw, "kv_blocks", where, 4096, minimum=2) or 4096,
        block_size=_int(srv_raw, "block_size", where, 16) or 16,
        max_model_len=_int(srv_raw, "max_model_len", where, 8192) or 8192,
        latency_scale=_float(srv_raw, "latency_scale", where, 1.0) or 0.0,
        capacity=str(srv_raw.get("capacity", "")),
    )
    seed = raw.get("seed", 0)
    if not isinstance(seed, int):
        raise ScenarioError(f"{where}: seed must be an integer")
    slo = raw.get("ttft_slo_ms")
    if slo is not None and (not isinstance(slo, (int, float)) or isinstance(slo, bool) or not math.isfinite(slo)
                            or slo <= 0):
        raise ScenarioError(f"{where}: ttft_slo_ms must be a number of milliseconds > 0, not {slo!r}")
    return Scenario(
        name=str(raw.get("name") or "scenario"),
        traffic=traffic,
        description=str(raw.get("description", "")).strip(),
        shows=str(raw.get("shows", "")).strip(),
        expect=expect,
        seed=seed,
        prompt_format=fmt,
        hints=bool(raw.get("hints", True)),
        server=server,
        source=where,
        ttft_slo_ms=float(slo) if slo is not None else None,
    )


def load_scenario(name_or_path: str) -> Scenario:
    """A bundled scenario by name, or a TOML file by path."""
    path = Path(name_or_path)
    if path.is_file():
        text, where = path.read_text(), str(path)
    else:
        res = _scenario_dir() / f"{name_or_path}.toml"
        if not res.is_file():
            known = ", ".join(bundled_scenarios())
            raise ScenarioError(f"no scenario {name_or_path!r}: not a file, nor one of {known}")
        text, where = res.read_text(), f"{name_or_path} (bundled)"
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{where}: not valid TOML: {exc}") from None
    scenario = scenario_from_dict(raw, where)
    if not raw.get("name"):
        scenario = Scenario(**{**scenario.__dict__, "name": path.stem})
    return scenario


def single_mode_scenario(mode: str, params: dict[str, Any], *, sessions: int | None, requests: int | None,
                         concurrency: int, rate: float | None, seed: int, prompt_format: str,
                         hints: bool) -> Scenario:
    """The scenario ``kvfabric bench --mode M`` runs: one traffic component."""
    raw: dict[str, Any] = {"name": mode, "mode": mode, "params": params, "concurrency": concurrency}
    if sessions is not None:
        raw["sessions"] = sessions
    if requests is not None:
        raw["requests"] = requests
    if rate is not None:
        raw["rate"] = rate
    return scenario_from_dict(
        {"name": mode, "seed": seed, "prompt_format": prompt_format, "hints": hints, "traffic": [raw]},
        where=f"--mode {mode}",
    )
