"""The checks python -m sut find-qps makes before its first try, from the tries' run settings (nothing runs):
a try must be a plain LoadGen performance run, and a warning when LoadGen's equal issue would make every try
far longer than ``--min-query-count`` asks."""

from __future__ import annotations

from typing import Optional

#: Warn before the search when LoadGen's equal issue makes each try at least this many times
#: ``--min-query-count`` queries (``equal_issue_warning``).
EQUAL_ISSUE_RATIO = 2


def check_performance_tries(rs) -> None:
    """``BadInput`` (exit 2) when the tries' run settings ``rs`` (the arguments after ``--`` and the preset)
    would make a try anything but a LoadGen performance run: ``--mode accuracy``, ``--compliance-test``,
    ``--audit-config`` (an audit config may switch LoadGen's mode or change its schedule)."""
    from sut.errors import BadInput

    given = [f"--mode {rs.mode}"] if rs.mode != "performance" else []
    given += [f"--compliance-test {rs.compliance_test}"] if rs.compliance_test else []
    given += [f"--audit-config {rs.audit_config}"] if rs.audit_config else []
    if given:
        raise BadInput(f"error: {', '.join(given)} (after -- or in the preset): every find-qps try is a plain LoadGen "
                       f"performance run that LoadGen calls VALID or INVALID; leave it out")


def check_first_qps(rs, qps: float, given_by: str) -> None:
    """``BadInput`` (exit 2, before the first try) when the first try's ``qps`` (queries/s; ``given_by``:
    "--start" or what chose it) is so low that its mean query gap exceeds the tries' stall timeout
    (``rs.stall_timeout_s``): each try's run would refuse its ``--target-qps`` (``check_target_qps``)."""
    from sut.errors import BadInput

    if 1.0 / qps > rs.stall_timeout_s:
        raise BadInput(f"error: {given_by} {qps:g}: one query every {1.0 / qps:.0f} s on average, longer than the "
                       f"tries' stall timeout {rs.stall_timeout_s:g} s (--stall-timeout-s after --); start at "
                       f"{1.0 / rs.stall_timeout_s:.2g} queries/s or more")


def equal_issue_warning(rs, samples: int, min_query_count: int, qps: Optional[float]) -> Optional[str]:
    """The warning to log before the first try when LoadGen's equal issue makes every try issue far more
    queries than ``min_query_count`` (at least ``EQUAL_ISSUE_RATIO`` times), else None.

    LoadGen rounds a Server/Interactive test's query count UP to a whole multiple of the performance sample
    count (mlperf.conf ``llama3_1-8b*.*.sample_concatenate_permutation = 1``); that count is the dataset's
    ``samples`` (after ``--max-samples``), at most mlperf.conf's ``performance_sample_count_override``
    (``sut.constants.PERFORMANCE_SAMPLE_COUNT``, 13,368) and ``--quick``'s cap (``rs``: the tries' RunSettings;
    a user.conf override of the count is not seen here)."""
    from sut.constants import PERFORMANCE_SAMPLE_COUNT

    perf = min(samples, PERFORMANCE_SAMPLE_COUNT.get(rs.model_key, samples), rs.performance_sample_cap or samples)
    if perf < EQUAL_ISSUE_RATIO * min_query_count:
        return None
    pace = f" (>= {perf / qps:,.0f} s a try at target_qps {qps:g})" if qps else ""
    return (f"every try will issue at least {perf:,} queries, not --min-query-count {min_query_count:,}{pace}: "
            f"LoadGen rounds a try's query count up to a whole multiple of the performance sample count, here "
            f"the dataset's {perf:,} samples (mlperf.conf's equal issue, sample_concatenate_permutation). For "
            f"short tries pass --max-samples {min_query_count} after -- (or use a smaller dataset).")
