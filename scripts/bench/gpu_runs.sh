#!/usr/bin/env bash
# GPU figures on H100 / H200 hosts (one GPU; two for x2). Runs on the GPU host after
# ../shared/gpu's two-half bundle was unpacked into /tmp/site (stage2.sh). Inputs (never committed):
# MODEL = a Llama-3.1-8B config folder (load_format dummy), REAL = the 1,020 real-length prompts
# (cnn_eval_public.json).
# Results go to $OUT (or ./gpu_out). Every step runs dummy weights with --benchmark-ignore-eos (128 tokens per
# answer): its figures are for the engine, never a submission; with real weights run python -m sut find-qps and
# `python -m sut run` yourself (docs/submission.md section 3).
# `start` empties $JOB (/tmp/job) first: to resume a search in a later session, copy scen/*.jsonl out of the
# job.tgz that batch-wait wrote into SCEN_PRIOR (default docs/results/find_qps_h200) before `start server`.
# One device session is 30 min: the uploads and setup take ~2.5 min of it, a 600 s confirmation ~11.5 min (engine
# start included), so two confirmations fit (2026-12-02: 27.3 min held), or a search (SCEN_BUDGET_S) plus one.
#
#   bash scripts/bench/gpu_runs.sh overhead      # raw LLM.generate vs standalone SUT, bf16 then fp8+fp8 KV
#   bash scripts/bench/gpu_runs.sh full-start    # 600 s+ Offline performance run, 13,368-sample pool (detached)
#   bash scripts/bench/gpu_runs.sh full-wait [S] # wait up to S seconds (default 540) for it, then copy results
#   bash scripts/bench/gpu_runs.sh setup         # from scripts/bench/gpu_bundle.sh's .gpu/c: Flame binaries to /root/gpu/flame/bin,
#                                           # prompts to /root/gpu/data, extra wheels (flamepy needs protobuf >= 6.31,
#                                           # grpcio >= 1.80; vllm serve jmespath, supervisor) into /tmp/site
#   bash scripts/bench/gpu_runs.sh batch-start   # detached: run 3 (scripts/bench/bench_flame.py: standalone vs Flame 32/64
#                                           # through the test stand-in, 2 rounds) then run 4 (tuning sweep)
#   bash scripts/bench/gpu_runs.sh batch-wait [S] # wait up to S seconds, copy what is done to $OUT
#   bash scripts/bench/gpu_runs.sh x2-start        # the GPU runs on nvidia-h200-x2: 1 vs 2 GPUs, Flame 32/64 on 2 engines
#                                             # (step `scale`, same as x2, with GPUS="1 2 4 8" on a larger host)
#   bash scripts/bench/gpu_runs.sh locality-start  # synthetic-locality traces (not MLPerf), one replica per GPU
#   bash scripts/bench/gpu_runs.sh start flame-real # Run 3 again through the REAL Flame v0.6.0 control plane
#                                             # (binaries in FLAME_BIN, default /root/gpu/flame/bin; ROUNDS, default 2)
#   bash scripts/bench/gpu_runs.sh start core      # --sut vllm vs raw generate; --sut vllm-http vs --sut vllm
#   bash scripts/bench/gpu_runs.sh start study     # Flame vs standalone locality pairs (STUDY_PAIRS, STUDY_TRACES,
#                                             # STUDY_POLICIES: a subset of prefix_affinity round_robin)
#   bash scripts/bench/gpu_runs.sh start workloads # the five locality workloads beyond the study, Flame vs standalone
#                                             # (WL_PRESETS, default all five; WL_PAIRS, default 3; WL_KV_BLOCKS,
#                                             # eviction's KV blocks per engine, default 4096; WL_LOSS_TIMEOUT_S,
#                                             # replica-loss's --loss-timeout-s, default 20; WL_ARGS: more flags)
#   bash scripts/bench/gpu_runs.sh start server    # Short Server / Interactive tries (SERVER_QPS, INTERACTIVE_QPS;
#                                             # SERVER_ARGS, INTERACTIVE_ARGS: extra engine flags per scenario;
#                                             # SCENARIOS, SCEN_S, SCEN_TRIES, SCEN_BUDGET_S, SCEN_FACTOR, SCEN_SUT,
#                                             # SCEN_PRIOR)
#   bash scripts/bench/gpu_runs.sh start confirm   # Full-length runs, CONFIRM="Server=55 Interactive=auto
#                                             # Offline=56:60 Interactive=43+--max-num-batched-tokens=1024"
#                                             # (target_qps per run, auto = the search's best VALID; ":S" a shorter
#                                             # dev run; "+FLAG=VALUE" engine flags of that run; "40/41/39": 40,
#                                             # then 41 if VALID else 39); CONFIRM_DATA, SCEN_SUT; no Offline entry:
#                                             # an Offline of CONFIRM_OFFLINE s (60; 0 none) first
#   bash scripts/bench/gpu_runs.sh start STEP...   # detached: the steps batch, x2, locality, perf one after another
#   (all are waited for with batch-wait; run 3 and run 4 use one GPU, CUDA_VISIBLE_DEVICES=${ONE_GPU:-0})
#   (batch: ROUNDS=N sets run 3's rounds, ROUNDS=0 skips run 3; TUNE="MNS,MNBT[,eager] ..." run 4's points,
#    TUNE= skips run 4. E.g. the eager point alone: ROUNDS=0 TUNE="512,8192,eager" bash $0 batch-start;
#    x2/scale: GPUS (default "1 2"), X2_ROUNDS (default 1) Flame rounds; locality: LOC_ROUNDS (default 1), LOC_RATE (Poisson arrivals per
#    second, one trace each, default 0 = all at once), LOC_GATE (router release gate, default excess),
#    ENGINES_PER_GPU (default 1))
set -uo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/../.."
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
MODEL=${MODEL:-/root/gpu/model}
REAL=${REAL:-/root/gpu/data/cnn_eval_public.json}
POOL=${POOL:-/tmp/pool13368.json}
OUT=${OUT:-$PWD/gpu_out}
FULL=/tmp/full
JOB=${JOB:-/tmp/job}  # the detached job's folder (tests set their own)
PRESET=${PRESET:-h200_fp8}  # loadgen_configs/PRESET.toml + PRESET.user.conf: h200_fp8 (one H200), h100_fp8 (one H100)
mkdir -p "$OUT"
COMMON=(--model "$MODEL" --load-format dummy --max-model-len 2668 --max-num-seqs 512 --max-num-batched-tokens 8192
        --gpu-memory-utilization 0.90 --device cuda)

# The server and confirm steps' checks and search-log names (scen_args, check_flag_words, server_check,
# confirm_check, best_valid, scen_log).
source "$(dirname "$SELF")/gpu_lib/scen.sh"

case "${1:-}" in
  overhead)
    python3 scripts/bench/bench_standalone.py "${COMMON[@]}" --dtype bfloat16 --dataset "$REAL" --ignore-eos --repeats 2 \
      --json "$OUT/overhead_bf16.json" 2>&1 | grep -vE "Warning|warn" | tail -12
    python3 scripts/bench/bench_standalone.py "${COMMON[@]}" --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8 \
      --dataset "$REAL" --ignore-eos --repeats 2 --json "$OUT/overhead_fp8.json" 2>&1 | grep -vE "Warning|warn" | tail -12
    ;;
  full-start)
    [ -f "$POOL" ] || python3 -m sut synthetic --out "$POOL" --samples 13368 --seed 0
    rm -rf "$FULL"; mkdir -p "$FULL"
    setsid nohup python3 -m sut run --config loadgen_configs/$PRESET.toml --model "$MODEL" --load-format dummy \
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
  setup)
    # Flame binaries and the real-length prompts from scripts/bench/gpu_bundle.sh's c/ (when carried), then the extra
    # wheels: grpcio/protobuf as flamepy needs them, jmespath/supervisor that `vllm serve` (--sut vllm-http)
    # imports (model_hosting_container_standards); older bundles kept them in a/extra, b/extra, c/fi.
    mkdir -p /root/gpu/flame/bin /root/gpu/data
    if [ -d .gpu/c/flame ]; then cp .gpu/c/flame/* /root/gpu/flame/bin/ && chmod +x /root/gpu/flame/bin/*; fi
    if [ -f .gpu/c/data/cnn_eval_public.json.gz ]; then
      gunzip -c .gpu/c/data/cnn_eval_public.json.gz > /root/gpu/data/cnn_eval_public.json; fi
    wheels=$(ls /root/gpu/extra/*.whl .gpu/a/extra/*.whl .gpu/b/extra/*.whl .gpu/c/extra/*.whl .gpu/c/fi/*.whl 2>/dev/null)
    [ -n "$wheels" ] || { echo "setup: no extra wheels found (bash scripts/bench/gpu_bundle.sh makes .gpu/c/extra)"; exit 2; }
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site --upgrade $wheels
    python3 -c "import grpc, google.protobuf, flamepy, sut.flame.client, sut.flame.service, tests.flame_standin, mlperf_loadgen; \
print('flame stack ok: grpcio', grpc.__version__, 'protobuf', google.protobuf.__version__)"
    ;;
  batch-start|x2-start|locality-start)
    bash "$SELF" start "${1%-start}"
    ;;
  start)
    # The steps run in order in one detached job; DONE is written when the last one ends, and each
    # step's exit code is logged in batch.console (batch-wait prints it).
    shift
    [ $# -gt 0 ] || { echo "start: name at least one step (batch, x2, scale, locality, flame-real, core, study, workloads, server, confirm, perf, server-steps)"; exit 2; }
    if [ -d "$JOB" ] && [ ! -f "$JOB/DONE" ]; then
      echo "start: a job is still running in $JOB (no DONE yet); wait for it with batch-wait"; exit 2
    fi
    rm -rf "$JOB"; mkdir -p "$JOB"
    setsid nohup bash -c 'for s in "${@:2}"; do echo "step $s $(date +%T)"; bash "$1" "$s"; echo "step $s rc=$?"; done
      echo done > '"$JOB"'/DONE' _ "$SELF" "$@" > "$JOB/batch.console" 2>&1 < /dev/null &
    echo "started pid $! ($*)"
    ;;
  batch)
    export CUDA_VISIBLE_DEVICES=${ONE_GPU:-0}  # one GPU, also on a host with more
    # Run 3: standalone, flame32, flame64 in rotated order, 2 rounds, same inputs and engine preset.
    # LoadGen issues 3,060 samples per run (target_qps x min_duration x 1.1 = 2,464, rounded up to whole passes
    # over the 1,020 prompts by equal-issue mode).
    QPS=(--target-qps 56 --min-duration-s 40)
    if [ "${ROUNDS:-2}" -gt 0 ]; then
      python3 scripts/bench/bench_flame.py --config loadgen_configs/$PRESET.toml --model "$MODEL" --load-format dummy \
        --dataset "$REAL" --user-conf loadgen_configs/$PRESET.user.conf "${QPS[@]}" --ignore-eos --rounds "${ROUNDS:-2}" \
        --idle-wait-s 0 --foreign-cpu-max 1 --standin-max-executors 40 --out "$JOB/flame" > "$JOB/flame.console" 2>&1
    fi
    # Run 4: tuning sweep of the standalone SUT around the shipped fp8 preset (512 / 8192 = the standalone runs above).
    # A point is MNS,MNBT or MNS,MNBT,eager (CUDA graphs off).
    for cfg in ${TUNE-"384,8192" "512,12288" "768,8192"}; do
      IFS=, read -r mns mnbt mode <<< "$cfg"
      name="tune_mns${mns}_mnbt${mnbt}${mode:+_$mode}"
      extra=(); [ "$mode" = eager ] && extra=(--enforce-eager)
      python3 -m sut run --config loadgen_configs/$PRESET.toml --model "$MODEL" --load-format dummy --dataset "$REAL" \
        --user-conf loadgen_configs/$PRESET.user.conf "${QPS[@]}" --min-query-count 1 --benchmark-ignore-eos \
        --max-num-seqs "$mns" --max-num-batched-tokens "$mnbt" "${extra[@]}" --output-dir "$JOB/tune" \
        --run-name "$name" --no-progress > "$JOB/$name.console" 2>&1
      r=$(ls -d "$JOB/tune/$name"* 2>/dev/null | head -1)
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(*sys.argv[2:], r.get('tokens_per_s'), r.get('samples_per_s'), r.get('validity'))" \
        "$r/run.json" "$mns" "$mnbt" "${mode:-graphs}" >> "$JOB/tune.tsv" 2>> "$JOB/tune.err" || echo "$cfg failed" >> "$JOB/tune.tsv"
    done
    ;;
  flame-real)
    # Run 3 (the batch step's bench_flame.py call: standalone, flame32, flame64 alternating, fp8 preset,
    # the same 1,020 prompts and LoadGen load, ROUNDS rounds, default 2) through the real Flame v0.6.0 session
    # manager and executor manager, started on this host by bench_flame.py (sut.flame.cluster, loopback ports).
    export CUDA_VISIBLE_DEVICES=${ONE_GPU:-0}
    FB=${FLAME_BIN:-/root/gpu/flame/bin}
    for b in flame-session-manager flame-executor-manager; do
      [ -x "$FB/$b" ] || { echo "flame-real: $FB/$b is missing or not executable (set FLAME_BIN)"; exit 2; }
      if ldd "$FB/$b" | grep -q "not found"; then echo "flame-real: $FB/$b misses libraries:"; ldd "$FB/$b"; exit 2; fi
    done
    QPS=(--target-qps 56 --min-duration-s "${MIN_S:-40}")  # MIN_S=20: 2,040 samples a run instead of 3,060
    python3 scripts/bench/bench_flame.py --config loadgen_configs/$PRESET.toml --model "$MODEL" --load-format dummy \
      --dataset "$REAL" --user-conf loadgen_configs/$PRESET.user.conf "${QPS[@]}" --ignore-eos --rounds "${ROUNDS:-2}" \
      --idle-wait-s 0 --foreign-cpu-max 1 --control-plane real --flame-bin "$FB" --out "$JOB/flame-real" \
      > "$JOB/flame-real.console" 2>&1
    for f in "$JOB"/flame-real/*/flame-cluster/home/logs/*; do  # the managers' own logs (batch-wait packs *.tail)
      [ -f "$f" ] && tail -c 3000 "$f" > "$JOB/flame-real-$(basename "$f").tail"
    done
    ;;
  x2|scale)
    # The standalone SUT on each GPU count in GPUS (default "1 2"; one engine per GPU, GPUs 0..n-1),
    # then Flame at 32/64 with one executor set per GPU vs standalone on the largest count. Same preset and
    # inputs; LoadGen load (target_qps 56 per GPU) and so the run length per GPU stay the same.
    ns=(${GPUS:-1 2}); nmax=${ns[-1]}
    for n in "${ns[@]}"; do
      CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) python3 -m sut run --config loadgen_configs/$PRESET.toml \
        --model "$MODEL" --load-format dummy --dataset "$REAL" --user-conf loadgen_configs/$PRESET.user.conf \
        --target-qps $((56 * n)) --min-duration-s 40 --min-query-count 1 --benchmark-ignore-eos --output-dir "$JOB/x2" \
        --run-name "gpus$n" --no-progress > "$JOB/gpus$n.console" 2>&1
    done
    python3 scripts/bench/gpu_scaling.py "$JOB/x2" "${ns[@]}" > "$JOB/x2.txt" 2>&1
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((nmax - 1))) python3 scripts/bench/bench_flame.py --config loadgen_configs/$PRESET.toml \
      --model "$MODEL" --load-format dummy --dataset "$REAL" --user-conf loadgen_configs/$PRESET.user.conf \
      --target-qps $((56 * nmax)) --min-duration-s 40 --ignore-eos --rounds "${X2_ROUNDS:-1}" --idle-wait-s 0 \
      --foreign-cpu-max 1 --flame-engines "$nmax" --standin-max-executors $((40 * nmax)) --out "$JOB/flame$nmax" \
      > "$JOB/flame$nmax.console" 2>&1
    ;;
  locality)
    # Synthetic-locality traces (NOT MLPerf): 32 documents of ~8K tokens x 4 questions, fp8 engines with prefix
    # caching, one replica per visible GPU (ENGINES_PER_GPU=2 splits one GPU into two replicas); one trace per
    # arrival rate in LOC_RATE (e.g. LOC_RATE="0 6 12", distinct values), router gate LOC_GATE (excess|absolute).
    for rate in ${LOC_RATE:-0}; do
      python3 -m sut.locality run --model "$MODEL" --load-format dummy --dtype bfloat16 --quantization fp8 \
        --kv-cache-dtype fp8 --max-num-seqs 512 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.90 \
        --device cuda --engines-per-device "${ENGINES_PER_GPU:-1}" --documents 32 --questions 4 \
        --release-gate "${LOC_GATE:-excess}" --pairs "${LOC_ROUNDS:-1}" --rate "$rate" --output-dir "$JOB/locality" \
        --run-name "rate$rate" --no-progress > "$JOB/locality_rate$rate.console" 2>&1
      cp "$JOB/locality/rate$rate-SYNTHETIC-LOCALITY-NOT-MLPERF/locality.json" "$JOB/locality_rate$rate.json"
    done
    ;;
  study)
    # The study's locality experiment (NOT MLPerf), scripts/bench/bench_locality.py: Flame vs standalone, both
    # with prefix affinity (study-reuse also round robin), STUDY_PAIRS fresh pairs (default 2; the study: 5, about
    # 2.5 min per case here), two engines sharing one H200 (the study: one B200 each), bf16 eager, max_num_seqs 64,
    # 8,192 batched tokens as the study; news text from the file's own Llama 3 ids (no tokenizer there), questions
    # of ~16 ids like the templates' (74.85 % of prompt tokens reusable, as with the tokenizer); the real Flame v0.6.0.
    export CUDA_VISIBLE_DEVICES=${ONE_GPU:-0}
    FB=${FLAME_BIN:-/root/gpu/flame/bin}
    python3 -m sut.flame cluster --flame-bin "$FB" --workdir "$JOB/study-cluster" > "$JOB/study-cluster.console" 2>&1 &
    cpid=$!
    until grep -q FLAME_ENDPOINT "$JOB/study-cluster.console"; do kill -0 $cpid || { cat "$JOB/study-cluster.console"; exit 2; }; sleep 0.5; done
    export "$(grep -m1 ^FLAME_ENDPOINT= "$JOB/study-cluster.console")"
    python3 scripts/bench/bench_locality.py --pairs "${STUDY_PAIRS:-2}" --traces ${STUDY_TRACES:-study-reuse study-no-reuse} \
      ${STUDY_POLICIES:+--policies $STUDY_POLICIES} \
      --out "$JOB/study" -- --model "$MODEL" --load-format dummy --dtype bfloat16 --enforce-eager --max-num-seqs 64 \
      --max-num-batched-tokens 8192 --gpu-memory-utilization 0.90 --device cuda --engines-per-device 2 \
      --dataset "$REAL" --question-tokens 16 --no-progress > "$JOB/study.console" 2>&1
    kill $cpid; wait $cpid
    ;;
  workloads)
    # The five synthetic-locality workloads beyond the study (NOT MLPerf; docs/locality.md, "Beyond the study"): each
    # preset of WL_PRESETS one run of WL_PAIRS fresh pairs (default 3), Flame vs standalone, on one GPU shared by two
    # engines, with the study step's engine settings and text (bf16 eager, max_num_seqs 64, 8,192 batched tokens,
    # the file's own Llama 3 ids with ~16-id questions). The presets are the shrunk GPU shapes (32 documents of ~8K
    # tokens: a case takes 1.5-3 min); eviction caps every engine's KV cache at WL_KV_BLOCKS blocks (default 4096 =
    # 65,536 tokens), so its 3x working set is 24 documents on any card. WL_ARGS: flags for every run (e.g. a resumed
    # arrivals run's --capacity). One run per preset in $JOB/workloads/<preset>-SYNTHETIC-LOCALITY-NOT-MLPERF.
    export CUDA_VISIBLE_DEVICES=${ONE_GPU:-0}
    FB=${FLAME_BIN:-/root/gpu/flame/bin}
    python3 -m sut.flame cluster --flame-bin "$FB" --workdir "$JOB/workloads-cluster" > "$JOB/workloads-cluster.console" 2>&1 &
    cpid=$!
    until grep -q FLAME_ENDPOINT "$JOB/workloads-cluster.console"; do kill -0 $cpid || { cat "$JOB/workloads-cluster.console"; exit 2; }; sleep 0.5; done
    export "$(grep -m1 ^FLAME_ENDPOINT= "$JOB/workloads-cluster.console")"
    worst=0
    for p in ${WL_PRESETS:-arrivals variable-answers hot-prefixes eviction replica-loss}; do
      extra=(); [ "$p" = eviction ] && extra=(--kv-blocks "${WL_KV_BLOCKS:-4096}")
      # replica-loss: 20 s without an answer after the kill end a case (a timed burst is 12-23 s here; the 60 s
      # default would add ~40 s to every case of a system that stops serving, past one device session)
      [ "$p" = replica-loss ] && extra=(--loss-timeout-s "${WL_LOSS_TIMEOUT_S:-20}")
      # shellcheck disable=SC2086
      python3 -m sut.locality run --trace-preset "$p" --systems standalone flame --pairs "${WL_PAIRS:-3}" \
        --model "$MODEL" --load-format dummy --dtype bfloat16 --enforce-eager --max-num-seqs 64 \
        --max-num-batched-tokens 8192 --gpu-memory-utilization 0.90 --device cuda --engines-per-device 2 \
        --dataset "$REAL" --question-tokens 16 "${extra[@]}" --output-dir "$JOB/workloads" --run-name "$p" \
        --no-progress ${WL_ARGS:-} > "$JOB/workload_$p.console" 2>&1
      rc=$?; [ $rc -eq 0 ] || { worst=$rc; echo "workloads $p: rc=$rc ($JOB/workload_$p.console)"; }
      cp "$JOB/workloads/$p-SYNTHETIC-LOCALITY-NOT-MLPERF/locality.json" "$JOB/locality_$p.json" 2>/dev/null
    done
    kill $cpid; wait $cpid
    exit $worst
    ;;
  perf)
    # Engine levers side by side with the shipped fp8 preset, then the torch-profiler map
    # (scripts/bench/perf_levers.py, scripts/bench/perf_profile.py); one GPU. LEVERS overrides the list, PERF_WARMUP the
    # warm-up prompts before each timed pass (default 64); flashinfer needs
    # FLASHINFER_SITE (a folder with flashinfer-python 0.6.14 installed with pip --target).
    export CUDA_VISIBLE_DEVICES=${ONE_GPU:-0}
    python3 scripts/bench/perf_levers.py --model "$MODEL" --dataset "$REAL" --out "$JOB/perf" \
      --levers "${LEVERS:-baseline,fusion,full_graphs,triton_attn,profile}" ${PERF_WARMUP:+--warmup "$PERF_WARMUP"} \
      > "$JOB/perf.console" 2>&1
    rc=$?
    for f in "$JOB"/perf/*.log; do [ -f "$f" ] && tail -c 4000 "$f" > "$f.tail"; done
    exit $rc  # perf_levers.py's, not the log loop's
    ;;
  server-steps)
    # Server's engine steps next to Offline's on one started engine of the fp8 preset (scripts/bench/server_steps.py;
    # ~4 min): SS_RATE Server's queries/s (default 52), SS_DURATION seconds a phase (default 90), SS_PROFILE steady
    # steps profiled per phase (default 0), SS_ADMIT the Server phases' --admit-every-steps Ks (space-separated,
    # default 1; e.g. "1 2 3": arrivals added every K engine steps while busy, one Server phase per K, each extra K
    # ~1.5 min, a Server phase of SS_DURATION s); PERF_BASE_OVERRIDE (JSON) changes the engine, e.g.
    # '{"max_num_seqs": 640}', or Interactive's '{"max_num_batched_tokens": 1536}' with SS_RATE=44 (each Server
    # phase also reports TTFT / TPOT p50 and p99). SS_OVERRIDES: several engines one after another, their
    # PERF_BASE_OVERRIDE objects separated by ";" (each a fresh engine, ~1.5 min to start, and its own folder
    # $JOB/server_steps_I/, I from 0), e.g. '{"max_num_batched_tokens": 1536}; {"max_num_batched_tokens": 3072}'.
    # SS_PHASES: "offline server" (default), or "server" alone (a latency screen needs no Offline reference).
    # SS_WARM: s into a phase where its steady window starts (default 30; Interactive's load is steady in ~5 s, so a
    # screen of short phases can start its window at 10).
    export CUDA_VISIBLE_DEVICES=${ONE_GPU:-0}
    read -ra ss_admit <<< "${SS_ADMIT:-1}"
    read -ra ss_phases <<< "${SS_PHASES:-offline server}"
    IFS=';' read -ra ss_over <<< "${SS_OVERRIDES:-${PERF_BASE_OVERRIDE:-}}"
    mkdir -p "$JOB"
    [ ${#ss_over[@]} -gt 0 ] || ss_over=("")
    worst=0
    for i in "${!ss_over[@]}"; do
      out="$JOB/server_steps"; [ ${#ss_over[@]} -gt 1 ] && out+="_$i"
      PERF_BASE_OVERRIDE=${ss_over[$i]} python3 scripts/bench/server_steps.py --model "$MODEL" --dataset "$REAL" \
        --out "$out" --rate "${SS_RATE:-52}" --duration-s "${SS_DURATION:-90}" --warm-s "${SS_WARM:-30}" \
        --profile-steps "${SS_PROFILE:-0}" \
        --admit-every-steps "${ss_admit[@]}" --phases "${ss_phases[@]}" > "$out.console" 2>&1 || worst=$?
    done
    exit $worst
    ;;
  core)
    # (one dispatch core), one GPU, fp8 preset: (a) --sut vllm vs raw LLM.generate on the same started
    # engine; (b) --sut vllm-http (vllm serve started here) vs --sut vllm, same prompts and LoadGen load, HTTP_ROUNDS
    # rounds (default 2) alternating, MIN_S-second LoadGen windows (default 40); Flame 32/64 vs standalone is the flame-real step. CORE_OVERHEAD=0 skips (a).
    export CUDA_VISIBLE_DEVICES=${ONE_GPU:-0}
    [ "${CORE_OVERHEAD:-1}" = 0 ] || python3 scripts/bench/bench_standalone.py "${COMMON[@]}" --dtype bfloat16 --quantization fp8 \
      --kv-cache-dtype fp8 --dataset "$REAL" --ignore-eos --repeats 2 --json "$JOB/core_overhead_fp8.json" \
      > "$JOB/core_overhead.console" 2>&1
    # CORE_STATS=1 adds `vllm-http+stats` (servers with vLLM's request statistics on, as `vllm serve` defaults).
    suts=(vllm vllm-http); variant=()
    [ "${CORE_STATS:-0}" = 1 ] && suts+=(vllm-http+stats) && variant=(--variant "vllm-http+stats=--sut vllm-http --server-log-stats")
    python3 scripts/bench/bench_suts.py --suts "${suts[@]}" "${variant[@]}" --rounds "${HTTP_ROUNDS:-2}" --out "$JOB/core_http" -- \
      --config loadgen_configs/$PRESET.toml --model "$MODEL" --load-format dummy --dataset "$REAL" \
      --user-conf loadgen_configs/$PRESET.user.conf --target-qps 56 --min-duration-s "${MIN_S:-40}" \
      --min-query-count 1 --benchmark-ignore-eos > "$JOB/core_http.console" 2>&1
    ;;
  server)
    # Target_qps search (python -m sut find-qps) for SCENARIOS (default "Server Interactive"), fp8 preset,
    # --sut SCEN_SUT (default vllm), tries of 1,000 queries and >= SCEN_S s (default 120;
    # shorter tries are not judged and CONFIRM=auto skips them), at most SCEN_TRIES per
    # scenario (default 8), none started that would end > SCEN_BUDGET_S s (default 1200) after this step began;
    # SCEN_FACTOR (default 2): find_qps's --factor while bracketing (e.g. 1.25 when the start is near the answer).
    # SERVER_ARGS / INTERACTIVE_ARGS: extra `sut run` flags for that scenario (engine settings, e.g.
    # INTERACTIVE_ARGS="--max-num-batched-tokens 2048"); the confirm step uses them too. Each settings set has its
    # own log, $JOB/scen/h200_fp8_<sc>[_<flags>]_<SCEN_S>s.jsonl, appended at once after every try; an earlier session's file
    # of the same name in SCEN_PRIOR (default docs/results/find_qps_h200) is copied there first and resumed. Keep
    # SCEN_S, SCEN_SUT, MODEL, REAL the same across sessions (find_qps refuses tries made with other settings).
    # --one-process: the engines start once per scenario; a try that fails ends that scenario's search (exit 1).
    export CUDA_VISIBLE_DEVICES=${ONE_GPU:-0}
    server_check || exit 2
    mkdir -p "$JOB/scen"; t0=$(date +%s); worst=0
    for sc in ${SCENARIOS:-Server Interactive}; do
      q=$([ $sc = Server ] && echo "${SERVER_QPS:-48}" || echo "${INTERACTIVE_QPS:-20}")
      read -ra extra <<< "$(scen_args "$sc")"
      f=$(scen_log "$JOB/scen" "$sc"); prior=$(scen_log "${SCEN_PRIOR:-docs/results/find_qps_h200}" "$sc")
      resume=(); [ -s "$prior" ] && cp "$prior" "$f" && resume=(--resume "$f")
      python3 -m sut find-qps --one-process --scenario $sc --start "$q" --log "$f" "${resume[@]}" \
        --budget-s $(( ${SCEN_BUDGET_S:-1200} - $(date +%s) + t0 )) --max-runs "${SCEN_TRIES:-8}" --factor "${SCEN_FACTOR:-2}" \
        --min-duration-s "${SCEN_S:-120}" --min-query-count 1000 --output-dir "$JOB/scen" -- \
        --config loadgen_configs/$PRESET.toml --sut "${SCEN_SUT:-vllm}" --model "$MODEL" --load-format dummy \
        --dataset "$REAL" --user-conf loadgen_configs/$PRESET.user.conf --benchmark-ignore-eos "${extra[@]}" \
        > "$JOB/scen_$sc.console" 2>&1
      rc=$?; [ $rc -eq 0 ] || { worst=$rc; echo "server $sc: find_qps rc=$rc ($JOB/scen_$sc.console)"; }
    done
    exit $worst
    ;;
  confirm)
    # Full-length confirmation runs, one per entry of CONFIRM (e.g. "Offline=56:60 Server=55
    # Interactive=auto Interactive=43+--max-num-batched-tokens=1024 Interactive=45+screen"):
    # SCENARIO=QPS[:S][+FLAG=VALUE...|+screen], all entries
    # checked before the first run (exit 2). QPS "auto" takes the highest VALID try judged steady (best_valid) of the
    # search log for that scenario, its SERVER_ARGS / INTERACTIVE_ARGS and SCEN_S: this job's (the server step run
    # first in the same `start`), else SCEN_PRIOR's (copy an earlier session's log there). Each runs `python -m sut run
    # --sut SCEN_SUT --scenario SCENARIO` with a copy of loadgen_configs/$PRESET.user.conf with that scenario's
    # target_qps line (in place of the file's own; no --target-qps override), the scenario's extra flags and the
    # entry's +flags, on CONFIRM_DATA (default $REAL, the prompts the search used). ":S" makes a dev run:
    # --min-duration-s S, and for Offline also --min-query-count 1 (else LoadGen's 13,368-sample minimum sets the
    # length: 2026-12-02 an Offline=56:60 took 6.5 min). Runs in $JOB/confirm/ as confirm-SCENARIO-QPS[-Ss][-flags]
    # (run.json + summaries come back with batch-wait). QPS "Q/UP/DOWN" (e.g. Interactive=40/41/39) bisects one step
    # in one job: Q first, then UP if LoadGen said VALID, else DOWN (2026-12-02: each 600 s Interactive run takes 12 min
    # of a 30-min session). "+screen" (Server / Interactive) takes the engine flags scripts/bench/screen_pick.py picks
    # from this job's latency screen, the setting with the most room under its binding p99 limit: one job screens
    # and confirms (`SS_OVERRIDES=... start server-steps confirm` with CONFIRM="Interactive=45+screen").
    # Exit code: the last failed run's, 1 for an auto with no VALID try or a +screen with no screen.
    # Without an Offline entry, Server / Interactive runs get a same-host Offline dev run first (confirm_with_offline:
    # CONFIRM_OFFLINE seconds, default 60, ~2.5 min with its engine start; 0: none).
    export CUDA_VISIBLE_DEVICES=${ONE_GPU:-0}
    given=$CONFIRM; CONFIRM=$(confirm_with_offline) || exit 2
    [ "$CONFIRM" = "$given" ] || echo "confirm: ${CONFIRM%% *} first, this host's Offline for the shares (CONFIRM_OFFLINE=0: none)"
    confirm_check || exit 2
    mkdir -p "$JOB/confirm"; worst=0
    for entry in $CONFIRM; do
      sc=${entry%%=*}; rest=${entry#*=}; flags=; [[ $rest == *+* ]] && flags=${rest#*+} && rest=${rest%%+*}
      q=${rest%%:*}; dur=()
      if [ "$rest" != "$q" ]; then
        dur=(--min-duration-s "${rest#*:}"); [ "$sc" = Offline ] && dur+=(--min-query-count 1)
      fi
      if [ "$flags" = screen ]; then  # the latency screen's pick (server-steps, earlier in this job)
        flags=$(python3 scripts/bench/screen_pick.py --scenario "$sc" "$JOB") \
          || { echo "confirm $sc: +screen, but no screen to pick from in $JOB (start server-steps first)"; worst=1; continue; }
        echo "confirm $sc: the screen picked +$flags"
      fi
      read -ra extra <<< "$(scen_args "$sc") ${flags//+/ }"
      if [ "$q" = auto ]; then  # this job's search log, else the one in SCEN_PRIOR
        log=$(scen_log "$JOB/scen" "$sc"); [ -s "$log" ] || log=$(scen_log "${SCEN_PRIOR:-docs/results/find_qps_h200}" "$sc")
        [ -s "$log" ] || { echo "confirm $sc: auto, but there is no search log $log (start server first, with the same"\
          "SCEN_S and ${sc^^}_ARGS)"; worst=1; continue; }
        q=$(best_valid "$log")
        [ -n "$q" ] || { echo "confirm $sc: auto, but no VALID try judged steady in $log (a try shorter than ~12 times"\
          "what a query holds its slot is not judged: search with SCEN_S=120 or more)"; worst=1; continue; }
      fi
      if [[ $q == */* ]]; then  # Q/IF_VALID/IF_NOT: a second run, one step up or down from the first's verdict
        IFS=/ read -r q up down <<< "$q"; confirm_run "$sc" "$q"
        next=$down; [ "$CONFIRM_VALID" = 1 ] && next=$up
        echo "confirm $sc: $q was $([ "$CONFIRM_VALID" = 1 ] && echo VALID || echo 'not VALID'): next $next"; q=$next
      fi
      confirm_run "$sc" "$q"
    done
    # each run's share of this job's Offline, if it ran one
    compgen -G "$JOB/confirm/*/run.json" > /dev/null && python3 scripts/bench/scenario_ratios.py "$JOB/confirm"
    exit $worst
    ;;
  batch-wait)
    limit=${2:-540}; t=0
    while [ $t -lt "$limit" ] && [ ! -f "$JOB/DONE" ]; do sleep 10; t=$((t+10)); done
    # One archive (the device tool brings back only a few files): records, consoles, log tails.
    for f in "$JOB"/flame*/*/logs/*.log; do [ -f "$f" ] && tail -c 3000 "$f" > "$JOB/$(basename "$f").tail"; done
    # The start-up timeline of the first locality case's engines (where a fresh engine's seconds go).
    for f in "$JOB"/workloads/*/pair0-standalone-*/engine-*.log; do
      [ -f "$f" ] && grep -aE "^(\(EngineCore|INFO|WARNING|engine)" "$f" | cut -c1-240 | head -120 \
        > "$JOB/startup-$(basename "$(dirname "$f")")-$(basename "$f").tail"
    done
    (cd "$JOB" && find . -name "run.json" -o -name "summary.json" -o -name "*.console" -o -name "tune.*" \
       -o -name "mlperf_log_summary.txt" -o -name "DONE" -o -name "*.tail" -o -name "x2.txt" \
       -o -name "locality*.json" -o -name "cases.jsonl" -o -name "run_header.json" -o -path "./scen/*.jsonl" -o -name "core_*.json" -o -name "summary.json" -o -path "./perf/*.json*" -o -path "./perf/*.tail" -o -name "server_steps.json" -o -name "*.png" | tar -czf "$OUT/job.tgz" -T -)
    cat "$JOB/x2.txt" 2>/dev/null; for f in "$JOB"/locality*.console; do [ -f "$f" ] && tail -5 "$f"; done
    grep -E "^step .* rc=" "$JOB/batch.console"
    tail -4 "$JOB"/core_*.console "$JOB"/scen_*.console "$JOB"/confirm-*.console 2>/dev/null
    grep -E "^round|^config|^standalone|^flame|target" "$JOB"/flame*.console 2>/dev/null
    grep -E "median|worst|round_robin|cached share|FAILED|note:" "$JOB/study.console" 2>/dev/null
    for f in "$JOB"/workload_*.console; do [ -f "$f" ] && { echo "== $f"; grep -E "median|FAILED|capacity|eviction:|hot prefixes:" "$f"; }; done
    for f in "$JOB"/scen/*.jsonl; do [ -f "$f" ] && cut -c1-200 "$f"; done
    cat "$JOB/tune.tsv" 2>/dev/null
    grep -E "^\[|^lever|^ +[a-z_]+ +[a-z_]+ +[0-9]" "$JOB/perf.console" 2>/dev/null | tail -30
    for f in "$JOB"/server_steps*.console; do  # 16 rows + a ratio line per Server phase, per engine
      [ -f "$f" ] && { echo "== $f"; grep -A24 "^steady window" "$f"; }
    done
    [ -f "$JOB/DONE" ] && echo "batch DONE after ${t}s" || echo "batch still running after ${t}s"
    ;;
  *) echo "usage: $0 overhead|full-start|full-wait [seconds]|setup|batch-start|x2-start|locality-start|start STEP...|batch-wait [seconds] (steps: batch x2 scale locality flame-real core study workloads server confirm perf server-steps)"; exit 2;;
esac
