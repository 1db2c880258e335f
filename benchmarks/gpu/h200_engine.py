#!/usr/bin/env python3
"""The real vLLM engine (0.26.0 on the lent H200) with and without KVFabric: overhead, events, policies.

Runs on the GPU machine after the staging recipe of ``benchmarks/gpu/staging/README.md`` (vLLM 0.26 + this
project's wheel + duckdb installed into /tmp/site). One driver process starts a real KVFabric collector, then runs
each *arm* in a fresh child process (a fresh engine), interleaved A/B/A/B so drift hits every arm alike:

  plain            vLLM without any KVFABRIC_* variable (the plugin is installed but does nothing)
  lru              KVFABRIC_LIFECYCLE=1, vLLM's own LRU, events streamed to the collector
  <policy>         KVFABRIC_LIFECYCLE=1 and KVFABRIC_EVICTION_POLICY=<policy>

Each arm replays the same seeded workload (template families, returning multi-turn conversations, one-off
requests) as token-id prompts on a random-weight model under KV-cache pressure (``--num-blocks``), with greedy
sampling, and reports throughput, TTFT percentiles, vLLM's own prefix-cache counters and, for hooked arms, the
collector's run summary. Output token ids of every arm are compared with plain's: a hook that observes only must
not change a single token.

    python3 benchmarks/gpu/h200_engine.py --out $OUT --arms plain,lru,plain,lru --num-blocks 3000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 24, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "initializer_range": 0.02, "use_cache": True,
}


def workload(seed: int, scale: int) -> list[dict]:
    from kvfabric.sim.workload import demo_workload

    items = demo_workload(seed, template_requests=260 * scale, num_conversations=14 * scale,
                          unique_requests=70 * scale, duration_s=40.0 * scale)
    return [{"rid": rid, "prompt": prompt, "max_tokens": max_tokens} for _, rid, prompt, max_tokens, _ in items]


def run_arm(args: argparse.Namespace) -> dict:
    """One engine, one pass over the workload (child process)."""
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
              gpu_memory_utilization=0.5, num_gpu_blocks_override=args.num_blocks, max_model_len=8192,
              max_num_seqs=64, dtype="bfloat16", seed=0, disable_log_stats=False)
    init_s = time.time() - t0
    items = workload(args.seed, args.scale)
    prompts = [{"prompt_token_ids": it["prompt"]} for it in items]
    params = [SamplingParams(max_tokens=it["max_tokens"], ignore_eos=True, detokenize=False, temperature=0.0)
              for it in items]

    def counters() -> dict[str, float]:
        out: dict[str, float] = {}
        for m in llm.get_metrics():
            if m.name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:num_preemptions"):
                out[m.name] = out.get(m.name, 0.0) + float(getattr(m, "value", 0) or 0)
        return out

    c0 = counters()
    t0 = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.time() - t0
    c1 = counters()
    time.sleep(1.0)  # let the hook's sink (100 ms flushes) send its last batch before the engine goes away
    ttft = []
    for o in outs:
        m = getattr(o, "metrics", None)
        v = getattr(m, "first_token_latency", None) if m is not None else None
        if v is None and m is not None and getattr(m, "first_token_ts", None) and getattr(m, "arrival_time", None):
            v = m.first_token_ts - m.arrival_time
        if v is not None:
            ttft.append(float(v))
    ttft.sort()
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    ptok = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs)

    def pct(q: float) -> float | None:
        return ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else None

    return {
        "init_s": round(init_s, 1), "wall_s": round(wall, 3), "requests": len(outs), "prompt_tokens": ptok,
        "output_tokens": gen, "output_tok_per_s": round(gen / wall, 1),
        "total_tok_per_s": round((gen + ptok) / wall, 1),
        "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99), "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "num_cached_tokens": cached, "per_request_hit_rate": cached / ptok if ptok else None,
        "vllm_prefix_hits": c1.get("vllm:prefix_cache_hits", 0) - c0.get("vllm:prefix_cache_hits", 0),
        "vllm_prefix_queries": c1.get("vllm:prefix_cache_queries", 0) - c0.get("vllm:prefix_cache_queries", 0),
        "preemptions": c1.get("vllm:num_preemptions", 0) - c0.get("vllm:num_preemptions", 0),
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", default="plain,lru,plain,lru")
    ap.add_argument("--num-blocks", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=int, default=3, help="workload size multiplier")
    ap.add_argument("--model", default="/tmp/kvf_qwen2")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.model, exist_ok=True)
    Path(args.model, "config.json").write_text(json.dumps(QWEN2_05B))
    if args.child:
        result = run_arm(args)
        Path(args.child).write_text(json.dumps(result))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvf-gpu-")
    sock, db, port = os.path.join(tmp, "c.sock"), os.path.join(tmp, "gpu.duckdb"), 18321
    collector = subprocess.Popen([sys.executable, "-m", "kvfabric.collector", "--db", db, "--socket", sock,
                                  "--port", str(port)], stdout=open(out / "collector.log", "wb"),
                                 stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            get_json(url + "/healthz")
            break
        except Exception:
            time.sleep(0.2)
    results: list[dict] = []
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    base_env.setdefault("PYTHONHASHSEED", "0")
    for i, arm in enumerate(args.arms.split(",")):
        env = dict(base_env)
        run_id = f"gpu-{arm}-{i}"
        if arm != "plain":
            env |= {"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": f"unix://{sock}", "KVFABRIC_RUN_ID": run_id,
                    "KVFABRIC_EVICTION_POLICY": arm, "KVFABRIC_ENGINE_ID": "h200"}
        res_path = os.path.join(tmp, f"arm{i}.json")
        t0 = time.time()
        proc = subprocess.run([sys.executable, __file__, "--out", args.out, "--child", res_path,
                               "--num-blocks", str(args.num_blocks), "--seed", str(args.seed),
                               "--scale", str(args.scale), "--model", args.model],
                              env=env, capture_output=True, text=True)
        (out / f"arm{i}-{arm}.log").write_text(proc.stdout[-20000:] + proc.stderr[-40000:])
        if proc.returncode != 0:
            results.append({"arm": arm, "error": proc.returncode})
            print(f"arm {i} {arm}: FAILED ({proc.returncode})", flush=True)
            continue
        res = json.loads(Path(res_path).read_text())
        res |= {"arm": arm, "run_id": run_id, "process_s": round(time.time() - t0, 1)}
        if arm != "plain":
            time.sleep(1.0)
            try:
                res["collector_summary"] = get_json(f"{url}/api/v1/runs/{run_id}/summary")
            except Exception as exc:
                res["collector_summary"] = {"error": str(exc)}
        results.append(res)
        print(f"arm {i} {arm}: wall {res['wall_s']}s, {res['output_tok_per_s']} out tok/s, "
              f"ttft p50 {res['ttft_p50_s']}, p99 {res['ttft_p99_s']}, hit {res['per_request_hit_rate']}", flush=True)
    collector.terminate()
    collector.wait(60)
    outputs = [r.pop("outputs", None) for r in results]
    reference = next((o for r, o in zip(results, outputs, strict=True) if r.get("arm") == "plain" and o), None)
    for r, o in zip(results, outputs, strict=True):
        if reference is not None and o is not None:
            r["outputs_identical_to_plain"] = o == reference
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps([{k: v for k, v in r.items() if k != "collector_summary"} for r in results], default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
