"""The dispatch core without engines: Dispatcher x routing x ledger over the FakeTransport test double."""

import logging
import time
from types import SimpleNamespace as QS

import numpy as np
import pytest
from transport_doubles import FakeOptions

from sut.core import guard
from sut.core.dispatcher import Dispatcher
from sut.core.routing import ROUTERS, AffinitySettings, make_router, model_revision
from sut.core.transport import TransportSpec, make_transport, transport_class
from sut.engine import GenerationSettings
from sut.errors import TransportError
from sut.ledger.sample import SampleLedger
from sut.ledger.streaming import StreamingLedger
from sut.messages import Completion, ReplicaRecord, Request


class Sink(list):
    def __call__(self, results):
        self.extend((sid, np.atleast_1d(np.asarray(ids)).tolist()) for sid, ids in results)


def _setup(policy="least_loaded", stream=False, chunk=3, gen=None, vocab_size=0, **opts):
    sink, firsts = Sink(), Sink()
    if stream:
        led = StreamingLedger((), progress=False, complete_fn=sink, first_fn=firsts)
    else:
        led = SampleLedger((), progress=False, complete_fn=sink)
    tr = make_transport("fake", TransportSpec(engine=None, generation=gen or GenerationSettings(max_tokens=opts.get("out_len", 4)),
                                              options=FakeOptions(**opts), stream=stream))
    d = Dispatcher(tr, make_router(policy, tr.replicas, 4), led, chunk=chunk, vocab_size=vocab_size)
    d.start()
    return led, d, tr, sink, firsts


def _issue(led, d, n, length=20):
    items = led.issue([QS(id=1000 + i, index=i) for i in range(n)])
    d.dispatch([Request(rid, (np.arange(length) + 7 * idx).astype(np.int32), idx) for rid, idx in items])


@pytest.mark.parametrize("policy", sorted(ROUTERS))
def test_every_request_answered_exactly_once_under_every_policy(policy):
    led, d, tr, sink, _ = _setup(policy)
    try:
        _issue(led, d, 25)
        assert led.idle.wait(10) and led.wait_sent(10)
        assert sorted(s for s, _ in sink) == list(range(1000, 1025)) and led.error is None
        assert sum(d.answered) == 25 and d.outstanding == 0
        st = d.stats()
        assert st["policy"] == policy and sum(st["routed"]) == 25
        if policy in ("round_robin", "least_loaded"):
            assert min(st["routed"]) >= 12  # both replicas used
    finally:
        tr.stop()


def test_a_duplicate_answer_fails_the_run_naming_the_request():
    led, d, tr, sink, _ = _setup(duplicate=0)
    try:
        _issue(led, d, 4)
        assert led.idle.wait(10)
        assert "answered twice" in led.error and "request 0" in led.error
        assert led.wait_sent(10) and len(sink) == 4  # the others still answered exactly once
    finally:
        tr.stop()


@pytest.mark.parametrize("gen, opts, error", [
    (GenerationSettings(max_tokens=4, ignore_eos=True), {"short_output": {2: 2}},
     "request 2 (QSL index 2, LoadGen sample 1002): replica {r} answered 2 generated ids, the generation settings "
     "ask for exactly 4 (not a complete answer): [24, 25]"),
    (GenerationSettings(max_tokens=4), {"out_len": 5}, "answered 5 generated ids, the generation settings ask for 1 to 4"),
    (GenerationSettings(max_tokens=4, min_tokens=3), {"short_output": {2: 2}}, "ask for 3 to 4"),
    (GenerationSettings(max_tokens=4), {"short_output": {2: 2}}, None),  # stopped at EOS: a complete answer
])
def test_an_answer_of_the_wrong_length_fails_the_run_naming_the_request(gen, opts, error):
    """A server that ends a stream early (the first chunk, then [DONE]) must not pass for a complete answer."""
    led, d, tr, sink, _ = _setup("round_robin", gen=gen, **opts)
    try:
        _issue(led, d, 4)
        assert led.idle.wait(10) and led.wait_sent(10) and sorted(s for s, _ in sink) == [1000, 1001, 1002, 1003]
        if error is None:
            assert led.error is None
        else:
            assert error.format(r=2 % tr.replicas) in led.error
    finally:
        tr.stop()


EOS, VOCAB = (128001, 128008, 128009), 128256
CUT = "request 2 (QSL index 2, LoadGen sample 1002): replica 0 answered"


@pytest.mark.parametrize("gen, answer, error", [
    (GenerationSettings(max_tokens=8, eos_token_ids=EOS), [11, 12, 13],
     f"{CUT} 3 ids, fewer than max_tokens 8, ending in 13, not an EOS id [128001, 128008, 128009] (an answer cut "
     "short): [11, 12, 13]"),
    (GenerationSettings(max_tokens=8, eos_token_ids=EOS), [11, 128009, 13], "ending in 13, not an EOS id"),
    (GenerationSettings(max_tokens=4, eos_token_ids=EOS), [11, 200000, 13, 14],
     f"{CUT} id 200000 at position 1 of 4, outside the model's vocabulary [0, 128256): [11, 200000, 13, 14]"),
    (GenerationSettings(max_tokens=8, eos_token_ids=EOS), [11, 12, VOCAB, 128009], f"{CUT} id 128256 at position 2"),
    (GenerationSettings(max_tokens=4, eos_token_ids=EOS), [11, -5, 13, 14], f"{CUT} id -5 at position 1 of 4"),
    (GenerationSettings(max_tokens=4, eos_token_ids=EOS), [11, 2 ** 31 - 1, 13, 14], "id 2147483647 at position 1"),
    (GenerationSettings(max_tokens=4, eos_token_ids=EOS), [11, 128009, 13, 14],
     f"{CUT} EOS id 128009 at position 1 of 4 ids, not at the end (the engine did not stop at an EOS id it was given)"),
    (GenerationSettings(max_tokens=8, eos_token_ids=EOS), [11, 128008], None),  # stopped at EOS
    (GenerationSettings(max_tokens=4, eos_token_ids=EOS), [11, 12, 13, VOCAB - 1], None),  # max_tokens: no EOS needed
    (GenerationSettings(max_tokens=4, ignore_eos=True, eos_token_ids=EOS), [11, 128009, 13, 14], None),
])
def test_an_answer_cut_short_or_outside_the_vocabulary_fails_the_run_naming_request_sample_and_replica(gen, answer,
                                                                                                      error):
    """The one answer check of every transport: before the ledger, so nothing of it reaches LoadGen."""
    led, d, tr, sink, _ = _setup("round_robin", gen=gen, vocab_size=VOCAB, out_len=gen.max_tokens,
                                 answers={2: answer})
    try:
        _issue(led, d, 4)
        assert led.idle.wait(10) and led.wait_sent(10) and sorted(s for s, _ in sink) == [1000, 1001, 1002, 1003]
        if error is None:
            assert led.error is None and dict(sink)[1002] == answer
        else:
            assert error in led.error and dict(sink)[1002] == []  # answered empty by the failure, never with the ids
    finally:
        tr.stop()


def test_a_streamed_first_token_outside_the_vocabulary_never_reaches_the_ledger():
    led, d, tr, sink, firsts = _setup("round_robin", stream=True, vocab_size=VOCAB, answers={1: [VOCAB + 5, 11, 12, 13]})
    try:
        _issue(led, d, 2)
        assert led.idle.wait(10) and led.wait_sent(10)
        assert led.error == ("request 1 (QSL index 1, LoadGen sample 1001): replica 1 streamed first token 128261, "
                             "outside the model's vocabulary [0, 128256)")
        assert (1001, [VOCAB + 5]) not in firsts and (1001, [None]) in firsts
    finally:
        tr.stop()


def test_the_answer_check_finds_the_bad_answer_and_position_in_a_batch():
    from sut.core.answers import AnswerCheck

    check = AnswerCheck(GenerationSettings(max_tokens=6, eos_token_ids=EOS), VOCAB)
    good = [np.array([5, 6, 128001], np.int32), np.arange(10, 16, dtype=np.int32)]
    assert check.fault([Completion(i, a) for i, a in enumerate(good)]) is None
    bad = np.array([7, 8, 9, 131072, 128009], np.int32)
    assert check.fault([Completion(i, a) for i, a in enumerate(good + [bad] + good)]) == (
        2, "answered id 131072 at position 3 of 5, outside the model's vocabulary [0, 128256): [7, 8, 9, 131072, 128009]")
    as_lists = [Completion(0, [5, 128009]), Completion(1, [1, 2, 3, 4, 5, -1])]  # not int32 arrays: checked the same
    assert check.fault(as_lists)[0] == 1
    long = np.r_[np.arange(20, 33), 128009].astype(np.int32)
    why = AnswerCheck(GenerationSettings(max_tokens=20, eos_token_ids=(2,)), VOCAB).fault([Completion(0, long)])[1]
    assert why.endswith("not an EOS id [2] (an answer cut short): [20, 21, 22, 23, 24, ... (4 more), 29, 30, 31, 32, 128009]")


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_a_request_id_twice_in_one_dispatch_fails_the_run_naming_it(policy):
    led, d, tr, sink, _ = _setup(policy)
    try:
        items = led.issue([QS(id=1000 + i, index=i) for i in range(3)])
        reqs = [Request(rid, (np.arange(20) + 7 * idx).astype(np.int32), idx) for rid, idx in items]
        d.dispatch(reqs + [reqs[1]])
        assert led.idle.wait(10)
        assert led.error == "dispatch refused: request id 1 came twice in one dispatch (ids must be unique)"
        assert led.wait_sent(10) and sorted(s for s, _ in sink) == [1000, 1001, 1002]  # each answered once (empty)
        assert d.outstanding == 0 and sum(d.stats()["routed"]) == 0  # nothing was routed or sent
    finally:
        tr.stop()


def test_a_request_id_still_outstanding_from_an_earlier_dispatch_fails_the_run_naming_it():
    led, d, tr, sink, _ = _setup("round_robin", step_s=0.2)
    try:
        items = led.issue([QS(id=1000 + i, index=i) for i in range(2)])
        reqs = [Request(rid, (np.arange(20) + 7 * idx).astype(np.int32), idx) for rid, idx in items]
        d.dispatch(reqs)
        d.dispatch(reqs[1:])
        assert led.idle.wait(10)
        assert led.error == "dispatch refused: request id 1 is still outstanding from an earlier dispatch"
        assert led.wait_sent(10) and sorted(s for s, _ in sink) == [1000, 1001]
    finally:
        tr.stop()


def test_an_answer_from_another_replica_fails_the_run_naming_both():
    led, d, tr, sink, _ = _setup("round_robin", wrong_replica=2)
    try:
        _issue(led, d, 4)
        assert led.idle.wait(10)
        assert led.error == "request 2 (QSL index 2, LoadGen sample 1002) was routed to replica 0 but answered by replica 1"
        assert led.wait_sent(10) and sorted(s for s, _ in sink) == [1000, 1001, 1002, 1003]
    finally:
        tr.stop()


def test_a_fatal_event_answers_every_outstanding_sample_empty():
    led, d, tr, sink, _ = _setup("round_robin", die_after={0: 1}, step_s=0.01)
    try:
        _issue(led, d, 10)
        assert led.idle.wait(10)
        assert led.error == "fake replica 0 died"
        assert led.wait_sent(10) and sorted(s for s, _ in sink) == list(range(1000, 1010))
        assert led.answered_empty + led.completed == 10 and led.answered_empty >= 4
    finally:
        tr.stop()


def test_a_transport_reports_one_fatal_event_quiet_after_stop_and_attach_then_refuses(caplog):
    """``Transport._report_fatal``: the first call sends, later ones and calls after ``stop`` do not (unless
    ``after_stop``); the log tail is logged once and the event names the log; ``attach`` refuses afterwards."""
    tr = make_transport("fake", TransportSpec(engine=None, generation=GenerationSettings(max_tokens=4), options=FakeOptions(replicas=1)))
    got = []
    tr.start(QS(on_fatal=got.append))
    try:
        tr.attach(QS(on_fatal=got.append))  # no failure yet: a later test may attach
        msg = "engine 0 died\n--- last lines of /x/engine-0.log ---\nTraceback boom\n--- end of /x/engine-0.log ---"
        assert tr._report_fatal(0, msg, tail_log=logging.getLogger("t")) is True
        assert tr._report_fatal(0, "second") is False
        sent = [(e.replica, "Traceback" in e.message, "/x/engine-0.log" in e.message) for e in got]
        assert sent == [(0, False, True)]
        assert caplog.text.count("Traceback boom") == 1 and tr.fatal_event is got[0]
        with pytest.raises(TransportError, match="a replica failed during an earlier test"):
            tr.attach(QS(on_fatal=got.append))
    finally:
        tr.stop()
    quiet = make_transport("fake", TransportSpec(engine=None, generation=GenerationSettings(max_tokens=4), options=FakeOptions(replicas=1)))
    quiet.start(QS(on_fatal=got.append))
    quiet.stop()
    assert quiet._report_fatal(0, "ended by stop") is False and len(got) == 1
    assert quiet._report_fatal(None, "close failed", after_stop=True) is True and got[-1].message == "close failed"


def test_two_fake_replicas_dying_at_once_send_one_fatal_event():
    opts = FakeOptions(die_after={0: 0, 1: 0})
    tr = make_transport("fake", TransportSpec(engine=None, generation=GenerationSettings(max_tokens=4), options=opts))
    got = []
    tr.start(QS(on_fatal=got.append))
    try:
        tr.submit(0, [Request(1, np.arange(4, dtype=np.int32))])
        tr.submit(1, [Request(2, np.arange(4, dtype=np.int32))])
        deadline = time.monotonic() + 5
        while not all(tr._dead) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(tr._dead) and len(got) == 1
    finally:
        tr.stop()


def test_submit_to_a_dead_replica_fails_the_run_after_waiting_for_the_transport_report():
    led, d, tr, sink, _ = _setup("round_robin")
    tr.stop()
    d.death_report_s = 0.2
    _issue(led, d, 2)
    assert led.error.startswith("dispatch failed: fake replica 0 is gone")
    assert led.wait_sent(10) and len(sink) == 2


def test_streaming_first_tokens_reach_the_ledger_and_the_least_pending_policy():
    led, d, tr, sink, firsts = _setup("least_pending", stream=True)
    try:
        _issue(led, d, 6)
        assert led.idle.wait(10) and led.wait_sent(10)
        assert led.error is None and len(firsts) == 6
        assert {sid: ids[0] for sid, ids in sink} == {sid: f[0] for sid, f in firsts}
        assert d.router.waiting_first == [0, 0] and d.router.inflight == [0, 0]
    finally:
        tr.stop()


def test_least_pending_scores_outstanding_plus_weighted_waiting():
    r = make_router("least_pending", 2, 128, AffinitySettings(first_token_weight=8))
    p = np.zeros(10, np.int32)
    assert [r.route(i, p) for i in range(2)] == [0, 1]
    r.first(0)  # replica 0: 1 outstanding, 0 waiting (score 1); replica 1: 1 + 8
    assert r.route(2, p) == 0  # scores 1 vs 9
    assert r.route(3, p) == 1  # replica 0 now 2 + 8 = 10 > 9
    r.done(1)
    assert r.route(4, p) == 1


@pytest.mark.parametrize("policy", sorted(ROUTERS))
def test_a_delivery_booked_at_once_routes_as_one_by_one(policy):
    """first_many / done_many (one re-key per replica a delivery) leave every policy where first / done one by one
    do: the same later routes; a request finished twice still raises."""
    rng = np.random.default_rng(3)
    one, many = (make_router(policy, 4, 128, AffinitySettings(first_token_weight=8)) for _ in range(2))
    prompts = [rng.integers(0, 1000, int(rng.integers(5, 300))).astype(np.int32) for _ in range(200)]
    routed: dict[int, list] = {}
    finished: list = []
    for rid, p in enumerate(prompts):
        r = one.route(rid, p)
        assert many.route(rid, p) == r
        routed.setdefault(r, []).append(rid)
        if rid % 7 == 6:  # a delivery: the first tokens of some of each replica's requests, the answers of others
            for rids in routed.values():
                half = rids[: len(rids) // 2]
                for x in half:
                    one.first(x)
                many.first_many(half)
                done, rids[:] = rids[len(rids) // 2:], []
                for x in done:
                    one.done(x)
                many.done_many(done)
                finished += done
    assert one.stats() == many.stats() and finished
    with pytest.raises(KeyError):
        many.done_many([finished[0], finished[0]])


def test_prefix_hash_depends_on_the_model_revision():
    p = np.arange(600, dtype=np.int32)
    a = make_router("prefix_affinity", 2, 16, AffinitySettings(model_revision="a"))
    b = make_router("prefix_affinity", 2, 16, AffinitySettings(model_revision="b"))
    a2 = make_router("prefix_affinity", 2, 16, AffinitySettings(model_revision="a"))
    assert a.keys(p) == a2.keys(p) and len(a.keys(p)) == 2
    assert not set(a.keys(p)) & set(b.keys(p))


def test_model_revision_is_the_config_hash(tmp_path):
    (tmp_path / "config.json").write_text('{"b": 1, "a": 2}')
    r1 = model_revision(tmp_path)
    (tmp_path / "config.json").write_text('{"a": 2, "b": 1}')
    assert model_revision(tmp_path) == r1 and len(r1) == 16
    (tmp_path / "config.json").write_text('{"a": 3, "b": 1}')
    assert model_revision(tmp_path) != r1


def test_the_guard_refuses_prefix_caching_on_or_unconfirmed():
    with pytest.raises(guard.PrefixCachingError, match="not allowed in an MLPerf run"):
        guard.check_settings(True, allowed=False)
    guard.check_settings(True, allowed=True)
    on, off, unknown = (ReplicaRecord(i, {"enable_prefix_caching": v}) for i, v in enumerate((True, False, None)))
    with pytest.raises(guard.PrefixCachingError, match="replica 0 reports enable_prefix_caching=True"):
        guard.check_replicas([off, on], allowed=False)
    with pytest.raises(guard.PrefixCachingError, match="replica 2: prefix caching could not be confirmed off"):
        guard.check_replicas([off, unknown], allowed=False)
    assert guard.check_replicas([off, unknown], allowed=False, allow_unconfirmed=True) == [2]
    assert guard.check_replicas([on, unknown], allowed=True) == []


def test_completions_unpack_like_pairs_for_the_ledger():
    c = Completion(5, np.array([1, 2], np.int32), cached_tokens=3)
    rid, ids, *_ = c
    assert rid == 5 and ids.tolist() == [1, 2] and c.t_first is None


def test_unknown_transport_lists_the_known_ones():
    with pytest.raises(KeyError, match="unknown transport 'nope'; known: .*flame.*http.*local"):
        transport_class("nope")


def _ctx(scenario="Offline", prefix_caching=False, **opts):
    from types import SimpleNamespace as NS

    from sut.base import SUTContext

    ds = NS(prompts=[(np.arange(20) + i).astype(np.int32) for i in range(8)], path="/nonexistent.json")
    return SUTContext(dataset=ds, engine=NS(enable_prefix_caching=prefix_caching),
                      generation=GenerationSettings(max_tokens=opts.get("out_len", 4)), options=FakeOptions(**opts),
                      progress=False, scenario=scenario)


class FakeSUT:
    """A TransportSUT over the fake transport (built lazily so the import order stays the product's)."""

    def __new__(cls, ctx):
        from sut.core.loadgen_sut import TransportSUT

        sub = type("FakeTransportSUT", (TransportSUT,), {"transport_name": "fake", "name": "fake"})
        return sub(ctx)


def test_transport_sut_answers_loadgen_samples_and_records_routing():
    sut = FakeSUT(_ctx())
    sink = Sink()
    sut.ledger._complete_fn = sink
    rec = sut.start()
    try:
        assert [e["device"]["uuid"] for e in rec["engines"]] == ["FAKE-0", "FAKE-1"]
        sut.issue_queries([QS(id=50 + i, index=i % 8) for i in range(12)])
        sut.flush_queries()
        assert sut.ledger.idle.wait(10) and sut.ledger.wait_sent(10)
        assert sorted(s for s, _ in sink) == list(range(50, 62)) and sut.ledger.error is None
    finally:
        sut.stop()
    r = sut.record()
    assert r["routing"]["policy"] == "least_loaded" and sum(r["routing"]["answered"]) == 12 and r["transport"] == "fake"


def test_transport_sut_picks_least_pending_for_streaming_scenarios():
    assert FakeSUT(_ctx("Server")).policy == "least_pending"
    assert FakeSUT(_ctx("Interactive")).policy == "least_pending"


def test_transport_sut_refuses_prefix_caching_before_and_after_start():
    from sut.errors import RunFailed

    with pytest.raises(RunFailed, match="not allowed in an MLPerf run"):
        FakeSUT(_ctx(prefix_caching=True))
    sut = FakeSUT(_ctx(prefix_caching_on=True))  # the engines say so although the settings did not ask
    try:
        with pytest.raises(RunFailed, match="replica 0 reports enable_prefix_caching=True"):
            sut.start()
    finally:
        sut.stop()


def test_a_first_token_from_another_replica_fails_the_run():
    led, d, tr, sink, firsts = _setup("round_robin", stream=True)
    try:
        items = led.issue([QS(id=1, index=0)])
        with d._lock:  # routed to replica 0 without sending it
            d._where[items[0][0]] = 0
            d.router.route(items[0][0], np.zeros(20, np.int32))
        from sut.messages import FirstToken

        d.on_first(1, [FirstToken(items[0][0], 5)])
        assert led.error == ("first token of request 0 (QSL index 0, LoadGen sample 1) was routed to replica 0 but "
                             "came from replica 1")
        assert led.wait_sent(10) and firsts == [(1, [None])]  # not 5: only the empty first token of the failure answer
    finally:
        tr.stop()


def test_transport_sut_refuses_a_second_start_and_answers_samples_issued_after_stop():
    sut = FakeSUT(_ctx())
    sink = Sink()
    sut.ledger._complete_fn = sink
    sut.start()
    with pytest.raises(RuntimeError, match="called twice"):
        sut.start()
    sut.stop()
    sut.issue_queries([QS(id=7, index=0)])
    assert "issue_queries after stop" in sut.ledger.error
    assert sut.ledger.wait_sent(10) and [s for s, _ in sink] == [7] and sut.ledger.outstanding == 0


@pytest.mark.parametrize("name", ["vllm", "vllm-http", "flame"])
def test_every_backend_checks_answers_with_the_models_eos_ids_and_vocabulary(name):
    """In-process engines, HTTP and Flame share the dispatcher's one answer check, fed from the run's context."""
    from types import SimpleNamespace as NS

    from sut.base import SUTContext, get_sut
    from sut.engine import EngineSettings

    ds = NS(prompts=[np.arange(20, dtype=np.int32)], path="/nonexistent.json")
    ctx = SUTContext(dataset=ds, engine=EngineSettings(model="m", device="cpu"), progress=False, vocab_size=VOCAB,
                     generation=GenerationSettings(max_tokens=7, eos_token_ids=EOS))
    sut = get_sut(name)(ctx)
    try:
        check = sut.dispatcher.check
        assert (check.vocab_size, check.max_tokens, check._eos_set) == (VOCAB, 7, frozenset(EOS))
    finally:
        sut.stop()


def test_the_answer_check_over_a_batch_names_the_first_fault_of_each_rule_as_a_scan_would():
    """The batch form of the answer check (numpy passes over one Answers) against the rules applied one answer at a
    time, over random batches with per-request max_tokens: same answer refused, for the same rule."""
    from sut.core.answers import AnswerCheck

    rng = np.random.default_rng(5)
    gen = GenerationSettings(max_tokens=6, min_tokens=2, eos_token_ids=EOS)
    check = AnswerCheck(gen, VOCAB)

    def scan(arrays, asked):
        for i, a in enumerate(arrays):
            lo, hi = gen.lengths_for(asked[i])
            if not lo <= len(a) <= hi:
                return i, "generated ids, the generation settings ask for"
        for i, a in enumerate(arrays):
            if (a >= VOCAB).any():
                return i, "outside the model's vocabulary"
        for i, a in enumerate(arrays):
            if len(a) < (asked[i] or 6) and a[-1] not in EOS:
                return i, "an answer cut short"
        return None

    for _ in range(400):
        n = int(rng.integers(1, 6))
        asked = [int(rng.choice([0, 0, 3, 6])) for _ in range(n)]
        arrays = []
        for own in asked:
            a = rng.integers(10, 20, int(rng.integers(1, 8))).astype(np.int32)
            if rng.random() < 0.5:
                a[-1] = EOS[0]
            if rng.random() < 0.05:
                a[0] = VOCAB + 1
            arrays.append(a)
        got = check.fault([Completion(i, a) for i, a in enumerate(arrays)], asked)
        want = scan(arrays, asked)
        assert (got is None) == (want is None) and (got is None or (got[0] == want[0] and want[1] in got[1])), \
            (arrays, asked, got, want)


def test_the_dispatch_thread_sends_what_waits_in_its_inbox_as_one_dispatch_in_order():
    """Queries LoadGen issued while the last dispatch ran go out together (one routing pass, one submit per replica);
    a flush still comes after the requests queued before it."""
    from sut.core.loadgen_sut import _FLUSH

    sut = FakeSUT(_ctx())
    calls = []
    sut.dispatcher.dispatch = lambda items: calls.append([r.rid for r in items])
    sut.dispatcher.flush = lambda: calls.append("flush")
    for item in ([Request(1, None)], [Request(2, None)], [Request(3, None)], _FLUSH, [Request(4, None)], None):
        sut._inbox.put(item)
    sut._dispatch_loop()  # returns at the None
    assert calls == [[1, 2, 3], "flush", [4]]
