# Sourced by scripts/bench/gpu_runs.sh, not run by itself: the server and confirm steps' settings checks (SCENARIOS,
# SCEN_*, SERVER_ARGS / INTERACTIVE_ARGS, CONFIRM) and their search logs (scen_log: a log's name; best_valid: what
# CONFIRM's auto takes from one). Functions only; best_valid needs the repository on PYTHONPATH (gpu_runs.sh sets it).

# Extra `sut run` flags of a scenario (SERVER_ARGS, INTERACTIVE_ARGS; none for Offline): words split
# at spaces (no shell quoting inside them); flags the steps set themselves are refused by check_scen_args.
scen_args() { case $1 in Server) echo "${SERVER_ARGS:-}" ;; Interactive) echo "${INTERACTIVE_ARGS:-}" ;; esac; }
# `sut run` takes any unambiguous prefix of a flag (argparse), so a prefix of one of these is refused too.
SET_HERE="--scenario --user-conf --target-qps --sut --config --model --dataset --output-dir --run-name --min-duration-s
  --min-query-count --mode --compliance-test --load-format --no-progress"
check_scen_args() {
  local sc; for sc in Server Interactive; do check_flag_words "${sc^^}_ARGS" $(scen_args $sc) || return 1; done
}
# Words $2... as engine flags for `sut run` (label $1 in messages): no quotes, no flag this script sets, nor a prefix
# of one.
check_flag_words() {
  local label=$1 w f what hits; shift
  for w in "$@"; do
    case $w in *[\"\']*) echo "$label: $w: words are split at spaces, quotes are not read"; return 1 ;; esac
    [[ $w == --?* ]] || continue
    hits=(); for f in $SET_HERE; do [[ $f == "${w%%=*}"* ]] && hits+=("$f"); done
    [ ${#hits[@]} -gt 0 ] || continue
    if [[ " ${hits[*]} " == *" ${w%%=*} "* ]]; then what="is set by this script"
    elif [ ${#hits[@]} -eq 1 ]; then what="is short for ${hits[0]}, which this script sets"
    else what="is a prefix of ${hits[*]}, which this script sets"; fi
    echo "$label: $w $what (SERVER_ARGS / INTERACTIVE_ARGS / CONFIRM's +flags take engine flags)"; return 1
  done
}
# The server step's settings, all checked before any search: SCENARIOS of Server / Interactive, whole seconds and
# counts > 0, SCEN_FACTOR > 1, start rates > 0; then check_scen_args.
server_check() {
  local sc v
  for sc in ${SCENARIOS:-Server Interactive}; do
    [[ $sc =~ ^(Server|Interactive)$ ]] || { echo "server: SCENARIOS: unknown scenario '$sc' (Server, Interactive)"; return 1; }
  done
  for v in SCEN_S SCEN_BUDGET_S SCEN_TRIES; do
    [[ -z ${!v:-} || ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "server: $v='${!v}' is not a whole number > 0"; return 1; }
  done
  for v in SERVER_QPS INTERACTIVE_QPS SCEN_FACTOR; do
    [[ -z ${!v:-} || ${!v} =~ ^[0-9]*\.?[0-9]+$ && ! ${!v} =~ ^0*\.?0*$ ]] || { echo "server: $v='${!v}' is not a number > 0"; return 1; }
  done
  [[ -z ${SCEN_FACTOR:-} ]] || awk -v f="$SCEN_FACTOR" 'BEGIN { exit !(f + 0 > 1) }' \
    || { echo "server: SCEN_FACTOR='$SCEN_FACTOR' must be > 1"; return 1; }
  check_scen_args
}
# CONFIRM's entries, all checked before any run: SCENARIO=QPS[:S][+FLAG=VALUE...|+screen], SCENARIO Offline/Server/Interactive,
# QPS a positive number, auto, or Q/IF_VALID/IF_NOT (three positive numbers: Q, then the second run's target), S a
# positive number of seconds, each +FLAG an engine flag with its value after "="
# (added after the scenario's SERVER_ARGS / INTERACTIVE_ARGS: the later one wins); a scenario may come more than once
# (e.g. "Interactive=41 Interactive=43+--max-num-batched-tokens=1024"), the same run twice may not (55 = 55.0;
# flags in any order), nor one flag twice in an entry. "+screen" (Server / Interactive, a number target) takes the
# flags scripts/bench/screen_pick.py picks from this job's server-steps results when the run comes.
confirm_check() {
  local entry sc rest q q1 n one flags names key seen="|"
  [ -n "${CONFIRM:-}" ] || { echo 'confirm: set CONFIRM, e.g. CONFIRM="Server=55 Interactive=auto"'; return 1; }
  for entry in $CONFIRM; do
    sc=${entry%%=*}; rest=${entry#*=}; flags=; [[ $rest == *+* ]] && flags=${rest#*+} && rest=${rest%%+*}; q=${rest%%:*}
    [[ $entry == *=* ]] || { echo "confirm: '$entry' is not SCENARIO=QPS[:S][+FLAG=VALUE...]"; return 1; }
    [[ $sc =~ ^(Offline|Server|Interactive)$ ]] || { echo "confirm: unknown scenario '$sc' in '$entry' (Offline, Server, Interactive)"; return 1; }
    one=0; IFS=/ read -ra n <<< "$q"
    for q1 in "${n[@]}"; do [[ $q1 =~ ^[0-9]*\.?[0-9]+$ && ! $q1 =~ ^0*\.?0*$ ]] || one=1; done
    [[ $q == auto || $one == 0 && ( ${#n[@]} == 1 || ${#n[@]} == 3 && $q != */ ) ]] \
      || { echo "confirm: '$q' in '$entry' is not a positive target_qps, Q/IF_VALID/IF_NOT (e.g. 40/41/39) or auto"; return 1; }
    [[ $rest == "$q" || ${rest#*:} =~ ^[0-9]+$ && ${rest#*:} -gt 0 ]] || { echo "confirm: '${rest#*:}' in '$entry' is not a positive number of seconds"; return 1; }
    [[ -z $flags || $flags == screen || $flags =~ ^(--[a-z0-9-]+=[^+]+)(\+--[a-z0-9-]+=[^+]+)*$ ]] \
      || { echo "confirm: '+$flags' in '$entry' is not +--FLAG=VALUE[+--FLAG=VALUE...] or +screen"; return 1; }
    [[ $flags != screen || $sc != Offline && $q != auto ]] || { echo "confirm: '$entry': +screen takes the flags of"\
      "a Server / Interactive latency screen (the server-steps step) for a number target"; return 1; }
    check_flag_words "confirm: $entry" ${flags//+/ } || return 1
    names=$(tr + '\n' <<< "$flags" | sed 's/=.*//' | sort); [ -z "$(uniq -d <<< "$names")" ] \
      || { echo "confirm: '$entry' gives $(uniq -d <<< "$names" | head -1) twice"; return 1; }
    # the same run twice (55 = 55.0, flags in another order): 11.5 min of a 30-min session for nothing
    key="$sc $( [ "$q" = auto ] && echo auto || awk -v q="$q" 'BEGIN { printf "%g", q }') ${rest#"$q"} $(tr + '\n' <<< "$flags" | sort | tr '\n' +)"
    [[ $seen == *"|$key|"* ]] && { echo "confirm: '$entry' is a run CONFIRM already has"; return 1; }
    seen+="|$key|"
    [[ $q != auto || -z $flags ]] || { echo "confirm: '$entry': auto takes the target of a search made with"\
      "${sc^^}_ARGS alone; give these flags there (and search with them) or a number instead of auto"; return 1; }
  done
  check_scen_args
}
# CONFIRM as the confirm step runs it (stdout; a message on stderr and status 1 on bad input): with an Offline dev
# run of CONFIRM_OFFLINE seconds (default 60; 0: none) at the preset user.conf's Offline target first when CONFIRM
# has Server / Interactive entries and no Offline one, so that each run's share (scenario_ratios.py) is of an
# Offline on the same host: the Server and Offline figures of a preset are compared on one machine (2026-12-06 an
# H100 Server run had only another host's Offline to go by).
confirm_with_offline() {
  local s=${CONFIRM_OFFLINE:-60} q conf="loadgen_configs/$PRESET.user.conf"
  [[ $s =~ ^[0-9]+$ ]] \
    || { echo "confirm: CONFIRM_OFFLINE='$s' is not a whole number of seconds (0: no Offline run)" >&2; return 1; }
  if [ "$s" = 0 ] || [[ " $CONFIRM" == *" Offline="* ]] || ! [[ " $CONFIRM" =~ \ (Server|Interactive)= ]]; then
    echo "$CONFIRM"; return 0
  fi
  q=$(sed -n 's/^llama3_1-8b\.Offline\.target_qps *= *\([0-9.]*\).*/\1/p' "$conf" 2>/dev/null | tail -1)
  [ -n "$q" ] || { echo "confirm: no llama3_1-8b.Offline.target_qps line in $conf for the same-host Offline run"\
    "(CONFIRM_OFFLINE=0 runs without it)" >&2; return 1; }
  echo "Offline=$q:$s $CONFIRM"
}
# The highest VALID try of search log $1 whose queue the harness judged steady (queue_growing false): a try too
# short to judge (null) is not taken. Two such short tries on one H200 were VALID and their 600 s runs were not
# (Server 55.5 in ~37 s: TTFT backlog; Interactive 47.25 in ~40 s: TPOT p99 34.3 ms over 600 s; docs/benchmarks.md).
# Empty when none; a cut-off last line is skipped, any other broken line is an error naming it.
best_valid() {
  python3 -c "import sys; from accuracy.jsontext import read_jsonl
v = [r['qps'] for _, r in read_jsonl(sys.argv[1]).records
     if isinstance(r, dict) and r.get('validity') == 'VALID' and r.get('queue_growing') is False]
print(max(v) if v else '')" "$1"
}
# The search log of a scenario, its extra flags and the try length SCEN_S in folder $1: h200_fp8_<sc>_<S>s.jsonl, or
# with flags h200_fp8_<sc>_<flags with every run of other characters than [A-Za-z0-9.] as one "_">_<S>s.jsonl (find_qps
# refuses to resume a log of tries with another length: each length has its own).
scen_log() {
  local tag; tag=$(scen_args "$2" | sed -E 's/[^A-Za-z0-9.]+/_/g; s/^_+|_+$//g')
  echo "$1/${PRESET}_$2${tag:+_$tag}_${SCEN_S:-120}s.jsonl"
}
# One confirmation run (gpu_runs.sh confirm): scenario $1 at target_qps $2 with the caller's dur/extra/flags arrays and
# strings; sets worst to a failed run's exit code and CONFIRM_VALID to 1 when LoadGen's console said "Result is : VALID".
confirm_run() {
  local sc=$1 q=$2 line name tag conf rc
  case $sc in
    Offline) line="llama3_1-8b.Offline.target_qps = $q" ;;
    Server) line="llama3_1-8b.Server.target_qps = $q" ;;
    Interactive) line="llama3_1-8b-interactive.Server.target_qps = $q" ;;
  esac
  name="confirm-$sc-$q${dur[1]:+-${dur[1]}s}"; tag=$(sed -E 's/[^A-Za-z0-9.]+/_/g; s/^_+|_+$//g' <<< "$flags")
  name+=${tag:+-$tag}
  # the shipped file's own line for this key (if any) is left out: the harness refuses a shadowed line
  conf="$JOB/confirm/$name.user.conf"; awk -v k="${line%% *}" '$1 != k' loadgen_configs/$PRESET.user.conf > "$conf"
  echo "$line" >> "$conf"
  echo "confirm $sc: $line ${extra[*]} ${dur[*]} $(date +%T)"
  python3 -m sut run --config loadgen_configs/$PRESET.toml --sut "${SCEN_SUT:-vllm}" --scenario "$sc" \
    --model "$MODEL" --load-format dummy --dataset "${CONFIRM_DATA:-$REAL}" --user-conf "$conf" \
    --benchmark-ignore-eos "${dur[@]}" "${extra[@]}" --output-dir "$JOB/confirm" --run-name "$name" \
    --no-progress > "$JOB/$name.console" 2>&1
  rc=$?; [ $rc -eq 0 ] || worst=$rc
  CONFIRM_VALID=0; [ $rc -eq 0 ] && grep -q "^Result is : VALID" "$JOB/$name.console" && CONFIRM_VALID=1
  echo "confirm $sc rc=$rc $(date +%T)"; grep -E "Result is|tokens per second|TTFT|TPOT" "$JOB/$name.console" | head -10
}
