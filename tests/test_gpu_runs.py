"""scripts/bench/gpu_runs.sh's Server / Interactive steps without a GPU: a stand-in ``python3`` on PATH records every
``python3 -m sut run`` / ``python3 -m sut find-qps`` call (and runs any other python3 call for real), so the flags each
scenario gets, the search log names and ``CONFIRM=...=auto`` are checked as the script composes them."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, standin_python3

FAKE = """#!/usr/bin/env bash
# a run whose --run-name is in FAKE_VALID prints LoadGen's VALID line, any other run LoadGen's INVALID one
valid() { local a n; for a in "$@"; do [ "$n" = 1 ] && [[ " $FAKE_VALID " == *" $a "* ]] && return 0; n=; [ "$a" = --run-name ] && n=1; done; return 1; }
case "$1" in scripts/bench/server_steps.py) echo "$* PERF_BASE_OVERRIDE=${PERF_BASE_OVERRIDE-unset}" >> "$CALLS"; exit 0 ;; esac
case "$1" in -m) [ "$2" != sut ] || { echo "$*" >> "$CALLS"
  if valid "$@"; then echo "Result is : VALID"; else echo "Result is : INVALID"; fi; exit ${FAKE_RC:-0}; } ;; esac
exec {real} "$@"
"""


def _run(tmp_path: Path, step: str, **env) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    calls = tmp_path / "calls.txt"
    full_env = dict(os.environ, **standin_python3(tmp_path, FAKE), CALLS=str(calls), JOB=str(tmp_path / "job"),
                    OUT=str(tmp_path / "out"), SCEN_PRIOR=str(tmp_path / "prior"), **{"CONFIRM_OFFLINE": "0", **env})
    out = subprocess.run(["bash", "scripts/bench/gpu_runs.sh", step], cwd=REPO, env=full_env, capture_output=True,
                         text=True, timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return out, [ln.split() for ln in lines]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_server_step_gives_each_scenario_its_own_flags_and_log(tmp_path):
    prior = tmp_path / "prior"
    prior.mkdir()
    (prior / "h200_fp8_Interactive_max-num-batched-tokens_2048_120s.jsonl").write_text("wrong name: never read\n")
    (prior / "h200_fp8_Interactive_max_num_batched_tokens_2048_20s.jsonl").write_text("other try length: never read\n")
    (prior / "h200_fp8_Interactive_max_num_batched_tokens_2048_120s.jsonl").write_text('{"qps": 40.0}\n')
    out, calls = _run(tmp_path, "server", INTERACTIVE_ARGS="--max-num-batched-tokens 2048", SCEN_FACTOR="1.25")
    assert out.returncode == 0, out.stderr
    server, inter = calls
    assert _flag(server, "--factor") == _flag(inter, "--factor") == "1.25" and server.index("--factor") < server.index("--")
    assert _flag(server, "--scenario") == "Server" and "--max-num-batched-tokens" not in server
    assert _flag(server, "--log").endswith("/scen/h200_fp8_Server_120s.jsonl") and "--resume" not in server
    assert _flag(server, "--min-duration-s") == _flag(inter, "--min-duration-s") == "120"  # SCEN_S unset
    assert _flag(server, "--user-conf") == "loadgen_configs/h200_fp8.user.conf"
    assert _flag(inter, "--max-num-batched-tokens") == "2048" and inter.index("--max-num-batched-tokens") > inter.index("--")
    log = _flag(inter, "--log")
    assert log.endswith("/scen/h200_fp8_Interactive_max_num_batched_tokens_2048_120s.jsonl") and _flag(inter, "--resume") == log
    assert Path(log).read_text() == '{"qps": 40.0}\n'  # the prior of the same settings, copied to resume


def test_confirm_auto_takes_the_highest_valid_try_with_that_searchs_flags(tmp_path):
    scen = tmp_path / "job" / "scen"
    scen.mkdir(parents=True)
    tries = [{"qps": 40.0, "validity": "VALID", "queue_growing": False}, {"qps": 42.5, "validity": "INVALID"},
             {"qps": 41.0, "validity": "VALID", "queue_growing": False},
             {"qps": 41.7, "validity": "VALID", "queue_growing": None},  # too short to judge: not taken
             {"qps": 41.5, "validity": "VALID", "queue_growing": True}]  # VALID, but its backlog grew: not taken
    (scen / "h200_fp8_Interactive_max_num_batched_tokens_2048_120s.jsonl").write_text(
        "".join(json.dumps(t) + "\n" for t in tries))
    (tmp_path / "prior").mkdir()
    (tmp_path / "prior" / "h200_fp8_Server_120s.jsonl").write_text(
        json.dumps({"qps": 55.5, "validity": "VALID", "queue_growing": False}) + "\n")
    out, calls = _run(tmp_path, "confirm", INTERACTIVE_ARGS="--max-num-batched-tokens 2048",
                      CONFIRM="Interactive=auto Server=auto Offline=56:60")
    assert out.returncode == 0, out.stderr
    inter, server, offline = calls
    assert _flag(inter, "--scenario") == "Interactive" and _flag(inter, "--max-num-batched-tokens") == "2048"
    conf = Path(_flag(inter, "--user-conf")).read_text()
    assert conf.rstrip().endswith("llama3_1-8b-interactive.Server.target_qps = 41.0") and "--target-qps" not in inter
    server_conf = Path(_flag(server, "--user-conf")).read_text()
    assert server_conf.rstrip().endswith("llama3_1-8b.Server.target_qps = 55.5")
    assert server_conf.count("llama3_1-8b.Server.target_qps") == 1  # the shipped file's own line is left out
    assert "--max-num-batched-tokens" not in server  # SERVER_ARGS unset: the preset's settings
    assert _flag(offline, "--min-duration-s") == "60" and _flag(offline, "--scenario") == "Offline"
    assert _flag(offline, "--min-query-count") == "1"  # else LoadGen's 13,368-sample minimum sets the length
    assert [_flag(c, "--run-name") for c in calls] == ["confirm-Interactive-41.0", "confirm-Server-55.5",
                                                       "confirm-Offline-56-60s"]
    (tmp_path / "again").mkdir()
    out, calls = _run(tmp_path / "again", "confirm", CONFIRM="Offline=56:60 Offline=56")  # a dev run, then a full one
    assert out.returncode == 0 and [_flag(c, "--run-name") for c in calls] == ["confirm-Offline-56-60s",
                                                                               "confirm-Offline-56"]
    out, calls = _run(tmp_path, "confirm", CONFIRM="Offline=56", FAKE_RC="1")
    assert out.returncode == 1 and "confirm Offline rc=1" in out.stdout  # a failed run fails the step


def test_confirm_runs_a_scenario_twice_with_each_entrys_own_flags(tmp_path):
    out, calls = _run(tmp_path, "confirm", INTERACTIVE_ARGS="--max-num-batched-tokens 2048",
                      CONFIRM="Interactive=41 Interactive=43+--max-num-batched-tokens=1024+--max-num-seqs=256 Server=53:120")
    assert out.returncode == 0, out.stdout + out.stderr
    first, second, server = calls
    assert _flag(first, "--max-num-batched-tokens") == "2048" and "--max-num-seqs" not in first
    # the entry's flags come after INTERACTIVE_ARGS: argparse keeps the last value
    assert _flag(second, "--max-num-batched-tokens") == "2048" and "--max-num-seqs=256" in second
    assert second.index("--max-num-batched-tokens=1024") > second.index("--max-num-batched-tokens")
    assert _flag(second, "--run-name") == "confirm-Interactive-43-max_num_batched_tokens_1024_max_num_seqs_256"
    assert _flag(first, "--run-name") == "confirm-Interactive-41"
    confs = [Path(_flag(c, "--user-conf")) for c in (first, second)]
    assert confs[0] != confs[1] and confs[1].read_text().rstrip().endswith("llama3_1-8b-interactive.Server.target_qps = 43")
    assert _flag(server, "--min-duration-s") == "120" and "--min-query-count" not in server  # Server: LoadGen's 100
    assert (tmp_path / "job" / "confirm-Interactive-41.console").exists()


def test_confirm_without_an_offline_entry_runs_the_presets_offline_first_on_the_same_host(tmp_path):
    """Server / Interactive entries alone get an Offline dev run first (the preset user.conf's Offline target, 60 s
    or CONFIRM_OFFLINE s, --min-query-count 1) so their shares are of this host's Offline; an Offline entry, an
    Offline-only CONFIRM or CONFIRM_OFFLINE=0 adds none; a bad CONFIRM_OFFLINE exits 2 before any run."""
    def run(name, **env):
        (tmp_path / name).mkdir()
        return _run(tmp_path / name, "confirm", **env)

    out, calls = run("a", PRESET="h100_fp8", CONFIRM="Server=51.5", CONFIRM_OFFLINE="")
    assert out.returncode == 0, out.stdout + out.stderr
    assert [_flag(c, "--scenario") for c in calls] == ["Offline", "Server"]
    assert (_flag(calls[0], "--min-duration-s"), _flag(calls[0], "--min-query-count")) == ("60", "1")
    assert _flag(calls[0], "--config") == "loadgen_configs/h100_fp8.toml" and "Offline=50:60 first" in out.stdout
    out, calls = run("b", CONFIRM="Interactive=43", CONFIRM_OFFLINE="90")
    assert [_flag(c, "--scenario") for c in calls] == ["Offline", "Interactive"]
    assert _flag(calls[0], "--min-duration-s") == "90" and "--min-duration-s" not in calls[1]
    for n, confirm in enumerate(("Offline=56:60 Server=53", "Offline=56")):
        out, calls = run(f"c{n}", CONFIRM=confirm, CONFIRM_OFFLINE="")
        assert len(calls) == len(confirm.split()) and "first" not in out.stdout
    out, calls = run("d", CONFIRM="Server=53", CONFIRM_OFFLINE="1m")
    assert out.returncode == 2 and calls == [] and "CONFIRM_OFFLINE='1m'" in out.stdout + out.stderr


def test_server_steps_runs_one_engine_per_override_each_in_its_own_folder(tmp_path):
    """SS_OVERRIDES: one server_steps.py run per ";"-separated PERF_BASE_OVERRIDE, folders server_steps_0, _1; without
    it one run in server_steps with PERF_BASE_OVERRIDE as given (blank when unset: the script's own base)."""
    (tmp_path / "a").mkdir()
    out, calls = _run(tmp_path / "a", "server-steps", SS_ADMIT="1 2", SS_RATE="44", SS_PHASES="server", SS_WARM="10",
                      SS_OVERRIDES='{"max_num_batched_tokens": 1536}; {"max_num_batched_tokens": 3072}')
    assert out.returncode == 0, out.stdout + out.stderr
    assert [_flag(c, "--warm-s") for c in calls] == ["10", "10"]
    assert [_flag(c, "--out").rsplit("/", 1)[1] for c in calls] == ["server_steps_0", "server_steps_1"]
    assert [" ".join(c).split("PERF_BASE_OVERRIDE=")[1] for c in calls] == ['{"max_num_batched_tokens": 1536}',
                                                                            ' {"max_num_batched_tokens": 3072}']
    assert _flag(calls[0], "--rate") == "44" and calls[0][calls[0].index("--admit-every-steps") + 1:][:2] == ["1", "2"]
    assert calls[0][calls[0].index("--phases") + 1:][:2] == ["server", 'PERF_BASE_OVERRIDE={"max_num_batched_tokens":']
    (tmp_path / "b").mkdir()
    out, calls = _run(tmp_path / "b", "server-steps", PERF_BASE_OVERRIDE='{"max_num_seqs": 640}')
    assert [_flag(c, "--out").rsplit("/", 1)[1] for c in calls] == ["server_steps"]
    assert _flag(calls[0], "--warm-s") == "30"
    assert calls[0][calls[0].index("--phases") + 1:][:2] == ["offline", "server"]
    assert calls[0][-2:] == ['PERF_BASE_OVERRIDE={"max_num_seqs":', '640}']


def test_preset_picks_the_cards_preset_and_user_conf(tmp_path):
    """PRESET=h100_fp8: every run uses loadgen_configs/h100_fp8.toml and a copy of h100_fp8.user.conf whose own line
    for the scenario gives way to the entry's target."""
    out, calls = _run(tmp_path, "confirm", PRESET="h100_fp8", CONFIRM="Server=47")
    assert out.returncode == 0, out.stdout + out.stderr
    (server,) = calls
    assert _flag(server, "--config") == "loadgen_configs/h100_fp8.toml"
    conf = Path(_flag(server, "--user-conf")).read_text().splitlines()
    shipped = (REPO / "loadgen_configs" / "h100_fp8.user.conf").read_text().splitlines()
    assert [ln for ln in conf if ln.startswith("llama3_1-8b.Server")] == ["llama3_1-8b.Server.target_qps = 47"]
    assert "llama3_1-8b.Offline.target_qps = 50" in conf and "llama3_1-8b.Offline.target_qps = 50" in shipped


def test_confirm_bisects_one_step_on_the_first_runs_verdict(tmp_path):
    out, calls = _run(tmp_path, "confirm", CONFIRM="Interactive=40/41/39 Server=53/54/52:120",
                      FAKE_VALID="confirm-Interactive-40 confirm-Server-54-120s")
    assert out.returncode == 0, out.stdout + out.stderr
    assert [_flag(c, "--run-name") for c in calls] == ["confirm-Interactive-40", "confirm-Interactive-41",
                                                       "confirm-Server-53-120s", "confirm-Server-52-120s"]
    assert "confirm Interactive: 40 was VALID: next 41" in out.stdout
    assert "confirm Server: 53 was not VALID: next 52" in out.stdout
    conf = Path(_flag(calls[1], "--user-conf")).read_text()
    assert conf.rstrip().endswith("llama3_1-8b-interactive.Server.target_qps = 41") and "= 40" not in conf
    (tmp_path / "x").mkdir()
    out, calls = _run(tmp_path / "x", "confirm", CONFIRM="Interactive=40/41/39", FAKE_VALID="confirm-Interactive-40",
                      FAKE_RC="1")  # a failed run counts as not VALID, whatever it printed
    assert out.returncode == 1 and [_flag(c, "--run-name") for c in calls][-1] == "confirm-Interactive-39"


def test_confirm_auto_without_a_valid_try_skips_that_scenario_and_says_so(tmp_path):
    scen = tmp_path / "job" / "scen"
    scen.mkdir(parents=True)
    (scen / "h200_fp8_Server_120s.jsonl").write_text(json.dumps({"qps": 60.0, "validity": "INVALID"}) + "\n")
    out, calls = _run(tmp_path, "confirm", CONFIRM="Server=auto")
    assert out.returncode == 1 and calls == [] and "confirm Server: auto, but no VALID try judged steady in" in out.stdout
    (scen / "h200_fp8_Server_20s.jsonl").write_text(json.dumps({"qps": 50.0, "validity": "VALID"}) + "\n")
    out, calls = _run(tmp_path, "confirm", CONFIRM="Server=auto", SCEN_S="20")  # short tries: none judged
    assert out.returncode == 1 and calls == [] and "search with SCEN_S=120 or more" in out.stdout
    out, calls = _run(tmp_path, "confirm", CONFIRM="Server=auto", SCEN_S="60")  # no log for 60 s tries
    assert out.returncode == 1 and calls == [] and "there is no search log" in out.stdout and not out.stderr


@pytest.mark.parametrize("env, said", [
    ({"CONFIRM": "Server=52 Interactiv=40"}, "unknown scenario 'Interactiv'"),
    ({"CONFIRM": "Server=52 Interactive"}, "'Interactive' is not SCENARIO=QPS[:S]"),
    ({"CONFIRM": "Server=52 Server=50 Server=52"}, "'Server=52' is a run CONFIRM already has"),
    ({"CONFIRM": "Server=55 Server=55.0"}, "'Server=55.0' is a run CONFIRM already has"),  # a recheck's finds
    ({"CONFIRM": "Server=55+--a=x+--b=y Server=55+--b=y+--a=x"}, "'Server=55+--b=y+--a=x' is a run CONFIRM already"),
    ({"CONFIRM": "Server=55+--max-num-seqs=256+--max-num-seqs=512"}, "gives --max-num-seqs twice"),
    ({"CONFIRM": "Server=52+max-num-seqs=768"}, "'+max-num-seqs=768' in 'Server=52+max-num-seqs=768' is not +--FLAG=VALUE"),
    ({"CONFIRM": "Server=52+--max-num-seqs"}, "is not +--FLAG=VALUE"),
    ({"CONFIRM": "Server=52+--max-num-seqs=768+--run-name=x"},
     "confirm: Server=52+--max-num-seqs=768+--run-name=x: --run-name=x is set by this script"),
    ({"CONFIRM": "Server=52+--scen=Offline"}, "--scen=Offline is short for --scenario, which this script sets"),
    ({"CONFIRM": "Server=auto+--max-num-seqs=768"}, "auto takes the target of a search made with SERVER_ARGS alone"),
    ({"CONFIRM": "Server=fast"}, "'fast' in 'Server=fast' is not a positive target_qps, Q/IF_VALID/IF_NOT"),
    ({"CONFIRM": "Interactive=40/41"}, "'40/41' in 'Interactive=40/41' is not a positive target_qps, Q/IF_VALID/"),
    ({"CONFIRM": "Interactive=40/41/39/"}, "'40/41/39/' in 'Interactive=40/41/39/' is not a positive target_qps"),
    ({"CONFIRM": "Interactive=40//39"}, "'40//39' in 'Interactive=40//39' is not a positive target_qps"),
    ({"CONFIRM": "Interactive=40/41/0"}, "'40/41/0' in 'Interactive=40/41/0' is not a positive target_qps"),
    ({"CONFIRM": "Server=0"}, "'0' in 'Server=0' is not a positive target_qps"),
    ({"CONFIRM": "Offline=56:soon"}, "'soon' in 'Offline=56:soon' is not a positive number of seconds"),
    ({"CONFIRM": ""}, "set CONFIRM"),
    ({"CONFIRM": "Server=52", "SERVER_ARGS": "--user-conf x.conf"}, "SERVER_ARGS: --user-conf is set by this script"),
    ({"CONFIRM": "Server=52", "INTERACTIVE_ARGS": "--target-qps=3"}, "INTERACTIVE_ARGS: --target-qps=3 is set by"),
    ({"CONFIRM": "Server=55", "SERVER_ARGS": "--max-num-seqs 768 --scen Offline"},
     "SERVER_ARGS: --scen is short for --scenario, which this script sets"),  # argparse takes prefixes
    ({"CONFIRM": "Server=55", "SERVER_ARGS": "--target-qp=99"}, "--target-qp=99 is short for --target-qps"),
    ({"CONFIRM": "Server=55", "SERVER_ARGS": "--c x"}, "--c is a prefix of --config --compliance-test, which"),
    ({"CONFIRM": "Server=52", "SERVER_ARGS": '--served-model-name "my model"'}, "quotes are not read"),
])
def test_confirm_refuses_a_bad_entry_or_flag_before_any_run(tmp_path, env, said):
    out, calls = _run(tmp_path, "confirm", **env)
    assert out.returncode == 2 and said in out.stdout and calls == []


def test_server_step_refuses_flags_it_sets_itself(tmp_path):
    out, calls = _run(tmp_path, "server", SERVER_ARGS="--max-num-seqs 640 --scenario Offline")
    assert out.returncode == 2 and "SERVER_ARGS: --scenario is set by this script" in out.stdout and calls == []


@pytest.mark.parametrize("env, said", [
    ({"SCENARIOS": "server Interactive"}, "SCENARIOS: unknown scenario 'server' (Server, Interactive)"),
    ({"SCENARIOS": "Offline"}, "SCENARIOS: unknown scenario 'Offline'"),
    ({"SCEN_S": "abc"}, "SCEN_S='abc' is not a whole number > 0"),
    ({"SCEN_BUDGET_S": "0"}, "SCEN_BUDGET_S='0' is not a whole number > 0"),
    ({"SCEN_TRIES": "2.5"}, "SCEN_TRIES='2.5' is not a whole number > 0"),
    ({"SERVER_QPS": "fast"}, "SERVER_QPS='fast' is not a number > 0"),
    ({"SCEN_FACTOR": "1"}, "SCEN_FACTOR='1' must be > 1"),
    ({"SCEN_FACTOR": "0.5"}, "SCEN_FACTOR='0.5' must be > 1"),
    ({"SCEN_S": "08"}, "SCEN_S='08' is not a whole number > 0"),
])
def test_server_step_checks_its_settings_before_any_search(tmp_path, env, said):
    out, calls = _run(tmp_path, "server", **env)
    assert out.returncode == 2 and f"server: {said}" in out.stdout and calls == [], out.stdout + out.stderr


def test_server_step_exits_with_a_failed_searchs_code(tmp_path):
    out, calls = _run(tmp_path, "server", SCENARIOS="Server Interactive", FAKE_RC="1")
    assert out.returncode == 1 and len(calls) == 2  # the second scenario still searched
    assert "server Server: find_qps rc=1" in out.stdout and "server Interactive: find_qps rc=1" in out.stdout


def test_confirm_auto_skips_a_cut_off_last_line_and_runs_on_the_searchs_sut(tmp_path):
    scen = tmp_path / "job" / "scen"
    scen.mkdir(parents=True)
    (scen / "h200_fp8_Server_120s.jsonl").write_text(json.dumps({"qps": 50.0, "validity": "VALID", "queue_growing": False})
                                                     + '\n{"qps": 60.0, "val')
    out, calls = _run(tmp_path, "confirm", CONFIRM="Server=auto", SCEN_SUT="vllm-http")
    assert out.returncode == 0, out.stdout + out.stderr
    (server,) = calls
    assert _flag(server, "--sut") == "vllm-http"
    assert Path(_flag(server, "--user-conf")).read_text().rstrip().endswith("llama3_1-8b.Server.target_qps = 50.0")


def test_gpu_bundle_names_a_missing_shared_input_and_exits_2_before_building(tmp_path):
    (tmp_path / "shared" / "gpu").mkdir(parents=True)
    (tmp_path / "shared" / "gpu" / "make_bundle.sh").write_text("exit 0\n")
    out = subprocess.run(["bash", "scripts/bench/gpu_bundle.sh", str(tmp_path / "dest")], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, SHARED=str(tmp_path / "shared")))
    assert out.returncode == 2, out.stderr
    assert "llama31_8b_dummy/config.json not found (set SHARED" in out.stderr
    assert not (tmp_path / "dest").exists()


def test_gpu_bundle_hands_make_bundle_an_absolute_dest(tmp_path):
    """make_bundle.sh changes directory before it writes: a relative DEST (the README's `.gpu`) lost part_00."""
    shared = tmp_path / "shared"
    for rel in ("gpu/llama31_8b_dummy/config.json", "flame/bin/flame-session-manager",
                "flame/bin/flame-executor-manager", "data/cnn_eval_public.json"):
        (shared / rel).parent.mkdir(parents=True, exist_ok=True)
        (shared / rel).write_text("{}")
    said = tmp_path / "dest_seen.txt"
    (shared / "gpu" / "make_bundle.sh").write_text(f'echo "$1" > {said}\nexit 3\n')  # stop before any download
    work = tmp_path / "work"
    work.mkdir()
    rel = os.path.relpath(tmp_path / "dest", REPO)  # relative to the repository root, where the script runs
    out = subprocess.run(["bash", str(REPO / "scripts" / "bench" / "gpu_bundle.sh"), rel], cwd=work, capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, SHARED=str(shared)))
    assert out.returncode == 3, out.stderr
    assert said.read_text().strip() == str((tmp_path / "dest").resolve())


def test_gpu_bundle_src_writes_heads_code_without_raw_runs_and_warns_of_uncommitted_changes(tmp_path):
    """``--src`` alone (DEST .gpu): HEAD's files with sut/record/COMMIT filled in, without docs/results' raw runs but
    with find_qps_h200 (SCEN_PRIOR); an edited tracked file is not in it, and the script says so."""
    import tarfile

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    shutil.copy(REPO / "scripts" / "bench" / "gpu_bundle.sh", clone / "scripts" / "bench")  # this tree's script
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "script", "--allow-empty"],
                   cwd=clone, check=True, timeout=60)
    run = lambda: subprocess.run(["bash", "scripts/bench/gpu_bundle.sh", "--src"], cwd=clone, capture_output=True,  # noqa: E731
                                 text=True, timeout=120)
    out = run()
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr
    with tarfile.open(clone / ".gpu" / "src.tar") as t:
        names = t.getnames()
        commit = t.extractfile("sut/record/COMMIT").read().decode().strip()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    assert commit == head and "scripts/bench/gpu_runs.sh" in names
    assert any(n.startswith("docs/results/find_qps_h200/") for n in names)
    assert not any(n.startswith(("docs/results/h100_", "docs/results/h200_", "docs/results/cpu_")) for n in names)
    with open(clone / "README.md", "a") as f:
        f.write("edited\n")
    assert "uncommitted changes are not in src.tar" in run().stderr


WORKLOADS_FAKE = """#!/usr/bin/env bash
# `-m sut.flame cluster`: says its endpoint and waits to be stopped; `-m sut.locality`: recorded
case "$1 $2" in
  "-m sut.flame") echo FLAME_ENDPOINT=http://127.0.0.1:1; exec sleep 60 ;;
  "-m sut.locality") echo "$*" >> "$CALLS"; exit 0 ;;
esac
exec {real} "$@"
"""


def test_workloads_step_gives_eviction_its_blocks_and_replica_loss_its_shorter_loss_timeout(tmp_path):
    calls = tmp_path / "calls.txt"
    (tmp_path / "job").mkdir()  # `start` makes the job's folder
    env = dict(os.environ, **standin_python3(tmp_path, WORKLOADS_FAKE), CALLS=str(calls), JOB=str(tmp_path / "job"),
               OUT=str(tmp_path / "out"), WL_PRESETS="eviction replica-loss arrivals")
    out = subprocess.run(["bash", "scripts/bench/gpu_runs.sh", "workloads"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    eviction, loss, arrivals = [ln.split() for ln in calls.read_text().splitlines()]
    assert _flag(eviction, "--trace-preset") == "eviction" and _flag(eviction, "--kv-blocks") == "4096"
    assert "--loss-timeout-s" not in eviction and "--kv-blocks" not in loss
    assert _flag(loss, "--trace-preset") == "replica-loss" and _flag(loss, "--loss-timeout-s") == "20"
    assert "--loss-timeout-s" not in arrivals and "--kv-blocks" not in arrivals and _flag(arrivals, "--pairs") == "3"


def _screen(job: Path, i: int, budget: int, phases: dict) -> None:
    """A server_steps.py result of one engine (``max_num_batched_tokens`` overridden to ``budget``) in
    ``job/server_steps_i``: phases name -> (admit_every_steps, TTFT p99 ms, TPOT p99 ms)."""
    d = job / f"server_steps_{i}"
    d.mkdir(parents=True)
    res = {"engine": {"max_num_batched_tokens": budget, "max_num_seqs": 512, "kv_cache_dtype": "fp8"},
           "engine_override": {"max_num_batched_tokens": budget},
           "phases": {name: {"admit_every_steps": k, "window": {"ttft_ms_p99": ttft, "tpot_ms_p99": tpot}}
                      for name, (k, ttft, tpot) in phases.items()}}
    (d / "server_steps.json").write_text(json.dumps(res))


def test_screen_pick_takes_the_setting_with_the_most_room_under_its_binding_limit(tmp_path):
    job = tmp_path / "job"
    _screen(job, 0, 1280, {"server": (1, 470.0, 26.0)})  # TTFT binds: 0.94
    _screen(job, 1, 1408, {"server": (1, 380.0, 27.3), "server-admit2": (2, 420.0, 27.0)})  # 0.91 / 0.90
    _screen(job, 2, 1536, {"server": (1, 320.0, 30.3), "offline": (1, None, None)})  # TPOT binds: 1.01
    r = subprocess.run(["python3", "scripts/bench/screen_pick.py", "--scenario", "Interactive", str(job)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "--max-num-batched-tokens=1408+--max-num-seqs=512+--admit-every-steps=2"
    assert "warning" not in r.stderr and r.stderr.count("screen: server_steps_") == 4  # offline is no candidate
    r = subprocess.run(["python3", "scripts/bench/screen_pick.py", "--scenario", "Server", str(job)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)  # Server's limits (2 s / 100 ms): TPOT binds
    assert r.stdout.strip() == "--max-num-batched-tokens=1280+--max-num-seqs=512"
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run(["python3", "scripts/bench/screen_pick.py", "--scenario", "Interactive", str(empty)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == "" and "no screened setting with both p99s" in r.stderr


def test_screen_pick_warns_when_even_the_best_is_near_a_limit(tmp_path):
    job = tmp_path / "job"
    _screen(job, 0, 1536, {"server": (1, 300.0, 29.1)})
    r = subprocess.run(["python3", "scripts/bench/screen_pick.py", "--scenario", "Interactive", str(job)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "warning: even the best setting uses 0.970 of a limit" in r.stderr


def test_confirm_plus_screen_runs_with_the_screens_pick_and_fails_without_a_screen(tmp_path):
    _screen(tmp_path / "job", 0, 1280, {"server": (1, 470.0, 26.0)})
    _screen(tmp_path / "job", 1, 1408, {"server": (1, 380.0, 27.3)})
    out, calls = _run(tmp_path, "confirm", PRESET="h100_fp8", CONFIRM="Interactive=45+screen")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the screen picked +--max-num-batched-tokens=1408+--max-num-seqs=512" in out.stdout
    (call,) = calls
    assert {"--max-num-batched-tokens=1408", "--max-num-seqs=512"} <= set(call)
    assert _flag(call, "--run-name") == "confirm-Interactive-45-max_num_batched_tokens_1408_max_num_seqs_512"
    (tmp_path / "b").mkdir()
    out, calls = _run(tmp_path / "b", "confirm", CONFIRM="Interactive=45+screen Server=51")
    assert out.returncode == 1 and "confirm Interactive: +screen, but no screen to pick from" in out.stdout
    assert [_flag(c, "--scenario") for c in calls] == ["Server"]  # the other entries still run


@pytest.mark.parametrize("confirm, said", [
    ("Offline=50+screen", "'Offline=50+screen': +screen takes the flags of a Server / Interactive latency screen"),
    ("Interactive=auto+screen", "'Interactive=auto+screen': +screen takes the flags"),
    ("Interactive=45+screen+--max-num-seqs=256", "is not +--FLAG=VALUE[+--FLAG=VALUE...] or +screen"),
])
def test_confirm_refuses_screen_where_it_has_no_meaning(tmp_path, confirm, said):
    out, calls = _run(tmp_path, "confirm", CONFIRM=confirm)
    assert out.returncode == 2 and said in out.stdout and calls == []
