#!/usr/bin/env bash
# GPU machine: one sitting of benchmarks/gpu/ab_h200.sh sized to what is left of the device command, for an A/B
# longer than one command (kvfabric ab --time-limit/--resume). Run from the checkout root.
#   T0      the command's start (date +%s), BUDGET the seconds the command may run (under the device's 600 s)
#   NAME    the A/B's name: the run folder is kept in /tmp/keep/$NAME for the next sitting on the same warm machine,
#           and comes back as $OUT/$NAME.tgz (a tar: the device returns files at most two folders down)
#   RESUME  (optional) an earlier run folder to continue (/tmp/keep/$NAME, or one carried with the command);
#           SCENARIOS, POLICIES, REPEAT, ... as ab_h200.sh takes them for a new A/B
# LIMIT_S (ab_h200.sh's backstop) is what is left less 20 s; TIME_LIMIT (no arm may end later) 40 s before that,
# for the report, the copy and the tar. Nothing is started with less than 150 s left.
# Example, the last staging command followed by the first sitting:
#   export T0=$(date +%s) BUDGET=588; bash .gpu/tools/dev.sh deps && bash .gpu/tools/dev.sh vllm && \
#     bash .gpu/tools/dev.sh kvfabric && bash .gpu/tools/dev.sh check && \
#     SCENARIOS=long_conversation_return POLICIES=lru,shared_aware REPEAT=5 NAME=lcr OUT=$OUT \
#     bash benchmarks/gpu/staging/sitting.sh
# and each later one:  export T0=$(date +%s) BUDGET=590; RESUME=/tmp/keep/lcr NAME=lcr OUT=$OUT bash ...sitting.sh
set -uo pipefail
: "${T0:?set T0 to the start of the command, in epoch seconds}" "${BUDGET:?}" "${NAME:?}" "${OUT:?}"
left=$(( BUDGET - ($(date +%s) - T0) ))
if [ "$left" -lt 150 ]; then echo "sitting.sh: $left s left, no sitting for $NAME"; exit 0; fi
mkdir -p "$OUT/$NAME" /tmp/keep
LIMIT_S=$(( left - 20 )) TIME_LIMIT=$(( left - 60 )) OUT="$OUT/$NAME" bash benchmarks/gpu/ab_h200.sh
rc=$?
rm -rf "/tmp/keep/$NAME"; cp -r "$OUT/$NAME/ab/run" "/tmp/keep/$NAME"
tar -czf "$OUT/$NAME.tgz" -C "$OUT/$NAME" ab && rm -rf "$OUT/$NAME"
echo "sitting.sh: $NAME exit $rc, $(( BUDGET - ($(date +%s) - T0) )) s left"
exit "$rc"
