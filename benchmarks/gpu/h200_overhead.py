#!/usr/bin/env python3
"""Hook overhead on the real vLLM engine (0.26 on the H200): resident engines, interleaved rounds.

Every arm is one ``vllm.LLM`` engine living in its own worker process for the whole run, all started at once (the
start-up, 40-70 s of imports, compilation and CUDA graphs, is paid in parallel and once). The driver then runs
rounds: in each round every arm replays the same seeded workload once, in an order that alternates between rounds,
so drift and noise hit every arm alike. Arms:

  plain       vLLM alone: no KVFABRIC_* variable, no KV events (the plugin is installed and does nothing)
  kv_events   vLLM's own KV-event publisher on (ZMQ), drained by a subscriber thread: the reference cost of
              vLLM's own observability
  lru         KVFABRIC_LIFECYCLE=1 streaming to a real collector (forwarder child, Arrow, Unix socket)
  lru_nosink  the same recording with KVFABRIC_SINK=none: the scheduler thread's share of the cost alone
  lru_python  ``lru`` with KVFABRIC_NATIVE=0: the Python hooks where the compiled ones are built (build them on
              the GPU machine first: ``python3 setup.py build_ext --inplace``)
  lru_before  the same with the hook of an earlier revision (``--before DIR``: a checkout's ``kvfabric`` package,
              put first on that worker's PYTHONPATH), for a side-by-side before/after
  adaptive_aging  ``lru`` with KVFABRIC_EVICTION_POLICY=adaptive_aging: the policy's index, statistics and queue
              hook on the scheduler thread (it changes which blocks stay cached: compare ``cached_tokens``)

Engine slots: every engine process is resident for the whole run, and on a CPU-bound shape (0.5B) where the
scheduler, the EngineCore and the forwarder land on the host's cores moved whole arms by 20-40 % between two runs
of one revision (q05b-r2 against q05b-r3). So by default (``--pin``) the arm that runs is moved, with every thread
of its process tree (EngineCore, forwarder), onto the same half of the cores, and every idle arm and the collector
onto the other half: each arm runs on the same cores as every other.

Each worker uses ``spawn``, so its EngineCore imports the plugin afresh with that worker's environment. Every
round's generated token ids are compared with plain's (observing must not change a token). With ``--profile S``,
``py-spy`` samples the EngineCore of the ``lru`` and ``lru_before`` arms for S seconds during one round and the
top of both profiles is written beside the results.

    python3 benchmarks/gpu/h200_overhead.py --out $OUT/overhead-8b --shape llama-3-8b --rounds 5 \\
        --arms plain,kv_events,lru,lru_before --before .gpu/before --profile 6

Results: ``results.json`` (every round of every arm) and ``summary.json`` (per arm: mean and spread of wall time
and output tokens/s, ratio to plain) under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
MODELS = ROOT / "kvfabric" / "sim" / "models"


# ------------------------------------------------------------------------------------------------- worker side


def _workload(seed: int, scale: float) -> list[tuple[list[int], int]]:
    from kvfabric.sim.workload import demo_workload

    items = demo_workload(seed, template_requests=int(260 * scale), num_conversations=max(2, int(14 * scale)),
                          unique_requests=int(70 * scale), duration_s=40.0 * scale)
    return [(prompt, max_tokens) for _, _, prompt, max_tokens, _ in items]


def _drain_kv_events(endpoint: str, stop: threading.Event, counter: list[int]) -> None:
    import zmq

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    while not stop.is_set():
        try:
            sub.recv_multipart()
            counter[0] += 1
        except zmq.Again:
            continue


def worker(args: argparse.Namespace) -> int:
    """One resident engine: builds it, says READY, then runs the workload once per line read from stdin."""
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    stop = threading.Event()
    published = [0]
    if args.worker == "kv_events":
        from vllm.config import KVEventsConfig

        port = 5557 + args.index
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=f"tcp://*:{port}")
        threading.Thread(target=_drain_kv_events, args=(f"tcp://127.0.0.1:{port}", stop, published),
                         daemon=True).start()
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    if "kv_cache_memory_bytes" in {f.name for f in dataclasses.fields(EngineArgs)}:
        # A fixed KV budget skips vLLM's memory profiling, which misreads memory that engines starting beside this
        # one take or free meanwhile; --num-blocks then sets the pool (4 GiB holds 2,048 Llama-3-8B blocks).
        kwargs["kv_cache_memory_bytes"] = 4 << 30
    t0 = time.time()
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
              gpu_memory_utilization=args.gpu_util, num_gpu_blocks_override=args.num_blocks, max_model_len=8192,
              max_num_seqs=64, dtype="bfloat16", seed=0, **kwargs)
    init_s = time.time() - t0
    items = _workload(args.seed, args.scale)
    prompts = [{"prompt_token_ids": p} for p, _ in items]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, detokenize=False, temperature=0.0) for _, m in items]
    engine_pids = [p.pid for p in _children()]
    print(json.dumps({"ready": True, "init_s": round(init_s, 1), "engine_pids": engine_pids}), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        if line.strip().startswith("reset"):
            llm.reset_prefix_cache()
            print(json.dumps({"reset": True}), flush=True)
            continue
        cpu0 = _cpu_by_process()
        t1 = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.time() - t1
        cpu1 = _cpu_by_process()
        cpu = {k: round(v - cpu0.get(k, 0.0), 3) for k, v in cpu1.items()}
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        ptok = sum(len(o.prompt_token_ids) for o in outs)
        cached = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs)
        digest = hash(tuple(tuple(o.outputs[0].token_ids) for o in outs))
        print(json.dumps({"wall_s": wall, "output_tokens": gen, "prompt_tokens": ptok, "cached_tokens": cached,
                          "output_tok_per_s": gen / wall, "outputs_digest": digest,
                          "kv_event_messages": published[0], "cpu_s": cpu}), flush=True)
    stop.set()
    return 0


def _cpu_by_process() -> dict[str, float]:
    """CPU seconds (user + system) so far of this worker and its descendants, by role: the EngineCore, the
    KVFabric forwarder, the rest (this process included)."""
    out: dict[str, float] = {}
    try:
        import psutil

        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            try:
                cmd = " ".join(p.cmdline())
                t = p.cpu_times()
            except Exception:
                continue
            role = ("forwarder" if "kvfabric.forwarder" in cmd else
                    "engine_core" if "EngineCore" in cmd or "EngineCore" in p.name() or "spawn_main" in cmd else
                    "other")
            out[role] = out.get(role, 0.0) + t.user + t.system
    except Exception:
        pass
    return out


def _children() -> list[Any]:
    try:
        import psutil

        return psutil.Process().children(recursive=True)
    except Exception:
        return []


# ------------------------------------------------------------------------------------------------- driver side


class Arm:
    def __init__(self, name: str, index: int, args: argparse.Namespace, env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = open(log, "wb")
        cmd = [sys.executable, str(HERE), "--worker", name, "--index", str(index), "--model", args.model_dir,
               "--num-blocks", str(args.num_blocks), "--gpu-util", str(args.gpu_util), "--seed", str(args.seed),
               "--scale", str(args.scale)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1)
        self.ready: dict[str, Any] | None = None

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"arm {self.name} exited ({self.proc.poll()}); see its log")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc, no psutil needed)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
    return out


def pin(pid: int, cores: set[int]) -> int:
    """Move every thread of ``pid``'s process tree onto ``cores`` (affinity is per thread on Linux; threads started
    later inherit their creator's). Returns how many threads were moved."""
    moved = 0
    for p in _tree(pid):
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cores)
                moved += 1
            except OSError:
                continue  # the thread ended meanwhile
    return moved


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _profile(pids: list[int], seconds: int, out: Path) -> subprocess.Popen[bytes] | None:
    """py-spy on the EngineCore (the child of the worker whose command line says EngineCore, else every child)."""
    if not pids:
        return None
    try:
        import psutil

        cores = [p for p in pids if "EngineCore" in " ".join(psutil.Process(p).cmdline()) or
                 "EngineCore" in psutil.Process(p).name()]
    except Exception:
        cores = []
    pid = (cores or pids)[0]
    import shutil

    exe = shutil.which("py-spy") or next((str(Path(d) / "bin" / "py-spy") for d in sys.path
                                         if (Path(d) / "bin" / "py-spy").exists()), None)
    if exe is None:
        print("py-spy not found: no profile", flush=True)
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "200",
                             "--format", "raw", "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def top_of_profile(raw: Path, n: int = 25) -> list[tuple[str, float, float]]:
    """(function, self %, inclusive %) of a py-spy raw (collapsed stacks) profile, by self time."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        total += c
        frames = stack.split(";")
        own[frames[-1]] += c
        for f in set(frames):
            incl[f] += c
    if not total:
        return []
    return [(f, 100.0 * c / total, 100.0 * incl[f] / total) for f, c in own.most_common(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", default="llama-3-8b", help="a model shape of kvfabric/sim/models (default llama-3-8b)")
    ap.add_argument("--arms", default="plain,kv_events,lru")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-blocks", type=int, default=1500)
    ap.add_argument("--scale", type=float, default=1.0, help="workload size multiplier (1 = the demo's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-util", type=float, default=0.2, help="gpu_memory_utilization of each resident engine")
    ap.add_argument("--before", default=None, help="directory holding an earlier revision's kvfabric package")
    ap.add_argument("--profile", type=int, default=0, help="py-spy seconds on the hooked arms' EngineCore")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="run each arm on the same half of the cores, idle arms and the collector on the other")
    ap.add_argument("--sequential-start", action="store_true", help="start the engines one after another")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvf-ovh-")
    args.model_dir = os.path.join(tmp, "model")
    os.makedirs(args.model_dir)
    Path(args.model_dir, "config.json").write_text((MODELS / f"{args.shape}.json").read_text())
    names = args.arms.split(",")
    sock, db, port = os.path.join(tmp, "c.sock"), os.path.join(tmp, "c.duckdb"), 18400
    collectors = [subprocess.Popen([sys.executable, "-m", "kvfabric.collector", "--db", db, "--socket", sock,
                                    "--port", str(port)], stdout=open(out / "collector.log", "wb"),
                                   stderr=subprocess.STDOUT)]
    url = f"http://127.0.0.1:{port}"
    before_sock = os.path.join(tmp, "before.sock")
    if "lru_before" in names and args.before:
        # The earlier revision speaks its own stream schema: it gets a collector of its own revision.
        env_before = dict(os.environ)
        env_before["PYTHONPATH"] = os.path.abspath(args.before) + os.pathsep + env_before.get("PYTHONPATH", "")
        collectors.append(subprocess.Popen(
            [sys.executable, "-m", "kvfabric.collector", "--db", os.path.join(tmp, "before.duckdb"), "--socket",
             before_sock, "--port", str(port + 1)], env=env_before,
            stdout=open(out / "collector-before.log", "wb"), stderr=subprocess.STDOUT))
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    base |= {"PYTHONHASHSEED": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "PYTHONUNBUFFERED": "1"}
    arms: list[Arm] = []
    t0 = time.time()
    for i, name in enumerate(names):
        env = dict(base)
        if name.startswith("lru") or name == "adaptive_aging":
            env |= {"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": f"unix://{sock}", "KVFABRIC_RUN_ID": f"ovh-{name}",
                    "KVFABRIC_ENGINE_ID": f"h200-{name}"}
        if name == "adaptive_aging":
            env["KVFABRIC_EVICTION_POLICY"] = "adaptive_aging"
        if name == "lru_nosink":
            env["KVFABRIC_SINK"] = "none"  # recording on the scheduler thread, no forwarder, nothing sent
        if name == "lru_python":
            env["KVFABRIC_NATIVE"] = "0"  # the Python hooks, where the compiled ones are built
        if name == "lru_before":
            if not args.before:
                raise SystemExit("--arms lru_before needs --before DIR")
            env["PYTHONPATH"] = os.path.abspath(args.before) + os.pathsep + env.get("PYTHONPATH", "")
            env["KVFABRIC_SINK"] = f"unix://{before_sock}"
        arms.append(Arm(name, i, args, env, out / f"{name}.log"))
        if args.sequential_start:
            arms[-1].ready = arms[-1].read()
    for arm in arms:
        if arm.ready is None:
            arm.ready = arm.read()
    start_s = time.time() - t0
    print(f"{len(arms)} engines ready in {start_s:.0f} s", flush=True)
    cores = sorted(os.sched_getaffinity(0))
    run_cores, idle_cores = set(cores[: len(cores) // 2]), set(cores[len(cores) // 2:])
    pinning: dict[str, Any] = {"on": bool(args.pin and len(cores) >= 4)}
    if pinning["on"]:
        pinning |= {"run_cores": sorted(run_cores), "idle_cores": sorted(idle_cores)}
        for proc in [*(a.proc for a in arms), *collectors]:
            pin(proc.pid, idle_cores)

    rounds: list[dict[str, dict[str, Any]]] = []
    profiles: dict[str, Path] = {}
    for r in range(args.rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        results: dict[str, dict[str, Any]] = {}
        for arm in order:
            spy = None
            if args.profile and r == 1 and arm.name.startswith("lru") and arm.ready:
                profiles[arm.name] = out / f"profile-{arm.name}.txt"
                spy = _profile(arm.ready.get("engine_pids", []), args.profile, profiles[arm.name])
            if pinning["on"]:
                pin(arm.proc.pid, run_cores)
            arm.send("run")
            results[arm.name] = arm.read()
            if spy is not None:
                spy.wait(timeout=args.profile + 30)
            arm.send("reset")  # every round starts from an empty prefix cache
            arm.read()
            if pinning["on"]:
                pin(arm.proc.pid, idle_cores)
        rounds.append(results)
        print(f"round {r + 1}: " + ", ".join(f"{a} {v['wall_s']:.2f}s" for a, v in results.items()), flush=True)
    for arm in arms:
        arm.send("quit")
    for arm in arms:
        arm.proc.wait(timeout=120)
    time.sleep(2.0)
    collector_runs: Any = None
    try:
        collector_runs = _get(f"{url}/api/v1/runs")
    except Exception as exc:  # the numbers above stand without it
        collector_runs = {"error": str(exc)}
    for c in collectors:
        c.terminate()
        c.wait(60)

    summary: dict[str, Any] = {"shape": args.shape, "rounds": args.rounds, "num_blocks": args.num_blocks,
                               "scale": args.scale, "engines_start_s": round(start_s, 1), "pinning": pinning,
                               "arms": {}}
    plain_walls = [rd["plain"]["wall_s"] for rd in rounds] if "plain" in names else []
    for name in names:
        walls = [rd[name]["wall_s"] for rd in rounds]
        tps = [rd[name]["output_tok_per_s"] for rd in rounds]
        entry: dict[str, Any] = {
            "wall_mean_s": statistics.fmean(walls), "wall_min_s": min(walls), "wall_max_s": max(walls),
            "wall_spread": (max(walls) - min(walls)) / statistics.fmean(walls),
            "out_tok_per_s_mean": statistics.fmean(tps),
            "outputs_identical_to_plain": all(rd[name]["outputs_digest"] == rd["plain"]["outputs_digest"]
                                              for rd in rounds) if "plain" in names else None,
            "cached_tokens": [rd[name]["cached_tokens"] for rd in rounds],
            "cpu_s_mean": {role: statistics.fmean(rd[name].get("cpu_s", {}).get(role, 0.0) for rd in rounds)
                           for role in sorted({k for rd in rounds for k in rd[name].get("cpu_s", {})})},
        }
        if plain_walls:
            entry["throughput_vs_plain"] = statistics.fmean(tps) / statistics.fmean(
                [rd["plain"]["output_tok_per_s"] for rd in rounds])
            entry["wall_vs_plain"] = statistics.fmean(walls) / statistics.fmean(plain_walls)
        summary["arms"][name] = entry
    summary["collector_runs"] = collector_runs
    summary["profiles"] = {name: top_of_profile(path) for name, path in profiles.items() if path.exists()}
    (out / "results.json").write_text(json.dumps(rounds, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "profiles"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
