"""The Server/Interactive ledger (sut/ledger/streaming.py) with recorders instead of LoadGen, and one
short LoadGen Server test with a stand-in engine (no vLLM): first tokens before completions, on one thread."""

import threading
from types import SimpleNamespace as QS

import numpy as np

from sut.ledger.streaming import StreamingLedger

EOS = (128009,)


class Rec:
    """Records every call of both LoadGen functions, in order, with its thread."""

    def __init__(self):
        self.events, self.threads = [], set()

    def first(self, results):
        self.threads.add(threading.current_thread().name)
        self.events += [("first", sid, f) for sid, f in results]

    def complete(self, results):
        self.threads.add(threading.current_thread().name)
        self.events += [("done", sid, ids.tolist()) for sid, ids in results]


def make():
    r = Rec()
    return StreamingLedger(EOS, progress=False, complete_fn=r.complete, first_fn=r.first), r


def test_first_token_then_response_on_the_completer_thread_with_latencies():
    led, r = make()
    (a, _), (b, _) = led.issue([QS(id=11, index=0), QS(id=12, index=1)])
    led.first_tokens([(a, 5), (b, 7)])
    led.complete([(a, np.array([5, 6, 128009, 128009], np.int32))])
    led.complete([(b, np.array([7], np.int32))])
    assert led.wait_sent(5)
    assert r.events == [("first", 11, 5), ("first", 12, 7), ("done", 11, [5, 6, 128009]), ("done", 12, [7])]
    assert r.threads == {"loadgen-completer"}
    assert led.error is None and led.first_sent == led.completed == 2 and led.output_tokens == 4
    s = led.latency_summary()
    assert s["ttft_ms"]["samples"] == 2 and s["tpot_ms"]["samples"] == 1 and s["ttft_ms"]["p99"] >= 0


def test_response_not_starting_with_its_first_token_fails_the_run():
    led, r = make()
    (a, _), (b, _) = led.issue([QS(id=11, index=0), QS(id=12, index=1)])
    led.first_tokens([(a, 5)])
    led.complete([(a, np.array([6, 5], np.int32))])
    assert led.wait_sent(5)
    assert "first token 5 was reported, but the response starts with [6]" in led.error
    assert sorted(e[1] for e in r.events if e[0] == "done") == [11, 12]  # both answered (empty) once
    assert all(e[2] == [] for e in r.events if e[0] == "done")


def test_samples_answered_empty_get_an_empty_first_token_first_when_they_had_none():
    """LoadGen 6.0.17 (accuracy mode) crashes on a QuerySamplesComplete without a FirstTokenComplete before it."""
    led, r = make()
    (a, _), (b, _), (c, _) = led.issue([QS(id=11, index=0), QS(id=12, index=1), QS(id=13, index=2)])
    led.first_tokens([(a, 5), (c, 9)])
    led.complete([(c, np.array([9, 4], np.int32))])
    led.fail("boom")
    led.issue([QS(id=14, index=3)])  # issued after the failure: answered empty at once
    assert led.wait_sent(5) and led.idle.is_set()
    assert r.events == [("first", 11, 5), ("first", 13, 9), ("done", 13, [9, 4]),
                        ("first", 12, None), ("done", 11, []), ("done", 12, []),
                        ("first", 14, None), ("done", 14, [])]
    assert led.first_sent == 2 and led.completed == 1 and led.answered_empty == 3


def test_response_without_first_token_and_a_doubled_first_token_fail():
    led, _ = make()
    (a, _), = led.issue([QS(id=11, index=0)])
    led.complete([(a, np.array([6, 7], np.int32))])
    assert "finished without a first token" in led.error
    led, _ = make()
    (a, _), = led.issue([QS(id=11, index=0)])
    led.first_tokens([(a, 6)])
    led.first_tokens([(a, 6)])
    assert "reported twice" in led.error


def test_samples_issued_after_a_failure_are_answered_empty_at_once():
    led, r = make()
    led.issue([QS(id=11, index=0)])
    led.fail("engine died")
    assert led.issue([QS(id=12, index=1), QS(id=13, index=2)]) == []
    assert led.wait_sent(5)
    assert sorted(e[1] for e in r.events if e[0] == "done") == [11, 12, 13]
    assert led.outstanding == 0 and led.idle.is_set() and led.answered_empty == 3


def test_loadgen_server_run_with_a_stand_in_engine_records_ttft(tmp_path):
    """LoadGen itself (Server, 40 queries): every first token reaches it before the response, no LoadGen error."""
    import subprocess
    import sys

    from conftest import REPO, sut_env

    code = r"""
import json, queue, sys, tempfile, threading, time
import numpy as np, mlperf_loadgen as lg
from sut.ledger.streaming import StreamingLedger
out = sys.argv[1]
led = StreamingLedger((128009,), progress=False)
work = queue.Queue()
def engine():
    while True:
        rid = work.get()
        time.sleep(0.002); led.first_tokens([(rid, 42)])
        time.sleep(0.01); led.complete([(rid, np.array([42, 43, 44, 128009], np.int32))])
threading.Thread(target=engine, daemon=True).start()
ts = lg.TestSettings(); ts.scenario = lg.TestScenario.Server
with tempfile.NamedTemporaryFile("w", suffix=".conf") as f:
    f.write("*.Server.target_qps = 100\n"); f.flush()
    assert ts.FromConfig(f.name, "llama3_1-8b-interactive", "Server") == 0
ts.mode = lg.TestMode.PerformanceOnly; ts.min_duration_ms = 200; ts.min_query_count = 40
sut = lg.ConstructSUT(lambda qs: [work.put(r) for r, _ in led.issue(qs)], lambda: None)
qsl = lg.ConstructQSL(16, 16, lambda x: None, lambda x: None)
o = lg.LogOutputSettings(); o.outdir = out; ls = lg.LogSettings(); ls.log_output = o; ls.enable_trace = False
lg.StartTestWithLogSettings(sut, qsl, ts, ls, out + "/none")
led.close()
print(json.dumps({"issued": led.issued, "completed": led.completed, "first": led.first_sent, "error": led.error}))
"""
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=sut_env(), cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    import json

    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["error"] is None and res["issued"] == res["completed"] == res["first"] >= 40
    detail = (tmp_path / "mlperf_log_detail.txt").read_text()
    assert '"is_error": true' not in detail
    assert '"result_first_token_99.00_percentile_latency_ns"' in detail


def test_deliveries_queued_while_loadgen_is_busy_go_together_each_first_token_once_before_its_answer():
    """Many engine threads deliver first tokens and answers while the LoadGen calls are slow: the completer sends
    what gathered meanwhile in few calls, and still every sample gets one first token, its answer's first id,
    before its answer (a doubled, late or wrong first token fails here)."""
    import time

    r = Rec()
    calls = []

    def slow_first(results):
        calls.append("first")
        time.sleep(0.002)  # LoadGen busy: later deliveries gather in the outbox
        r.first(results)

    def slow_complete(results):
        calls.append("done")
        time.sleep(0.002)
        r.complete(results)

    led = StreamingLedger(EOS, progress=False, complete_fn=slow_complete, first_fn=slow_first)
    n_threads, per = 4, 50
    pairs = led.issue([QS(id=1000 + i, index=i) for i in range(n_threads * per)])
    firsts = {rid: 10 + (rid % 500) for rid, _ in pairs}

    def engine(mine):
        for k in range(0, len(mine), 2):  # engine steps of two requests: first tokens, then answers a step later
            step = mine[k:k + 2]
            led.first_tokens([(rid, firsts[rid]) for rid in step])
            led.complete([(rid, np.array([firsts[rid], 7, 128009], np.int32)) for rid in step])

    rids = [rid for rid, _ in pairs]
    threads = [threading.Thread(target=engine, args=(rids[t::n_threads],)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert led.wait_sent(10) and led.error is None
    seen_first, seen_done = {}, {}
    for i, (kind, sid, val) in enumerate(r.events):
        book = seen_first if kind == "first" else seen_done
        assert sid not in book, f"{kind} of sample {sid} sent twice"
        book[sid] = (i, val)
    assert set(seen_first) == set(seen_done) == {1000 + i for i in range(n_threads * per)}
    for rid, _ in pairs:
        sid = 1000 + rid  # ledger request ids count from 0 in issue order
        (fi, f), (di, ids) = seen_first[sid], seen_done[sid]
        assert fi < di and f == firsts[rid] == ids[0], (sid, fi, di, f, ids)
    assert len(calls) < 2 * len(pairs) // 2  # fewer calls than deliveries: merged
    assert led.first_sent == led.completed == len(pairs) and led.output_tokens == 3 * len(pairs)
