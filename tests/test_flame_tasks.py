"""What a finished Flame task must be before its answers reach the dispatcher (``sut.flame.tasks.TaskTracker``), and
the engines a replica's warm-up reads back (``FlameTransport._warm_up``): without a cluster, through the real
dispatcher, answer check and ledger, with results made by ``sut.flame.payload``."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

from sut.core.dispatcher import Dispatcher
from sut.core.routing import make_router
from sut.engine import GenerationSettings
from sut.errors import RunFailed
from sut.flame import payload as pl
from sut.flame.client import FlameSUT
from sut.flame.session import SUCCEED
from sut.flame.stats import FlameStats
from sut.flame.tasks import Batch, TaskTracker
from sut.ledger.sample import SampleLedger
from sut.messages import FatalEvent, Request
from tests.test_flame_client import _ctx

EOS = 9
GEN = GenerationSettings(max_tokens=8, eos_token_ids=(EOS,))
NODE, KEY = "node-0", "cpu-0"


def _ping_meta(node=NODE, key=KEY, replica=0, prefix_caching=False) -> dict:
    """A warm-up answer's meta as the engine host writes it (``sut.flame.engine_host.EngineHost.handle_task``)."""
    return {"executor": {"id": f"e-{node}", "node": node, "pid": 1, "role": "host", "seat": 0},
            "shard": {"key": key, "node": node, "slot": 0, "replica": replica, "session_id": "s0"},
            "engine": {"enable_prefix_caching": prefix_caching}}


def _result_meta(node=NODE, key=KEY, replica=0) -> dict:
    return {"executor": {"id": f"e-{node}", "node": node}, "shard": key, "node": node, "replica": replica,
            "t": {"service_s": 0.01, "engine_s": 0.01}}


class _Owner:
    """The transport's side of a tracker: deliveries to the dispatcher, fatal events to it too."""

    def __init__(self, dispatcher):
        self.dispatcher, self.halted = dispatcher, False

    def deliver(self, replica, completions):
        self.dispatcher.on_results(replica, completions)

    def fatal(self, replica, message):
        self.dispatcher.on_fatal(FatalEvent(replica, message))


def _track(make_output, pings=(_ping_meta(),), n=4, replicas=1):
    """One batch of ``n`` samples routed to replica 0 (of ``replicas``: round robin, so ``n`` 1 when 2), whose
    Flame task succeeds with ``make_output(requests)``; ``pings``: the warm-up answers the run saw. Returns ``(ledger
    error, [(LoadGen sample, ids)] sent)``."""
    sent = []
    ledger = SampleLedger((EOS,), progress=False,
                          complete_fn=lambda b: sent.extend((sid, np.asarray(ids).tolist()) for sid, ids in b))
    d = Dispatcher(NS(replicas=replicas, spec=NS(generation=GEN)), make_router("round_robin", replicas, 4), ledger,
                   vocab_size=100)
    reqs = [Request(rid, np.arange(5, dtype=np.int32) + i, i)
            for rid, i in ledger.issue([NS(id=1000 + i, index=i) for i in range(n)])]
    d._route_locked(reqs, {})
    assert set(d._where.values()) == {0}
    stats = FlameStats()
    for meta in pings:
        stats.note_ping(meta)
    rs = NS(replica=0, id="s0", endpoint="http://127.0.0.1:1",
            await_terminal=lambda task_id, running: (SUCCEED, make_output(reqs), None))
    tb = Batch(3, reqs, b"", 0, task_id="t-1")
    TaskTracker(rs, stats, _Owner(d), lambda _tb: None)._track(tb)
    assert ledger.wait_sent(10)
    return ledger.error, sent


def _answers(reqs, ids=(1, 2, EOS)):
    return [pl.SampleResult(r.rid, True, token_ids=np.array(ids, np.int32)) for r in reqs]


def _result(samples, batch_id=3, meta=None) -> bytes:
    return pl.encode_result(batch_id, samples, meta=_result_meta() if meta is None else meta).data


def test_a_result_of_the_batch_from_an_engine_the_warm_up_read_back_is_answered():
    error, sent = _track(lambda reqs: _result(_answers(reqs)))
    assert error is None and sorted(sent) == [(1000 + i, [1, 2, EOS]) for i in range(4)]


@pytest.mark.parametrize("make, said", [
    (lambda reqs: _result(_answers(reqs), batch_id=4), "result of batch 4 with 4 samples does not match"),
    (lambda reqs: _result(_answers([r._replace(rid=r.rid + 100) for r in reqs])), "does not match"),
    (lambda reqs: _result(_answers(reqs[:1] + reqs[:-1])), "does not match"),  # one answered twice, one dropped
    (lambda reqs: _result(_answers(reqs[:-1])), "result of batch 3 with 3 samples does not match"),
    (lambda reqs: _result(_answers(reqs[::-1])), "does not match"),
    (lambda reqs: _result(_answers(reqs, (1, 100))), "answered id 100 at position 1 of 2, outside the model's vocab"),
    (lambda reqs: _result(_answers(reqs, (1, -1))), "answered id -1 at position 1 of 2, outside"),
    (lambda reqs: _result(_answers(reqs, (1,) * 8 + (EOS,))), "answered 9 generated ids, the generation settings ask"),
    (lambda reqs: _result(_answers(reqs, (1, EOS, 2, EOS))), "answered EOS id 9 at position 1 of 4 ids, not at the"),
    (lambda reqs: _result(_answers(reqs, ())), "answered 0 generated ids"),
    (lambda reqs: _result(_answers(reqs))[:-3], "returned an unreadable result: payload length"),
    (lambda reqs: b"", "returned an unreadable result: payload of 0 bytes"),
    (lambda reqs: _result([]), "result of batch 3 with 0 samples does not match"),
])
def test_a_result_that_is_not_the_batchs_answers_fails_the_run_and_reaches_no_ledger_entry(make, said):
    error, sent = _track(make)
    assert error and said in error, error
    assert sorted(sid for sid, _ in sent) == [1000, 1001, 1002, 1003] and not any(ids for _, ids in sent)


@pytest.mark.parametrize("meta, said", [
    (_result_meta(node="node-7"), "served by engine shard node-7/cpu-0, which no warm-up answer of this run named"),
    (dict(_result_meta(), shard=None), "served by engine shard node-0/None, which no warm-up answer"),
    (dict(_result_meta(), replica=5), "the result names replica 5, but its engine shard node-0/cpu-0 serves replica 0"),
    (dict(_result_meta(), replica="x"), "the result names replica 'x', but its engine shard node-0/cpu-0 serves"),
    ([1], "the result's meta is a list, not an object"),
    (dict(_result_meta(), t={"service_s": "0.01"}), "the result's meta field 't' must be an object of finite seconds, "
                                                    'got {"service_s": "0.01"}'),
    (dict(_result_meta(), t=[0.01]), "the result's meta field 't' must be an object of finite seconds"),
    (dict(_result_meta(), t={"engine_s": float("nan")}), "the result's meta field 't' must be an object of finite "
                                                        "seconds, got {\"engine_s\": NaN}"),
    (dict(_result_meta(), executor="e-0"), "the result's meta field 'executor' must be an object, got \"e-0\""),
    (dict(_result_meta(), engine_gc_max_pause_ms="3"), "the result's meta field 'engine_gc_max_pause_ms' must be a "
                                                      "finite number, got \"3\""),
])
def test_a_result_from_an_engine_no_warm_up_read_back_fails_the_run(meta, said):
    """A result names the engine shard that served it. One that no warm-up answer named came from an engine whose
    read-back (prefix caching included) was never checked: it was answered as any other. A meta naming a replica
    of no engine shard failed as "watcher ... crashed: IndexError" or ValueError, and a timing field that is no number
    as "watcher ... crashed: TypeError", naming no field."""
    error, sent = _track(lambda reqs: _result(_answers(reqs), meta=meta))
    assert error and f"Flame task t-1 (batch 3, replica 0): {said}" in error, error
    assert not any(ids for _, ids in sent)


def test_a_result_from_another_replicas_engine_names_both_replicas():
    error, _ = _track(lambda reqs: _result(_answers(reqs), meta=_result_meta(key="cpu-1", replica=1)),
                      pings=(_ping_meta(), _ping_meta(key="cpu-1", replica=1)), replicas=2, n=1)
    assert "was routed to replica 0 but answered by replica 1" in error, error


def test_every_engine_a_replicas_warm_up_reaches_is_checked_for_prefix_caching(monkeypatch):
    """One replica, executors on two nodes: an engine on each. Only the first answer's engine became the replica's
    record (``guard.check_replicas``); the second engine, reporting prefix caching on, served the run."""
    answers = [_ping_meta(), _ping_meta(node="node-1", prefix_caching=True)]

    class TwoNodes:
        def __init__(self, rs, need, on_answer, *_args):
            self.on_answer = on_answer

        def run(self):
            for meta in answers:
                self.on_answer(meta)
            return {"executors": 2, "pings": 2, "seconds": 0.1, "bind_failures_retried": []}

    monkeypatch.setattr("sut.flame.transport.Warmup", TwoNodes)
    transport = FlameSUT(_ctx()).transport
    with pytest.raises(RunFailed, match=r"engine shard node-1/cpu-0 of replica 0 reports enable_prefix_caching=True"):
        transport._warm_up([NS(replica=0, id="s0")])
    answers[1] = _ping_meta(node="node-1", prefix_caching=None)
    transport = FlameSUT(_ctx()).transport
    with pytest.raises(RunFailed, match=r"engine shard node-1/cpu-0 of replica 0: prefix caching could not be "):
        transport._warm_up([NS(replica=0, id="s0")])
    answers[1] = _ping_meta(node="node-1")
    transport = FlameSUT(_ctx()).transport
    records = transport._warm_up([NS(replica=0, id="s0")])
    assert [r.index for r in records] == [0] and records[0].enable_prefix_caching is False


@pytest.mark.parametrize("output, said", [
    (b"junk", "returned an unreadable answer: payload of 4 bytes is shorter than the 32-byte header"),
    (pl.encode_result(0, [], meta=[1]).data, "returned an unreadable answer: its meta is a list, not an object"),
], ids=["junk", "meta-list"])
def test_an_unreadable_warm_up_answer_fails_the_start_naming_the_task(output, said):
    """A PayloadError (or an AttributeError for a meta that is no object) left the warm-up as itself, a traceback
    naming neither the task nor the session."""
    from sut.flame.options import FlameOptions
    from sut.flame.warmup import Warmup

    rs = NS(replica=0, id="s0", endpoint="http://127.0.0.1:1", o=FlameOptions(), create_task=lambda data: "t-9",
            await_terminal=lambda task_id: (SUCCEED, output, None), check_bind_failures=lambda: None,
            executors=lambda: None)
    with pytest.raises(RunFailed, match=f"warm-up task t-9 of session s0 {said}"):
        Warmup(rs, 1, lambda meta: None).run()
