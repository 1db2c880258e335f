#!/usr/bin/env bash
# Here (no GPU time): lay out the folders to bring to the GPU machine inside a
# checkout, each <= CHUNK_MIB, under CHECKOUT/.gpu/ (git-ignored through
# .git/info/exclude, so nothing is committed and tracked files are untouched).
#   .gpu/tools   dev.sh, $EXTRA_WHEELS (space-separated paths),
#                WHEEL_NAME / WHEEL_NPARTS / WHEEL_SHA256   (bring it along in EVERY command)
#   .gpu/c1      deps/*.whl   (the missing runtime deps, ~53 MiB, largest first)
#   .gpu/c2..cN  parts/<vllm wheel>.part.NN  (one split piece each); deps that
#                did not fit in c1 ride in the last cN (so run `dev.sh deps`
#                in the LAST command, after every folder has been copied)
# A command on the GPU machine also brings the checkout's own tracked + untracked-not-ignored
# files and shared/, all within 64 MiB a command: CHUNK_MIB defaults to
# min(58, 61 - that size in MiB), so re-run stage.sh when the checkout grows.
# Usage: stage.sh CHECKOUT_ROOT VLLM_WHEEL DEPS_DIR [CHUNK_MIB=auto]
set -euo pipefail
ROOT=$(cd "${1:?usage: stage.sh CHECKOUT_ROOT VLLM_WHEEL DEPS_DIR [CHUNK_MIB]}" && pwd)
WHL=$(readlink -f "${2:?vllm wheel}")
DEPS=$(cd "${3:?deps dir}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
tree_b=$(cd "$ROOT" && { git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1; } || echo 0)
tree_b=${tree_b:-0}
if [ -d "$ROOT/shared" ] && git -C "$ROOT" check-ignore -q shared; then
  tree_b=$(( tree_b + $(du -sb "$ROOT/shared" | cut -f1) ))
fi
tree_mib=$(( (tree_b + 1048575) / 1048576 ))
auto=$(( 61 - tree_mib )); [ "$auto" -gt 58 ] && auto=58
CHUNK=${4:-$auto}
[ "$CHUNK" -ge 8 ] || { echo "checkout already sends ${tree_mib} MiB: too little room left"; exit 1; }
echo "checkout sends ~${tree_mib} MiB by itself; chunk size ${CHUNK} MiB"

ex=$(git -C "$ROOT" rev-parse --git-path info/exclude)
case "$ex" in /*) ;; *) ex="$ROOT/$ex" ;; esac
mkdir -p "$(dirname "$ex")"; touch "$ex"
grep -qxF '/.gpu/' "$ex" || echo '/.gpu/' >> "$ex"
git -C "$ROOT" check-ignore -q .gpu/x || { echo ".gpu is not ignored in $ROOT"; exit 1; }

G=$ROOT/.gpu
rm -rf "$G"; mkdir -p "$G/tools"
cp "$HERE"/dev.sh "$G/tools/"
# extra wheels to install beside vLLM (e.g. this project built with `pip wheel --no-deps -w DIR .`)
for w in ${EXTRA_WHEELS:-}; do cp "$w" "$G/tools/"; done
name=$(basename "$WHL")
echo "$name" > "$G/tools/WHEEL_NAME"
(cd "$(dirname "$WHL")" && sha256sum "$name") > "$G/tools/WHEEL_SHA256"

# deps: largest first into c1 up to CHUNK MiB; the rest ride along with the
# last (partial) vLLM piece when there is room, else in extra folders.
lim=$((CHUNK*1024*1024)); used=0; mkdir -p "$G/c1/deps"; over=()
for w in $(ls -S "$DEPS"/*.whl); do
  s=$(stat -c %s "$w")
  if [ $((used+s)) -le $lim ]; then cp "$w" "$G/c1/deps/"; used=$((used+s)); else over+=("$w"); fi
done
# vllm wheel: split into CHUNK MiB pieces, one folder each
i=1; tmp=$(mktemp -d)
split -b "${CHUNK}M" -d -a 2 "$WHL" "$tmp/$name.part."
n=0
for p in "$tmp/$name".part.*; do
  i=$((i+1)); n=$((n+1)); mkdir -p "$G/c$i/parts"; mv "$p" "$G/c$i/parts/"
done
rmdir "$tmp"
used=$(du -sb "$G/c$i" | cut -f1)
for w in "${over[@]}"; do
  s=$(stat -c %s "$w")
  if [ "$s" -gt "$lim" ]; then
    # A wheel larger than a folder (pyarrow: ~53 MiB) travels in pieces, one folder each; `dev.sh deps`
    # joins split/NAME.part.* back into deps/NAME.
    tmp=$(mktemp -d); split -b "${CHUNK}M" -d -a 1 "$w" "$tmp/$(basename "$w").part."
    for p in "$tmp"/*.part.*; do i=$((i+1)); mkdir -p "$G/c$i/split"; mv "$p" "$G/c$i/split/"; done
    rmdir "$tmp"; used=$lim; continue
  fi
  if [ $((used+s)) -gt $lim ]; then i=$((i+1)); used=0; fi
  mkdir -p "$G/c$i/deps"; cp "$w" "$G/c$i/deps/"; used=$((used+s))
done
echo "$n" > "$G/tools/WHEEL_NPARTS"
echo "staged under $G:"; du -sm "$G"/* | sed 's/^/  MiB /'
last=$(ls -d "$G"/c* | sort -V | tail -1); last=$(basename "$last")
echo "commands on the GPU machine, back to back (it is released 30 s after a command ends);"
echo "each command brings along .gpu/tools and .gpu/cK:"
for d in $(ls -d "$G"/c* | sort -V); do k=$(basename "$d"); [ "$k" = "$last" ] && break; echo "  bash .gpu/tools/dev.sh copy .gpu/$k"; done
echo "  last: bash .gpu/tools/dev.sh copy .gpu/$last && bash .gpu/tools/dev.sh deps && bash .gpu/tools/dev.sh vllm && bash .gpu/tools/dev.sh kvfabric && bash .gpu/tools/dev.sh check"
echo "then (same warm machine): export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0"
