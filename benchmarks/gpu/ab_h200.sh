#!/usr/bin/env bash
# kvfabric ab against a real `vllm serve` on the H200: vLLM 0.26.0, Llama-3-8B shape with dummy weights, compiled
# (torch.compile + CUDA graphs), KV limited by --num-gpu-blocks-override so that the scenarios are under pressure;
# template_family_revisit and ordinary_unique_cold, lru against adaptive_aging, 5 repetitions each, by the fair
# method of docs/design.md §8.3: arms interleaved (ABAB), one server at a time (PRESTART=0: nothing else starts or
# compiles on the GPU while an arm is measured), a warm-up per server excluded from every number. CAPACITIES=a,b
# sweeps the KV pool (kvfabric ab --capacities; lru must be in POLICIES) and reports the KV saved at equal hit rate.
#
# On the GPU machine, from the checkout root, after the staging recipe of benchmarks/gpu/staging/README.md (vLLM 0.26.0 and
# this project's wheel, duckdb, installed into /tmp/site):
#     OUT=$OUT bash benchmarks/gpu/ab_h200.sh
# Results: $OUT/ab/run/<scenario>/{report.md,ab.json,plan.json,runs/,logs/}, $OUT/ab/ab.jsonl (the --format json
# line), $OUT/ab/console.log, $OUT/ab/environment.txt. Plots need matplotlib; without it there, re-render here with
#     kvfabric ab --report-only --out <the fetched ab/run folder>
#
# Rehearsal on a CPU machine (kvfabric sim-serve stands in for vllm serve, same command line otherwise):
#     SERVE=sim SITE= OUT=/tmp/ab-rehearsal bash benchmarks/gpu/ab_h200.sh
#
# Device time (the scarce part). One `kvfabric ab` runs the scenarios against one collector, one server at a time
# (the first start fills vLLM's compile cache; later starts reuse it). Expected on the H200: first start ~70-90 s,
# then per arm start ~45-60 s + warm-up ~2 s + run ~25 s: 20 arms (2 scenarios x 2 policies x 5) do not fit one
# 10-minute command. Run one scenario per command on the warm machine (SCENARIOS=template_family_revisit ..., then
# SCENARIOS=ordinary_unique_cold ...; the compile cache stays), two policies x 5 repetitions ~ 10 x 75 s, still
# close to LIMIT_S: a run cut short by LIMIT_S reports the arms that finished (their warm-ups split off by
# --report-only below), and its report shows how many repetitions each arm got.
# PRESTART=2 brings back the overlapped start-ups (faster, noisier; the report then says the arms were not isolated).
#
# Sittings. An A/B of 10 or more arms does not fit one command: `kvfabric ab --time-limit` starts no arm that would
# end past TIME_LIMIT (default LIMIT_S - 60 s, leaving time for the report), and RESUME=<the run folder of an
# earlier sitting> continues it (`kvfabric ab --resume`): the folder is copied to $OUT/ab/run, the arms not yet run
# run in the planned ABAB order, and every sitting is recorded in its plan.json and environment.txt. Carry the folder
# with the command (an untracked folder of the checkout travels), e.g.
#     RESUME=benchmarks/results/gpu/serving/long_conversation_return OUT=$OUT bash benchmarks/gpu/ab_h200.sh
set -euo pipefail

OUT=${OUT:?set OUT to the folder whose files come back}
PY=${PYTHON:-python3}
SITE=${SITE-/tmp/site}
SERVE=${SERVE:-vllm}            # vllm | sim
REPEAT=${REPEAT:-5}
POLICIES=${POLICIES:-lru,adaptive_aging}
SCENARIOS=${SCENARIOS:-template_family_revisit,ordinary_unique_cold}
PRESTART=${PRESTART:-0}
WARMUP=${WARMUP:-8}
CAPACITIES=${CAPACITIES:-}        # e.g. 640,960,1280: a KV pool sweep (lru must be in POLICIES)
TTFT_SLO_MS=${TTFT_SLO_MS:-}      # overrides the scenarios' ttft_slo_ms for goodput
LIMIT_S=${LIMIT_S:-570}         # the device tool allows 600 s a command
TIME_LIMIT=${TIME_LIMIT:-$(( LIMIT_S - 60 ))}   # no arm may end later (the report and the warm-up split follow)
RESUME=${RESUME:-}              # the run folder of an earlier sitting: continue it

export PYTHONPATH="$PWD${SITE:+:$SITE}"   # this checkout's kvfabric first, then vLLM 0.26 and the wheels
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PYTHONHASHSEED=${PYTHONHASHSEED:-0} # vLLM 0.26's root block hash is random per process without it
unset KVFABRIC_EVICTION_POLICY KVFABRIC_LIFECYCLE KVFABRIC_SINK KVFABRIC_RUN_ID   # ab sets them per arm

missing=$("$PY" - <<'PY'
import importlib.util as u
need = ["kvfabric", "pyarrow", "duckdb", "fastapi", "uvicorn", "httpx", "tqdm", "prometheus_client", "vllm"]
print(" ".join(m for m in need if u.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then echo "ab_h200.sh: missing Python modules: $missing (PYTHONPATH=$PYTHONPATH)" >&2; exit 2; fi
# vllm serve loads the hook only through the installed entry point (this project's wheel in $SITE, or an install).
if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(not any(e.name == "kvfabric" for e in m.entry_points(group="vllm.general_plugins")))'; then
  if [ "$SERVE" != sim ]; then echo "ab_h200.sh: no kvfabric vllm.general_plugins entry point: install this project's wheel" >&2; exit 2; fi
fi
"$PY" -c 'import importlib.util as u; print("matplotlib:", "yes" if u.find_spec("matplotlib") else "no (plots later: kvfabric ab --report-only)")'

# A fixed path: the serve command (recorded in the plan) and vLLM's compile cache stay the same in every sitting.
MODEL_DIR=/tmp/kvf-model/llama-3-8b
mkdir -p "$MODEL_DIR"
cp kvfabric/sim/models/llama-3-8b.json "$MODEL_DIR/config.json"

if [ "$SERVE" = sim ]; then
  CMD="$PY -m kvfabric.cli sim-serve --model $MODEL_DIR --served-model-name llama-3-8b --kv-blocks {kv_blocks} \
--block-size {block_size} --max-model-len {max_model_len} --host 127.0.0.1 --port {port}"
else
  # A fixed KV budget skips vLLM's memory profiling, which fails when another process frees GPU memory meanwhile
  # (a server stopping while the next one starts); KV_CACHE_GIB (default 24) holds 12,288 Llama-3-8B blocks of 16
  # tokens (2 MiB each), the largest pool of the bundled scenarios, and --num-gpu-blocks-override then sets the
  # scenario's pool. Only where this vLLM has the option.
  KVMEM=""
  if grep -qs "kv_cache_memory_bytes" "$("$PY" -c 'import importlib.util as u; print(u.find_spec("vllm.engine.arg_utils").origin)')"; then
    KVMEM="--kv-cache-memory-bytes $(( ${KV_CACHE_GIB:-24} * 1073741824 ))"
  fi
  CMD="$PY -m vllm.entrypoints.cli.main serve $MODEL_DIR --served-model-name llama-3-8b --load-format dummy \
--skip-tokenizer-init --enable-prefix-caching --enable-prompt-tokens-details --num-gpu-blocks-override {kv_blocks} \
--block-size {block_size} --max-model-len {max_model_len} --max-num-seqs 32 --gpu-memory-utilization 0.25 $KVMEM \
--host 127.0.0.1 --port {port}"
fi

mkdir -p "$OUT/ab"
if [ -n "$RESUME" ]; then
  [ -f "$RESUME/plan.json" ] || { echo "ab_h200.sh: RESUME=$RESUME holds no plan.json" >&2; exit 2; }
  cp -r "$RESUME" "$OUT/ab/run"
  rm -rf "$OUT/ab/run/plots" "$OUT/ab/run/report.md" "$OUT/ab/run/ab.json"   # re-rendered at the end
fi
mkdir -p "$OUT/ab/run"
{
  echo "== sitting $(( $(grep -c '^== sitting' "$OUT/ab/run/environment.txt" 2>/dev/null || true) + 1 ))"
  echo "date: $(date -u +%FT%TZ)"; echo "host: $(hostname) $(nproc) cores"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import sys; print("python", sys.version.split()[0])'
  "$PY" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"), "torch", m.version("torch"))' || true
  # Which FlashAttention kernels the vLLM install carries (staging may leave FA2 out: slim_wheel.py).
  "$PY" -c 'import importlib.util as u, pathlib as p; d = p.Path(u.find_spec("vllm").origin).parent / "vllm_flash_attn"; print("vllm FlashAttention kernels:", ", ".join(k for k in ("fa2", "fa3") if list(d.glob(f"_vllm_{k}_C*.so"))) or "none")' 2>/dev/null || true
  echo "serve command: $CMD"
} >> "$OUT/ab/run/environment.txt"
cp "$OUT/ab/run/environment.txt" "$OUT/ab/environment.txt"

t0=$(date +%s)
# Stop (SIGINT: servers and collector are shut down cleanly) before the device tool's 10-minute command limit, so
# that what finished can still be reported below.
if [ -n "$RESUME" ]; then
  ARGS=(--resume)
else
  ARGS=(--scenario "$SCENARIOS" --policies "$POLICIES" --repeat "$REPEAT" --prestart "$PRESTART" --warmup "$WARMUP"
        ${CAPACITIES:+--capacities "$CAPACITIES"} ${TTFT_SLO_MS:+--ttft-slo-ms "$TTFT_SLO_MS"})
fi
# --time-limit stops between arms; timeout (SIGINT: servers and collector shut down cleanly) is the backstop.
timeout --signal=INT "$LIMIT_S" "$PY" -m kvfabric.cli ab "${ARGS[@]}" --serve-cmd "$CMD" --ready-timeout 480 \
  --time-limit "$TIME_LIMIT" --out "$OUT/ab/run" --format json --no-progress 2>&1 | tee -a "$OUT/ab/console.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ] && [ -d "$OUT/ab/run" ]; then
  echo "ab_h200.sh: ab stopped with $rc; reporting the arms that finished" | tee -a "$OUT/ab/console.log"
  "$PY" -m kvfabric.cli ab --report-only --out "$OUT/ab/run" --format json 2>&1 | tee -a "$OUT/ab/console.log" || true
fi
tail -n 1 "$OUT/ab/console.log" > "$OUT/ab/ab.jsonl"
echo "ab_h200.sh: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/ab/console.log"
cat "$OUT/ab/console.log" >> "$OUT/ab/run/console.log"
# Everything the reports need is in runs/*.json once the warm-ups are split off; keep $OUT small.
rm -f "$OUT"/ab/run/collector*.duckdb "$OUT"/ab/run/collector*.duckdb.wal
exit "$rc"
