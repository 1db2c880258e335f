"""deploy/fleet/: the fleet's compose file, Kubernetes manifests, collector image and Prometheus config, checked
structurally (no Docker engine or cluster runs on this project's test machines).

Every ``kvfabric collector`` command line is parsed by the collector's real parser and turned into its config (so a
flag the collector would refuse fails here), with the environment it would get (compose interpolation defaults,
Kubernetes ``$(VAR)`` expansion from ConfigMap and Secret references). Then, per vLLM host (compose) or pod
(Kubernetes): vLLM and its collector share the socket path through the same volume; vLLM's ``KVFABRIC_*`` names are
the plugin's settings and their values parse; exactly one collector is ``--read-only`` and it mounts no socket;
every collector names the same lake; a collector listening beyond loopback has a token from a secret; Prometheus
scrapes every collector with that token. The checks are functions of the parsed files, and the last tests break
copies of the files and expect each check to fail.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from kvfabric import settings
from kvfabric.argtypes import duration_text
from kvfabric.collector.config import TOKEN_ENV, CollectorConfig, check_http_exposure, config_from_args
from kvfabric.collector.main import build_parser
from kvfabric.ingest import defaults as D

REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "deploy" / "fleet"
COMPOSE = FLEET / "docker-compose.yml"
PROMETHEUS = FLEET / "prometheus" / "prometheus.yml"
K8S = FLEET / "k8s"
SECRETS_TEMPLATE = K8S / "secrets.example.yaml"
ENV_EXAMPLE = FLEET / "fleet.env.example"
COLLECTOR_DOCKERFILE = FLEET / "collector" / "Dockerfile"
DOC = REPO / "docs" / "fleet.md"

COLLECTOR_PREFIX = ["kvfabric", "collector"]
SECRET_WORDS = ("PASSWORD", "SECRET", "TOKEN", "PGPASS", "ACCESS_KEY")


def _yaml_files() -> list[Path]:
    return sorted([*FLEET.rglob("*.yml"), *FLEET.rglob("*.yaml")])


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@dataclasses.dataclass
class Collector:
    """One ``kvfabric collector`` command line found in a manifest, parsed, with the environment it gets."""

    where: str
    config: CollectorConfig
    env: dict[str, str]
    argv: list[str]
    replicas: int = 1  # pods a Kubernetes workload runs of it


def _parse_collector(where: str, argv: list[str], env: dict[str, str]) -> Collector:
    assert argv[:2] == COLLECTOR_PREFIX, f"{where}: not a kvfabric collector command line: {argv}"
    try:
        args = build_parser().parse_args(argv[2:])
    except SystemExit:  # (argparse has printed the reason: an unknown flag, a bad value)
        raise AssertionError(f"{where}: the collector refuses its command line {argv}") from None
    config = config_from_args(args)
    assert "--token" not in argv, f"{where}: a token on argv is visible to ps: use ${TOKEN_ENV} from a secret"
    assert not config.allow_remote_without_token, f"{where}: --allow-remote-without-token serves every run to anyone"
    return Collector(where, config, env, argv)


def _sink_path(where: str, env: dict[str, str]) -> str:
    """The socket vLLM's plugin streams into: its KVFABRIC_* settings parsed by the plugin's own table."""
    names = {k for k in env if k.startswith("KVFABRIC_")}
    unknown = names - set(settings.BY_NAME)
    assert not unknown, f"{where}: {sorted(unknown)} are not KVFabric settings (kvfabric/settings.py)"
    for name in sorted(names):
        setting = settings.BY_NAME[name]
        assert setting.reader == settings.HOOK, f"{where}: {name} is read by the {setting.reader}, not by vLLM"
        if not env[name].startswith("<"):  # (a secret or field reference: its value is not in the file)
            setting.parse(env[name])  # BadValue: the plugin would warn and fall back to the default
    assert settings.BY_NAME["KVFABRIC_LIFECYCLE"].parse(env.get("KVFABRIC_LIFECYCLE", "0")) is True, \
        f"{where}: KVFABRIC_LIFECYCLE=1 turns the plugin on"
    sink = settings.BY_NAME["KVFABRIC_SINK"].parse(env.get("KVFABRIC_SINK", "none"))
    assert sink.startswith("unix://"), f"{where}: KVFABRIC_SINK must be the collector's socket, not {sink!r}"
    return sink[len("unix://"):]


# ---------------------------------------------------------------------------------------------- common checks


def check_collectors(where: str, collectors: list[Collector]) -> None:
    """Exactly one reader; every collector on the same shared lake; beyond loopback only with a token."""
    assert collectors, f"{where}: no kvfabric collector"
    readers = [c for c in collectors if c.config.read_only]
    assert len(readers) == 1, f"{where}: want exactly one --read-only collector, got {[c.where for c in readers]}"
    writers = sum(c.replicas for c in collectors if not c.config.read_only)
    assert writers >= 2, f"{where}: a fleet has at least two writer collectors, got {writers}"
    lakes = {c.where: c.config.lake_location() for c in collectors}
    assert len(set(lakes.values())) == 1, f"{where}: every collector names the same --lake and --data: {lakes}"
    lake = next(iter(lakes.values()))
    assert lake is not None and lake.catalog_kind == "postgres", f"{where}: a fleet's catalog is PostgreSQL"
    assert lake.remote_data and lake.data.startswith("s3://"), f"{where}: a fleet's data is on object storage"
    assert "password=" not in lake.catalog.lower(), f"{where}: the catalog's password goes in PGPASSWORD"
    for c in collectors:
        for name in ("PGPASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION"):
            assert name in c.env, f"{c.where}: {name} is not set"
        # The collector's own start-up check, with the token the manifest gives it (None: no token variable).
        check_http_exposure(dataclasses.replace(c.config, token=c.env.get(TOKEN_ENV, "")))
        if not c.config.read_only:
            assert c.config.retain_s > 0 and c.config.maintenance_interval_s > 0, c.where


# --------------------------------------------------------------------------------------------------- compose

_INTERPOLATION = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def _interpolate(value: Any) -> str:
    """A compose value as the container sees it: ${VAR:-default} -> default, a required ${VAR:?...} -> <VAR>."""
    def one(m: re.Match[str]) -> str:
        return m.group(3) if m.group(2) in (":-", "-") else f"<{m.group(1)}>"
    return _INTERPOLATION.sub(one, str(value)).replace("$$", "$")


def _compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: _interpolate(v) for k, v in env.items()}


def _argv(service: dict[str, Any]) -> list[str]:
    def words(x: Any) -> list[str]:
        if x is None:
            return []
        return shlex.split(x) if isinstance(x, str) else [_interpolate(w) for w in x]
    return words(service.get("entrypoint")) + words(service.get("command"))


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's volumes (short syntax)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        out[target] = source
    return out


def compose_collectors(compose: dict[str, Any]) -> dict[str, Collector]:
    return {name: _parse_collector(f"compose {name}", _argv(s), _compose_env(s))
            for name, s in compose["services"].items() if _argv(s)[:2] == COLLECTOR_PREFIX}


def compose_vllms(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if _argv(s)[:2] == ["vllm", "serve"]}


def check_compose_files(compose: dict[str, Any]) -> None:
    """Mount sources exist, named volumes are declared, ports are on loopback, images built from this repository."""
    named = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for target, source in _mounts(service).items():
            assert PurePosixPath(target).is_absolute(), (name, target)
            if source.startswith((".", "/")):
                assert (FLEET / source).resolve().exists(), f"{name}: mount source {source} does not exist"
            else:
                assert source in named, f"{name}: named volume {source} is not declared"
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: publish on loopback only, not {port}"
        if "build" in service:
            assert (FLEET / service["build"]["context"]).resolve() == REPO, f"{name}: build from the repository root"
            assert (REPO / service["build"]["dockerfile"]).is_file(), f"{name}: {service['build']['dockerfile']}"
        else:
            image = service["image"]
            assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image ({image})"
        for secret in service.get("secrets", []):
            assert secret in (compose.get("secrets") or {}), f"{name}: secret {secret} is not declared"


def check_compose_storage(compose: dict[str, Any], collectors: dict[str, Collector]) -> None:
    """PostgreSQL 15 on a named volume with a health check; an S3 server whose bucket a one-shot service creates
    before any collector starts; the collectors reach both by the names their --lake and AWS_ENDPOINT_URL give."""
    services = compose["services"]
    postgres = services["postgres"]
    assert postgres["image"] == "postgres:15"
    assert _mounts(postgres).get("/var/lib/postgresql/data") in set(compose["volumes"])
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert "POSTGRES_PASSWORD" not in postgres["environment"], "postgres reads its password from a secret file"
    lake = next(iter(collectors.values())).config.lake_location()
    assert lake is not None
    words = dict(w.split("=", 1) for w in lake.catalog.split(":", 1)[1].split())
    assert words["host"] == "postgres" and words["dbname"] == postgres["environment"]["POSTGRES_DB"]
    assert words["user"] == postgres["environment"]["POSTGRES_USER"]
    bucket = lake.data.split("://", 1)[1].split("/", 1)[0]
    makes_bucket = re.compile(rf"\bmc mb\b.*/{re.escape(bucket)}\b")
    inits = [name for name, s in services.items() if makes_bucket.search(" ".join(_argv(s)))]
    assert len(inits) == 1, f"no one-shot service creates bucket {bucket!r}"
    init = services[inits[0]]
    assert init.get("restart", "no") == "no"
    s3_host = next(iter(init["depends_on"]))
    assert init["depends_on"][s3_host]["condition"] == "service_healthy" and "healthcheck" in services[s3_host]
    for name, c in collectors.items():
        assert c.env["AWS_ENDPOINT_URL"].split("://", 1)[1].split(":")[0] == s3_host, name
        depends = services[name]["depends_on"]
        if not c.config.read_only:
            assert depends["postgres"]["condition"] == "service_healthy", name
            assert depends[inits[0]]["condition"] == "service_completed_successfully", name


def check_compose_hosts(compose: dict[str, Any], collectors: dict[str, Collector]) -> None:
    """Each vLLM host streams into its own collector through a socket in a volume only the two of them mount."""
    services = compose["services"]
    vllms = compose_vllms(compose)
    assert len(vllms) >= 2, "a fleet has at least two vLLM hosts"
    writers = {n: c for n, c in collectors.items() if not c.config.read_only}
    served: dict[str, str] = {}
    for name, vllm in vllms.items():
        path = _sink_path(f"compose {name}", _compose_env(vllm))
        socket_dir = str(PurePosixPath(path).parent)
        volume = _mounts(vllm).get(socket_dir)
        assert volume in set(compose["volumes"]), f"{name}: {socket_dir} is not on a named volume"
        mine = [n for n, c in writers.items()
                if c.config.socket_path == path and _mounts(services[n]).get(socket_dir) == volume]
        assert len(mine) == 1, f"{name}: want one collector on {path} in volume {volume}, got {mine}"
        others = [n for n, s in services.items() if n not in (name, mine[0]) and volume in _mounts(s).values()]
        assert not others, f"{name}: socket volume {volume} is also mounted by {others}"
        assert services[name]["depends_on"][mine[0]]["condition"] == "service_healthy", name
        assert services[name].get("hostname"), f"{name}: a stable hostname keeps the engine label stable"
        served[mine[0]] = name
    assert set(served) == set(writers), f"collectors serving no vLLM: {set(writers) - set(served)}"
    hostnames = [v["hostname"] for v in vllms.values()]
    assert len(set(hostnames)) == len(hostnames), "each vLLM host has its own hostname"
    for name, c in collectors.items():
        if c.config.read_only:
            assert not services[name].get("volumes"), f"{name}: the read-only collector mounts no socket volume"


def check_compose_secrets(compose: dict[str, Any]) -> None:
    """No secret value is written in the compose file: only ${VAR} interpolations (from .env) and secret files."""
    for name, service in compose["services"].items():
        env = service.get("environment") or {}
        for key, value in env.items():
            if any(word in key.upper() for word in SECRET_WORDS) and not key.endswith("_FILE"):
                assert re.fullmatch(r"\$\{\w+(:[-?][^}]*)?\}", str(value)), f"{name}: {key} is a literal"
                assert ":-" not in str(value) or str(value).endswith(":-}"), f"{name}: {key} has a default"
    for name, secret in (compose.get("secrets") or {}).items():
        assert set(secret) <= {"environment", "file"}, name
        if "file" in secret:
            assert not (FLEET / secret["file"]).exists(), f"secret {name}: a secret file is not committed"


def check_compose_prometheus(compose: dict[str, Any], prometheus: dict[str, Any],
                             collectors: dict[str, Collector]) -> None:
    """Prometheus scrapes every collector (with the collectors' token) and every vLLM; the writers in the job the
    dashboards and alerts select."""
    service = compose["services"]["prometheus"]
    mounts = {target: source for source, target, *_ in (v.split(":") for v in service["volumes"])}
    assert (FLEET / mounts["/etc/prometheus/prometheus.yml"]).resolve() == PROMETHEUS.resolve()
    assert (FLEET / mounts["/etc/prometheus/rules"]).resolve() == (REPO / "deploy" / "prometheus" / "rules").resolve()
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    targets = {job: {t for sc in j["static_configs"] for t in sc["targets"]} for job, j in jobs.items()}
    token_secrets = {n for n, s in compose["secrets"].items() if s.get("environment") == TOKEN_ENV}
    for name, c in collectors.items():
        scraped = [job for job, ts in targets.items() if f"{name}:{c.config.port}" in ts]
        assert len(scraped) == 1, f"Prometheus scrapes collector {name}:{c.config.port} in {scraped}"
        if not c.config.read_only:
            assert scraped == ["kvfabric-collector"], f"{name}: writers belong to job kvfabric-collector"
        auth = jobs[scraped[0]].get("authorization") or {}
        secret = PurePosixPath(auth.get("credentials_file", "/nowhere"))
        assert str(secret.parent) == "/run/secrets" and secret.name in token_secrets, \
            f"{name}: job {scraped[0]} sends no bearer token from the {TOKEN_ENV} secret"
        assert secret.name in service.get("secrets", []), f"prometheus does not mount secret {secret.name}"
        assert TOKEN_ENV in c.env, f"{name}: no token, yet Prometheus sends one"
    for name, vllm in compose_vllms(compose).items():
        assert f"{name}:{_argv(vllm)[_argv(vllm).index('--port') + 1]}" in targets["vllm"], name


def check_compose(compose: dict[str, Any], prometheus: dict[str, Any]) -> None:
    collectors = compose_collectors(compose)
    check_compose_files(compose)
    check_collectors("compose", list(collectors.values()))
    check_compose_storage(compose, collectors)
    check_compose_hosts(compose, collectors)
    check_compose_secrets(compose)
    check_compose_prometheus(compose, prometheus, collectors)


# ------------------------------------------------------------------------------------------------ Kubernetes

POD_OWNERS = ("Deployment", "StatefulSet", "DaemonSet")


def k8s_objects() -> list[dict[str, Any]]:
    objects = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name not in ("kustomization.yaml", SECRETS_TEMPLATE.name):
            objects += _docs(path)
    return objects


def _by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def _k8s_env(where: str, container: dict[str, Any], objects: list[dict[str, Any]],
             secrets: dict[str, dict[str, Any]]) -> dict[str, str]:
    """A container's environment as the kubelet builds it; Secret values stand as <secret name/key>."""
    maps = _by_kind(objects, "ConfigMap")
    env: dict[str, str] = {}
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = str(item["value"])
            continue
        ref = item["valueFrom"]
        if "configMapKeyRef" in ref:
            cm = ref["configMapKeyRef"]
            assert cm["name"] in maps and cm["key"] in maps[cm["name"]]["data"], f"{where}: {name}: no {cm}"
            env[name] = str(maps[cm["name"]]["data"][cm["key"]])
        elif "secretKeyRef" in ref:
            sk = ref["secretKeyRef"]
            if not sk.get("optional"):
                assert sk["key"] in secrets.get(sk["name"], {}).get("stringData", {}), \
                    f"{where}: {name}: Secret {sk['name']}/{sk['key']} is not in {SECRETS_TEMPLATE.name}"
            env[name] = f"<secret {sk['name']}/{sk['key']}>"
        else:
            env[name] = f"<{next(iter(ref))}>"
    return env


def _expand(words: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of command and args (an unknown $(VAR) stays as written)."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), w) for w in words]


def _k8s_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    return _expand(list(container.get("command", [])) + list(container.get("args", [])), env)


def _mount_of(container: dict[str, Any], path: str) -> str | None:
    return next((m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == path), None)


def _pods(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, pod template metadata, pod spec) of every workload."""
    return [(f"{o['kind']} {o['metadata']['name']}", o["spec"]["template"]["metadata"], o["spec"]["template"]["spec"])
            for o in objects if o["kind"] in POD_OWNERS]


def check_k8s_objects(objects: list[dict[str, Any]], kustomization: dict[str, Any]) -> None:
    """Every manifest is a named object in namespace kvfabric, and kustomization.yaml lists every file but the
    Secret template."""
    for o in objects:
        assert o.get("apiVersion") and o.get("kind") and o["metadata"].get("name"), o
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == kustomization["namespace"], o["metadata"]["name"]
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", SECRETS_TEMPLATE.name}
    assert set(kustomization["resources"]) == files, "kustomization.yaml lists every manifest"
    assert SECRETS_TEMPLATE.name not in kustomization["resources"], "placeholder Secrets are never applied"
    services = _by_kind(objects, "Service")
    for name, sts in _by_kind(objects, "StatefulSet").items():
        headless = services.get(sts["spec"]["serviceName"])
        assert headless and headless["spec"].get("clusterIP") == "None", f"{name}: serviceName is a headless Service"


def k8s_collectors(objects: list[dict[str, Any]], secrets: dict[str, dict[str, Any]]) -> list[Collector]:
    out = []
    for o in objects:
        if o["kind"] not in POD_OWNERS:
            continue
        where = f"{o['kind']} {o['metadata']['name']}"
        for c in _containers(o["spec"]["template"]["spec"]):
            env = _k8s_env(f"{where}/{c['name']}", c, objects, secrets)
            argv = _k8s_argv(c, env)
            if argv[:2] == COLLECTOR_PREFIX:
                collector = _parse_collector(f"{where}/{c['name']}", argv, env)
                out.append(dataclasses.replace(collector, replicas=int(o["spec"].get("replicas", 1))))
    return out


def check_k8s_pods(objects: list[dict[str, Any]], secrets: dict[str, dict[str, Any]]) -> None:
    """Per vLLM pod: one collector, a native sidecar started before vLLM, on the socket path vLLM streams into,
    through the same emptyDir, whose ownership an init container gives to the collector's user; the reader's pod
    has no socket at all."""
    vllm_pods = 0
    socket_volumes: set[str] = set()  # the socket volumes' names and mount paths, over every vLLM pod
    readers: list[tuple[str, dict[str, Any]]] = []
    for where, _meta, pod in _pods(objects):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        inits = pod.get("initContainers", [])
        parsed = []
        for c in _containers(pod):
            env = _k8s_env(f"{where}/{c['name']}", c, objects, secrets)
            argv = _k8s_argv(c, env)
            parsed.append((c, env, argv))
        vllms = [(c, env) for c, env, argv in parsed if argv[:2] == ["vllm", "serve"]]
        collectors = [(c, _parse_collector(f"{where}/{c['name']}", argv, env)) for c, env, argv in parsed
                      if argv[:2] == COLLECTOR_PREFIX]
        if not vllms:
            for c, coll in collectors:
                assert coll.config.read_only, f"{where}: a writer collector without vLLM"
                readers.append((where, c))
            continue
        vllm_pods += 1
        assert len(vllms) == 1 and len(collectors) == 1, f"{where}: one vLLM and its collector per pod"
        (vllm, vllm_env), (collector, coll) = vllms[0], collectors[0]
        path = _sink_path(f"{where}/vllm", vllm_env)
        socket_dir = str(PurePosixPath(path).parent)
        assert coll.config.socket_path == path, f"{where}: vLLM streams into {path}, the collector listens on " \
            f"{coll.config.socket_path}"
        volume = _mount_of(vllm, socket_dir)
        assert volume is not None and volume == _mount_of(collector, socket_dir), \
            f"{where}: vLLM and the collector do not mount the same volume at {socket_dir}"
        assert "emptyDir" in volumes[volume], f"{where}: the socket volume is an emptyDir"
        assert not coll.config.read_only
        assert collector in inits and collector.get("restartPolicy") == "Always", \
            f"{where}: the collector is a native sidecar (it starts before vLLM, stops after it)"
        assert collector.get("startupProbe", {}).get("httpGet", {}).get("path") == "/healthz", \
            f"{where}: vLLM starts once the collector's startup probe says the socket is there"
        kvf_env = {k for k in vllm_env if k.startswith("KVFABRIC_")}
        assert "KVFABRIC_HOST" in kvf_env, f"{where}: the pod's name is the host in the engine labels"
        uid = collector["securityContext"]["runAsUser"]
        assert uid != 0 and collector["securityContext"].get("runAsNonRoot") is True
        before = inits[: inits.index(collector)]
        prepare = [c for c in before if _mount_of(c, socket_dir) == volume and c.get("restartPolicy") != "Always"]
        assert prepare, f"{where}: nothing gives {socket_dir} to uid {uid} before the collector starts"
        script = " ".join(prepare[0]["command"] + prepare[0].get("args", []))
        assert re.search(rf"\bchmod 0?750 {re.escape(socket_dir)}\b", script), script
        assert re.search(rf"\bchown {uid}(:\d+)? {re.escape(socket_dir)}\b", script), script
        socket_volumes |= {volume, socket_dir}
    assert vllm_pods >= 1, "no vLLM pod"
    for where, c in readers:
        mounted = {m["name"] for m in c.get("volumeMounts", [])} | {m["mountPath"] for m in c.get("volumeMounts", [])}
        assert not mounted & socket_volumes, \
            f"{where}: the read-only collector mounts no socket volume ({sorted(mounted)})"


def check_k8s_prometheus(objects: list[dict[str, Any]], secrets: dict[str, dict[str, Any]]) -> None:
    """The scrape jobs keep, through a Service's EndpointSlices, the port of every collector (with the token)
    and of every vLLM."""
    [scrape] = [o for o in objects if o["kind"] == "ConfigMap" and "prometheus.yml" in o.get("data", {})]
    jobs = {j["job_name"]: j for j in yaml.safe_load(scrape["data"]["prometheus.yml"])["scrape_configs"]}
    services = _by_kind(objects, "Service")
    token_secret = next(sk for o in objects if o["kind"] in POD_OWNERS
                        for c in _containers(o["spec"]["template"]["spec"]) for e in c.get("env", [])
                        if e["name"] == TOKEN_ENV for sk in [e["valueFrom"]["secretKeyRef"]])

    def kept(job: dict[str, Any]) -> tuple[str, str]:
        [keep] = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
        assert keep["source_labels"] == ["__meta_kubernetes_service_name",
                                         "__meta_kubernetes_endpointslice_port_name"], job["job_name"]
        assert job["kubernetes_sd_configs"][0]["role"] == "endpointslice", job["job_name"]
        service, port = keep["regex"].split(";")
        return service, port

    def target_port(service: str, port_name: str, labels: dict[str, str]) -> int | None:
        svc = services.get(service)
        if svc is None or not set(svc["spec"]["selector"].items()) <= set(labels.items()):
            return None
        return next((int(p["targetPort"]) for p in svc["spec"]["ports"] if p["name"] == port_name), None)

    for where, meta, pod in _pods(objects):
        labels = meta["labels"]
        for c in _containers(pod):
            env = _k8s_env(where, c, objects, secrets)
            argv = _k8s_argv(c, env)
            if argv[:2] == COLLECTOR_PREFIX:
                port = _parse_collector(where, argv, env).config.port
                scraped = [n for n, j in jobs.items() if target_port(*kept(j), labels) == port]
                assert len(scraped) == 1, f"{where}/{c['name']}: port {port} scraped by {scraped}"
                auth = jobs[scraped[0]].get("authorization") or {}
                mount = f"/etc/prometheus/secrets/{token_secret['name']}/{token_secret['key']}"
                assert auth.get("credentials_file") == mount, f"{scraped[0]}: no bearer token from {mount}"
                assert any(p["containerPort"] == port for p in c.get("ports", [])), f"{where}: port {port}"
            elif argv[:2] == ["vllm", "serve"]:
                port = int(argv[argv.index("--port") + 1])
                assert "vllm" in jobs and target_port(*kept(jobs["vllm"]), labels) == port, where
    assert "kvfabric-collector" in jobs, "the dashboards and alert rules select job=\"kvfabric-collector\""


def check_k8s(objects: list[dict[str, Any]], kustomization: dict[str, Any], secrets: dict[str, dict[str, Any]]) -> None:
    check_k8s_objects(objects, kustomization)
    check_collectors("k8s", k8s_collectors(objects, secrets))
    check_k8s_pods(objects, secrets)
    check_k8s_prometheus(objects, secrets)


def _secrets_template() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _docs(SECRETS_TEMPLATE)}


# ------------------------------------------------------------------------------------------------------ tests


def test_every_yaml_file_parses() -> None:
    files = _yaml_files()
    names = {str(p.relative_to(FLEET)) for p in files}
    assert {"docker-compose.yml", "prometheus/prometheus.yml", "k8s/kustomization.yaml"} <= names
    for path in files:
        docs = _docs(path)
        assert docs and all(isinstance(d, dict) for d in docs), path
    for o in k8s_objects():
        if o["kind"] == "ConfigMap":
            for key, text in o["data"].items():
                if key.endswith((".yml", ".yaml")):
                    assert isinstance(yaml.safe_load(text), dict), (o["metadata"]["name"], key)


def test_compose() -> None:
    check_compose(_load(COMPOSE), _load(PROMETHEUS))


def test_kubernetes() -> None:
    check_k8s(k8s_objects(), _load(K8S / "kustomization.yaml"), _secrets_template())


def test_secret_template_and_env_example_hold_placeholders_only() -> None:
    for secret in _secrets_template().values():
        assert secret["kind"] == "Secret"
        assert all(v == "REPLACE-ME" for v in secret["stringData"].values()), secret["metadata"]["name"]
    env = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
               if line.strip() and not line.startswith("#"))
    compose_text = COMPOSE.read_text()
    required = set(re.findall(r"\$\{(\w+):\?", compose_text))
    assert required <= set(env), f"fleet.env.example lacks {required - set(env)}"
    for key, value in env.items():
        if any(word in key for word in (*SECRET_WORDS, "_KEY", "ROOT_USER")) and key != "HF_TOKEN":
            assert value.startswith("local-dev-only-"), f"{key}: mark local-dev defaults as such"
    assert ".env" in (FLEET / ".gitignore").read_text().split(), "the filled-in .env stays out of git"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds_the_manifests() -> None:
    """`kubectl kustomize` (offline) renders exactly the objects the checks above read."""
    done = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    built = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == \
        sorted((o["kind"], o["metadata"]["name"]) for o in k8s_objects())
    assert all(d["metadata"].get("namespace") == "kvfabric" for d in built if d["kind"] != "Namespace")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_compose_prometheus_config(tmp_path: Path) -> None:
    """`promtool check config` on a copy whose token file and rules exist here (it opens both)."""
    config = _load(PROMETHEUS)
    token = tmp_path / "token"
    token.write_text("t")
    for job in config["scrape_configs"]:
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(token)
    config["rule_files"] = [str(REPO / "deploy" / "prometheus" / "rules" / "*.yml")]
    copy_path = tmp_path / "prometheus.yml"
    copy_path.write_text(yaml.safe_dump(config))
    done = subprocess.run(["promtool", "check", "config", str(copy_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_collector_image() -> None:
    text = re.sub(r"\\\n", " ", COLLECTOR_DOCKERFILE.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[0].startswith("FROM python:3.11")
    run = next(ln for ln in lines if ln.startswith("RUN ") and "pip install" in ln)
    assert re.search(r"pip install .*-c constraints\.txt \"?\.\[lake\]\"?", run), "the image needs the [lake] extra"
    assert all(name in run for name in ("ducklake", "postgres_scanner", "httpfs")), "the build checks the extensions"
    entry = next(ln for ln in lines if ln.startswith("ENTRYPOINT "))
    assert yaml.safe_load(entry.split(" ", 1)[1]) == COLLECTOR_PREFIX
    assert any(ln.startswith("USER ") and "root" not in ln for ln in lines)
    uid = re.search(r"useradd .*--uid (\d+)", text)
    pods = [o for o in k8s_objects() if o["kind"] in POD_OWNERS]
    uids = {c.get("securityContext", {}).get("runAsUser", spec.get("securityContext", {}).get("runAsUser"))
            for o in pods for spec in [o["spec"]["template"]["spec"]] for c in _containers(spec)
            if c.get("command", [])[:2] == COLLECTOR_PREFIX}
    assert uid and uids == {int(uid.group(1))}, f"the manifests run the collector as {uids}, the image as {uid}"
    assert any(ln.startswith("HEALTHCHECK ") and "/healthz" in ln for ln in lines)
    allowed = [ln[1:].rstrip("/") for ln in (COLLECTOR_DOCKERFILE.parent / "Dockerfile.dockerignore").read_text()
               .splitlines() if ln.startswith("!")]
    for ln in lines:
        if ln.startswith("COPY "):
            *sources, _ = ln.split()[1:]
            for source in sources:
                assert (REPO / source).exists() and source.rstrip("/") in allowed, source
    images = {s.get("image") for s in _load(COMPOSE)["services"].values()
              if s.get("build", {}).get("dockerfile") == str(COLLECTOR_DOCKERFILE.relative_to(REPO))}
    k8s_images = {c["image"] for o in pods for c in _containers(o["spec"]["template"]["spec"])
                  if c.get("command", [])[:2] == COLLECTOR_PREFIX}
    assert len(images) == 1 and images == k8s_images, (images, k8s_images)


def test_doc_names_the_defaults_and_the_benchmark() -> None:
    text = DOC.read_text()
    assert "benchmarks/results/fleet.md" in text
    for flag, default in (("--retain", D.RETAIN_S), ("--maintenance-interval", D.MAINTENANCE_INTERVAL_S)):
        said = re.findall(rf"`{flag}` \(default (\w+)\b", text)
        assert said == [duration_text(default)], f"docs/fleet.md gives {flag}'s default as {said}"
    metrics = (REPO / "docs" / "metrics.md").read_text()
    for metric in set(re.findall(r"\b(kvfabric_[a-z_]+_total)\b", text)):
        assert f"`{metric}`" in metrics, f"{metric} is not in docs/metrics.md"
    for path in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (DOC.parent / path).resolve().is_relative_to(REPO), path
        if "benchmarks/results/fleet.md" not in path:  # (being produced separately)
            assert (DOC.parent / path).exists(), f"docs/fleet.md links {path}, which does not exist"


# --------------------------------------------------------------------------------- the checks catch breakage


def _set_flag(argv: list[str], flag: str, value: str) -> None:
    argv[argv.index(flag) + 1] = value


def _compose_breakers() -> dict[str, Callable[[dict[str, Any], dict[str, Any]], None]]:
    def unknown_flag(c: dict[str, Any], _p: dict[str, Any]) -> None:
        c["services"]["collector-a"]["command"].append("--no-such-flag")

    def other_socket(c: dict[str, Any], _p: dict[str, Any]) -> None:
        _set_flag(c["services"]["collector-b"]["command"], "--socket", "/run/kvfabric/other.sock")

    def other_volume(c: dict[str, Any], _p: dict[str, Any]) -> None:
        c["services"]["vllm-b"]["volumes"][0] = "kvfabric-run-a:/run/kvfabric"

    def unknown_setting(c: dict[str, Any], _p: dict[str, Any]) -> None:
        c["services"]["vllm-a"]["environment"] = {**c["services"]["vllm-a"]["environment"], "KVFABRIC_LIFECYLE": "1"}

    def plugin_off(c: dict[str, Any], _p: dict[str, Any]) -> None:
        c["services"]["vllm-a"]["environment"] = {**c["services"]["vllm-a"]["environment"], "KVFABRIC_LIFECYCLE": "0"}

    def two_readers(c: dict[str, Any], _p: dict[str, Any]) -> None:
        c["services"]["collector-b"]["command"].append("--read-only")

    def reader_socket(c: dict[str, Any], _p: dict[str, Any]) -> None:
        c["services"]["collector-reader"]["volumes"] = ["kvfabric-run-a:/run/kvfabric"]

    def other_lake(c: dict[str, Any], _p: dict[str, Any]) -> None:
        _set_flag(c["services"]["collector-reader"]["command"], "--data", "s3://kvfabric/other")

    def no_token(c: dict[str, Any], _p: dict[str, Any]) -> None:
        env = dict(c["services"]["collector-b"]["environment"])
        del env[TOKEN_ENV]
        c["services"]["collector-b"]["environment"] = env

    def literal_password(c: dict[str, Any], _p: dict[str, Any]) -> None:
        c["services"]["collector-a"]["environment"] = {**c["services"]["collector-a"]["environment"],
                                                       "PGPASSWORD": "hunter2"}

    def unscraped(_c: dict[str, Any], p: dict[str, Any]) -> None:
        p["scrape_configs"][0]["static_configs"].pop()

    def scraped_without_token(_c: dict[str, Any], p: dict[str, Any]) -> None:
        del p["scrape_configs"][1]["authorization"]

    def public_port(c: dict[str, Any], _p: dict[str, Any]) -> None:
        c["services"]["collector-reader"]["ports"] = ["8321:8321"]

    def no_bucket(c: dict[str, Any], _p: dict[str, Any]) -> None:
        c["services"]["minio-init"]["command"] = ["mc ls fleet"]

    return {f.__name__: f for f in (unknown_flag, other_socket, other_volume, unknown_setting, plugin_off,
                                    two_readers, reader_socket, other_lake, no_token, literal_password, unscraped,
                                    scraped_without_token, public_port, no_bucket)}


@pytest.mark.parametrize("breaker", sorted(_compose_breakers()))
def test_compose_checks_fail_on_a_broken_copy(breaker: str) -> None:
    compose, prometheus = _load(COMPOSE), _load(PROMETHEUS)
    check_compose(copy.deepcopy(compose), copy.deepcopy(prometheus))  # (the real files pass)
    _compose_breakers()[breaker](compose, prometheus)
    with pytest.raises((AssertionError, ValueError)):  # (ValueError: the collector's own checks)
        check_compose(compose, prometheus)


def _container(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    workload = next(o for o in objects if o["kind"] == kind)
    return next(c for c in _containers(workload["spec"]["template"]["spec"]) if c["name"] == name)


def _k8s_breakers() -> dict[str, Callable[[list[dict[str, Any]]], None]]:
    def sts(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
        return _container(objects, "StatefulSet", name)

    def reader(objects: list[dict[str, Any]]) -> dict[str, Any]:
        return _container(objects, "Deployment", "collector")

    def unknown_flag(o: list[dict[str, Any]]) -> None:
        sts(o, "collector")["args"].append("--no-such-flag")

    def other_socket(o: list[dict[str, Any]]) -> None:
        sts(o, "vllm")["env"][1]["value"] = "unix:///run/kvfabric/other.sock"

    def other_volume(o: list[dict[str, Any]]) -> None:
        sts(o, "vllm")["volumeMounts"][0]["name"] = "collector-tmp"

    def unknown_setting(o: list[dict[str, Any]]) -> None:
        sts(o, "vllm")["env"].append({"name": "KVFABRIC_NO_SUCH", "value": "1"})

    def collector_setting_in_vllm(o: list[dict[str, Any]]) -> None:
        sts(o, "vllm")["env"].append({"name": "KVFABRIC_MAX_LABEL_RUNS", "value": "8"})

    def not_a_sidecar(o: list[dict[str, Any]]) -> None:
        del sts(o, "collector")["restartPolicy"]

    def no_socket_dir_owner(o: list[dict[str, Any]]) -> None:
        sts(o, "socket-dir")["command"] = ["sh", "-c", "true"]

    def two_readers(o: list[dict[str, Any]]) -> None:
        sts(o, "collector")["args"].append("--read-only")

    def not_read_only(o: list[dict[str, Any]]) -> None:
        reader(o)["args"].remove("--read-only")

    def one_replica(o: list[dict[str, Any]]) -> None:
        next(x for x in o if x["kind"] == "StatefulSet")["spec"]["replicas"] = 1

    def reader_socket(o: list[dict[str, Any]]) -> None:
        reader(o)["volumeMounts"].append({"name": "tmp", "mountPath": "/run/kvfabric"})

    def other_lake(o: list[dict[str, Any]]) -> None:
        reader(o)["args"][reader(o)["args"].index("--lake") + 1] = "postgres:dbname=other host=db"

    def no_token(o: list[dict[str, Any]]) -> None:
        reader(o)["env"] = [e for e in reader(o)["env"] if e["name"] != TOKEN_ENV]

    def missing_secret_key(o: list[dict[str, Any]]) -> None:
        env = next(e for e in sts(o, "collector")["env"] if e["name"] == "PGPASSWORD")
        env["valueFrom"]["secretKeyRef"]["key"] = "PGPASS"

    def unscraped_reader(o: list[dict[str, Any]]) -> None:
        svc = next(x for x in o if x["kind"] == "Service" and x["metadata"]["name"] == "kvfabric-reader")
        svc["spec"]["ports"][0]["name"] = "web"

    def scraped_without_token(o: list[dict[str, Any]]) -> None:
        cm = next(x for x in o if x["kind"] == "ConfigMap" and "prometheus.yml" in x["data"])
        config = yaml.safe_load(cm["data"]["prometheus.yml"])
        del config["scrape_configs"][0]["authorization"]
        cm["data"]["prometheus.yml"] = yaml.safe_dump(config)

    return {f.__name__: f for f in (unknown_flag, other_socket, other_volume, unknown_setting,
                                    collector_setting_in_vllm, not_a_sidecar, no_socket_dir_owner, two_readers,
                                    not_read_only, reader_socket, other_lake, no_token, missing_secret_key,
                                    unscraped_reader, scraped_without_token, one_replica)}


@pytest.mark.parametrize("breaker", sorted(_k8s_breakers()))
def test_kubernetes_checks_fail_on_a_broken_copy(breaker: str) -> None:
    objects, kustomization, secrets = k8s_objects(), _load(K8S / "kustomization.yaml"), _secrets_template()
    check_k8s(copy.deepcopy(objects), kustomization, secrets)  # (the real files pass)
    _k8s_breakers()[breaker](objects)
    with pytest.raises((AssertionError, ValueError)):  # (ValueError: the collector's own checks)
        check_k8s(objects, kustomization, secrets)
