"""Miss attribution, what-if and the Mooncake export on the demo's run: the numbers README and docs/design.md §5
quote, written by this script (never by hand).

It runs ``kvfabric demo`` (vLLM's real scheduler on CPU, the plugin through vLLM's entry points, a real collector;
seed 0, 640 blocks of 16 tokens, LRU) unless ``--db`` names a database that already holds the run, then reads the
run back through the same code the REST API and the CLI use:

* the miss split (hit / evicted / novel / uncacheable) of the run and its families, and evictions by reason;
* hits the offline model cannot reproduce: hit blocks first cached as an earlier request's *output* (decode) blocks;
* ``kvfabric whatif`` under the run's own policy and capacity (the replay error, against the stated tolerance) and
  a sweep of every policy and the optimum over capacities (also drawn as a PNG);
* ``kvfabric export --format mooncake`` replayed by ``kvfabric replay`` (512-token ids, vLLM's real scheduler), and
  the 16-token export replayed offline with room for everything.

Usage: python benchmarks/demo_misses_whatif.py [--db PATH --run R] [--out benchmarks/results/demo_misses_whatif.md]
       [--plot docs/whatif-demo.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

CAPACITIES = (300, 400, 500, 640, 800, 1000)
DECODE_HITS_SQL = """
WITH lk AS (SELECT engine, request_id, prompt_tokens // $bs AS full_blocks FROM events
            WHERE run_id = $run AND event = 'prefix_lookup'),
first_seal AS (
    SELECT s.engine, s.block_hash, arg_min(s.depth >= lk.full_blocks, (s.ts_ns, s.rowid)) AS decode
    FROM events AS s JOIN lk ON lk.engine = s.engine AND lk.request_id = s.request_id
    WHERE s.run_id = $run AND s.event = 'block_sealed'
    GROUP BY s.engine, s.block_hash
)
SELECT count(*) AS hit_blocks, count(*) FILTER (WHERE f.decode) AS hits_on_decode_blocks
FROM events AS t LEFT JOIN first_seal AS f ON f.engine = t.engine AND f.block_hash = t.block_hash
WHERE t.run_id = $run AND t.event = 'block_touched'
"""


def run_demo(db: str, run_id: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    with tempfile.TemporaryDirectory() as work:
        done = subprocess.run(
            [sys.executable, "-m", "kvfabric.cli", "demo", "--db", db, "--run-id", run_id, "--port", "0",
             "--parquet", os.path.join(work, "parquet")],
            cwd=work, env=env, capture_output=True, text=True, timeout=600,
        )
    if done.returncode != 0:
        sys.exit(f"kvfabric demo failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def decode_hits(db: str, run: str, block_size: int) -> dict[str, int]:
    import duckdb

    con = duckdb.connect(db, read_only=True)
    try:
        row = con.execute(DECODE_HITS_SQL, {"run": run, "bs": block_size}).fetchone()
    finally:
        con.close()
    assert row is not None
    return {"hit_blocks": int(row[0]), "hits_on_decode_blocks": int(row[1])}


def replay_export(db: str, run: str, work: str) -> dict[str, Any]:
    """The 512-token export through `kvfabric replay` (real scheduler), the 16-token one offline."""
    from kvfabric.collector.mooncake import export_mooncake
    from kvfabric.sim.offline import load_trace, simulate

    coarse, fine = os.path.join(work, "demo.jsonl"), os.path.join(work, "demo16.jsonl")
    export_mooncake(db, run, coarse)
    export_mooncake(db, run, fine, block_tokens=16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    done = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "replay", "--trace", coarse, "--policy", "lru", "--num-blocks",
         "640", "--format", "json", "--no-progress"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    if done.returncode != 0:
        sys.exit(f"kvfabric replay failed:\n{done.stderr[-2000:]}")
    real = json.loads(done.stdout.strip().splitlines()[-1])
    unbounded = simulate(load_trace(fine), "lru", 1_000_000, block_size=16, trace_block_tokens=16)
    unbounded_coarse = simulate(load_trace(coarse), "lru", 1_000_000, block_size=16)
    return {
        "replay_512_lru_640": {k: real[k] for k in ("requests", "prompt_tokens", "prefix_hit_rate", "evicted_blocks",
                                                  "wasted_prefill_tokens")},
        "offline_16_unbounded_hit_rate": unbounded["prefix_hit_rate"],
        "offline_512_unbounded_hit_rate": unbounded_coarse["prefix_hit_rate"],
    }


def plot(sweep: list[dict[str, Any]], actual: float, own_blocks: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for policy in sorted({r["policy"] for r in sweep}, key=lambda p: (p == "optimal", p)):
        pts = sorted((r["num_blocks"], r["hit_rate"]) for r in sweep if r["policy"] == policy)
        style = {"color": "black", "linestyle": "--"} if policy == "optimal" else {}
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=policy, **style)
    ax.scatter([own_blocks], [100 * actual], marker="*", s=220, color="red", zorder=5, label="recorded run (lru)")
    ax.set_xlabel("KV capacity (blocks of 16 tokens)")
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_title("kvfabric whatif on the demo's recorded traffic")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default=None, help="database holding the run (default: run the demo into a tmp file)")
    parser.add_argument("--run", default="demo-misses", help="run id (default: demo-misses)")
    parser.add_argument("--out", default="benchmarks/results/demo_misses_whatif.md")
    parser.add_argument("--plot", default="docs/whatif-demo.png")
    args = parser.parse_args()

    from kvfabric.analysis.whatif import TOLERANCE, whatif
    from kvfabric.policies import POLICY_NAMES
    from kvfabric.queries import QueryRunner

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as work:
        db = args.db or os.path.join(work, "demo.duckdb")
        if args.db is None:
            print("running kvfabric demo ...", file=sys.stderr)
            run_demo(db, args.run)
        q = QueryRunner.for_path(db)
        summary = q.run_summary(args.run)
        misses = q.misses(args.run, bucket_s=2.0)
        decode = decode_hits(db, args.run, int(summary["block_size"]))
        own = whatif(q, args.run)
        print("sweeping policies x capacities ...", file=sys.stderr)
        sweep = []
        for blocks in CAPACITIES:
            for policy in POLICY_NAMES:
                w = whatif(q, args.run, policy, blocks)
                sweep.append({"policy": policy, "num_blocks": blocks, "hit_rate": w["whatif_prefix_hit_rate"],
                              "wasted": w["whatif_wasted_prefill_tokens"]})
            sweep.append({"policy": "optimal", "num_blocks": blocks, "hit_rate": w["optimal_prefix_hit_rate"],
                          "wasted": w["optimal_wasted_prefill_tokens"]})
        print("exporting and replaying ...", file=sys.stderr)
        export = replay_export(db, args.run, work)
    elapsed = time.monotonic() - t0

    results = {"summary": {k: summary[k] for k in ("prompt_tokens", "prefix_hit_tokens", "prefix_hit_rate",
                                                   "evicted_blocks", "wasted_prefill_tokens", "evicted_tokens",
                                                   "novel_tokens", "uncacheable_tokens", "hit_tokens_past_prompt",
                                                   "evictions_by_reason", "requests")},
               "misses_totals": misses["totals"], "families": misses["items"], "decode_hits": decode,
               "whatif_own": {k: v for k, v in own.items() if k != "engines"}, "engines": own["engines"],
               "sweep": sweep, "export": export, "tolerance": TOLERANCE}
    plot(sweep, own["actual_prefix_hit_rate"], own["engines"][0]["own_num_blocks"], args.plot)
    write_markdown(args, results, elapsed)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
        json.dump(results, fh, indent=1, sort_keys=True)
    print(f"wrote {args.out}, {os.path.splitext(args.out)[0]}.json and {args.plot}", file=sys.stderr)
    return 0


def write_markdown(args: argparse.Namespace, r: dict[str, Any], elapsed: float) -> None:
    s, t, own, dec, exp = r["summary"], r["misses_totals"], r["whatif_own"], r["decode_hits"], r["export"]
    pct = 100.0 / t["prompt_tokens"]
    lines = [
        "# Miss attribution, what-if and export on the demo's run",
        "",
        f"Command: `python benchmarks/demo_misses_whatif.py --out {args.out} --plot {args.plot}`"
        + (f" (database `{args.db}`, run `{args.run}`)" if args.db else " (runs `kvfabric demo`: seed 0, 640 blocks "
                                                                         "of 16 tokens, lru)"),
        f"Machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; {elapsed:.0f} s",
        "",
        "## Why prompt tokens were recomputed (docs/design.md §5)",
        "",
        f"{s['requests']} admissions, {t['prompt_tokens']:,} prompt tokens. Every admission's split adds up to its "
        "prompt; families and windows add up to the run.",
        "",
        "| part | tokens | share |",
        "|---|---:|---:|",
    ]
    for key in ("hit_tokens", "evicted_tokens", "novel_tokens", "uncacheable_tokens"):
        lines.append(f"| {key.removesuffix('_tokens')} | {t[key]:,} | {t[key] * pct:.1f} % |")
    lines += [
        "",
        f"Evicted tokens = wasted prefill of the run ({s['wasted_prefill_tokens']:,}): every block recomputed after "
        "an eviction was one the engine had cached. Evictions by reason: "
        + ", ".join(f"{k} {v:,}" for k, v in s["evictions_by_reason"].items()) + ".",
        "",
        "Families with the most evicted tokens:",
        "",
        "| family | admissions | prompt | hit | evicted | novel | uncacheable |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for f in r["families"][:6]:
        lines.append(f"| {f['family']} | {f['admissions']} | {f['prompt_tokens']:,} | {f['hit_tokens']:,} | "
                     f"{f['evicted_tokens']:,} | {f['novel_tokens']:,} | {f['uncacheable_tokens']:,} |")
    e = r["engines"][0]
    lines += [
        "",
        "## What-if: the recorded traffic replayed offline",
        "",
        f"Own configuration ({own['actual_policy']} at {e['own_num_blocks']} blocks, {e['concurrency']} requests in "
        f"flight = the run's mean {e['mean_in_flight']:.2f} rounded): replayed prefix hit rate "
        f"{100 * own['replay_own_prefix_hit_rate']:.2f} % vs {100 * own['actual_prefix_hit_rate']:.2f} % recorded: "
        f"error {100 * own['replay_own_error']:+.2f} points (tolerance {100 * r['tolerance']:.0f} points); wasted "
        f"prefill {own['replay_own_wasted_prefill_tokens']:,} replayed vs {own['actual_wasted_prefill_tokens']:,}.",
        f"Hits the model cannot make: {dec['hits_on_decode_blocks']} of {dec['hit_blocks']:,} hit blocks were first "
        f"cached as an earlier request's output (a conversation's previous answer) = "
        f"{100 * dec['hits_on_decode_blocks'] * e['block_size'] / t['prompt_tokens']:.2f} points of hit rate; the "
        "replay keeps outputs private.",
        "",
        "| capacity (blocks) | " + " | ".join(sorted({x["policy"] for x in r["sweep"]} - {"optimal"})) + " | optimal |",
        "|---:|" + "---:|" * (len({x["policy"] for x in r["sweep"]})),
    ]
    policies = [*sorted({x["policy"] for x in r["sweep"]} - {"optimal"}), "optimal"]
    for blocks in CAPACITIES:
        row = {x["policy"]: x["hit_rate"] for x in r["sweep"] if x["num_blocks"] == blocks}
        lines.append(f"| {blocks} | " + " | ".join(f"{100 * row[p]:.2f} %" for p in policies) + " |")
    lines += [
        "",
        f"![what-if sweep]({os.path.relpath(args.plot, os.path.dirname(args.out))})",
        "",
        "## The run as a Mooncake trace",
        "",
        f"`kvfabric export --format mooncake` (512 tokens per id) replayed by `kvfabric replay --policy lru "
        f"--num-blocks 640` through vLLM's real scheduler: {exp['replay_512_lru_640']['requests']} requests, "
        f"{exp['replay_512_lru_640']['prompt_tokens']:,} prompt tokens, prefix hit rate "
        f"{100 * exp['replay_512_lru_640']['prefix_hit_rate']:.2f} % (outputs capped at 1 token by the replay's "
        "default). With room for everything (offline), the 16-token export hits "
        f"{100 * exp['offline_16_unbounded_hit_rate']:.2f} % and the 512-token one "
        f"{100 * exp['offline_512_unbounded_hit_rate']:.2f} %: 512-token ids keep sharing only up to the last "
        "512-token boundary of a shared prefix.",
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
