#!/usr/bin/env bash
# Build everything a GPU session (the `device` tool's H200 host: Python 3.12, torch 2.11, no network) needs
# for scripts/bench/gpu_runs.sh, in DEST (default .gpu, git-ignored), as three uploads of at most 64 MiB each:
#   DEST/a  part_00 of the vLLM 0.26.0 bundle, model/ (the Llama-3.1-8B dummy config)
#   DEST/b  part_01, wheels/ (vLLM's missing dependencies + flamepy, LoadGen, pymongo), stage2.sh
#   DEST/b2 only when b would not fit beside the working tree: b's largest wheels, moved (one more call, 2a)
#   DEST/c  flame/ (the Flame v0.6.0 binaries), data/cnn_eval_public.json.gz (real-length prompts),
#           extra/ (grpcio and protobuf as flamepy needs them; jmespath, supervisor for `vllm serve`)
# plus DEST/src.tar, the code the job runs: `bash scripts/bench/gpu_bundle.sh DEST --src` just before call 3 writes it
# (git archive of HEAD without docs/results' raw files of earlier runs, ~4 MiB; find_qps_h200/ stays: SCEN_PRIOR).
# a and b come from ../shared/gpu/make_bundle.sh (about 8 min on 2 cores); c from ../shared/flame, ../shared/data and
# PyPI (cp312 manylinux wheels). SHARED (default ../shared) names the shared folder.
# Usage: bash scripts/bench/gpu_bundle.sh [DEST] [--only-c | --src]
# The device calls (docs/perf.md "GPU sessions"):
#   1. carry [DEST/a]: mkdir -p /root/gpu && cp -r DEST/a/part_00 DEST/a/model /root/gpu/
#   2a. only if DEST/b2 exists: carry [DEST/b2]: mkdir -p /root/gpu/wheels && cp DEST/b2/*.whl /root/gpu/wheels/
#   2. carry [DEST/b]: cp /root/gpu/wheels/*.whl DEST/b/wheels/ 2>/dev/null; bash DEST/b/stage2.sh DEST/b
#   3. `bash scripts/bench/gpu_bundle.sh DEST --src`, carry [DEST/c, DEST/src.tar]: bash scripts/bench/gpu_runs.sh
#      setup, then unpack src.tar into /root/src and start the steps there (docs/perf.md "GPU sessions" has the
#      exact command lines)
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in --*) set -- .gpu "$@" ;; esac  # the options alone: DEST is .gpu
DEST=${1:-.gpu}; ONLY_C=${2:-}
SHARED=${SHARED:-../shared}
src_tar() {  # HEAD's files less docs/results' raw runs (h100_*, h200_*, cpu_*), as a tar on stdout
  git archive HEAD -- . ':!docs/results/h*' ':!docs/results/cpu*'
}
if [ "$ONLY_C" = "--src" ]; then
  git diff --quiet HEAD -- || echo "warning: uncommitted changes are not in src.tar (HEAD's code): commit them first" >&2
  mkdir -p "$DEST"; src_tar > "$DEST/src.tar"
  echo "$DEST/src.tar: $(( $(stat -c %s "$DEST/src.tar") / 1048576 )) MiB, commit $(git rev-parse --short HEAD)"
  exit 0
fi
for need in "$SHARED/gpu/make_bundle.sh" "$SHARED/gpu/llama31_8b_dummy/config.json" "$SHARED/flame/bin/flame-session-manager" \
            "$SHARED/flame/bin/flame-executor-manager" "$SHARED/data/cnn_eval_public.json"; do
  [ -e "$need" ] || { echo "error: $need not found (set SHARED to the shared folder)" >&2; exit 2; }
done
mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)  # absolute: make_bundle.sh changes directory before it writes
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
if [ "$ONLY_C" != "--only-c" ]; then
  rm -rf "$DEST/a" "$DEST/b"
  bash "$SHARED/gpu/make_bundle.sh" "$DEST" flamepy==0.6.0 mlcommons-loadgen==6.0.17 pymongo
  cp -r "$SHARED/gpu/llama31_8b_dummy" "$DEST/a/model"
fi
rm -rf "$DEST/c"; mkdir -p "$DEST/c/flame" "$DEST/c/data" "$DEST/c/extra"
cp "$SHARED"/flame/bin/flame-session-manager "$SHARED"/flame/bin/flame-executor-manager "$DEST/c/flame/"
gzip -c "$SHARED/data/cnn_eval_public.json" > "$DEST/c/data/cnn_eval_public.json.gz"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$DEST/c/extra" grpcio==1.85.3 protobuf==7.36.2 jmespath supervisor
# Every device call also carries the working tree (tracked files; this script is run from a clean one), and
# call 3 src.tar (the code again, without docs/results' raw runs): 64 MiB in all per call; 60 MiB kept as the
# budget (b at 57 MiB beside a 7 MiB tree was refused, 2026-12-02: the tool counts more than the file bytes).
tree_b=$(git ls-files -z | xargs -0 cat | wc -c)
src_b=$(src_tar | wc -c)
room_b=$((60 * 1048576 - tree_b))
if [ -d "$DEST/b2" ]; then  # an earlier sizing's moved wheels go back first (--only-c keeps a and b)
  [ -d "$DEST/b/wheels" ] && mv "$DEST"/b2/*.whl "$DEST/b/wheels/"
  rm -rf "$DEST/b2"
fi
if [ -d "$DEST/b" ]; then  # move b's largest wheels to b2 until b fits beside the tree
  while [ "$(du -sb "$DEST/b" | cut -f1)" -gt "$room_b" ]; do
    whl=$(ls -S "$DEST"/b/wheels/*.whl | sed -n 1p)  # sed reads it all: no SIGPIPE under pipefail
    mkdir -p "$DEST/b2"; mv "$whl" "$DEST/b2/"
  done
fi
big=0
for part in a b b2 c; do
  [ -d "$DEST/$part" ] || continue
  size=$(du -sb "$DEST/$part" | cut -f1); room=$room_b
  [ $part = c ] && room=$((room_b - src_b))  # call 3 also carries src.tar
  beside="the $((tree_b / 1048576)) MiB working tree"; [ $part = c ] && beside+=" and the $((src_b / 1048576)) MiB src.tar"
  echo "$DEST/$part: $((size / 1048576)) MiB (a device call carries at most $((room / 1048576)) MiB of it beside $beside)"
  [ "$size" -le "$room" ] || { echo "error: $DEST/$part is too large for one call" >&2; big=1; }
done
[ -d "$DEST/b2" ] && echo "note: b did not fit beside the working tree: call 2a uploads $DEST/b2 before call 2 (header)"
exit $big
