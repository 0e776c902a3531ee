import re
import subprocess
import sys
import threading
from types import SimpleNamespace as QS

import numpy as np
import pytest
from conftest import REPO, sut_env

from sut.base import SampleLedger

EOS = (128009,)


class Sink:
    """Records every complete_fn call: its thread and its (sample id, ids) pairs."""

    def __init__(self):
        self.calls = []
        self.batches = []
        self.threads = set()

    def __call__(self, results):
        self.threads.add(threading.current_thread().name)
        self.batches.append(len(results))
        self.calls.extend((sid, ids.tolist()) for sid, ids in results)


def make(**kw):
    sink = Sink()
    return SampleLedger(EOS, progress=False, complete_fn=sink, **kw), sink


def test_each_issued_sample_gets_its_own_request_even_for_repeats():
    led, sink = make()
    pairs = led.issue([QS(id=101, index=7), QS(id=102, index=7), QS(id=103, index=2)])
    rids = [r for r, _ in pairs]
    assert len(set(rids)) == 3 and [i for _, i in pairs] == [7, 7, 2]
    led.complete([(rids[1], np.array([5, 128009, 128009], np.int32)), (rids[0], np.array([6, 7], np.int32))])
    led.complete([(rids[2], np.array([8, 9], np.int32))])
    assert led.idle.wait(10) and led.wait_sent(10)
    assert sink.calls == [(102, [5, 128009]), (101, [6, 7]), (103, [8, 9])]
    assert led.completed == led.issued == 3 and led.outstanding == 0
    assert led.output_tokens == 6 and led.error is None and led.answered_empty == 0


def test_second_answer_fails_the_run_loudly():
    led, sink = make()
    (rid, _), (rid2, _) = led.issue([QS(id=1, index=0), QS(id=2, index=1)])
    led.complete([(rid, np.array([1, 2], np.int32))])
    led.complete([(rid, np.array([1, 2], np.int32))])
    assert "answered twice" in led.error
    # the remaining sample is released (empty) so LoadGen can stop; the run is failed
    assert led.wait_sent(10)
    assert sink.calls == [(1, [1, 2]), (2, [])]
    assert led.outstanding == 0 and led.completed == 1 and led.answered_empty == 1


def test_a_bad_id_in_a_batch_still_sends_the_good_results_of_that_batch():
    led, sink = make()
    pairs = led.issue([QS(id=i, index=i) for i in range(3)])
    led.complete([(pairs[0][0], np.array([4], np.int32)), (999, np.array([1], np.int32))])
    assert led.wait_sent(10) and "request 999" in led.error
    assert sorted(sink.calls) == [(0, [4]), (1, []), (2, [])]  # every issued sample answered exactly once


def test_fail_answers_outstanding_once_and_ignores_late_results():
    led, sink = make()
    pairs = led.issue([QS(id=i, index=i) for i in range(4)])
    led.complete([(pairs[0][0], np.array([1, 2], np.int32))])
    led.fail("engine 0 died")
    led.fail("second error is not recorded")
    led.complete([(pairs[1][0], np.array([3, 4], np.int32))])  # late result after failure: dropped
    assert led.error == "engine 0 died"
    assert led.idle.wait(10)
    assert sorted(s for s, _ in sink.calls) == [0, 1, 2, 3]
    assert len(sink.calls) == 4


def test_every_loadgen_call_is_made_on_one_long_lived_thread_in_chunks():
    """complete/fail called from threads that end at once: LoadGen is only ever called from the
    ledger's completer thread (a thread that called LoadGen must not exit while LoadGen runs)."""
    led, sink = make(fail_chunk=1000)
    pairs = led.issue([QS(id=i, index=i % 64) for i in range(13400)])
    workers = [threading.Thread(target=led.complete, args=([(pairs[0][0], np.array([5], np.int32))],)),
               threading.Thread(target=led.fail, args=("engine 0 (pid 1) exited unexpectedly",))]
    for w in workers:
        w.start()
        w.join()
    assert led.idle.wait(10)
    assert sink.threads == {"loadgen-completer"}
    assert sink.batches == [1] + [1000] * 13 + [399]
    assert sorted(s for s, _ in sink.calls) == list(range(13400))
    assert led.completed == 1 and led.answered_empty == 13399


def test_a_failing_loadgen_call_fails_the_run():
    def boom(results):
        raise RuntimeError("bad response")

    led = SampleLedger(EOS, progress=False, complete_fn=boom)
    (rid, _), = led.issue([QS(id=1, index=0)])
    led.complete([(rid, np.array([1], np.int32))])
    assert led.wait_sent(10)
    assert "QuerySamplesComplete failed" in led.error and "bad response" in led.error


def test_progress_bar_has_no_zero_line_and_closes_before_the_last_answer(capsys):
    order = []
    led = SampleLedger(EOS, progress=True, complete_fn=lambda r: order.append(("loadgen", led._bar is None)))
    pairs = led.issue([QS(id=i, index=i) for i in range(3)])
    led.complete([(pairs[0][0], np.array([1], np.int32))])
    assert led.wait_sent(10)  # sent on its own (deliveries queued together go in one call)
    led.complete([(rid, np.array([1], np.int32)) for rid, _ in pairs[1:]])
    assert led.wait_sent(10)
    led.close()
    err = capsys.readouterr().err
    assert not re.search(r"(?<![\d.])0(\.0+)?sample/s", err) and "3/3" in err  # no zero rate ("5955.00sample/s" is fine)
    # the bar was open for the first call and already closed (final line written) for the last one
    assert order == [("loadgen", False), ("loadgen", True)]


def test_server_issue_one_query_at_a_time_does_not_redraw_the_bar_per_query(capsys):
    """A new user's redirected Server log held one redraw per issued query (~5 KB for 48 queries): the bar's
    total grows with every query, and each growth redrew it."""
    led = SampleLedger(EOS, progress=True, complete_fn=lambda r: None)
    rids = [led.issue([QS(id=i, index=i)])[0][0] for i in range(200)]  # LoadGen Server: one query per call
    led.complete([(rid, np.array([1], np.int32)) for rid in rids])
    assert led.wait_sent(10)
    led.close()
    err = capsys.readouterr().err
    assert err.count("\r") < 10 and "200/200" in err  # drawn at most once a second (and at the end), not 200 times


def test_a_bar_reopened_after_an_idle_moment_counts_from_the_first_query(capsys):
    """A new user's Server run: the bar closes whenever every issued sample is answered (its last line before
    LoadGen's summary), and the next query opened a new one whose elapsed time started at 0 ("6/6 [00:03]",
    then "7/7 [00:01]")."""
    led = SampleLedger(EOS, progress=True, complete_fn=lambda r: None)
    (rid, _), = led.issue([QS(id=0, index=0)])
    led.first_issue_t -= 65  # the first query came 65 s ago
    led.complete([(rid, np.array([1], np.int32))])
    assert led.wait_sent(10) and led._bar is None  # idle: closed
    (rid, _), = led.issue([QS(id=1, index=1)])
    led.complete([(rid, np.array([1], np.int32))])
    assert led.wait_sent(10)
    led.close()
    assert "2/2 [01:05" in capsys.readouterr().err


def test_a_bar_reopened_while_the_last_answers_go_to_loadgen_counts_them_and_the_time_from_the_first_query(capsys):
    """The bar closes when the last outstanding answer is taken for LoadGen; LoadGen may issue the next query while
    that answer is still being sent (before it counts as completed). The bar it opened started from the completed
    count without that answer (the run ended at "1/2") and, with none completed yet, at 0 s elapsed."""
    led = SampleLedger(EOS, progress=True, complete_fn=lambda r: next_query())
    later = []

    def next_query():
        if not later:
            later.extend(led.issue([QS(id=1, index=1)]))  # LoadGen's issue thread, meanwhile

    (rid, _), = led.issue([QS(id=0, index=0)])
    led.first_issue_t -= 65  # the first query came 65 s ago
    led.complete([(rid, np.array([1], np.int32))])
    assert led.wait_sent(10) and later
    led.complete([(later[0][0], np.array([1], np.int32))])
    assert led.wait_sent(10)
    led.close()
    assert "2/2 [01:05" in capsys.readouterr().err


def test_offline_bar_keeps_its_elapsed_time_moving_and_shows_no_time_left(capsys, monkeypatch):
    """A new user's Offline CPU run: every sample completed near the end, so the bar sat at "0/64 [00:00<?]"
    for a minute, then read "30.48s/sample, 31:29 left" a second before the end. The harness ticks the ledger
    twice a second: the bar redraws at most once a second while nothing completes, with no rate or time left."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # a terminal: redrawn once a second
    led = SampleLedger(EOS, progress=True, complete_fn=lambda r: None)
    pairs = led.issue([QS(id=i, index=i) for i in range(4)])
    led.tick()  # just drawn: nothing to do
    assert capsys.readouterr().err.count("\r") == 1
    led._bar.start_t -= 61  # the first minute passes with nothing completed
    led._bar_drawn -= 1.5
    led._bar.last_print_t -= 1.5
    led.tick()
    led.tick()  # drawn a moment ago: no second redraw
    err = capsys.readouterr().err
    assert err.count("\r") == 1 and "0/4 [01:01]" in err, err
    led.complete([(rid, np.array([1], np.int32)) for rid, _ in pairs])
    assert led.wait_sent(10)
    led.close()
    err = capsys.readouterr().err
    assert "4/4 [01:01" in err and "<" not in err and "sample/s" not in err and "s/sample" not in err, err


def test_a_bar_written_to_a_log_file_redraws_every_30_s_not_every_second(capsys, monkeypatch):
    """A new user's redirected console held one bar frame per second of the run ('\\r'-separated in one line):
    when stderr is not a terminal the bar redraws every 30 s."""
    from sut.ledger import sample as ledger

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    led = SampleLedger(EOS, progress=True, complete_fn=lambda r: None)
    pairs = led.issue([QS(id=i, index=i) for i in range(4)])
    assert led._bar.mininterval == ledger.BAR_INTERVAL_LOG_S == 30
    capsys.readouterr()
    for _ in range(20):  # 20 s of the harness's ticks with nothing completed
        led._bar_drawn -= 1.0
        led._bar.last_print_t -= 1.0
        led.tick()
    assert capsys.readouterr().err.count("\r") == 0
    led._bar_drawn -= 11
    led._bar.last_print_t -= 11
    led.tick()
    assert capsys.readouterr().err.count("\r") == 1
    led.complete([(rid, np.array([1], np.int32)) for rid, _ in pairs[:2]])  # 17 s after that frame: none
    assert led.wait_sent(10)
    assert capsys.readouterr().err.count("\r") == 0
    led.complete([(rid, np.array([1], np.int32)) for rid, _ in pairs[2:]])
    assert led.wait_sent(10)
    led.close()
    assert "4/4" in capsys.readouterr().err  # the last frame is always written


@pytest.mark.parametrize("via", ["ledger-fail", "ledger-complete"])
def test_full_query_answered_from_short_lived_threads_does_not_crash_loadgen(via):
    """Real LoadGen, 13,368 samples answered from a thread that ends at once. Before the
    completer thread this died with SIGSEGV (exit 139) in most 20-round runs."""
    script = REPO / "tests" / "loadgen_exit_repro.py"
    out = subprocess.run([sys.executable, str(script), "--via", via, "--rounds", "20"],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stdout[-1000:], out.stderr[-2000:])
    assert out.stdout.count("13368 of 13368 issued samples answered") == 20


def test_an_unusable_result_fails_the_run_and_its_sample_is_still_answered_once():
    led, sink = make()
    (r0, _), (r1, _) = led.issue([QS(id=100, index=0), QS(id=101, index=1)])
    led.complete([(r0, "not an array of ids"), (r1, np.array([3, 4], np.int32))])
    assert led.error and "result of request 0 is unusable" in led.error
    assert led.wait_sent(10) and sorted(sid for sid, _ in sink.calls) == [100, 101]
    assert led.outstanding == 0 and led.completed == 1 and led.answered_empty == 1
