from types import SimpleNamespace as QS

import numpy as np
import pytest

from sut.base import SampleLedger

EOS = (128009,)


class Sink:
    def __init__(self):
        self.calls = []

    def __call__(self, results):
        self.calls.extend((sid, ids.tolist()) for sid, ids in results)


def make():
    sink = Sink()
    return SampleLedger(EOS, progress=False, complete_fn=sink), sink


def test_each_issued_sample_gets_its_own_request_even_for_repeats():
    led, sink = make()
    pairs = led.issue([QS(id=101, index=7), QS(id=102, index=7), QS(id=103, index=2)])
    rids = [r for r, _ in pairs]
    assert len(set(rids)) == 3 and [i for _, i in pairs] == [7, 7, 2]
    led.complete([(rids[1], np.array([5, 128009, 128009], np.int32)), (rids[0], np.array([6, 7], np.int32))])
    led.complete([(rids[2], np.array([8, 9], np.int32))])
    assert sink.calls == [(102, [5, 128009]), (101, [6, 7]), (103, [8, 9])]
    assert led.completed == led.issued == 3 and led.outstanding == 0 and led.idle.is_set()
    assert led.output_tokens == 6 and led.error is None


def test_second_answer_fails_the_run_loudly():
    led, sink = make()
    (rid, _), (rid2, _) = led.issue([QS(id=1, index=0), QS(id=2, index=1)])
    led.complete([(rid, np.array([1, 2], np.int32))])
    led.complete([(rid, np.array([1, 2], np.int32))])
    assert "answered twice" in led.error
    # the remaining sample is released (empty) so LoadGen can stop; the run is failed
    assert sink.calls == [(1, [1, 2]), (2, [])]
    assert led.outstanding == 0


def test_fail_answers_outstanding_once_and_ignores_late_results():
    led, sink = make()
    pairs = led.issue([QS(id=i, index=i) for i in range(4)])
    led.complete([(pairs[0][0], np.array([1, 2], np.int32))])
    led.fail("engine 0 died")
    led.fail("second error is not recorded")
    led.complete([(pairs[1][0], np.array([3, 4], np.int32))])  # late result after failure: dropped
    assert led.error == "engine 0 died"
    assert sorted(s for s, _ in sink.calls) == [0, 1, 2, 3]
    assert len(sink.calls) == 4
