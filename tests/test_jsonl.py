"""``accuracy.jsontext.read_jsonl``: the one reader of JSON Lines files a killed run may leave with a cut-off
last line (scripts/find_qps.py's tries, ``sut.locality``'s cases.jsonl)."""

import sys

import pytest

from accuracy.jsontext import JSONLinesError, read_jsonl
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from find_qps_search import TryLog  # noqa: E402

SETTINGS = {"scenario": "Server"}


def test_a_cut_off_last_line_is_skipped_and_reported(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"a": 1}\n\n[2]\n{"a": 3, "b": "x')
    jl = read_jsonl(p)
    assert jl.records == [(1, {"a": 1}), (3, [2])] and jl.cut_line == 4
    p.write_text('{"a": 1}\n{"a": 2}')  # the last record whole, only its newline missing: kept
    assert read_jsonl(p).records == [(1, {"a": 1}), (2, {"a": 2})] and read_jsonl(p).cut_line is None


@pytest.mark.parametrize("text,line", [('{"a": 1}\n{"a": \n{"a": 3}\n', 2),  # not the last line: corrupt
                                       ('{"a": 1}\n{"a": \n', 2),  # ended by its newline: not cut off by a kill
                                       ('[' * 100_000 + '\n{}\n', 1)])  # too deeply nested
def test_a_bad_line_that_is_not_a_cut_off_last_line_names_file_and_line(tmp_path, text, line):
    p = tmp_path / "a.jsonl"
    p.write_text(text)
    with pytest.raises(JSONLinesError, match=rf"a.jsonl line {line}: not JSON") as e:
        read_jsonl(p)
    assert (e.value.path, e.value.line) == (p, line)


def test_a_cut_last_line_is_an_error_where_none_may_be_cut(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"a": 1}\n{"a')
    with pytest.raises(JSONLinesError, match="line 2: not JSON"):
        read_jsonl(p, allow_cut_last=False)


def test_the_try_log_refuses_a_line_that_is_json_but_no_record_naming_it(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('12\n')
    with pytest.raises(ValueError, match="t.jsonl line 1: not a try record"):
        TryLog(p, SETTINGS).read()
    p.write_text('{"qps": 4, "validity": "VALID", "settings": {"scenario": "Server"}}\n{"qps": 8, "valid')
    assert [t.qps for t in TryLog(p, SETTINGS).read()] == [4]
