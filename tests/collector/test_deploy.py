"""deploy/: compose file, Dockerfiles, systemd unit, Prometheus config and rules, checked structurally.

No Docker engine runs in this project's test machines, so `docker compose` is never started: the compose file is
parsed and every file it mounts or builds from must exist, and the collector must accept every flag the compose
file, the images and the systemd unit pass it. Prometheus itself (promtool, a live server) is exercised in
tests/collector/test_prometheus.py.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
UNIT = DEPLOY / "systemd" / "kvfabric-collector.service"
SYSUSERS = DEPLOY / "systemd" / "kvfabric.sysusers.conf"
METRICS_DOC = REPO / "docs" / "metrics.md"


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _collector_args(argv: list[str]) -> Any:
    """Parse collector flags exactly as ``python -m kvfabric.collector`` does, and check what it checks before it
    starts (the flags agree; a non-loopback bind has a token or says it needs none)."""
    from kvfabric.collector.config import check_http_exposure, config_from_args
    from kvfabric.collector.main import build_parser

    args = build_parser().parse_args(argv)
    check_http_exposure(config_from_args(args))
    return args


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# ------------------------------------------------------------------------------------------------- compose


def test_compose_services_and_mounts() -> None:
    compose = _compose()
    services = compose["services"]
    assert set(services) == {"vllm", "collector", "prometheus", "grafana"}
    named = set(compose.get("volumes", {}))
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source, target, *mode = volume.split(":")
            assert PurePosixPath(target).is_absolute(), (name, volume)
            if source.startswith((".", "/")):
                path = (DEPLOY / source).resolve()
                assert path.exists(), f"{name}: mount source {source} does not exist ({path})"
                assert mode == ["ro"], f"{name}: configuration mounts are read-only: {volume}"
            else:
                assert source in named, f"{name}: named volume {source} is not declared"
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: publish on loopback only, not {port}"
        if "build" in service:
            context = (DEPLOY / service["build"]["context"]).resolve()
            assert context == REPO, f"{name}: build from the repository root"
            assert (context / service["build"]["dockerfile"]).is_file()
    for name in ("prometheus", "grafana"):
        image = services[name]["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image ({image})"
    assert services["grafana"]["image"].startswith("grafana/grafana:11.6")


def test_compose_wiring_between_services() -> None:
    services = _compose()["services"]
    collector, vllm, prometheus, grafana = (services[n] for n in ("collector", "vllm", "prometheus", "grafana"))
    # The collector's flags parse, and its socket is in the volume vLLM mounts too.
    args = _collector_args(collector["command"])
    assert args.socket_mode == 0o660 and args.host == "0.0.0.0"
    socket_dir = str(PurePosixPath(args.socket_path).parent)
    shared = {v.split(":")[0] for v in collector["volumes"] if v.split(":")[1] == socket_dir}
    assert shared and shared == {v.split(":")[0] for v in vllm["volumes"] if v.split(":")[1] == socket_dir}
    env = vllm["environment"]
    assert env["KVFABRIC_LIFECYCLE"] == "1" and env["KVFABRIC_SINK"] == f"unix://{args.socket_path}"
    assert vllm["depends_on"]["collector"]["condition"] == "service_healthy"
    assert "--enable-prefix-caching" in vllm["command"]
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    # Prometheus scrapes the ports the services listen on, with this repository's config and rules.
    targets = {job["job_name"]: job["static_configs"][0]["targets"]
               for job in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    assert targets["kvfabric-collector"] == [f"collector:{args.port}"]
    assert targets["vllm"] == [f"vllm:{_flag(vllm['command'], '--port')}"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "./prometheus/rules:/etc/prometheus/rules:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    # Grafana gets both provisioning directories and the generated dashboards.
    assert {v.split(":")[1] for v in grafana["volumes"]} >= {
        "/etc/grafana/provisioning/datasources", "/etc/grafana/provisioning/dashboards",
        "/var/lib/grafana/dashboards/kvfabric"}
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (REPO / "dashboards" / "json" / PurePosixPath(home).name).is_file()


# ---------------------------------------------------------------------------------------------- images


def _dockerfile(path: Path) -> list[str]:
    """Instructions of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_vllm_image_installs_the_plugin() -> None:
    lines = _dockerfile(DEPLOY / "vllm" / "Dockerfile")
    arg = next(line for line in lines if line.startswith("ARG VLLM_VERSION="))
    version = arg.split("=", 1)[1]
    pinned = re.search(r"^vllm==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert pinned and version == f"v{pinned.group(1)}", "the image's vLLM is the version CI tests"
    assert "FROM vllm/vllm-openai:${VLLM_VERSION}" in lines
    run = next(line for line in lines if line.startswith("RUN ") and "pip install" in line)
    assert re.search(r"pip install .*-c constraints\.txt \.( |$)", run), run
    assert "[vllm]" not in run, "never reinstall vLLM/torch over the image's own"
    assert "vllm.general_plugins" in run, "the build fails if the entry point is missing"
    _check_copies(lines, DEPLOY / "vllm" / "Dockerfile.dockerignore")


def test_collector_image() -> None:
    lines = _dockerfile(DEPLOY / "collector" / "Dockerfile")
    assert lines[0].startswith("FROM python:3.11")
    assert any(line.startswith("USER ") and "root" not in line for line in lines)
    assert any(line.startswith("HEALTHCHECK ") and "/healthz" in line for line in lines)
    entry = next(line for line in lines if line.startswith("ENTRYPOINT "))
    assert yaml.safe_load(entry.split(" ", 1)[1]) == ["python3", "-m", "kvfabric.collector"]
    cmd = yaml.safe_load(next(line for line in lines if line.startswith("CMD ")).split(" ", 1)[1])
    args = _collector_args(cmd)
    assert args.socket_path.startswith("/run/kvfabric/") and args.db_path.startswith("/var/lib/kvfabric/")
    _check_copies(lines, DEPLOY / "collector" / "Dockerfile.dockerignore")


def _check_copies(lines: list[str], ignore_file: Path) -> None:
    """Every COPY source exists in the repository and is let through the Dockerfile's .dockerignore."""
    allowed = [line[1:].rstrip("/") for line in ignore_file.read_text().splitlines() if line.startswith("!")]
    for line in lines:
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (REPO / source).exists(), source
                assert source.rstrip("/") in allowed, f"{source} is excluded by {ignore_file.name}"


# --------------------------------------------------------------------------------------------- systemd


def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as section -> key -> values (keys may repeat; continuation lines joined)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_unit_is_hardened() -> None:
    service = _unit(UNIT)["Service"]

    def one(key: str) -> str:
        assert key in service, f"missing {key}="
        return service[key][-1]

    assert one("User") == "kvfabric" and one("Group") == "kvfabric"
    assert re.search(r"^u kvfabric ", SYSUSERS.read_text(), re.M), "sysusers.d must create the user"
    expected = {
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "PrivateDevices": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes", "RestrictNamespaces": "yes", "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes", "MemoryDenyWriteExecute": "yes", "SystemCallArchitectures": "native",
        "RuntimeDirectory": "kvfabric", "RuntimeDirectoryMode": "0750", "StateDirectory": "kvfabric",
        "CapabilityBoundingSet": "", "KillSignal": "SIGTERM", "Restart": "on-failure",
    }
    for key, value in expected.items():
        assert one(key) == value, f"{key}={one(key)!r}, want {value!r}"
    assert set(one("RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert "@system-service" in service["SystemCallFilter"]
    assert one("IPAddressDeny") == "any" and one("IPAddressAllow") == "localhost"
    # The collector accepts the flags, listens on loopback, and keeps its files in the unit's directories.
    argv = shlex.split(one("ExecStart"))
    assert argv[:3] == ["/opt/kvfabric/.venv/bin/python", "-m", "kvfabric.collector"]
    args = _collector_args(argv[3:])
    assert args.host == "127.0.0.1" and args.socket_mode == 0o660
    assert args.socket_path == "/run/kvfabric/kvfabric.sock" and args.db_path.startswith("/var/lib/kvfabric/")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_and_security() -> None:
    done = subprocess.run(["systemd-analyze", "verify", str(UNIT)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()
                  and "/opt/kvfabric/.venv/bin/python" not in line]  # the venv does not exist on this machine
    assert not complaints, "\n".join(complaints)
    done = subprocess.run(["systemd-analyze", "security", "--offline=true", str(UNIT)], capture_output=True,
                          text=True, timeout=60)
    if "--offline" in done.stderr and done.returncode != 0:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout)
    assert m, done.stdout + done.stderr
    assert float(m.group(1)) <= 2.0, done.stdout


# ------------------------------------------------------------------------------------- Prometheus config


def test_prometheus_config_structure() -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) >= {"kvfabric-collector", "vllm"}
    assert config["rule_files"] == ["rules/*.yml"] and RULES
    [relabel] = jobs["vllm"]["metric_relabel_configs"]
    assert relabel["source_labels"] == ["__name__"] and relabel["target_label"] == "__name__"


def test_vllm_relabel_restores_vllm_metric_names() -> None:
    """Why the relabel exists: prometheus_client, asked for OpenMetrics the way Prometheus 2.x asks, writes vLLM's
    `vllm:` samples as `vllm_`; the relabel (anchored, as Prometheus anchors regexes) gives the names back."""
    from prometheus_client import CollectorRegistry, Counter
    from prometheus_client.exposition import choose_encoder

    registry = CollectorRegistry()
    Counter("vllm:prefix_cache_queries", "queried tokens", registry=registry).inc(5)
    prometheus2_accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                          "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    encoder, _ = choose_encoder(prometheus2_accept)
    samples = [line.split()[0] for line in encoder(registry).decode().splitlines() if not line.startswith("#")]
    relabel = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    [rule] = next(job for job in relabel if job["job_name"] == "vllm")["metric_relabel_configs"]
    pattern = re.compile(f"^(?:{rule['regex']})$")
    renamed = {pattern.sub(rule["replacement"].replace("$1", r"\1"), name) for name in samples}
    assert "vllm:prefix_cache_queries_total" in renamed
    assert pattern.sub(rule["replacement"].replace("$1", r"\1"), "vllm:num_preemptions_total") == \
        "vllm:num_preemptions_total"  # names that arrive with colons are untouched


def test_alert_rules_structure() -> None:
    documented = set(re.findall(r"^\| `(kvfabric_[a-z0-9_]+)`", METRICS_DOC.read_text(), re.M))
    alerts = []
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                assert "alert" in rule, f"{path.name}: only alerting rules here"
                alerts.append(rule["alert"])
                assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
                assert rule["labels"]["severity"] in {"critical", "warning", "info"}
                assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 40
                for metric in re.findall(r"\b(kvfabric_[a-z0-9_]+?)(?:_bucket)?\b", rule["expr"]):
                    assert metric in documented, f"{rule['alert']}: {metric} is not in docs/metrics.md"
    assert len(alerts) == len(set(alerts))
    for wanted in ("KVFabricSharedAnchorEvictionsHigh", "KVFabricRebuiltRateHigh", "KVFabricSinkDropping",
                   "KVFabricIngestLagHigh", "KVFabricCollectorDown"):
        assert wanted in alerts


def test_readme_states_what_was_not_run() -> None:
    text = (DEPLOY / "README.md").read_text().lower()
    assert "no grafana server could be run" in text and "no docker engine" in text
