"""``--kv-events SPEC`` and ``--engine-metrics [ENGINE=]URL``: defaults, every key, and every mistake as one line
naming the spec (the collector exits 2 with it, before starting anything)."""

from __future__ import annotations

import socket

import pytest

from kvfabric.collector.config import CollectorConfig, config_from_args
from kvfabric.collector.main import build_parser, main
from kvfabric.kvevents.spec import SpecError, engine_metrics_targets, parse_engine_metrics, parse_spec


def test_defaults() -> None:
    s = parse_spec("tcp://10.0.0.7:5557")
    assert (s.endpoint, s.replay, s.engine, s.run_id, s.host, s.topic, s.metrics_url, s.hwm) == (
        "tcp://10.0.0.7:5557", None, "kv-events@10.0.0.7:5557", "default", "10.0.0.7", None, None, 10_000)
    assert parse_spec("tcp://127.0.0.1:5557").host == socket.gethostname()  # the engine runs here
    assert parse_spec("tcp://[::1]:5558").engine == "kv-events@[::1]:5558"


def test_every_key() -> None:
    s = parse_spec("tcp://gpu-3:5557, replay=tcp://gpu-3:5558,engine=llama/dp1,run=ab-1,topic=kv,"
                   "metrics=http://gpu-3:8000/metrics,host=node-3,hwm=50")
    assert (s.replay, s.engine, s.run_id, s.topic, s.metrics_url, s.host, s.hwm) == (
        "tcp://gpu-3:5558", "llama/dp1", "ab-1", "kv", "http://gpu-3:8000/metrics", "node-3", 50)


@pytest.mark.parametrize(("text", "says"), [
    ("", "give the publisher's address"),
    ("engine=x", "the first part must be the publisher's address"),
    ("udp://h:1", "is not tcp://HOST:PORT"),
    ("tcp://h", "is not tcp://HOST:PORT"),
    ("tcp://h:0", "no port in 1..65535"),
    ("tcp://h:99999", "no port in 1..65535"),
    ("tcp://*:5557", "is a bind address"),
    ("tcp://h:1,replay=h:2", "replay= 'h:2' is not tcp://HOST:PORT"),
    ("tcp://h:1,colour=red", "unknown key 'colour'"),
    ("tcp://h:1,engine", "is not KEY=VALUE"),
    ("tcp://h:1,engine=a,engine=b", "engine= given twice"),
    ("tcp://h:1,engine=", "engine= is empty"),
    ("tcp://h:1,run=a\x01b", "control characters"),
    ("tcp://h:1,engine=" + "e" * 1100, "at most 1024"),
    ("tcp://h:1,metrics=h:8000/metrics", "is not an http(s)://HOST[:PORT]/metrics URL"),
    ("tcp://h:1,hwm=0", "hwm='0' must be an integer"),
])
def test_each_mistake_is_one_line(text: str, says: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(text)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_engine_metrics_targets() -> None:
    one = parse_spec("tcp://h:1,engine=a,run=r1,host=n1,metrics=http://h:8000/metrics")
    two = parse_spec("tcp://h:2,engine=b")
    assert parse_engine_metrics("b=http://h:8001/metrics") == ("b", "http://h:8001/metrics")
    assert parse_engine_metrics("https://h/metrics") == (None, "https://h/metrics")
    targets = engine_metrics_targets([one, two], ["b=http://h:8001/metrics", "solo=http://other:9/metrics"])
    assert [(t.engine, t.url, t.run_id, t.host) for t in targets] == [
        ("a", "http://h:8000/metrics", "r1", "n1"), ("b", "http://h:8001/metrics", "default", "h"),
        ("solo", "http://other:9/metrics", "default", "other")]
    assert engine_metrics_targets([two], ["http://h:8001/metrics"])[0].engine == "b"  # the only engine
    with pytest.raises(SpecError, match="name the engine"):
        engine_metrics_targets([one, two], ["http://h:8001/metrics"])
    with pytest.raises(SpecError, match="already has an engine-metrics URL"):
        engine_metrics_targets([one], ["a=http://h:9/metrics"])


def test_the_collector_refuses_a_bad_spec_in_one_line_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kv-events", "tcp://h:1", "--kv-events", "tcp://h:2,engine=kv-events@h:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "engine 'kv-events@h:1' is already the engine of 'tcp://h:1'" in err
    assert main(["--kv-events", "tcp://h:1", "--lake", "x.duckdb", "--data", "d", "--read-only"]) == 2
    assert "a --read-only collector takes neither" in capsys.readouterr().err


def test_specs_travel_to_a_child_collector_as_flags() -> None:
    config = CollectorConfig(kv_events=("tcp://h:1,engine=a", "tcp://h:2"), engine_metrics=("a=http://h/metrics",))
    args = build_parser().parse_args(config.to_argv())
    again = config_from_args(args)
    assert (again.kv_events, again.engine_metrics) == (config.kv_events, config.engine_metrics)
    settings = again.ingest_settings()
    assert [s.engine for s in settings.kv_events] == ["a", "kv-events@h:2"]
    assert [t.engine for t in settings.engine_metrics] == ["a"]
