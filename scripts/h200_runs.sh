#!/usr/bin/env bash
# GPU figures on one H200 (issue 5). Runs on the GPU host after ../shared/gpu's two-half bundle
# was unpacked into /tmp/site (stage2.sh). Inputs (never committed): MODEL = a Llama-3.1-8B
# config folder (load_format dummy), REAL = the 1,020 real-length prompts (cnn_eval_public.json).
# Results go to $OUT (or ./gpu_out).
#
#   bash scripts/h200_runs.sh overhead      # raw LLM.generate vs standalone SUT, bf16 then fp8+fp8 KV
#   bash scripts/h200_runs.sh full-start    # 600 s+ Offline performance run, 13,368-sample pool (detached)
#   bash scripts/h200_runs.sh full-wait [S] # wait up to S seconds (default 540) for it, then copy results
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
MODEL=${MODEL:-/root/gpu/model}
REAL=${REAL:-/root/gpu/data/cnn_eval_public.json}
POOL=${POOL:-/tmp/pool13368.json}
OUT=${OUT:-$PWD/gpu_out}
FULL=/tmp/full
mkdir -p "$OUT"
COMMON=(--model "$MODEL" --load-format dummy --max-model-len 2668 --max-num-seqs 512 --max-num-batched-tokens 8192
        --gpu-memory-utilization 0.90 --device cuda)

case "${1:-}" in
  overhead)
    python3 scripts/bench_standalone.py "${COMMON[@]}" --dtype bfloat16 --dataset "$REAL" --ignore-eos --repeats 2 \
      --json "$OUT/overhead_bf16.json" 2>&1 | grep -vE "Warning|warn" | tail -12
    python3 scripts/bench_standalone.py "${COMMON[@]}" --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8 \
      --dataset "$REAL" --ignore-eos --repeats 2 --json "$OUT/overhead_fp8.json" 2>&1 | grep -vE "Warning|warn" | tail -12
    ;;
  full-start)
    [ -f "$POOL" ] || python3 -m sut synthetic --out "$POOL" --samples 13368 --seed 0
    rm -rf "$FULL"; mkdir -p "$FULL"
    setsid nohup python3 -m sut run --config loadgen_configs/h200_fp8.toml --model "$MODEL" --load-format dummy \
      --dataset "$POOL" --benchmark-ignore-eos --output-dir "$FULL" --run-name full600 --no-progress \
      > "$FULL/console.log" 2>&1 < /dev/null &
    echo "started pid $!"
    ;;
  full-wait)
    limit=${2:-540}; t=0
    while [ $t -lt "$limit" ] && pgrep -f "run-name full600" >/dev/null; do sleep 10; t=$((t+10)); done
    if pgrep -f "run-name full600" >/dev/null; then echo "still running after ${t}s"; tail -c 600 "$FULL/console.log"; exit 3; fi
    d=$(ls -d "$FULL"/full600* | head -1)
    cp "$d/mlperf_log_summary.txt" "$OUT/full600_summary.txt"; cp "$d/run.json" "$OUT/full600_run.json"
    cp "$d/mlperf_log_detail.txt" "$OUT/full600_detail.txt"
    grep -vE "Warning|warn" "$FULL/console.log" | tail -c 4000 > "$OUT/full600_console.txt"
    head -40 "$OUT/full600_summary.txt"
    ;;
  *) echo "usage: $0 overhead|full-start|full-wait [seconds]"; exit 2;;
esac
