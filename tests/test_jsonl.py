"""``accuracy.jsontext.read_jsonl``: the one reader of JSON Lines files a killed run may leave with a cut-off
last line (python -m sut find-qps's tries, ``sut.locality``'s cases.jsonl)."""


import pytest

from accuracy.jsontext import JSONLinesError, read_jsonl
from sut.findqps.search import TryLog

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


def test_a_line_that_is_not_utf8_names_file_and_line_unless_it_is_the_cut_off_last_one(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'{"a": 1}\n{"a": "\xc9t\xe9"}\n{"a": 3}\n')
    with pytest.raises(JSONLinesError, match=r"a\.jsonl.* line 2.*not UTF-8") as e:
        read_jsonl(p)
    assert e.value.line == 2
    p.write_bytes(b'{"a": 1}\n{"a": "caf\xc3')  # a write cut in the middle of a UTF-8 sequence
    jl = read_jsonl(p)
    assert jl.records == [(1, {"a": 1})] and jl.cut_line == 2


@pytest.mark.parametrize("rec,field", [({"qps": 1.0, "validity": "VALID", "settings": 5}, "settings"),
                                       ({"qps": "abc", "validity": "INVALID"}, "qps"),
                                       ({"qps": float("nan"), "validity": "INVALID"}, "qps"),
                                       ({"qps": 0, "validity": "INVALID"}, "qps"),
                                       ({"qps": 1.0, "validity": "VALID", "wall_s": "x"}, "wall_s"),
                                       ({"qps": 1.0, "validity": "valid"}, "validity")])
def test_the_try_log_refuses_a_record_with_a_wrongly_typed_field_naming_it(tmp_path, rec, field):
    import json

    p = tmp_path / "tries.jsonl"
    p.write_text(json.dumps({"settings": SETTINGS, **rec}) + "\n")
    with pytest.raises(ValueError, match=rf"tries\.jsonl line 1: not a try record \({field} "):
        TryLog(p, SETTINGS).read()
