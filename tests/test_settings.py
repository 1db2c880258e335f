"""The settings table (kvfabric/settings.py): every ``KVFABRIC_*`` variable declared once, parsed by one reader, with
one warning line and the documented default for a bad value, and rendered into the docs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from kvfabric import settings as T
from kvfabric.contract import protocol as P
from kvfabric.contract import schema as S
from kvfabric.engine.config import HookSettings, default_socket_path, load_hook_settings

ROOT = Path(__file__).resolve().parent.parent

# One case per variable: (a good value, what it parses to, a bad value). test_every_variable_has_a_case keeps this
# in step with the table, so a variable added without a test fails here.
LONG = "x" * (P.MAX_LABEL_CHARS + 1)
CASES: dict[str, tuple[str, Any, str]] = {
    "KVFABRIC_LIFECYCLE": ("on", True, "yes-please"),
    "KVFABRIC_SINK": ("jsonl:///tmp/e.jsonl", "jsonl:///tmp/e.jsonl", "tcp://collector:9"),
    "KVFABRIC_LIFECYCLE_LOG_PATH": ("/var/log/kv.jsonl", "/var/log/kv.jsonl", "\udcff.jsonl"),
    "KVFABRIC_EVICTION_POLICY": ("Adaptive_Aging", "adaptive_aging", "arc"),
    "KVFABRIC_POLICY_MODEL": ("/models/m.json", "/models/m.json", "\udcffm.json"),
    "KVFABRIC_PROTECT_MIN_HIT_COUNT": ("3", 3, "0"),
    "KVFABRIC_TLRU_THRESHOLD_TOKENS": ("4096", 4096, "-1"),
    "KVFABRIC_TLRU_NEXT_PROMPT_TOKENS": ("0", 0, "many"),
    "KVFABRIC_ADMISSION_ANCHOR_BLOCKS": ("24", 24, "abc"),
    "KVFABRIC_CACHE_AWARE_SCHEDULING": ("YES", True, "sometimes"),
    "KVFABRIC_NATIVE": ("off", False, "maybe"),
    "KVFABRIC_FAMILY_DEPTH": ("2", 2, "-1"),
    "KVFABRIC_FAMILY_FROM_REQUEST_ID": ("true", True, "2"),
    "KVFABRIC_RUN_ID": ("  prod-a ", "prod-a", LONG),
    "KVFABRIC_ENGINE_ID": ("node-3/dp1", "node-3/dp1", LONG),
    "KVFABRIC_HOST": (" gpu-node-7 ", "gpu-node-7", LONG),
    "KVFABRIC_BATCH_EVENTS": ("8192", 8192, str(P.MAX_BATCH_ROWS)),
    "KVFABRIC_FLUSH_MS": ("50", 50, "0.5"),
    "KVFABRIC_BUFFER_EVENTS": ("1000", 1000, "0"),
    "KVFABRIC_EVICTED_MEMORY": ("200000", 200_000, "lots"),
    "KVFABRIC_REGRET_WINDOW_S": ("2.5", 2.5, "nan"),
    "KVFABRIC_API_TOKEN": (" s3cret ", " s3cret ", None),  # any text is a token: nothing to refuse
    "KVFABRIC_MAX_LABEL_RUNS": ("8", 8, "0"),
    "KVFABRIC_SIM_LATENCY": ("qwen", "qwen", "gpt"),
    "KVFABRIC_SIM_LATENCY_SCALE": ("0", 0.0, "-2"),
}


def test_every_variable_has_a_case() -> None:
    assert set(CASES) == set(T.BY_NAME)
    assert len(T.BY_NAME) == len(T.SETTINGS)  # no variable declared twice


def test_every_variable_in_the_code_is_declared() -> None:
    """Every KVFABRIC_* name the package or its deployment files mention is in the table."""
    names: dict[str, str] = {}
    for base in ("kvfabric", "deploy"):
        for path in (ROOT / base).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".c", ".yml", ".yaml", ".service", ".env", "") \
                    and "__pycache__" not in path.parts:
                for name in re.findall(r"(?<!\w)KVFABRIC_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")):
                    names.setdefault(name, str(path.relative_to(ROOT)))
    undeclared = {n: where for n, where in names.items() if n not in T.BY_NAME}
    assert not undeclared
    assert len(names) >= 15  # the scan sees the package (a broken glob would pass the line above vacuously)


# Modules that still read a variable straight from os.environ, each with the change that removes it:
# kvfabric.engine.install.engine_id should take HookSettings.engine_id (checked against the collector's limit);
# kvfabric.api.app and kvfabric.collector.status should take kvfabric.settings.read("KVFABRIC_API_TOKEN"). No other
# module may join them.
def ad_hoc_reads(text: str) -> set[str]:
    """KVFABRIC_* variables ``text`` reads from the environment itself (by literal or by a module constant)."""
    aliases = dict(re.findall(r"^(\w+)\s*=\s*[\"'](KVFABRIC_[A-Z0-9_]+)[\"']", text, re.M))
    found = set()
    for arg in re.findall(r"(?:environ\.get|getenv)\(\s*([\"']?\w+[\"']?)|environ\[\s*([\"']?\w+[\"']?)\s*\](?!\s*=)",
                          text):
        word = next(a for a in arg if a)
        name = aliases.get(word, word.strip("\"'"))
        if name.startswith("KVFABRIC_"):
            found.add(name)
    return found


def test_no_module_parses_a_variable_on_its_own() -> None:
    sample = 'X_ENV = "KVFABRIC_X"\na = os.environ.get(X_ENV)\nb = os.getenv("KVFABRIC_Y", "")\n' \
             'c = os.environ["KVFABRIC_Z"]\nos.environ["KVFABRIC_W"] = "1"\nd = env.get("KVFABRIC_V")\n'
    assert ad_hoc_reads(sample) == {"KVFABRIC_X", "KVFABRIC_Y", "KVFABRIC_Z"}
    found = set()
    for path in (ROOT / "kvfabric").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if rel != "kvfabric/settings.py":
            found |= {(rel, name) for name in ad_hoc_reads(path.read_text())}
    assert not found, f"read outside kvfabric/settings.py: {sorted(found)}"


@pytest.mark.parametrize("name", list(CASES))
def test_variable(name: str) -> None:
    """Per variable: unset or blank gives the documented default; a good value parses; a bad one gives the
    documented default and exactly one warning line naming the variable, the value, what is accepted and what is
    used instead."""
    setting = T.BY_NAME[name]
    good, parsed, bad = CASES[name]
    assert T.read(name, {}) == setting.default
    assert T.read(name, {name: "  "}) == setting.default
    warnings: list[str] = []
    value = T.read(name, {name: good}, warnings)
    assert value == (os.path.abspath(parsed) if setting.kind == "path" else parsed) and type(value) is type(parsed)
    assert warnings == []
    if bad is None:
        return
    assert T.read(name, {name: bad}, warnings) == setting.default
    assert len(warnings) == 1
    (line,) = warnings
    assert "\n" not in line
    assert line.startswith(f"{name}={T.shown(bad, setting)} ")
    assert f"(accepted: {setting.accepted()}); using the default {setting.default_text()}" in line


@pytest.mark.parametrize("name", [s.name for s in T.SETTINGS if s.field])
def test_hook_variable_through_load_hook_settings(name: str) -> None:
    """The hook's own reader gives the same: the good value in its field, the bad one the field's default."""
    setting = T.BY_NAME[name]
    good, parsed, bad = CASES[name]
    got = load_hook_settings({name: good})
    value = getattr(got, setting.field or "")
    if setting.kind == "path":
        parsed = os.path.abspath(parsed)
    if name == "KVFABRIC_POLICY_MODEL":
        assert value == "" and len(got.warnings) == 1  # no such file: the built-in model, said once
        assert got.warnings[0].startswith(f"KVFABRIC_POLICY_MODEL={parsed!r} is not a usable reuse model")
    else:
        assert value == parsed and got.warnings == ()
    bad_settings = load_hook_settings({name: bad})
    assert len(bad_settings.warnings) == 1 and bad_settings.warnings[0].startswith(f"{name}=")
    documented = setting.default if name != "KVFABRIC_SINK" else f"unix://{default_socket_path()}"
    assert getattr(bad_settings, setting.field or "") == documented


def test_dataclass_defaults_are_the_tables() -> None:
    """HookSettings() (built directly by replays and tests) has the table's defaults; the sink's is computed."""
    plain = HookSettings()
    for s in T.SETTINGS:
        if s.field and s.name != "KVFABRIC_SINK":
            assert getattr(plain, s.field) == s.default, s.name
    assert load_hook_settings({}) == HookSettings(sink=f"unix://{default_socket_path()}")


@pytest.mark.parametrize("word,value", [("1", True), ("0", False), ("TRUE", True), ("False", False),
                                        ("yes", True), ("No", False), (" on ", True), ("OFF", False)])
def test_booleans_accept_the_documented_words(word: str, value: bool) -> None:
    for name in ("KVFABRIC_LIFECYCLE", "KVFABRIC_NATIVE", "KVFABRIC_CACHE_AWARE_SCHEDULING",
                 "KVFABRIC_FAMILY_FROM_REQUEST_ID"):
        got = load_hook_settings({name: word})
        assert getattr(got, T.BY_NAME[name].field or "") is value and got.warnings == ()


def test_warning_line_format() -> None:
    (line,) = load_hook_settings({"KVFABRIC_NATIVE": "maybe"}).warnings
    assert line == ("KVFABRIC_NATIVE='maybe' is not a boolean (accepted: 1/0/true/false/yes/no/on/off); "
                    "using the default 1")
    (line,) = load_hook_settings({"KVFABRIC_RUN_ID": "a\nb" * 3000}).warnings
    assert "\n" not in line and len(line) < 300 and "(9000 characters)" in line
    assert line.endswith("using the default 'default'")


# ---------------------------------------------------------------------------------------------- the admission gate

@pytest.mark.parametrize("bad", ["abc", "-1", "2.5", "24 blocks"])
def test_bad_anchor_blocks_leave_the_gate_off(bad: str) -> None:
    got = load_hook_settings({"KVFABRIC_ADMISSION_ANCHOR_BLOCKS": bad})
    assert not got.admission_gate_on and not got.steers and not got.active
    assert got.admission_anchor_blocks == 0
    (line,) = got.warnings
    assert line.startswith(f"KVFABRIC_ADMISSION_ANCHOR_BLOCKS={bad!r} ") and line.endswith("using the default 0 (off)")
    assert "24" not in line.replace(bad, "")  # the default said is the documented one, not the old fallback


def test_stream_settings_tell_gate_on_from_gate_off() -> None:
    from kvfabric.engine.install import stream_metadata

    def recorded(env: dict[str, str]) -> dict[str, Any]:
        meta = stream_metadata(load_hook_settings(env), engine="e", policy="lru", block_size=16, num_blocks=64)
        return json.loads(meta[S.META_SETTINGS])

    on = recorded({"KVFABRIC_ADMISSION_ANCHOR_BLOCKS": "24"})
    off = recorded({})
    typo = recorded({"KVFABRIC_ADMISSION_ANCHOR_BLOCKS": "abc"})
    assert on["admission_gate"] is True and on["admission_anchor_blocks"] == 24
    assert off["admission_gate"] is False and off["admission_anchor_blocks"] == 0
    assert typo["admission_gate"] is False and typo["admission_anchor_blocks"] == 0
    assert on != off
    assert typo["warnings"] and typo["warnings"][0].startswith("KVFABRIC_ADMISSION_ANCHOR_BLOCKS='abc'")
    assert {k: v for k, v in typo.items() if k != "warnings"} == {k: v for k, v in off.items() if k != "warnings"}
    # Every hook setting in force is recorded.
    assert {s.field for s in T.SETTINGS if s.field} <= set(off)


# ---------------------------------------------------------------------------------------------- recording switches

def test_unknown_lifecycle_word_warns_and_stays_off() -> None:
    got = load_hook_settings({"KVFABRIC_LIFECYCLE": "yes-please"})
    assert not got.lifecycle and not got.active
    (line,) = got.warnings
    assert line.startswith("KVFABRIC_LIFECYCLE='yes-please' is not a boolean") and line.endswith("the default 0")


def test_log_path_is_shorthand_for_a_jsonl_recording(tmp_path: Path) -> None:
    path = str(tmp_path / "e.jsonl")
    got = load_hook_settings({"KVFABRIC_LIFECYCLE_LOG_PATH": path})
    assert got.lifecycle and got.active and got.sink == f"jsonl://{path}" and got.warnings == ()
    assert load_hook_settings({"KVFABRIC_LIFECYCLE_LOG_PATH": path, "KVFABRIC_LIFECYCLE": "1"}) == got
    off = load_hook_settings({"KVFABRIC_LIFECYCLE_LOG_PATH": path, "KVFABRIC_LIFECYCLE": "no"})
    assert not off.lifecycle and not off.active and off.warnings == ()
    # A bad KVFABRIC_LIFECYCLE is not an explicit "no": the shorthand's default (on) applies, and is said.
    typo = load_hook_settings({"KVFABRIC_LIFECYCLE_LOG_PATH": path, "KVFABRIC_LIFECYCLE": "of"})
    assert typo.lifecycle
    assert typo.warnings == ("KVFABRIC_LIFECYCLE='of' is not a boolean (accepted: 1/0/true/false/yes/no/on/off); "
                             "using the default 1 (KVFABRIC_LIFECYCLE_LOG_PATH is set)",)
    # An explicit sink wins, and the unused path is said.
    other = load_hook_settings({"KVFABRIC_LIFECYCLE_LOG_PATH": path, "KVFABRIC_SINK": "none"})
    assert other.lifecycle and other.sink == "none"
    (line,) = other.warnings
    assert line == f"KVFABRIC_LIFECYCLE_LOG_PATH={path!r} is not used: KVFABRIC_SINK='none' takes precedence"
    relative = load_hook_settings({"KVFABRIC_LIFECYCLE_LOG_PATH": "rel/e.jsonl"})
    assert relative.sink == f"jsonl://{os.path.abspath('rel/e.jsonl')}"


def test_native_maybe_keeps_the_compiled_default() -> None:
    got = load_hook_settings({"KVFABRIC_NATIVE": "maybe"})
    assert got.native is True and len(got.warnings) == 1


# ---------------------------------------------------------------------------------------------- the collector's limits

def _collector_accepts(run_id: str, engine: str) -> bool:
    from kvfabric.ingest.errors import BadStream
    from kvfabric.ingest.validate import parse_stream_meta

    meta = {S.META_SCHEMA_VERSION: str(S.SCHEMA_VERSION), S.META_STREAM_ID: "s", S.META_ENGINE: engine,
            S.META_RUN_ID: run_id, S.META_BLOCK_SIZE: "16", S.META_NUM_BLOCKS: "64", S.META_POLICY: "lru"}
    try:
        parse_stream_meta(S.stream_schema(meta))
    except BadStream:
        return False
    return True


@pytest.mark.parametrize("name", ["KVFABRIC_RUN_ID", "KVFABRIC_ENGINE_ID"])
def test_labels_the_collector_refuses_never_leave_the_hook(name: str) -> None:
    huge = "r" * 5000
    assert not _collector_accepts(huge, "e") and not _collector_accepts("r", huge)  # what the hook used to send
    got = load_hook_settings({name: huge})
    field = T.BY_NAME[name].field or ""
    assert getattr(got, field) == T.BY_NAME[name].default and len(got.warnings) == 1
    longest = "é" * P.MAX_LABEL_CHARS  # characters, not bytes, as the collector and the API count
    kept = load_hook_settings({name: longest})
    assert getattr(kept, field) == longest and kept.warnings == ()
    assert _collector_accepts(longest, longest)


def test_limits_are_shared_not_copied() -> None:
    from kvfabric.api.params import MAX_TEXT
    from kvfabric.collector.config import CollectorConfig
    from kvfabric.ingest import validate

    assert validate.MAX_META_VALUE_CHARS == P.MAX_META_VALUE_CHARS
    assert validate.MAX_SETTINGS_CHARS == P.MAX_SETTINGS_CHARS
    assert MAX_TEXT == P.MAX_LABEL_CHARS <= P.MAX_META_VALUE_CHARS
    assert validate.BatchLimits().max_rows == CollectorConfig().max_batch_rows == P.MAX_BATCH_ROWS
    # The largest accepted batch, plus the row reporting lost events, fits the collector's default.
    assert T.BY_NAME["KVFABRIC_BATCH_EVENTS"].maximum + 1 <= P.MAX_BATCH_ROWS  # type: ignore[operator]


def test_latency_model_names_are_the_simulators() -> None:
    # The table names the models without importing the simulator (above it); the simulator checks the names at load.
    from kvfabric.sim.latency import LATENCY_MODELS

    assert tuple(LATENCY_MODELS) == T.LATENCY_MODEL_NAMES
    assert T.BY_NAME["KVFABRIC_SIM_LATENCY"].default in T.LATENCY_MODEL_NAMES
    assert T.BY_NAME["KVFABRIC_SIM_LATENCY"].accepted() == "/".join(T.LATENCY_MODEL_NAMES)


def test_settings_metadata_fits_the_collector() -> None:
    worst = load_hook_settings({n: "\udcff" + "w" * 5000 for n in T.BY_NAME if T.BY_NAME[n].field})
    assert len(json.dumps(worst.as_metadata())) < P.MAX_SETTINGS_CHARS
    assert len(worst.warnings) == len([s for s in T.SETTINGS if s.field])  # each bad value said once


def test_undecodable_bytes_are_refused() -> None:
    """Bytes that are not UTF-8 reach os.environ as surrogates; Arrow metadata could not carry them."""
    got = load_hook_settings({"KVFABRIC_RUN_ID": "run-\udcff"})
    assert got.run_id == "default" and "is not valid UTF-8" in got.warnings[0]


# ---------------------------------------------------------------------------------------------- collector and sim

def test_collector_reads_its_variables_through_the_table(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    from kvfabric.collector.config import CollectorConfig
    from kvfabric.ingest.metrics import CollectorMetrics

    monkeypatch.setenv("KVFABRIC_MAX_LABEL_RUNS", "3")
    assert CollectorMetrics()._max_runs == 3
    monkeypatch.setenv("KVFABRIC_MAX_LABEL_RUNS", "0")
    with caplog.at_level("WARNING", logger="kvfabric.settings"):
        assert CollectorMetrics()._max_runs == 64
    assert "KVFABRIC_MAX_LABEL_RUNS='0' is below 1 (accepted: an integer >= 1); using the default 64" in caplog.text
    monkeypatch.setenv("KVFABRIC_API_TOKEN", "t0ken")
    assert CollectorConfig().resolved_token() == "t0ken"
    assert CollectorConfig(token="").resolved_token() is None
    monkeypatch.setenv("KVFABRIC_API_TOKEN", "")
    assert CollectorConfig().resolved_token() is None
    assert T.shown("t0ken", T.BY_NAME["KVFABRIC_API_TOKEN"]) == "<5 characters>"


@pytest.mark.vllm
def test_simulated_executor_reads_its_variables_through_the_table(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    from kvfabric.sim.executor import LATENCY_ENV, LATENCY_SCALE_ENV, SimulatedExecutor

    def started() -> Any:
        ex = SimulatedExecutor.__new__(SimulatedExecutor)
        ex._init_executor()
        return ex

    monkeypatch.setenv(LATENCY_ENV, "QWEN")
    monkeypatch.setenv(LATENCY_SCALE_ENV, "0.5")
    ex = started()
    assert ex.latency.name == "qwen" and ex.latency_scale == 0.5
    monkeypatch.setenv(LATENCY_ENV, "gpt")
    monkeypatch.setenv(LATENCY_SCALE_ENV, "fast")
    with caplog.at_level("WARNING", logger="kvfabric.settings"):
        ex = started()
    assert ex.latency.name == "llama" and ex.latency_scale == 1.0
    assert "KVFABRIC_SIM_LATENCY='gpt' is not one of the accepted values" in caplog.text
    assert "KVFABRIC_SIM_LATENCY_SCALE='fast' is not a number" in caplog.text


# ---------------------------------------------------------------------------------------------- a real vLLM scheduler

def _run_plugin(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> tuple[Any, dict[str, Any], list[dict]]:
    """A real Scheduler, hooked through the plugin path with ``env`` as the only KVFABRIC_* variables; returns the
    installation, the stream metadata and the events its JSONL file holds."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvfabric.engine.plugin import unwrap_scheduler_class, wrap_scheduler_class
    from kvfabric.sim.harness import SimulatedEngine

    for var in [k for k in os.environ if k.startswith("KVFABRIC_")]:
        monkeypatch.delenv(var)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    wrap_scheduler_class(Scheduler)
    try:
        engine = SimulatedEngine.create(64, "zero", max_num_batched_tokens=4096)
    finally:
        unwrap_scheduler_class(Scheduler)
    inst = getattr(engine.scheduler, "_kvfabric", None)
    assert inst is not None
    shared = list(range(1000, 1000 + 16 * 6))
    engine.add_workload([(0.01 * i, f"r{i}", shared + list(range(i * 50, i * 50 + 40)), 2, None) for i in range(6)])
    engine.run_until_done(max_steps=10_000)
    inst.close()
    lines = Path(env["KVFABRIC_LIFECYCLE_LOG_PATH"]).read_text().splitlines()
    meta = json.loads(lines[0])["kvfabric_stream"]
    return inst, meta, [json.loads(x) for x in lines[1:]]


@pytest.mark.vllm
def test_log_path_alone_records_and_the_gate_shows_in_the_stream(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """Through vLLM's scheduler: KVFABRIC_LIFECYCLE_LOG_PATH alone records into its file; a typo in the gate's
    variable leaves it off, and the two streams' recorded settings tell them apart."""
    on_inst, on_meta, on_events = _run_plugin(monkeypatch, {
        "KVFABRIC_LIFECYCLE_LOG_PATH": str(tmp_path / "on.jsonl"), "KVFABRIC_ADMISSION_ANCHOR_BLOCKS": "2"})
    off_inst, off_meta, off_events = _run_plugin(monkeypatch, {
        "KVFABRIC_LIFECYCLE_LOG_PATH": str(tmp_path / "off.jsonl"), "KVFABRIC_ADMISSION_ANCHOR_BLOCKS": "abc"})
    for events in (on_events, off_events):
        assert sum(e["event"] == S.PREFIX_LOOKUP for e in events) == 6
    assert on_inst.steering is not None and on_inst.steering.gate is not None
    assert off_inst.steering is None or off_inst.steering.gate is None
    assert any(e["event"] == S.CACHE_ADMISSION_LIMITED for e in on_events)
    assert not any(e["event"] == S.CACHE_ADMISSION_LIMITED for e in off_events)
    on_settings, off_settings = json.loads(on_meta[S.META_SETTINGS]), json.loads(off_meta[S.META_SETTINGS])
    assert (on_settings["admission_gate"], off_settings["admission_gate"]) == (True, False)
    assert off_settings["warnings"][0].startswith("KVFABRIC_ADMISSION_ANCHOR_BLOCKS='abc'")


# ---------------------------------------------------------------------------------------------- the docs

@pytest.mark.parametrize("rel", T.DOC_FILES)
def test_docs_hold_the_generated_table(rel: str) -> None:
    """README.md, README.zh-CN.md and docs/design.md hold exactly the rendered table (regenerate with
    ``python -m kvfabric.settings --write-docs``)."""
    text = (ROOT / rel).read_text(encoding="utf-8")
    assert T.table_in(text) == T.render_table()
    for s in T.SETTINGS:
        assert f"| `{s.name}` |" in text


def test_write_docs_rewrites_only_between_the_markers(tmp_path: Path) -> None:
    text = "# head\n\nbefore\n" + T.BEGIN + "\n| stale |\n" + T.END + "\nafter\n"
    out = T.replace_table(text)
    assert out.startswith("# head\n\nbefore\n" + T.BEGIN + "\n") and out.endswith("\n" + T.END + "\nafter\n")
    assert T.table_in(out) == T.render_table() and T.replace_table(out) == out
    with pytest.raises(ValueError):
        T.replace_table(text + T.BEGIN)
    assert T.main(["--check"]) == 0
    assert T.main(["--bogus"]) == 2
