"""The ``local`` transport (``sut.core.transports.local``) and the engine worker's typed pipe.

Fast tests run the real worker, pipe, handle and transport in spawned processes with the stand-in
``vllm`` of ``tests/vllm_standin.py`` (deterministic tokens, prefix-cache hits, a child process in
the worker's group); the slow one runs the real vLLM on CPU with the tiny dummy-weight model.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import vllm_standin
from conftest import TINY_MODEL, process_ended

from sut.core.transport import TransportSpec, make_transport
from sut.engine import EngineSettings, GenerationSettings
from sut.engine import messages as wm
from sut.engine.handle import OOM_HINT
from sut.errors import EngineError, TransportError
from sut.messages import Completion, FatalEvent, FirstToken, ReplicaRecord, Request

pytestmark = pytest.mark.timeout(120)
OUT_LEN = 4


class Sink:
    """A ``ResultSink`` that keeps every delivery in order."""

    def __init__(self):
        self.events: list = []
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)

    def _add(self, ev):
        with self.cond:
            self.events.append(ev)
            self.cond.notify_all()

    def on_first(self, replica, firsts):
        for f in firsts:
            self._add(("first", replica, f))

    def on_results(self, replica, results):
        for c in results:
            self._add(("done", replica, c))

    def on_fatal(self, event):
        self._add(("fatal", event.replica, event))

    def wait(self, pred, timeout=30.0):
        with self.cond:
            assert self.cond.wait_for(lambda: pred(self.events), timeout), self.events
            return list(self.events)

    def of(self, kind):
        return [e for e in self.events if e[0] == kind]


def _done_count(n):
    return lambda evs: sum(e[0] == "done" for e in evs) >= n


@pytest.fixture
def standin(tmp_path, monkeypatch):
    vllm_standin.install(tmp_path / "standin", monkeypatch)
    pids = tmp_path / "child-pids"
    monkeypatch.setenv("STANDIN_CHILD_PIDS", str(pids))
    return pids


def _transport(engines=1, stream=False, detail=False, **kw):
    es = EngineSettings(model=str(TINY_MODEL), device="cpu", engines_per_device=engines, max_model_len=512)
    spec = TransportSpec(engine=es, generation=GenerationSettings(max_tokens=OUT_LEN), stream=stream, detail=detail, **kw)
    return make_transport("local", spec)


def _requests(rids, length=20):
    return [Request(rid, (np.arange(length) + 3 * (rid % 2)).astype(np.int32), rid) for rid in rids]


def _expected(req):
    return ((int(req.prompt[0]) + np.arange(OUT_LEN)) % 1000 + 10).tolist()


def _gone(pids, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(process_ended(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


# --------------------------------------------------------------------------- start / submit / results
def test_streaming_replicas_give_first_tokens_then_typed_completions(standin):
    t, sink = _transport(engines=2, stream=True), Sink()
    try:
        records = t.start(sink)
        assert [type(r) for r in records] == [ReplicaRecord, ReplicaRecord] and [r.index for r in records] == [0, 1]
        assert all(r.enable_prefix_caching is False and r.info["device"]["kind"] == "cpu" for r in records)
        assert records[0].info["engine_args"]["model"] == str(TINY_MODEL) and records[0].info["pid"] != os.getpid()
        reqs = _requests(range(6))
        t.submit(0, reqs[:4])  # rids 0 and 2 share their first 16 ids, as do 1 and 3: prefix-cache hits
        t.submit(1, reqs[4:])
        events = sink.wait(_done_count(6))
    finally:
        t.stop()
    assert not sink.of("fatal")
    by_rid = {}
    for kind, replica, item in events:
        assert type(item) is (FirstToken if kind == "first" else Completion)
        by_rid.setdefault(item.rid, []).append((kind, replica, item))
    for req in reqs:
        (k1, r1, first), (k2, r2, c) = by_rid[req.rid]  # exactly one first token, then one completion
        assert (k1, k2) == ("first", "done") and r1 == r2 == (0 if req.rid < 4 else 1)
        assert c.token_ids.dtype == np.int32 and c.token_ids.tolist() == _expected(req)
        assert first.token_id == c.token_ids[0]
        assert isinstance(c.cached_tokens, int) and c.t_queued <= c.t_first <= c.t_done
    assert [by_rid[r][1][2].cached_tokens for r in range(6)] == [0, 0, 16, 16, 0, 0]
    st = t.stats()
    assert [e["samples"] for e in st["engines"]] == [4, 2] and st["dispatch_chunk"] == 512
    assert [e["engine"] for e in st["engines"]] == [0, 1]


def test_offline_completions_carry_queue_and_done_times_but_no_first_token(standin):
    t, sink = _transport(), Sink()
    try:
        t.start(sink)
        t.submit(0, _requests(range(3)))
        events = sink.wait(_done_count(3))
    finally:
        t.stop()
    assert [e[0] for e in events] == ["done"] * 3
    for _, _, c in events:
        assert c.t_first is None and c.t_queued <= c.t_done and c.cached_tokens in (0, 16)


def test_detail_times_first_tokens_without_reporting_them(standin):
    t, sink = _transport(detail=True), Sink()
    try:
        t.start(sink)
        t.submit(0, _requests([7]))
        ((kind, _, c),) = sink.wait(_done_count(1))
    finally:
        t.stop()
    assert kind == "done" and c.t_queued <= c.t_first <= c.t_done


def test_raw_generate_answers_completions_on_an_idle_engine(standin):
    t = _transport()
    try:
        t.start(Sink())
        e = t.pool.engines[0]
        e.raw_generate_start([(r.rid, r.prompt) for r in _requests([1, 2])])
        secs, res = e.raw_generate_result(timeout=30)
    finally:
        t.stop()
    assert secs >= 0 and [type(c) for c in res] == [Completion, Completion]
    assert [(c.rid, c.token_ids.tolist()) for c in res] == [(r.rid, _expected(r)) for r in _requests([1, 2])]


# --------------------------------------------------------------------------- failures and stop
def test_a_killed_worker_is_one_fatal_event_naming_its_replica_and_stop_leaves_no_process(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_STEP_S", "0.05")  # slow steps: requests are still running when it dies
    t, sink = _transport(engines=2), Sink()
    try:
        t.start(sink)
        workers = [e.pid for e in t.pool.engines]
        children = [int(x) for x in standin.read_text().split()]
        assert len(children) == 2 and all(not process_ended(p) for p in workers + children)
        t.submit(1, _requests(range(100, 140)))
        os.kill(workers[1], signal.SIGKILL)
        sink.wait(lambda evs: any(e[0] == "fatal" for e in evs))
        time.sleep(0.5)  # a second report would arrive now
        (fatal,) = sink.of("fatal")
        ev = fatal[2]
        assert type(ev) is FatalEvent and ev.replica == 1
        assert f"engine 1 (pid {workers[1]}) exited unexpectedly" in ev.message
        with pytest.raises(TransportError, match="engine 1 is gone"):
            t.submit(1, _requests([999]))
    finally:
        t.stop()
    assert _gone(workers + children), [p for p in workers + children if not process_ended(p)]
    t.stop()  # twice is fine


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_loses_is_a_fatal_event_at_once(standin, monkeypatch, stream):
    """The engine's second finished request (rid 1) never comes back: the replica fails naming it within seconds
    (it otherwise waited for the run's stall limit), in Offline's and the streaming modes."""
    monkeypatch.setenv("STANDIN_FAULT", "drop")
    t, sink = _transport(stream=stream), Sink()
    try:
        t.start(sink)
        t.submit(0, _requests([0]))
        sink.wait(_done_count(1))
        t0 = time.monotonic()
        t.submit(0, _requests([1]))
        sink.wait(lambda evs: any(e[0] == "fatal" for e in evs), timeout=20)
        assert time.monotonic() - t0 < 10
    finally:
        t.stop()
    (fatal,) = sink.of("fatal")
    assert fatal[2].replica == 0 and "Traceback" not in fatal[2].message
    assert "engine 0 failed: the engine is idle but never finished 1 request(s) it was given (request ids 1)" \
        in fatal[2].message
    assert [e[2].rid for e in sink.of("done")] == [0]


def test_a_request_id_given_again_while_it_runs_is_a_fatal_event(standin, monkeypatch):
    """vLLM runs two requests under one id (it adds its own suffix): the worker refuses the second, since the two
    answers could not be told apart; after the first finished, the id may come again."""
    monkeypatch.setenv("STANDIN_STEP_S", "0.05")  # rid 3 still runs when it comes again
    t, sink = _transport(), Sink()
    try:
        t.start(sink)
        t.submit(0, _requests([3]))
        sink.wait(_done_count(1))
        t.submit(0, _requests([3]))  # finished: fine
        t.submit(0, _requests([3]))  # still running: refused
        sink.wait(lambda evs: any(e[0] == "fatal" for e in evs), timeout=20)
    finally:
        t.stop()
    (fatal,) = sink.of("fatal")
    assert "engine 0 failed: request 3 was given again while it still runs here" in fatal[2].message
    assert [e[2].rid for e in sink.of("done")] == [3]


def _engine_killed_after_last_words(tmp_path, kill):
    """Start one engine logging to ``tmp_path``, append a line to its log, ``kill(transport, pid)``; returns
    ``(transport, pid, the fatal event, the log file)`` once the transport reported the loss (it is stopped)."""
    t, sink = _transport(log_dir=str(tmp_path)), Sink()
    log_file = tmp_path / "engine-0.log"
    try:
        t.start(sink)
        pid = t.pool.engines[0].pid
        with open(log_file, "a") as fh:
            fh.write("the worker's last words\n")
        kill(t, pid)
        (fatal,) = sink.wait(lambda evs: any(e[0] == "fatal" for e in evs))
    finally:
        t.stop()
    return t, pid, fatal[2], log_file


def test_a_dead_engines_log_tail_is_logged_once_and_the_fatal_event_names_the_log(standin, tmp_path, caplog):
    _, pid, fatal, log_file = _engine_killed_after_last_words(tmp_path, lambda t, pid: os.kill(pid, signal.SIGKILL))
    msg = fatal.message
    assert msg == (f"engine 0 (pid {pid}) exited unexpectedly with code -9 (SIGKILL) (the last lines of its log are "
                   f"above; all of it: {log_file}){OOM_HINT}")
    logged = [r.getMessage() for r in caplog.records if "last words" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith(
        f"engine 0 (pid {pid}) exited unexpectedly with code -9 (SIGKILL)\n--- last lines of {log_file} ---\n")
    assert "the worker's last words" in log_file.read_text()


def test_a_planned_kill_is_reported_without_the_log_tail(standin, tmp_path, caplog):
    """replica-loss kills a replica on purpose (``sut.locality.failover.kill_replica`` marks it planned): its loss
    names the log, and nothing of the log reaches the console."""
    from sut.locality.failover import kill_replica

    how = []
    t, pid, fatal, log_file = _engine_killed_after_last_words(tmp_path, lambda t, pid: how.append(kill_replica(t, 0)))
    assert how == [f"SIGKILL to pid {pid} (replica 0's engine process)"] and t.planned_losses == {0}
    assert fatal.message == (f"engine 0 (pid {pid}) exited unexpectedly with code -9 (SIGKILL) (its log: {log_file})"
                             f"{OOM_HINT}")
    assert not [r for r in caplog.records if "last words" in r.getMessage() or "last lines of" in r.getMessage()]


def test_stop_is_prompt_even_when_the_engine_is_slow_to_shut_down_and_leaves_no_process(standin, monkeypatch):
    monkeypatch.setenv("STANDIN_SHUTDOWN_S", "5")  # releasing the LLM: 5 s, the interpreter's exit: 5 s more
    t, sink = _transport(engines=2), Sink()
    try:
        t.start(sink)
        t.submit(0, _requests([1, 2]))
        sink.wait(_done_count(2))
        pids = [e.pid for e in t.pool.engines] + [int(x) for x in standin.read_text().split()]
        t0 = time.monotonic()
        t.stop()
        took = time.monotonic() - t0
    finally:
        t.stop()
    assert took < 3.0, f"stop took {took:.1f} s"
    assert _gone(pids, timeout=0.5), [p for p in pids if not process_ended(p)]


def test_a_worker_that_fails_to_start_leaves_nothing_running(standin, tmp_path):
    t = _transport(engines=2, log_dir=str(tmp_path))
    t.pool.engines[1].gen = None  # engine 1's worker raises after LLM(...) started its child process
    with pytest.raises(TransportError, match="engine 1 failed to start"):
        t.start(Sink())
    children = [int(x) for x in standin.read_text().split()]
    assert len(children) >= 1 and _gone([e.pid for e in t.pool.engines if e.pid] + children)
    assert "AttributeError" in (tmp_path / "engine-1.log").read_text()


def _wait_for_children(pid_file, n=1, timeout=30.0):
    """The stand-in's child pids once ``n`` workers are inside ``LLM.__init__`` (building their engine)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pids = [int(x) for x in pid_file.read_text().split()] if pid_file.exists() else []
        if len(pids) >= n:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"no worker reached LLM.__init__ within {timeout:.0f} s")


@pytest.mark.timeout(300)
def test_ctrl_c_during_engine_start_ends_the_starting_workers_at_once(standin, monkeypatch, caplog):
    """Ctrl-C / SIGTERM (the harness turns it into KeyboardInterrupt) while the engines are still being built:
    a starting worker reads no Stop and ignores SIGTERM, so waiting for it took 40 s (Stop: 30 s, SIGTERM: 10 s)."""
    monkeypatch.setenv("STANDIN_START_S", "600")
    t = _transport(engines=2)
    main = threading.get_ident()
    took = []

    def interrupt():  # Ctrl-C even when the workers are slow to get there: a test that fails, never one that hangs
        try:
            children = _wait_for_children(standin, n=2, timeout=100.0)
        except AssertionError as e:
            children = [str(e)]
        took.append((time.monotonic(), children))
        signal.pthread_kill(main, signal.SIGINT)

    # Ctrl-C must raise here even when the suite runs in the background (SIGINT inherited as ignored);
    # tests/conftest.py restores the handler afterwards
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        with caplog.at_level("WARNING", logger="sut.engine.handle"), pytest.raises(KeyboardInterrupt):
            t.start(Sink())
        t0, children = took[0]
        took = time.monotonic() - t0
        assert all(isinstance(c, int) for c in children), children
        pids = [e.pid for e in t.pool.engines] + children
    finally:
        t.stop()
    assert took < 6.0, f"stopping 2 starting engines took {took:.1f} s"
    assert _gone(pids, timeout=1.0), [p for p in pids if not process_ended(p)]
    said = [r.getMessage() for r in caplog.records if "is still starting: ending it now" in r.getMessage()]
    assert len(said) == 2, said


def test_a_starting_worker_in_its_parents_process_group_is_ended_at_once(standin, monkeypatch, caplog):
    """The Flame service's engine (``own_process_group=False``): SIGTERM to the worker only, then SIGKILL."""
    from sut.engine import EngineHandle, plan_engines

    monkeypatch.setenv("STANDIN_START_S", "600")
    es = EngineSettings(model=str(TINY_MODEL), device="cpu", max_model_len=512)
    h = EngineHandle(plan_engines(es)[0], es, GenerationSettings(max_tokens=OUT_LEN), own_process_group=False)
    h.start()
    children = []
    try:
        children = _wait_for_children(standin)
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="sut.engine.handle"):
            h.shutdown()
        took = time.monotonic() - t0
        assert took < 5.0, f"stopping a starting engine took {took:.1f} s"
        assert process_ended(h.pid) and any("is still starting" in r.getMessage() for r in caplog.records)
    finally:
        h.shutdown()
        for pid in children:  # in this process's group: Flame's executor manager ends it in production
            os.kill(pid, signal.SIGKILL)


def test_raw_generate_refuses_outputs_that_come_back_in_another_order(standin_here):
    """``LLM.generate`` returns its outputs in input order; outputs that came back in another order would give each
    request another prompt's answer: refused, naming the first such request. In order, every one is answered."""
    from sut.engine.worker import raw_generate

    class Llm:
        llm_engine = SimpleNamespace(has_unfinished_requests=lambda: False)

        def __init__(self, reverse):
            self.reverse = reverse

        def generate(self, prompts, params, use_tqdm=False):
            outs = [SimpleNamespace(prompt_token_ids=list(p["prompt_token_ids"]), num_cached_tokens=0,
                                    outputs=[SimpleNamespace(token_ids=[p["prompt_token_ids"][0]])]) for p in prompts]
            return outs[::-1] if self.reverse else outs

    batch = [(r.rid, r.prompt) for r in _requests([1, 2])]
    _, res = raw_generate(Llm(False), None, batch)
    assert [(c.rid, c.token_ids.tolist()) for c in res] == [(1, [3]), (2, [0])]
    with pytest.raises(EngineError, match="raw generate: the output for request 1 answers another prompt"):
        raw_generate(Llm(True), None, batch)


# --------------------------------------------------------------------------- the typed pipe
class FakeConn:
    """The worker's end of the pipe, scripted: ``inbox`` is read in order, ``sent`` collects."""

    def __init__(self, inbox):
        self.inbox, self.sent = list(inbox), []

    def poll(self, timeout=None):
        return bool(self.inbox)

    def recv(self):
        return self.inbox.pop(0)

    def send(self, msg):
        self.sent.append(msg)


@pytest.fixture
def standin_here(standin):
    """The stand-in ``vllm`` imported into this process; taken out of ``sys.modules`` afterwards."""
    import importlib
    import sys

    before = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in before:
        del sys.modules[k]
    yield importlib.import_module("vllm")
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        del sys.modules[k]
    sys.modules.update(before)


def test_serve_speaks_typed_messages_whatever_the_mode(standin_here):
    vllm = standin_here
    from sut.engine.worker import serve

    for stream in (False, True):
        llm = vllm.LLM(model="m", max_model_len=64, max_num_seqs=4, enable_prefix_caching=False)
        params = GenerationSettings(max_tokens=2).sampling_params()
        reqs = _requests([1, 2])
        conn = FakeConn([wm.Generate(reqs), wm.StatsQuery()])
        orig_step = llm.llm_engine.step

        def step(engine=llm.llm_engine, orig=orig_step):  # stop once both requests are done
            outs = orig()
            if not engine.has_unfinished_requests():
                conn.inbox.extend([wm.ResetCache(), wm.Stop()])
            return outs

        llm.llm_engine.step = step
        serve(conn, llm.llm_engine, params, stats_fn=lambda: {"collections": 0}, llm=llm, stream=stream)
        kinds = [type(m) for m in conn.sent]
        assert kinds[0] is wm.Stats and kinds[-1] is wm.Stats and conn.sent[-1].stats == {"reset_prefix_cache": True}
        done = [c for m in conn.sent if type(m) is wm.Done for c in m.completions]
        firsts = [f for m in conn.sent if type(m) is wm.Firsts for f in m.firsts]
        assert sorted(c.rid for c in done) == [1, 2] and all(type(c) is Completion for c in done)
        assert (len(firsts) == 2) is stream and all(type(f) is FirstToken for f in firsts)
        assert kinds.index(wm.Done) > (kinds.index(wm.Firsts) if stream else 0)
    with pytest.raises(Exception, match="unknown message"):
        serve(FakeConn([("gen", [])]), llm.llm_engine, params)


class StepCountingEngine:
    """An engine whose requests each run ``steps`` steps, then finish with one token; records the step index at
    which each request was added."""

    def __init__(self, steps=5):
        self.steps, self.left, self.added_at, self.n = steps, {}, {}, 0  # steps: int, or {request id: steps}
        self.prompts = {}

    def has_unfinished_requests(self):
        return bool(self.left)

    def get_num_unfinished_requests(self):
        return len(self.left)

    def add_request(self, rid, prompt, params):
        self.left[rid] = self.steps[int(rid)] if isinstance(self.steps, dict) else self.steps
        self.added_at[int(rid)] = self.n
        self.prompts[rid] = prompt["prompt_token_ids"]

    def step(self):
        self.n += 1
        ended = [r for r, k in self.left.items() if k <= 1]
        self.left = {r: k - 1 for r, k in self.left.items() if k > 1}
        return [SimpleNamespace(request_id=r, prompt_token_ids=self.prompts.pop(r), finished=True,
                                outputs=[SimpleNamespace(token_ids=[7])], num_cached_tokens=0) for r in ended]


@pytest.mark.parametrize("admit_every, added_at", [
    (1, {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 7: 7}),
    (3, {0: 0, 1: 3, 2: 3, 3: 3, 4: 6, 5: 6, 6: 6, 7: 9}),
])
def test_serve_admits_new_requests_every_n_steps_while_busy_and_at_once_when_idle(admit_every, added_at):
    """One request arrives per engine step (each runs 5 steps): every step, or in groups every ``admit_every``
    steps; a Stop is read at the next intake too. After the engine drained, a late request is admitted at once."""
    from sut.engine.worker import serve

    engine = StepCountingEngine()
    conn = FakeConn([wm.Generate(_requests([0]))])
    arrivals, sent = iter(range(1, 8)), []  # sent: the late request, then Stop
    orig = engine.step

    def step():
        out = orig()
        rid = next(arrivals, None)
        if rid is not None:
            conn.inbox.append(wm.Generate(_requests([rid])))
        elif not engine.left and not sent:  # drained: a late request; Stop once it was added
            sent.append(wm.Generate(_requests([100])))
            conn.inbox.append(sent[-1])
        elif 100 in engine.added_at and len(sent) == 1:
            sent.append(wm.Stop())
            conn.inbox.append(sent[-1])
        return out

    engine.step = step
    serve(conn, engine, GenerationSettings(max_tokens=2).sampling_params(), admit_every=admit_every)
    late_at = engine.added_at.pop(100)
    assert engine.added_at == added_at
    assert late_at == max(added_at.values()) + 5  # the step after the last request finished: no wait


def test_serve_holds_requests_beyond_the_free_slots_and_adds_them_only_every_n_steps():
    """admit_every 2, 2 slots, 4 requests at once (running 2, 6, 1 and 5 steps): two go in at once; r2 takes the slot
    r0 freed at the admission step after it (2); r3 waits for the next admission step (4) although r2's slot was free
    after step 3: vLLM's own queue would have filled it the step it freed. Without a cap every request goes in at
    once."""
    from sut.engine.worker import serve

    for slots, added_at in ((2, {0: 0, 1: 0, 2: 2, 3: 4}), (None, {0: 0, 1: 0, 2: 0, 3: 0})):
        engine = StepCountingEngine(steps={0: 2, 1: 6, 2: 1, 3: 5})
        conn = FakeConn([wm.Generate(_requests([0, 1, 2, 3]))])
        orig, peak = engine.step, []

        def step(orig=orig, engine=engine, conn=conn, peak=peak):
            peak.append(len(engine.left))
            out = orig()
            if not engine.left and len(engine.added_at) == 4:
                conn.inbox.append(wm.Stop())
            return out

        engine.step = step
        serve(conn, engine, GenerationSettings(max_tokens=2).sampling_params(), admit_every=2, slots=slots)
        assert engine.added_at == added_at, slots
        assert max(peak) == (slots or 4)


def _scripted(engine, conn, at: dict):
    """``engine.step`` that appends ``at[n]`` (a message) to ``conn``'s inbox after step n."""
    orig = engine.step

    def step():
        out = orig()
        if engine.n in at:
            conn.inbox.append(at.pop(engine.n))
        return out

    engine.step = step


def test_a_stats_query_alone_is_no_admission_step():
    """admit every 2: a stats query read at the due step 2 does not restart the count, so r1, arriving after step
    3, goes in before step 4 (a restart would have held it one step more)."""
    from sut.engine.worker import serve

    engine = StepCountingEngine(steps=6)
    conn = FakeConn([wm.Generate(_requests([0]))])
    _scripted(engine, conn, {2: wm.StatsQuery(), 3: wm.Generate(_requests([1])), 5: wm.Stop()})
    serve(conn, engine, GenerationSettings(max_tokens=2).sampling_params(), stats_fn=lambda: {}, admit_every=2,
          slots=4)
    assert engine.added_at == {0: 0, 1: 3} and any(type(m) is wm.Stats for m in conn.sent)


def test_a_held_requests_queue_time_starts_when_the_worker_received_it():
    """1 slot, admit every 2: r1 arrives after step 3 while r0 holds the slot, waits in the worker and goes in when
    r0 finished (step 4); its ``t_queued`` stamp is its arrival (103), as if it had waited in vLLM's own queue."""
    from sut.engine import outputs
    from sut.engine.worker import serve

    engine = StepCountingEngine(steps={0: 4, 1: 6})
    conn = FakeConn([wm.Generate(_requests([0]))])
    _scripted(engine, conn, {3: wm.Generate(_requests([1])), 6: wm.Stop()})
    made = []

    class Recorded(outputs.FinalCollector):
        def __init__(self):
            super().__init__()
            made.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sut.engine.worker.time.monotonic", lambda: 100.0 + engine.n)
        mp.setattr("sut.engine.worker.FinalCollector", Recorded)
        serve(conn, engine, GenerationSettings(max_tokens=2).sampling_params(), admit_every=2, slots=1)
    assert engine.added_at == {0: 0, 1: 4}
    assert made[0].t_add == {"1": 103.0}  # r0 finished (its stamp went into its Completion), r1 still runs
    (done,) = [m for m in conn.sent if type(m) is wm.Done]
    assert [(c.rid, c.t_queued) for c in done.completions] == [(0, 100.0)]


def test_worker_messages_pickle_about_as_small_as_plain_tuples():
    """A typed batch costs its class reference once, not a name per item."""
    comps = [Completion(i, np.arange(128, dtype=np.int32) + i, 0, 1.0 + i, 2.0 + i, 3.0 + i) for i in range(256)]
    a = len(pickle.dumps(wm.Done(comps), -1))
    b = len(pickle.dumps(("done", [tuple(c) for c in comps]), -1))
    assert a < 1.02 * b, (a, b)
    back = pickle.loads(pickle.dumps(wm.Done(comps), -1))
    assert type(back) is wm.Done and type(back.completions[0]) is Completion and back.completions[5].rid == 5


# --------------------------------------------------------------------------- the real engine
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_cpu_engine_admitting_every_2nd_step_into_2_slots_answers_every_request(tmp_path):
    """The worker's held requests and slot cap on a real vLLM engine (``get_num_unfinished_requests``): 7 requests
    at once into 2 slots, each answered once with its 8 tokens."""
    es = EngineSettings(model=str(TINY_MODEL), dtype="float32", load_format="dummy", enforce_eager=True, device="cpu",
                        max_model_len=512, max_num_seqs=2, max_num_batched_tokens=512, admit_every_steps=2)
    t = make_transport("local", TransportSpec(engine=es, generation=GenerationSettings(max_tokens=8, ignore_eos=True),
                                              stream=True, log_dir=str(tmp_path)))
    sink = Sink()
    try:
        t.start(sink)
        t.submit(0, [Request(i, (np.arange(30) * (i + 1) % 1000).astype(np.int32), i) for i in range(7)])
        events = sink.wait(_done_count(7), timeout=300)
    finally:
        t.stop()
    done = [c for k, _, c in events if k == "done"]
    assert sorted(c.rid for c in done) == list(range(7)) and all(len(c.token_ids) == 8 for c in done)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_cpu_engine_streams_first_tokens_and_completions_with_cached_tokens(tmp_path):
    es = EngineSettings(model=str(TINY_MODEL), dtype="float32", load_format="dummy", enforce_eager=True, device="cpu",
                        max_model_len=512)
    t = make_transport("local", TransportSpec(engine=es, generation=GenerationSettings(max_tokens=8, ignore_eos=True),
                                              stream=True, log_dir=str(tmp_path)))
    sink = Sink()
    try:
        (rec,) = t.start(sink)
        assert rec.enable_prefix_caching is False and rec.info["engine_args"]["dtype"] == "float32"
        t.submit(0, [Request(i, (np.arange(40) * (i + 1) % 1000).astype(np.int32), i) for i in range(4)])
        events = sink.wait(_done_count(4), timeout=300)
        pid = t.pool.engines[0].pid
        t0 = time.monotonic()
        t.stop()
        took = time.monotonic() - t0
    finally:
        t.stop()
    assert took < 3.0, f"stop took {took:.1f} s"  # it took 9-17 s before the worker skipped vLLM's teardown
    firsts = {f.rid: f.token_id for k, _, f in events if k == "first"}
    done = [c for k, _, c in events if k == "done"]
    assert sorted(firsts) == [0, 1, 2, 3] and len(done) == 4
    for c in done:
        assert len(c.token_ids) == 8 and c.token_ids[0] == firsts[c.rid]
        assert c.cached_tokens == 0 and c.t_queued <= c.t_first <= c.t_done
    assert _gone([pid], timeout=0.5)


def test_a_long_temp_dir_gets_a_short_vllm_rpc_dir():
    """Flame sets TMPDIR inside the app's working dir; vLLM's IPC socket path (dir + 37 bytes) must fit 107."""
    from sut.engine.worker import MAX_RPC_DIR, short_rpc_dir

    long = "/tmp/job/study/bench-study-reuse-SYNTHETIC-LOCALITY-NOT-MLPERF/flame-service/work/sut-vllm/tmp"
    assert len(long) > MAX_RPC_DIR and MAX_RPC_DIR + 37 <= 107
    assert short_rpc_dir({}, long) == "/tmp"
    assert short_rpc_dir({}, "/tmp") is None
    assert short_rpc_dir({"VLLM_RPC_BASE_PATH": "/run/x"}, long) is None
    assert short_rpc_dir({"VLLM_RPC_BASE_PATH": long}, "/tmp") == "/tmp"


def test_a_result_sink_that_raises_becomes_one_fatal_event_not_a_dead_watcher(standin):
    """A broken callback (e.g. the ledger raising) must fail the run at once, not stall it for 30 minutes."""

    class RaisingSink(Sink):
        def on_results(self, replica, results):
            raise ValueError("ledger bug")

    t = _transport()
    sink = RaisingSink()
    t.start(sink)
    try:
        t.submit(0, _requests([0]))
        evs = sink.wait(lambda evs: any(e[0] == "fatal" for e in evs))
        fatal = [e for e in evs if e[0] == "fatal"][0][2]
        assert fatal.replica == 0 and "handling its results failed: ValueError('ledger bug')" in fatal.message
    finally:
        t.stop()
