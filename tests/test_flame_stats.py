"""``sut.flame.stats.FlameStats``: what the flame transport records, timed and untimed batches apart."""

from sut.flame.payload import TaskResult
from sut.flame.stats import FlameStats
from sut.flame.tasks import Batch


def _finish(stats: FlameStats, replica: int, batch_id: int, n: int, executor: str) -> None:
    tb = Batch(batch_id, [None] * n, b"x" * 10, 40, task_id=f"t{replica}-{batch_id}", attempts=1, t_create=1.0,
               t_done=1.5)
    meta = {"executor": {"id": executor, "node": "h", "pid": 1, "role": "host", "seat": 0}, "node": "h",
            "shard": "cpu-0.e0", "t": {"service_s": 0.4, "engine_s": 0.3}}
    stats.note_result(replica, tb, TaskResult(batch_id, [], meta, raw_bytes=8 * n, wire_bytes=4 * n))


def test_batches_before_mark_timed_count_as_untimed_also_when_they_finish_after_it():
    st = FlameStats()
    st.note_batch(0, 0, 4)
    st.note_batch(1, 0, 2)
    _finish(st, 0, 0, 4, "e0")  # a warm-up batch done before the mark
    st.mark_timed()
    st.note_batch(0, 1, 4)
    st.note_batch(1, 1, 4)
    st.note_batch(1, 2, 3)
    _finish(st, 1, 0, 2, "e1")  # a warm-up batch done after the mark
    for replica, bid, n in ((0, 1, 4), (1, 1, 4), (1, 2, 3)):
        _finish(st, replica, bid, n, f"e{replica}")
    rec = st.record()
    assert rec["batch_size_distribution"] == {"3": 1, "4": 2}
    assert rec["untimed"] == {"batches": 2, "batch_size_distribution": {"2": 1, "4": 1}, "tasks_completed": 2}
    assert rec["tasks"]["completed"] == 3 and rec["tasks"]["total_s"]["n"] == 3
    assert sorted((t["replica"], t["batch_id"]) for t in rec["per_task"]) == [(0, 1), (1, 1), (1, 2)]
    assert {e["id"]: e["tasks"] for e in rec["executor_list"]} == {"e0": 1, "e1": 2}
    assert rec["bytes"]["out_raw"] == 8 * (4 + 2 + 4 + 4 + 3)  # bytes cover every task


def test_without_a_mark_every_batch_is_timed_and_counts_do_not_need_the_task_log():
    st = FlameStats(record_tasks=False)
    for bid in range(3):
        st.note_batch(0, bid, 8)
        _finish(st, 0, bid, 8, "e0")
    rec = st.record()
    assert rec["batch_size_distribution"] == {"8": 3} and rec["tasks"]["completed"] == 3
    assert rec["untimed"] == {"batches": 0, "batch_size_distribution": {}, "tasks_completed": 0}
    assert rec["per_task"] == [] and rec["executor_list"][0]["tasks"] == 3
