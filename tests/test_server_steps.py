"""scripts/bench/server_steps.py: Poisson plans, the step loop and its log on a made-up engine (DELTA outputs,
a fixed number of slots, one token a step), the steady window and the ratios; the whole command on the tiny CPU
model (slow)."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import server_steps  # noqa: E402


def test_plans_offline_all_at_zero_and_server_poisson_at_the_rate():
    assert server_steps.arrivals(5, 0.0, 10.0, 0) == [(0.0, i) for i in range(5)]
    plan = server_steps.arrivals(3, 50.0, 100.0, 7)
    times = [t for t, _ in plan]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 100.0
    assert abs(len(plan) - 5000) < 4 * 5000 ** 0.5  # Poisson count: mean 5,000, sd ~71
    assert [i for _, i in plan] == list(range(len(plan))) and plan == server_steps.arrivals(3, 50.0, 100.0, 7)


class Clock:
    """Advances 0.1 ms a reading and ``step_s`` an engine step: the loop always moves on."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.0001
        return self.t


class Engine:
    """``slots`` requests run at once; a request's first step is its prefill (first token), then one token a step
    until ``max_tokens``; outputs are DELTA ones."""

    def __init__(self, clock, slots=4, max_tokens=3, step_s=0.01):
        self.clock, self.slots, self.max_tokens, self.step_s = clock, slots, max_tokens, step_s
        self.queue, self.running, self.aborted = [], {}, []

    def add_request(self, rid, prompt, params):
        self.queue.append((rid, prompt["prompt_token_ids"]))

    def has_unfinished_requests(self):
        return bool(self.queue or self.running)

    def get_num_unfinished_requests(self):
        return len(self.queue) + len(self.running)

    def step(self):
        while self.queue and len(self.running) < self.slots:
            rid, p = self.queue.pop(0)
            self.running[rid] = [p, 0]
        outs = []
        for rid, st in list(self.running.items()):
            st[1] += 1
            done = st[1] == self.max_tokens
            outs.append(SimpleNamespace(request_id=rid, prompt_token_ids=st[0], finished=done,
                                        outputs=[SimpleNamespace(token_ids=[1])]))
            if done:
                del self.running[rid]
        self.clock.t += self.step_s
        return outs

    def abort_request(self, ids):
        self.aborted += ids


def test_offline_steps_fill_every_slot_and_what_is_left_is_aborted():
    clock = Clock()
    eng = Engine(clock)
    prompts = [[1] * 10, [2] * 20]
    log = server_steps.drive(eng, prompts, server_steps.arrivals(400, 0.0, 1.0, 0), None, 1.0, clock=clock)
    assert all(s["tokens"] == 4 and s["decoding"] <= 4 for s in log.steps)  # the queue outlasts the phase
    finished = sum(s["finished"] for s in log.steps)
    started = [f"r{i}" for i in range(400) if f"r{i}" not in log.open or f"r{i}" in log.length]
    assert sum(s["tokens"] for s in log.steps) == 3 * finished + sum(log.length.values())
    assert sum(s["prefills"] for s in log.steps) == len(started) == finished + len(log.length)
    assert sum(s["prefill_tokens"] for s in log.steps) == sum(10 if int(r[1:]) % 2 == 0 else 20 for r in started)
    assert log.steps[-1]["waiting"] == 400 - len(started)
    assert eng.aborted == sorted(log.open) and len(log.open) == 400 - finished > 0


def test_a_server_under_capacity_waits_for_arrivals_and_never_queues():
    clock = Clock()
    eng = Engine(clock, slots=8)
    plan = server_steps.arrivals(4, 20.0, 3.0, 1)
    log = server_steps.drive(eng, [[5] * 8], plan, None, 3.0, clock=clock, sleep=lambda s: setattr(clock, "t",
                                                                                                 clock.t + s))
    w = server_steps.window(log.steps, 1.0, offline=False)
    assert max(s["waiting"] for s in log.steps) <= 1 and 0 < w["tokens_per_step"] < 8
    assert sum(s["prefills"] for s in log.steps) == sum(s["finished"] for s in log.steps) + len(log.length)
    assert len(plan) > 40 and sum(s["finished"] for s in log.steps) >= len(plan) - 2


def test_the_offline_window_ends_when_its_queue_empties_and_ratios_divide_server_by_offline():
    steps = [{"t_s": t, "ms": 10.0, "tokens": 4, "prefills": 1, "prefill_tokens": 100, "finished": 1,
              "decoding": 4, "waiting": w} for t, w in ((0.0, 3), (1.0, 2), (2.0, 1), (3.0, 0), (4.0, 0))]
    w = server_steps.window(steps, 1.0, offline=True)
    assert (w["steps"], w["from_s"], w["output_tokens_per_s"], w["waiting_last"]) == (2, 1.0, 400.0, 1)
    assert server_steps.window(steps, 1.0, offline=False)["steps"] == 4
    assert w["busy_share"] == round(0.02 / 1.01, 4)  # 10 ms steps a second apart: the engine mostly idled
    assert server_steps.window(steps, 9.0, offline=False) == {"steps": 0}
    r = server_steps.ratios({"output_tokens_per_s": 90.0, "tokens_per_step": 3.0, "ms_per_step_mean": 12.0,
                             "prefill_tokens_per_step": 50.0},
                            {"output_tokens_per_s": 100.0, "tokens_per_step": 4.0, "ms_per_step_mean": 10.0,
                             "prefill_tokens_per_step": 0.0})
    assert r == {"output_tokens_per_s": 0.9, "tokens_per_step": 0.75, "ms_per_step_mean": 1.2,
                 "prefill_tokens_per_step": None}


class Recording(Engine):
    """``Engine`` that notes, per ``add_request``, the request id and how many steps ran before it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stepped, self.adds = 0, []

    def add_request(self, rid, prompt, params):
        self.adds.append((rid, self.stepped))
        super().add_request(rid, prompt, params)

    def step(self):
        self.stepped += 1
        return super().step()


def test_admitting_every_2nd_step_defers_due_arrivals_while_busy_and_admits_at_once_when_idle():
    # one slot, one token a request: a request is one step; steps take 10 ms (the made-up clock)
    plan = [(0.0, 0), (0.0, 1), (0.005, 2), (0.035, 3), (0.035, 4), (0.04, 5), (0.05, 6)]
    adds = {}
    for k in (1, 2):
        clock = Clock()
        eng = Recording(clock, slots=1, max_tokens=1)
        log = server_steps.drive(eng, [[1] * 3], plan, None, 1.0, clock=clock, admit_every=k,
                                 sleep=lambda s, clock=clock: setattr(clock, "t", clock.t + s))
        assert len(log.steps) == 7 and sum(s["finished"] for s in log.steps) == 7
        adds[k] = eng.adds
    # r2 is due after step 0 (r1 still queued): K=1 adds it before step 1, K=2 only before step 2; the engine is
    # idle after step 2, so r3 and r4 come at once (one step after the last admission); r5 is due after step 3
    # with r4 still queued: K=2 waits until step 5, when r6 is due too
    assert adds[1] == [("r0", 0), ("r1", 0), ("r2", 1), ("r3", 3), ("r4", 3), ("r5", 4), ("r6", 5)]
    assert adds[2] == [("r0", 0), ("r1", 0), ("r2", 2), ("r3", 3), ("r4", 3), ("r5", 5), ("r6", 5)]


def test_admitting_every_2nd_step_adds_only_into_free_slots_and_counts_the_rest_as_held():
    """2 slots, 6 arrivals at 0, 3 steps a request: with the slot cap two go in at once and two more each time the
    engine drained (the admission step between found no free slot), the rest held and counted as waiting; without
    the cap (``slots`` None) all six go into the engine's queue at once."""
    plan = [(0.0, i) for i in range(6)]
    got = {}
    for slots in (2, None, 10):  # 10: more free slots than arrivals left
        clock = Clock()
        eng = Recording(clock, slots=2, max_tokens=3)
        log = server_steps.drive(eng, [[1] * 3], plan, None, 1.0, clock=clock, admit_every=2, slots=slots,
                                 sleep=lambda s, clock=clock: setattr(clock, "t", clock.t + s))
        assert sum(s["finished"] for s in log.steps) == 6
        got[slots] = ([n for _, n in eng.adds], [s["held"] for s in log.steps], [s["waiting"] for s in log.steps])
    assert got[2][:2] == ([0, 0, 3, 3, 6, 6], [4, 4, 4, 2, 2, 2, 0, 0, 0])
    assert got[2][2][:3] == [4, 4, 4]  # after step 1 r0 and r1 have first tokens: the held four wait
    assert got[None][:2] == ([0] * 6, [0] * 9) and got[None][2][0] == 4  # four waiting in the engine's queue
    assert got[10][:2] == ([0] * 6, [0] * 9)


def _out(rid, n=1, finished=False):
    return SimpleNamespace(request_id=rid, prompt_token_ids=[1, 2], finished=finished,
                           outputs=[SimpleNamespace(token_ids=[7] * n)])


@pytest.mark.parametrize("c_arrives, timed", [(2.0, ["a", "b"]), (0.2, ["a"])])
def test_latencies_count_ttft_from_arrival_and_tpot_from_first_to_last_token_up_to_the_first_unfinished(
        c_arrives, timed):
    """a (arrived 0.0) and b (0.5) each get 3 tokens over 100 ms steps; c never finishes: only requests that
    arrived before c are timed, so a request cut off by the phase's end never biases the percentiles."""
    log = server_steps.StepLog()
    for rid, t in (("a", 0.0), ("b", 0.5), ("c", c_arrives)):
        log.submit(rid, t)
    log.record(1.0, 100.0, [_out("a")])
    log.record(1.1, 100.0, [_out("a"), _out("b")])
    log.record(1.2, 100.0, [_out("a", finished=True), _out("b")])
    log.record(1.3, 100.0, [_out("b", finished=True)])
    lat = server_steps.latency(log, 0.0, 10.0)
    ttft = {"a": 1100.0, "b": 700.0}
    assert lat["requests_timed"] == len(timed) and lat["timed_to_s"] == c_arrives
    assert lat["ttft_ms_p99"] == pytest.approx(1096.0 if len(timed) == 2 else 1100.0)  # linear between 700 and 1100
    assert lat["ttft_ms_p50"] == pytest.approx(sum(ttft[r] for r in timed) / len(timed), abs=0.5)
    assert lat["tpot_ms_p50"] == pytest.approx(100.0, abs=0.01) == lat["tpot_ms_p99"]
    assert server_steps.latency(log, 5.0, 10.0)["requests_timed"] == 0


def test_a_server_phase_under_capacity_has_one_step_of_ttft_and_of_tpot():
    """One request every 100 ms into an idle engine of 10 ms steps: TTFT and TPOT ~10 ms (the made-up clock's
    readings add a little), every request timed; the steady window carries them."""
    clock = Clock()
    eng = Engine(clock, slots=4, max_tokens=3)
    plan = [(0.1 * i, 0) for i in range(10)]
    log = server_steps.drive(eng, [[1] * 5], plan, None, 0.95, clock=clock,
                             sleep=lambda s: setattr(clock, "t", clock.t + s))
    lat = server_steps.latency(log, 0.0, 0.95)
    assert lat["requests_timed"] == 10
    for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"):
        assert 10.0 <= lat[k] <= 11.0, (k, lat)


@pytest.mark.parametrize("ks", [["0"], ["1", "1"], ["2", "-1"]])
def test_an_admit_every_steps_below_1_or_given_twice_exits_2(ks, tmp_path, capsys):
    argv = ["--model", "m", "--dataset", "d", "--out", str(tmp_path)]
    assert server_steps.parse(argv).admit_every_steps == [1]
    assert server_steps.parse([*argv, "--admit-every-steps", "1", "3"]).admit_every_steps == [1, 3]
    with pytest.raises(SystemExit) as e:
        server_steps.parse([*argv, "--admit-every-steps", *ks])
    assert e.value.code == 2 and "need --admit-every-steps K >= 1, each once" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--rate", "0"], ["--warm-s", "90"], ["--samples", "0"], ["--duration-s", "-1"],
                                  ["--rate", "inf"], ["--rate", "nan"], ["--duration-s", "inf"],
                                  ["--profile-steps", "-1"], ["--phases", "server", "server"]])
def test_bad_settings_exit_2(args, tmp_path):
    with pytest.raises(SystemExit) as e:
        server_steps.parse(["--model", "m", "--dataset", "d", "--out", str(tmp_path), *args])
    assert e.value.code == 2


@pytest.mark.slow
def test_the_command_on_the_tiny_cpu_model_writes_both_phases_and_ratios(tmp_path):
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"tok_input": list(range(100, 100 + n))} for n in (40, 90, 150, 60)]))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PERF_BASE_OVERRIDE=json.dumps(
        {"quantization": None, "kv_cache_dtype": "auto", "max_model_len": 512, "max_num_seqs": 4, "dtype": "float32",
         "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.1, "enforce_eager": True}))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "server_steps.py"), "--model",
                        str(ROOT / "sut" / "models" / "tiny-llama3"), "--dataset", str(data), "--samples", "4",
                        "--offline-samples", "2000", "--rate", "2", "--duration-s", "6", "--warm-s", "2",
                        "--max-tokens", "8", "--profile-steps", "3", "--out", str(tmp_path / "o")],
                       env=env, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "o" / "server_steps.json").read_text())
    off, srv = res["phases"]["offline"], res["phases"]["server"]
    assert off["window"]["tokens_per_step"] == 4.0  # 4 slots, all decoding while the queue lasts
    # 2 queries/s of 8 tokens: far below the 4 slots' capacity even on a loaded 2-core machine (a step ~10-50 ms)
    assert srv["window"]["waiting_mean"] < 2 and 0 < srv["window"]["tokens_per_step"] < 4
    w = srv["window"]  # ~8 arrivals in the 4 s window, each answered in 8 short steps on a real engine
    assert w["requests_timed"] >= 2 and 0 < w["tpot_ms_p50"] <= w["tpot_ms_p99"] < w["ttft_ms_p99"] * 20
    assert "tpot_ms_p99" not in off["window"] and "tpot_ms_p99" in r.stdout
    assert res["ratios"]["server"]["output_tokens_per_s"] < 1 and "server / offline" in r.stdout
    assert (tmp_path / "o" / "server_steps.png").stat().st_size > 10_000
    for ph in (off, srv):  # profiled after the window (CPU: no GPU kernels to sum), and not counted in it
        assert ph["profile"] == {"error": "no GPU activity in the trace"} and ph["window"]["to_s"] <= 6.5
        assert ph["steps"][-1]["t_s"] >= 6.0


STANDIN = """#!/usr/bin/env bash
# python3 of scripts/bench/gpu_runs.sh's server-steps step: records its flags, writes what the command would
case "$*" in
  "scripts/bench/server_steps.py"*) echo "$*" >> "$CALLS"; mkdir -p "$JOB/server_steps"
    echo '{"phases": {}}' > "$JOB/server_steps/server_steps.json"
    printf 'steady window   offline   server\\nsteps   1200   1100\\nserver / offline: output_tokens_per_s 0.9400\\n'
    exit 0 ;;
esac
exec {real} "$@"
"""


def test_the_gpu_step_passes_its_settings_and_batch_wait_brings_the_record_back(tmp_path):
    import tarfile

    from conftest import standin_python3

    job = tmp_path / "job"
    job.mkdir()
    env = dict(os.environ, **standin_python3(tmp_path, STANDIN), CALLS=str(tmp_path / "calls"),
               JOB=str(job), OUT=str(tmp_path / "out"), SS_RATE="56", SS_PROFILE="40")
    gpu = ["bash", "scripts/bench/gpu_runs.sh"]
    for admit in (None, "1 2  3"):
        run_env = env if admit is None else dict(env, SS_ADMIT=admit)
        assert subprocess.run([*gpu, "server-steps"], cwd=ROOT, env=run_env, timeout=60).returncode == 0
    flags = []
    for line in (tmp_path / "calls").read_text().splitlines():  # a flag -> its values
        flags.append({})
        for word in line.split()[1:]:
            if word.startswith("--"):
                key = flags[-1].setdefault(word, [])
            else:
                key.append(word)
    assert [f["--admit-every-steps"] for f in flags] == [["1"], ["1", "2", "3"]]
    assert (flags[0]["--rate"], flags[0]["--duration-s"], flags[0]["--profile-steps"]) == (["56"], ["90"], ["40"])
    assert flags[0]["--out"] == [str(job / "server_steps")]
    (job / "DONE").write_text("done")
    w = subprocess.run([*gpu, "batch-wait", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "server / offline: output_tokens_per_s 0.9400" in w.stdout and "batch DONE" in w.stdout
    with tarfile.open(tmp_path / "out" / "job.tgz") as t:
        assert "./server_steps/server_steps.json" in t.getnames()


def test_a_profiler_that_fails_leaves_the_phase_its_step_log():
    clock = Clock()
    prof = server_steps.Profiler(5, start_s=0.0)
    prof._tick = lambda: (_ for _ in ()).throw(RuntimeError("CUPTI not available"))
    log = server_steps.drive(Engine(clock), [[1] * 4], server_steps.arrivals(50, 0.0, 1.0, 0), None, 0.5,
                             on_step=prof, clock=clock, keep_going=prof.active)
    assert len(log.steps) > 10 and prof.summary(0) == {"error": "RuntimeError: CUPTI not available"}
    assert server_steps.Profiler(5, start_s=99.0).summary(0) is None


def test_the_profiled_steps_come_after_the_window_and_are_not_in_it():
    clock = Clock()
    ticks = []

    class Counting(server_steps.Profiler):
        def _tick(self):
            ticks.append(clock.t)
            self.done = len(ticks) == self.left

    prof = Counting(7, start_s=0.5)
    log = server_steps.drive(Engine(clock), [[1] * 4], server_steps.arrivals(400, 0.0, 1.0, 0), None, 0.5,
                             on_step=prof, clock=clock, keep_going=prof.active)
    assert len(ticks) == 7 and min(ticks) >= 0.5 and prof.done
    after = [s for s in log.steps if s["t_s"] >= 0.5]
    assert len(after) == 7  # the phase ran on for exactly the profiled steps
    w = server_steps.window(log.steps, 0.1, offline=True, end_s=0.5)
    assert w["steps"] == sum(1 for s in log.steps if 0.1 <= s["t_s"] < 0.5)


def test_the_figure_draws_a_value_a_second_not_every_step(tmp_path):
    steps = [{"t_s": t / 100, "ms": 10.0, "tokens": t % 7, "waiting": 500 - t} for t in range(300)]
    x, y = server_steps.per_second(steps, "tokens")
    assert x == [0.5, 1.5, 2.5] and y[0] == sum(t % 7 for t in range(100)) / 100
    assert server_steps.per_second(steps, "waiting", last=True)[1] == [401, 301, 201]
    res = {"settings": {"warm_s": 1.0, "rate": 5.0}, "card": "cpu",
           "phases": {"offline": {"steps": steps, "window": {"tokens_per_step": 3.0, "ms_per_step_mean": 10.0}},
                      "server": {"steps": [], "window": {"steps": 0}}}}
    png = server_steps.figure(res)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000 and not list(tmp_path.iterdir())  # drawn only


def test_a_failing_phase_leaves_the_earlier_phases_record_and_a_failing_figure_only_a_warning(tmp_path, monkeypatch,
                                                                                             caplog):
    a = server_steps.parse(["--model", "m", "--dataset", "d", "--out", str(tmp_path), "--duration-s", "0.3",
                            "--warm-s", "0.1", "--offline-samples", "40"])
    real = server_steps.run_phase

    def phase(engine, name, *args):
        if name == "server":
            raise RuntimeError("CUDA out of memory")
        return real(engine, name, *args)

    monkeypatch.setattr(server_steps, "run_phase", phase)
    res = {"settings": vars(a), "phases": {}}
    with pytest.raises(RuntimeError):
        server_steps.run_phases(Engine(Clock()), [[1] * 4], a, None, res, tmp_path)
    saved = json.loads((tmp_path / "server_steps.json").read_text())
    assert list(saved["phases"]) == ["offline"] and saved["phases"]["offline"]["steps"]
    monkeypatch.setattr(server_steps, "run_phase", real)
    monkeypatch.setattr(server_steps, "figure", lambda res: 1 / 0)
    res = {"settings": vars(a), "phases": {}}
    caplog.set_level(logging.INFO)
    server_steps.run_phases(Engine(Clock()), [[1] * 4], a, None, res, tmp_path)
    saved = json.loads((tmp_path / "server_steps.json").read_text())
    assert set(saved["ratios"]) == {"server"} and set(saved["ratios"]["server"]) >= {"output_tokens_per_s"}
    assert saved["notes"][-1].startswith("no figure (ZeroDiv")
    assert "no figure (ZeroDivisionError" in caplog.text and "server_steps.png" not in caplog.text


ENGINE_CHECK = """
import sys
sys.path.insert(0, sys.argv[1] + "/scripts/bench")
import server_steps as ss
from vllm import LLM, SamplingParams
from vllm.sampling_params import RequestOutputKind
llm = LLM(model=sys.argv[1] + "/sut/models/tiny-llama3", load_format="dummy", skip_tokenizer_init=True,
          dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_utilization=0.1,
          enforce_eager=True, enable_prefix_caching=False, seed=0)
eng, prompts, out = llm.llm_engine, [list(range(100, 100 + n)) for n in (40, 90, 150, 60)], []
sp = lambda n: SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                              output_kind=RequestOutputKind.DELTA)
for n in (1, 3):  # 64-token steps: the 90- and 150-token prompts take 2 and 3 steps before their first token
    st = ss.drive(eng, prompts, ss.arrivals(40, 0.0, 1.0, 0), sp(n), 1000.0).steps
    out.append([sum(s[k] for s in st) for k in ("tokens", "prefills", "finished", "prefill_tokens")]
               + [st[-1]["waiting"], st[-1]["decoding"], min(s["tokens"] for s in st)])
log = ss.drive(eng, prompts, ss.arrivals(200, 0.0, 1.0, 0), sp(8), 0.3)
out.append([len(log.open) > 0, eng.has_unfinished_requests()])
st = ss.drive(eng, prompts, ss.arrivals(8, 0.0, 1.0, 0), sp(8), 1000.0).steps  # same ids as the aborted phase's
out.append([sum(s["tokens"] for s in st), sum(s["finished"] for s in st), st[0]["waiting"]])
print(out)
"""


@pytest.mark.slow
def test_the_step_log_counts_what_the_cpu_engine_generated_and_its_abort_leaves_a_clean_engine():
    r = subprocess.run([sys.executable, "-c", ENGINE_CHECK, str(ROOT)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    assert r.returncode == 0, r.stderr[-3000:]
    one, three, aborted, after = json.loads(r.stdout.strip().splitlines()[-1].replace("True", "true")
                                            .replace("False", "false"))
    prompt_tokens = 10 * (40 + 90 + 150 + 60)
    assert one == [40, 40, 40, prompt_tokens, 0, 0, 0]  # steps of only partial prefills generate nothing
    assert three == [120, 40, 40, prompt_tokens, 0, 0, 1]
    assert aborted == [True, False]
    assert after == [64, 8, 7]


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in ``vllm`` for ``main``: ``LLM`` records each engine start (its arguments) and drives the made-up
    ``Engine``; no real engine, no GPU. Returns the list of starts."""
    import types

    started = []

    class LLM:
        def __init__(self, **kwargs):
            started.append(kwargs)
            self.llm_engine = Engine(Clock())

        def generate(self, *args, **kwargs):
            return []

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.__version__ = LLM, lambda **kw: kw, "stand-in"
    sp = types.ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = SimpleNamespace(DELTA="delta")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)
    monkeypatch.delenv("PERF_BASE_OVERRIDE", raising=False)
    return started


def dataset(tmp_path, rows=None) -> str:
    """A small cnn_eval-format file (``rows``, or four prompts) in ``tmp_path``; its path."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows if rows is not None else [{"tok_input": [1] * n} for n in (4, 8, 12, 6)]))
    return str(path)


def quick(tmp_path, out, *extra) -> list[str]:
    """``main``'s argv for a sub-second run on the stand-in engine (0.3 s phases)."""
    return ["--model", "m", "--dataset", dataset(tmp_path), "--out", str(out), "--duration-s", "0.3", "--warm-s",
            "0.1", "--offline-samples", "40", "--rate", "20", *extra]


@pytest.mark.parametrize("args", [["--seed", "-1"], ["--rate", "1e12"], ["--offline-samples", "10000001"],
                                  ["--rate", "100000", "--duration-s", "101"],
                                  ["--rate", "100000", "--duration-s", "90", "--profile-steps", "5"]])
def test_a_negative_seed_or_a_plan_over_the_cap_exits_2_before_the_engine_and_the_folder(args, tmp_path, fake_vllm):
    with pytest.raises(SystemExit) as e:
        server_steps.main(quick(tmp_path, tmp_path / "o") + args)
    assert e.value.code == 2 and not fake_vllm and not (tmp_path / "o").exists()


def test_the_plan_refuses_more_than_max_arrivals_and_draws_the_same_gaps_as_one_by_one():
    for n, rate in ((1, 1e12), (server_steps.MAX_ARRIVALS + 1, 0.0)):
        with pytest.raises(ValueError, match="MAX_ARRIVALS"):
            server_steps.arrivals(n, rate, 90.0, 0)
    rng, t, one_by_one = server_steps.np.random.default_rng(3), 0.0, []
    while (t := t + float(rng.exponential(1 / 40.0))) < 30.0:
        one_by_one.append((t, len(one_by_one)))
    assert server_steps.arrivals(2, 40.0, 30.0, 3) == one_by_one


@pytest.mark.parametrize("override, rows, says", [
    ("{not json", None, "PERF_BASE_OVERRIDE: not JSON"),
    ("[1]", None, "PERF_BASE_OVERRIDE: a JSON object of engine arguments expected, got a JSON array"),
    ('{"model": "x"}', None, "PERF_BASE_OVERRIDE: must not set 'model'"),
    (None, "missing", "d.json: cannot read it (FileNotFoundError"),
    (None, [{"tok_input": [1, 2]}, {"text": "x"}], "d.json: row 1: no 'tok_input' field"),
    (None, [{"tok_input": [1, 2]}, {"tok_input": "1 2"}], "d.json: row 1: 'tok_input' must be a non-empty array"),
    (None, {"tok_input": [1, 2]}, "d.json: a JSON array of rows with 'tok_input' expected, got a JSON object")],
    ids=["override_not_json", "override_array", "override_model", "dataset_missing", "row_without_tok_input",
         "tok_input_a_string", "dataset_an_object"])
def test_a_bad_override_or_dataset_exits_2_naming_it_before_the_engine_and_the_folder(override, rows, says, tmp_path,
                                                                                     fake_vllm, monkeypatch, caplog):
    argv = quick(tmp_path, tmp_path / "o")
    if override is not None:
        monkeypatch.setenv("PERF_BASE_OVERRIDE", override)
    if rows == "missing":
        (tmp_path / "d.json").unlink()
    elif rows is not None:
        dataset(tmp_path, rows)
    assert server_steps.main(argv) == 2 and says in caplog.text
    assert not fake_vllm and not (tmp_path / "o").exists()


def test_an_out_folder_that_cannot_take_the_record_exits_2_before_the_engine_leaving_no_folder(tmp_path, fake_vllm,
                                                                                             monkeypatch, caplog):
    (tmp_path / "o" / "server_steps.json").mkdir(parents=True)
    assert server_steps.main(quick(tmp_path, tmp_path / "o")) == 2 and "--out" in caplog.text
    (tmp_path / "f").write_text("a file")
    assert server_steps.main(quick(tmp_path, tmp_path / "f")) == 2
    assert server_steps.main(quick(tmp_path, tmp_path / "f" / "o")) == 2

    def unwritable(out):
        raise PermissionError(13, "Permission denied", str(out / "probe"))

    monkeypatch.setattr(server_steps, "_probe_write", unwritable, raising=False)
    assert server_steps.main(quick(tmp_path, tmp_path / "new" / "deeper")) == 2 and "Permission denied" in caplog.text
    assert not fake_vllm and not (tmp_path / "new").exists() and (tmp_path / "f").read_text() == "a file"


def test_a_figure_that_cannot_be_written_fails_the_run_and_is_not_claimed(tmp_path, fake_vllm, monkeypatch, caplog):
    real = server_steps.figure
    out = tmp_path / "o"

    def figure_then_png_is_a_folder(res, *rest):  # the folder changes under a running phase (e.g. another job)
        (out / "server_steps.png").mkdir()
        return real(res, *rest)

    monkeypatch.setattr(server_steps, "figure", figure_then_png_is_a_folder)
    caplog.set_level(logging.INFO)
    assert server_steps.main(quick(tmp_path, out)) == 1 and len(fake_vllm) == 1
    assert "server_steps.png: cannot write it (IsADirectoryError" in caplog.text
    assert not [r for r in caplog.records if "wrote" in r.getMessage() and "server_steps.png" in r.getMessage()]
    assert json.loads((out / "server_steps.json").read_text())["phases"]


def test_an_offline_queue_empty_before_warm_s_is_explained_in_the_log_the_record_and_the_table(tmp_path, fake_vllm,
                                                                                             caplog, capsys):
    caplog.set_level(logging.INFO)
    assert server_steps.main(quick(tmp_path, tmp_path / "o")) == 0  # 40 requests finish in microseconds
    res = json.loads((tmp_path / "o" / "server_steps.json").read_text())
    note = res["phases"]["offline"]["note"]
    assert res["phases"]["offline"]["window"] == {"steps": 0} and note in res["notes"] and note in caplog.text
    assert "queue of 40 requests was empty" in note and "--warm-s 0.1" in note
    table = capsys.readouterr().out
    assert "server / offline: none: a phase has no steady window (notes: offline: no steady window" in table
    assert "wrote " + str(tmp_path / "o" / "server_steps.json") + ", " in caplog.text
    assert (tmp_path / "o" / "server_steps.png").stat().st_size > 10_000


def test_server_phases_alone_print_their_table_with_latencies_and_no_ratios(tmp_path, fake_vllm, capsys):
    """--phases server (a latency screen): the table, TTFT / TPOT rows included, and no ratio lines."""
    out = tmp_path / "o"
    assert server_steps.main(quick(tmp_path, out, "--rate", "200", "--phases", "server",
                                   "--admit-every-steps", "1", "2")) == 0
    res = json.loads((out / "server_steps.json").read_text())
    assert list(res["phases"]) == ["server", "server-admit2"] and "ratios" not in res
    table = capsys.readouterr().out.splitlines()
    assert next(line for line in table if line.startswith("steady window")).split()[2:] == ["server", "server-admit2"]
    assert any(line.startswith("tpot_ms_p99") for line in table) and not any("/ offline" in line for line in table)


def test_one_server_phase_per_admit_k_each_with_its_ratios_and_table_column(tmp_path, fake_vllm, monkeypatch, capsys):
    real = Engine.step

    def slow_step(self):  # ~1 ms a step in real time (main's clock): Offline's 2,000 requests outlast 0.3 s
        server_steps.time.sleep(0.001)
        return real(self)

    monkeypatch.setattr(Engine, "step", slow_step)
    out = tmp_path / "o"
    assert server_steps.main(quick(tmp_path, out, "--offline-samples", "2000", "--rate", "200",
                                   "--admit-every-steps", "1", "2")) == 0
    res = json.loads((out / "server_steps.json").read_text())
    assert list(res["phases"]) == ["offline", "server", "server-admit2"] and len(fake_vllm) == 1
    assert [res["phases"][p].get("admit_every_steps") for p in res["phases"]] == [None, 1, 2]
    assert res["phases"]["server-admit2"]["steps"][0]["t_s"] < 0.3 and res["settings"]["admit_every_steps"] == [1, 2]
    assert set(res["ratios"]) == {"server", "server-admit2"}
    assert all(r["output_tokens_per_s"] and r["tokens_per_step"] for r in res["ratios"].values())
    table = capsys.readouterr().out.splitlines()
    head = next(line for line in table if line.startswith("steady window"))
    assert head.split() == ["steady", "window", "offline", "server", "server-admit2"]
    assert len(next(line for line in table if line.startswith("tokens_per_step")).split()) == 4
    for name in ("server", "server-admit2"):
        assert any(line.startswith(f"{name} / offline: output_tokens_per_s ") for line in table)
    assert (out / "server_steps.png").stat().st_size > 10_000


def test_a_server_phase_without_a_steady_window_is_named_in_its_note_and_its_own_table_line():
    a = SimpleNamespace(warm_s=5.0, duration_s=10.0, rate=0.1)
    note = server_steps.no_window_note("server-admit3", [], a)
    assert note.startswith("server-admit3: no steady window: no engine step from --warm-s 5 s")
    ok = {"steps": 3, "output_tokens_per_s": 100.0, "tokens_per_step": 4.0, "ms_per_step_mean": 10.0,
          "prefill_tokens_per_step": 10.0}
    res = {"phases": {"offline": {"window": ok}, "server": {"window": ok}, "server-admit3": {"window": {"steps": 0}}},
           "notes": [note]}
    res["ratios"] = {n: server_steps.ratios(res["phases"][n]["window"], ok) for n in ("server", "server-admit3")}
    lines = server_steps.table(res)
    assert lines[-2] == ("server / offline: output_tokens_per_s 1.0000, tokens_per_step 1.0000, "
                         "ms_per_step_mean 1.0000, prefill_tokens_per_step 1.0000")
    assert lines[-1] == f"server-admit3 / offline: none: a phase has no steady window (notes: {note})"
    assert lines[0].split()[-1] == "server-admit3" and lines[1].split()[1:] == ["3", "3", "0"]
