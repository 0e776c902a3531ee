import json

import numpy as np
import pytest

from sut.data.dataset import QuerySampleLibrary, load_dataset
from sut.errors import DatasetError

VOCAB = 1000


def rec(ids, out="ref"):
    return {"instruction": {"llama": "t"}, "input": "x", "tok_input": ids, "output": out}


def good():
    return [rec([1, 2, 3]), rec([4, 5]), rec(list(range(1, 100)))]


def test_valid_file_loads_as_int32(write_json):
    ds = load_dataset(write_json(good()), VOCAB, 300)
    assert len(ds) == 3 and ds.total_in_file == 3
    assert all(p.dtype == np.int32 for p in ds.prompts)
    assert ds.prompts[1].tolist() == [4, 5]
    assert ds.references[0] == "ref"
    assert len(ds.sha256) == 64


def test_subset_keeps_first_n(write_json):
    ds = load_dataset(write_json(good()), VOCAB, 300, max_samples=2)
    assert len(ds) == 2 and ds.total_in_file == 3


@pytest.mark.parametrize(
    "bad, index, field, text",
    [
        ({"input": "x", "output": "y"}, 1, "tok_input", "missing"),
        (rec([]), 1, "tok_input", "non-empty list"),
        (rec([1, 2.0, 3]), 1, "tok_input", "position 1 is 2.0, not an integer"),
        (rec([1, True]), 1, "tok_input", "not an integer"),
        (rec([1, "7"]), 1, "tok_input", "not an integer"),
        (rec([1, VOCAB]), 1, "tok_input", f"id {VOCAB} at position 1 is outside the model vocabulary"),
        (rec([-1]), 1, "tok_input", "outside the model vocabulary"),
        (rec(list(range(1, 200))), 1, "tok_input",
         "more than 150 (max_model_len less the answer's [generation] max_tokens)"),
        ("not a dict", 1, None, "must be a JSON object"),
        (rec([1], out=5), 1, "output", "must be a string"),
    ],
)
def test_each_bad_record_names_file_index_field(write_json, bad, index, field, text):
    data = [rec([1, 2]), bad]
    path = write_json(data)
    with pytest.raises(DatasetError) as ei:
        load_dataset(path, VOCAB, max_model_len=128 + 150)
    e = ei.value
    assert e.path == str(path) and e.index == index and e.field == field
    assert text in str(e) and str(path) in str(e) and f"record {index}" in str(e)


def test_the_room_kept_for_the_answer_is_the_runs_max_tokens(write_json):
    path = write_json([rec(list(range(1, 101)))])  # a 100-token prompt
    assert len(load_dataset(path, VOCAB, max_model_len=228, reserve=128)) == 1
    with pytest.raises(DatasetError, match="more than 28 "):
        load_dataset(path, VOCAB, max_model_len=228, reserve=200)
    with pytest.raises(DatasetError, match="no room for a prompt and 228 new tokens"):
        load_dataset(path, VOCAB, max_model_len=228, reserve=228)


def test_malformed_json(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('[{"tok_input": [1, 2]')
    with pytest.raises(DatasetError, match="malformed JSON"):
        load_dataset(p, VOCAB, 300)


def test_not_a_list_and_empty(write_json):
    with pytest.raises(DatasetError, match="JSON list"):
        load_dataset(write_json({"tok_input": [1]}), VOCAB, 300)
    with pytest.raises(DatasetError, match="no records"):
        load_dataset(write_json([]), VOCAB, 300)


def test_pickle_is_refused_not_unpickled(tmp_path):
    import pickle

    p = tmp_path / "cnn_eval.pkl"
    p.write_bytes(pickle.dumps([{"tok_input": [1]}]))
    with pytest.raises(DatasetError, match="pickle"):
        load_dataset(p, VOCAB, 300)


def test_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_dataset(tmp_path / "nope.json", VOCAB, 300)


def test_qsl_counts(write_json):
    ds = load_dataset(write_json(good()), VOCAB, 300)
    qsl = QuerySampleLibrary(ds, 13368)
    try:
        assert qsl.total_sample_count == 3
        assert qsl.performance_sample_count == 3  # capped at the dataset size
    finally:
        qsl.destroy()


def test_synthetic_is_deterministic_in_vocab_and_cnn_like(tmp_path):
    from sut.data.synthetic import SyntheticSettings, make_lengths, write_dataset

    s = SyntheticSettings(samples=13368)
    lens = make_lengths(s)
    assert 820 <= lens.mean() <= 900 and 760 <= np.median(lens) <= 800
    assert lens.max() <= 2540 and lens.min() >= 76
    assert 1950 <= np.percentile(lens, 99) <= 2350
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_dataset(a, SyntheticSettings(samples=50, seed=3))
    write_dataset(b, SyntheticSettings(samples=50, seed=3))
    assert a.read_bytes() == b.read_bytes()
    ds = load_dataset(a, 128256, 2668)
    assert len(ds) == 50 and all(p[0] == 128000 for p in ds.prompts)
    assert max(int(p[1:].max()) for p in ds.prompts) < 128000


def test_synthetic_tokenizer_round_trip(synthetic_small):
    from transformers import AutoTokenizer

    path, tokdir = synthetic_small
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    assert len(tok) == 128256
    recs = json.loads(path.read_text())
    body = recs[0]["tok_input"][28:]
    assert tok.decode(body) == recs[0]["input"]
    assert tok.decode([5, 128009, 6], skip_special_tokens=True).split() == tok.decode([5, 6]).split()


def test_retokenize_with_template_and_bos(tmp_path, synthetic_small):
    from transformers import AutoTokenizer

    from sut.constants import PROMPT_TEMPLATE
    from sut.data.retokenize import retokenize

    _, tokdir = synthetic_small
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"article": "bababa bababe", "highlights": "bababi.", "split": "validation"}) + "\n"
                   + json.dumps({"article": "bababo", "highlights": "x", "split": "train"}) + "\n")
    out = tmp_path / "out.json"
    stats = retokenize(src, str(tokdir), out, split="validation")
    recs = json.loads(out.read_text())
    assert stats["samples"] == 1 and recs[0]["output"] == "bababi."
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    assert recs[0]["tok_input"] == tok(PROMPT_TEMPLATE.format(input="bababa bababe"))["input_ids"]


def test_retokenize_bad_row_is_named(tmp_path, synthetic_small):
    from sut.data.retokenize import retokenize

    src = tmp_path / "rows.json"
    src.write_text(json.dumps([{"input": "a"}, {"output": "b"}]))
    with pytest.raises(DatasetError, match=r"record 1, field 'input'"):
        retokenize(src, str(synthetic_small[1]), tmp_path / "o.json")


@pytest.mark.parametrize("content, split, expect", [
    (b"5\n", None, r"rows.jsonl: record 0: a JSONL row must be a JSON object, got int"),
    (b'{"article": "a", "split": "w"}\n[[[\n', "v", r"rows.jsonl: record 1: malformed JSON line"),
    (b"5\n", "v", r"record 0: a JSONL row must be a JSON object"),
    ('[{"input": "a"}]'.encode("utf-16"), None, r"rows.jsonl: is not UTF-8 text \(UTF-16\)"),
    (b"\x80\x81\xfe" * 50, None, r"rows.jsonl: is not UTF-8 text \(undecodable bytes\)"),
])
def test_retokenize_names_a_source_it_cannot_read_before_the_tokenizer(tmp_path, content, split, expect):
    """Before: each of these ended in a traceback (AttributeError, JSONDecodeError, UnicodeDecodeError), exit 1."""
    from sut.data.retokenize import retokenize

    src = tmp_path / "rows.jsonl"
    src.write_bytes(content)
    with pytest.raises(DatasetError, match=expect):
        retokenize(src, str(tmp_path / "no-tokenizer"), tmp_path / "o.json", split=split)
    assert not (tmp_path / "o.json").exists()


def test_retokenize_names_a_tokenizer_folder_it_cannot_load(tmp_path):
    from sut.data.retokenize import retokenize

    src = tmp_path / "rows.json"
    src.write_text(json.dumps([{"input": "a", "output": "b"}]))
    with pytest.raises(DatasetError, match=f"{tmp_path}: --tokenizer: not a loadable Hugging Face tokenizer folder"):
        retokenize(src, str(tmp_path), tmp_path / "o.json")


def test_directory_overflowing_ids_and_too_many_samples_are_named(tmp_path, write_json):
    with pytest.raises(DatasetError, match="is a directory"):
        load_dataset(tmp_path, VOCAB, 300)
    with pytest.raises(DatasetError, match="record 0.*tok_input.*64 bits"):
        load_dataset(write_json([rec([1180591620717411303424])]), VOCAB, 300)
    with pytest.raises(DatasetError, match="--max-samples 4 is more than the 3 records"):
        load_dataset(write_json(good()), VOCAB, 300, max_samples=4)


# ------------------------------------------------------------------------- one reader for the run and the gate
def _encoded(tmp_path, encoding: str, prefix: bytes = b""):
    text = json.dumps([rec([1, 2, 3], "Résumé — “quoted”"), rec([4, 5], "second")], ensure_ascii=False)
    p = tmp_path / f"cnn_eval.{encoding}.json"
    p.write_bytes(prefix + text.encode(encoding, errors="replace"))
    return p


@pytest.mark.parametrize("encoding, message", [
    ("utf-16", "is UTF-16-encoded; only UTF-8 (with or without a byte-order mark) is read"),
    ("utf-16-le", "is UTF-16-encoded"),
    ("utf-16-be", "is UTF-16-encoded"),
    ("utf-32", "is UTF-32-encoded"),
    ("utf-32-le", "is UTF-32-encoded"),
    ("latin-1", "is not UTF-8 (with or without a byte-order mark): byte "),
    ("cp1252", "is not UTF-8"),
])
def test_other_encodings_are_refused_by_the_run_and_the_gate_alike(tmp_path, encoding, message):
    """Before: the run auto-detected UTF-16/32 (json.load on bytes) and the gate, reading UTF-8 only, failed after
    the whole accuracy run."""
    from accuracy.dataset import load_references
    from accuracy.errors import AccuracyInputError

    p = _encoded(tmp_path, encoding)
    with pytest.raises(DatasetError) as run_err:
        load_dataset(p, VOCAB, 300)
    assert message in str(run_err.value) and str(p) in str(run_err.value)
    with pytest.raises(AccuracyInputError) as gate_err:
        load_references(p)
    assert message in str(gate_err.value) and str(p) in str(gate_err.value)


@pytest.mark.parametrize("prefix", [b"", b"\xef\xbb\xbf"])
def test_utf8_with_or_without_bom_is_read_the_same_by_the_run_and_the_gate(tmp_path, prefix):
    from accuracy.dataset import load_references

    p = _encoded(tmp_path, "utf-8", prefix)
    ds = load_dataset(p, VOCAB, 300)
    assert ds.references == load_references(p) == ["Résumé — “quoted”", "second"]


def test_run_with_a_utf16_dataset_exits_2_before_any_engine_starts(tmp_path):
    import subprocess
    import sys

    from conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, sut_env

    p = _encoded(tmp_path, "utf-16")
    out_dir = tmp_path / "results"
    out = subprocess.run([sys.executable, "-m", "sut", "run", "--no-progress", *TINY_ENGINE_ARGS, "--dataset", str(p),
                          "--user-conf", str(CPU_CONF), "--mode", "accuracy", "--output-dir", str(out_dir)],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"{p}: is UTF-16-encoded" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not (out_dir.exists() and any(out_dir.iterdir()))


def test_synthetic_tokenizer_folder_carries_the_models_eos_ids(tmp_path):
    """The gate reads EOS ids from generation_config.json next to the tokenizer: the synthetic folder must name the
    same three ids as the tiny model the demo runs, or a re-score cuts only at 128009."""
    import json
    from pathlib import Path

    from sut.data.synthetic import write_tokenizer

    folder = write_tokenizer(tmp_path / "tok", vocab_size=128256)
    model_eos = json.loads((Path(__file__).resolve().parent.parent / "sut/models/tiny-llama3/generation_config.json")
                           .read_text())["eos_token_id"]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == model_eos


# ------------------------------------------------------------------------- bounded reads: regular files up to a size
def test_a_device_is_refused_from_its_stat_before_reading(tmp_path):
    """Before: /dev/null was read (and /dev/zero read until the OOM killer came); the error was about JSON."""
    with pytest.raises(DatasetError, match=r"/dev/null: is not a regular file \(a device, FIFO or socket\)"):
        load_dataset("/dev/null", VOCAB, 300)


def test_a_path_with_a_nul_byte_is_refused_by_name():
    """Before: a dataset path with a NUL (a hand-edited run.json run_settings.dataset, which python -m accuracy
    takes) ended in a ValueError traceback ("embedded null byte", exit 1)."""
    from accuracy.dataset import DatasetFileError, read_dataset_json

    with pytest.raises(DatasetFileError, match="dataset /tmp/a\x00b: the path holds a NUL byte"):
        read_dataset_json("/tmp/a\x00b")


def test_a_fifo_is_refused_without_opening_it(tmp_path):
    """Before: opening the FIFO blocked for ever (no writer)."""
    import os
    import threading

    fifo = tmp_path / "cnn_eval.json"
    os.mkfifo(fifo)
    got = []

    def read():
        try:
            load_dataset(fifo, VOCAB, 300)
        except DatasetError as e:
            got.append(str(e))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the reader so that the thread ends, then fail
        with open(fifo, "wb"):
            pass
        t.join(10)
        pytest.fail("reading a FIFO blocked")
    assert got and "is not a regular file" in got[0] and str(fifo) in got[0]


def test_a_file_above_the_size_limit_is_refused_before_reading(tmp_path, write_json, monkeypatch):
    import accuracy.dataset as ad

    # the limit covers the official file (about 266 MB as download_cnndm.py writes it) about 4 times
    assert getattr(ad, "MAX_DATASET_BYTES", 0) >= 4 * 266_000_000
    p = write_json(good())
    size = p.stat().st_size
    monkeypatch.setattr(ad, "MAX_DATASET_BYTES", size - 1, raising=False)
    with pytest.raises(DatasetError, match=rf"is {size:,} bytes, more than the {size - 1:,}-byte limit"):
        load_dataset(p, VOCAB, 300)
    monkeypatch.setattr(ad, "MAX_DATASET_BYTES", size, raising=False)
    assert len(load_dataset(p, VOCAB, 300)) == 3


def test_run_with_dev_zero_as_dataset_exits_2_before_reading(tmp_path):
    """Before: the reader read /dev/zero until memory ran out (here: capped at 6 GiB of address space)."""
    import resource
    import subprocess
    import sys

    from conftest import CPU_CONF, REPO, TINY_ENGINE_ARGS, sut_env

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    out_dir = tmp_path / "results"
    out = subprocess.run([sys.executable, "-m", "sut", "run", "--no-progress", *TINY_ENGINE_ARGS, "--dataset", "/dev/zero",
                          "--user-conf", str(CPU_CONF), "--output-dir", str(out_dir)],
                         env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120, preexec_fn=cap)
    assert out.returncode == 2 and "/dev/zero: is not a regular file" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not (out_dir.exists() and any(out_dir.iterdir()))
