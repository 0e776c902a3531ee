"""The study's parts that need no engines: news-text traces (a made-up cnn_eval file with the word-level
tokenizer, and the real public file when ../shared/data is there), presets, shifted warm-ups, input and
trace hashes, validation of results, the pair report's arithmetic and its figure."""

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, SHARED_DATA, TINY_MODEL, sut_env

from sut.data.synthetic import word
from sut.errors import DatasetError, RunFailed
from sut.locality.news import load_corpus
from sut.locality.study import (
    RequestResult,
    pair_report,
    plot_pair_report,
    raise_for_failures,
    ratios_by_pair,
    report_lines,
    validate_results,
)
from sut.locality.trace import (
    TRACE_PRESETS,
    TraceRequest,
    TraceSettings,
    describe,
    input_hash,
    make_trace,
    shift_trace,
    trace_hash,
    warmup_shifts,
    warmup_traces,
)

BOS = 128000
HEAD, TAIL = [9370, 5730, 553, 279, 512], [19791, 25]  # a made-up template around every article


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


@pytest.fixture(scope="module")
def tiny_news(tmp_path_factory):
    """A made-up cnn_eval file of 12 pseudo-word articles (``input`` and ``tok_input`` agree), the
    word-level tokenizer, and question templates in its words."""
    from sut.data.synthetic import write_tokenizer

    d = tmp_path_factory.mktemp("news")
    rng = np.random.default_rng(3)
    bodies = [rng.integers(1000, 120000, size=int(rng.integers(40, 120))).tolist() for _ in range(12)]
    recs = [{"instruction": {"llama": "x"}, "input": " ".join(word(i) for i in b), "tok_input": [BOS] + HEAD + b + TAIL,
             "output": "y"} for b in bodies]
    (d / "tiny.json").write_text(json.dumps(recs))
    write_tokenizer(d / "tok")  # passed as its tokenizer.json: AutoTokenizer takes 15-25 s on this folder
    templates = tuple(" ".join(word(i) for i in range(10 * k, 10 * k + 3 + k)) for k in range(1, 5))
    return d / "tiny.json", d / "tok" / "tokenizer.json", bodies, templates


def news_settings(path, tok=None, **kw):
    base = dict(documents=5, doc_tokens=150, questions=3, question_tokens=12, text="news", dataset=str(path),
                tokenizer=str(tok) if tok else None, seed=2)
    return TraceSettings(**{**base, **kw})


def check_shape(trace, ts):
    """Lengths within the settings, questions of a document share exactly the document, documents share
    nothing beyond BOS in their first block."""
    lo, hi = int(ts.doc_tokens * (1 - ts.doc_jitter)), int(ts.doc_tokens * (1 + ts.doc_jitter))
    by_doc = {}
    for r in trace:
        assert r.prompt[0] == BOS and r.prompt.dtype == np.int32 and r.prompt[1:].max() < ts.id_limit
        assert lo + 1 <= r.prefix_tokens <= hi + 1 and len(r.prompt) <= ts.max_prompt_tokens
        by_doc.setdefault(r.document, []).append(r)
    assert len(by_doc) == ts.documents and len(trace) == ts.documents * ts.questions
    for reqs in by_doc.values():
        p = reqs[0].prefix_tokens
        assert all(r.prefix_tokens == p and np.array_equal(r.prompt[:p], reqs[0].prompt[:p]) for r in reqs)
        assert len({r.prompt[p:].tobytes() for r in reqs}) == len(reqs)  # distinct questions
    firsts = [reqs[0] for reqs in by_doc.values()]
    assert all(lcp(a.prompt, b.prompt) < 1 + 256 for i, a in enumerate(firsts) for b in firsts[i + 1:])
    return by_doc


# ------------------------------------------------------------------------------------- news traces
def test_news_trace_with_a_tokenizer_is_real_text_deterministic_and_shares_document_prefixes(tiny_news):
    path, tok, bodies, templates = tiny_news
    corpus = load_corpus(str(path), str(tok), templates=templates)
    assert [a.tolist() for a in corpus.articles] == bodies and corpus.separator.size == 0  # "\n\n" is no word
    ts = news_settings(path, tok)
    trace = make_trace(ts, corpus)
    by_doc = check_shape(trace, ts)
    # every document is whole articles joined (no separator here), cut inside the last one
    for reqs in by_doc.values():
        doc = reqs[0].prompt[1:reqs[0].prefix_tokens].tolist()
        while doc:
            whole = next((b for b in bodies if doc[:len(b)] == b), None)
            if whole is None:
                assert any(b[:len(doc)] == doc for b in bodies)
                break
            doc = doc[len(whole):]
        # the questions are the templates, tokenized the same way
        for r in reqs:
            assert r.prompt[r.prefix_tokens:].tolist() in [[int(x) for x in corpus.encode(t)] for t in templates]
    again = make_trace(ts, corpus)
    assert [r.prompt.tolist() for r in again] == [r.prompt.tolist() for r in trace]
    assert trace_hash(make_trace(news_settings(path, tok, seed=3), corpus)) != trace_hash(trace)


def test_news_trace_from_the_files_ids_strips_the_common_template(tiny_news):
    path, _, bodies, _ = tiny_news
    corpus = load_corpus(str(path))
    # the head (BOS + HEAD) and TAIL common to every record are gone: the article ids are left
    assert [a.tolist() for a in corpus.articles] == bodies and corpus.tail.tolist() == TAIL
    ts = news_settings(path)
    trace = make_trace(ts)
    check_shape(trace, ts)
    for r in trace:  # questions: the opening ids of an article, then the template's tail
        q = r.prompt[r.prefix_tokens:].tolist()
        assert q[-2:] == TAIL and any(b[:len(q) - 2] == q[:-2] for b in bodies)
    assert [r.prompt.tolist() for r in make_trace(ts)] == [r.prompt.tolist() for r in trace]


def test_news_knobs_popularity_order_and_lengths_still_work(tiny_news):
    path, tok, _, templates = tiny_news
    corpus = load_corpus(str(path), str(tok), templates=templates)
    ts = news_settings(path, tok, documents=4, questions=3, zipf_s=1.5, order="round_robin", doc_tokens=300)
    trace = make_trace(ts, corpus)
    shape = describe(trace)
    assert shape["requests"] == 12 and shape["hot_document_share"] > 0.25
    assert [r.question for r in trace] == sorted(r.question for r in trace)  # round robin: question 0 first
    assert 270 + 1 <= min(r.prefix_tokens for r in trace) and max(r.prefix_tokens for r in trace) <= 330 + 1


def test_bad_news_input_is_refused_with_the_cause(tiny_news, tmp_path):
    path, tok, _, templates = tiny_news
    with pytest.raises(ValueError, match="needs a dataset"):
        TraceSettings(text="news")
    with pytest.raises(ValueError, match="--text news only"):
        TraceSettings(dataset=str(path))
    with pytest.raises(ValueError, match="12 usable articles, fewer than the 13 documents"):
        make_trace(news_settings(path, documents=13))
    with pytest.raises(ValueError, match="question template .* outside \\[0, 128000\\)"):  # English words: unknown
        load_corpus(str(path), str(tok))
    with pytest.raises(ValueError, match="more than 1.5 x --question-tokens = 3"):
        make_trace(news_settings(path, tok, question_tokens=2), load_corpus(str(path), str(tok), templates=templates))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"input": "kaba"}]))  # no word of the tokenizer
    with pytest.raises(ValueError, match="record 0, field 'input': id 128001 at position 0 is outside"):
        load_corpus(str(bad), str(tok))
    bad.write_text(json.dumps([{"input": word(5000)}, {"tok_input": [1, 2]}]))
    with pytest.raises(DatasetError, match="record 1, field 'input'"):
        load_corpus(str(bad), str(tok))
    with pytest.raises(DatasetError, match="record 0, field 'tok_input'"):
        load_corpus(str(bad))
    with pytest.raises(DatasetError, match="cannot read"):
        load_corpus(str(tmp_path / "missing.json"))
    beyond = [{"tok_input": [BOS, *HEAD, 5, 2 ** 63, *TAIL]}, {"tok_input": [BOS, *HEAD, 6, 7, *TAIL]}]
    bad.write_text(json.dumps(beyond))  # numpy cannot hold it: refused before, naming record and position
    with pytest.raises(DatasetError, match=rf"record 0, field 'tok_input'.*id {2 ** 63} at position {len(HEAD) + 2} "
                                           "is no token id"):
        load_corpus(str(bad))
    from sut.data.synthetic import write_tokenizer

    small = write_tokenizer(tmp_path / "small", vocab_size=1000)  # not a Llama 3 vocabulary
    with pytest.raises(ValueError, match="news traces need a Llama 3-vocabulary tokenizer"):
        load_corpus(str(path), str(small / "tokenizer.json"), templates=templates)


@pytest.mark.realdata
def test_study_reuse_from_the_public_cnn_file_and_the_llama3_tokenizer():
    from accuracy.tokenizer import load_tokenizer

    data, tok = SHARED_DATA / "cnn_eval_public.json", SHARED_DATA / "llama3_tokenizer"
    ts = TraceSettings(**TRACE_PRESETS["study-reuse"]["trace"], dataset=str(data), tokenizer=str(tok))
    trace = make_trace(ts)
    check_shape(trace, ts)
    shape = describe(trace)
    assert shape["requests"] == 256 and shape["documents"] == 64 and ts.max_tokens == 16
    assert 0.74 < shape["reusable_share_upper_bound"] < 0.75  # the study: 74.86 % served from cache
    det = load_tokenizer(tok)
    articles = [r["input"] for r in json.loads(data.read_text())]
    text = det.decode_batch([trace[0].prompt[1:60]])[0]
    assert any(text in a for a in articles), text  # real news text
    assert det.decode_batch([trace[0].prompt[trace[0].prefix_tokens:]])[0].lstrip().startswith("Question ")
    assert trace_hash(make_trace(ts)) == trace_hash(trace)


# ---------------------------------------------------------------------------------------- warm-ups
def all_lcps(trace):
    return [[lcp(a.prompt, b.prompt) for b in trace] for a in trace]


def test_warmups_keep_lengths_and_prefix_relations_but_share_no_measured_prefix():
    trace = make_trace(TraceSettings(documents=6, doc_tokens=400, questions=3, seed=5))
    w1, w2 = warmup_traces(trace)
    measured = {r.prompt[:2].tobytes() for r in trace}
    for w in (w1, w2):
        assert [len(r.prompt) for r in w] == [len(r.prompt) for r in trace]
        assert [(r.rid, r.document, r.question, r.prefix_tokens) for r in w] == \
            [(r.rid, r.document, r.question, r.prefix_tokens) for r in trace]
        assert all_lcps(w) == all_lcps(trace)  # same prefix relations, exactly
        assert all(r.prompt[0] == BOS and r.prompt[1:].max() < 128000 for r in w)
        assert not measured & {r.prompt[:2].tobytes() for r in w}  # nothing beyond BOS in common
    assert not {r.prompt[:2].tobytes() for r in w1} & {r.prompt[:2].tobytes() for r in w2}
    assert warmup_shifts(trace) == warmup_shifts(trace) and len(set(warmup_shifts(trace))) == 2


def test_warmup_shifts_use_longer_keys_when_first_ids_cover_the_vocabulary():
    """50 prompts whose first ids are all of [0, 50): no shift moves them apart, so two ids decide."""
    rng = np.random.default_rng(0)
    trace = [TraceRequest(i, i, 0, np.array([BOS, i, *rng.integers(0, 50, 5)], dtype=np.int32), 7) for i in range(50)]
    for w in warmup_traces(trace, 2, id_limit=50):
        assert not {r.prompt[:3].tobytes() for r in trace} & {r.prompt[:3].tobytes() for r in w}
        assert all_lcps(w) == all_lcps(trace) and all(r.prompt[1:].max() < 50 for r in w)


def test_shift_refuses_what_it_cannot_shift():
    trace = make_trace(TraceSettings(documents=2, doc_tokens=50, questions=1))
    with pytest.raises(ValueError, match="multiple of id_limit"):
        shift_trace(trace, 128000)
    bad = [TraceRequest(0, 0, 0, np.array([BOS, 5, 128009], dtype=np.int32), 2)]
    with pytest.raises(ValueError, match="request 0: ids after position 1"):
        shift_trace(bad, 7)
    with pytest.raises(ValueError, match="count must be >= 1"):
        warmup_shifts(trace, 0)


def test_input_and_trace_hashes():
    trace = make_trace(TraceSettings(documents=3, doc_tokens=50, questions=2))
    p = trace[0].prompt
    assert input_hash(p) == hashlib.sha256(p.astype("<i4").tobytes()).hexdigest() == input_hash(p.tolist())
    q = p.copy()
    q[-1] += 1
    assert input_hash(q) != input_hash(p)
    h = trace_hash(trace)
    assert h == trace_hash(make_trace(TraceSettings(documents=3, doc_tokens=50, questions=2)))
    assert trace_hash(trace[::-1]) != h and trace_hash(warmup_traces(trace, 1)[0]) != h


# -------------------------------------------------------------------------------------- validation
def good_results(trace, max_tokens=4):
    return [RequestResult(r.rid, r.rid % 2, r.rid % 2, [1] * max_tokens, input_hash(r.prompt)) for r in trace]


def test_validation_passes_a_clean_burst_and_names_every_failed_request():
    trace = make_trace(TraceSettings(documents=3, doc_tokens=50, questions=2))
    res = good_results(trace)
    assert validate_results(trace, res, 4) == []
    res[1] = RequestResult(1, 1, 1, [1, 2, 3], res[1].input_hash)            # short output
    res[2] = RequestResult(2, 1, 0, [1] * 4, res[2].input_hash)               # served elsewhere
    res[3] = RequestResult(3, 1, 1, [1] * 4, input_hash(trace[0].prompt))     # another prompt
    res[4] = res[0]                                                           # 0 twice, 4 never
    res.append(RequestResult(99, 0, 0, [1] * 4, "00"))                        # unknown
    fails = validate_results(trace, res, 4)
    assert fails == ["request 1: 3 output tokens, 4 asked",
                     "request 2: served by replica 1, routed to replica 0",
                     f"request 3: input hash {input_hash(trace[0].prompt)[:12]} != the trace's "
                     f"{input_hash(trace[3].prompt)[:12]}",
                     "request 99: not in the trace",
                     "request 0: answered 2 times (exactly once required)",
                     "request 4: never answered"]
    with pytest.raises(RunFailed, match="6 check\\(s\\): request 1: 3 output tokens.*\\(and 3 more\\)"):
        raise_for_failures(fails, shown=3)
    raise_for_failures([])


# ------------------------------------------------------------------------------------- pair report
def made_up_records():
    """5 pairs; flame / standalone = 0.99, 1.0, 0.98, 0.995, 1.01 with affinity; round robin at 0.55x."""
    recs = []
    for p, ratio in enumerate([0.99, 1.0, 0.98, 0.995, 1.01]):
        base = 28.0 + p
        for system, f in (("standalone", 1.0), ("flame", ratio)):
            recs.append({"system": system, "policy": "prefix_affinity", "pair": p, "requests_per_s": base * f,
                         "output_tokens_per_s": 16 * base * f, "cached_share": 0.748})
            recs.append({"system": system, "policy": "round_robin", "pair": p, "requests_per_s": base * 0.55,
                         "output_tokens_per_s": 16 * base * 0.55, "cached_share": 0.2 + 0.01 * p})
    return recs


def test_pair_report_medians_ratios_and_policy_ratios():
    rep = pair_report(made_up_records())
    aff = rep["pair_ratios"]["prefix_affinity"]
    assert [x["pair"] for x in aff["per_pair"]] == [0, 1, 2, 3, 4]
    assert aff["median"] == pytest.approx(0.995) and aff["min"] == pytest.approx(0.98)
    assert aff["max"] == pytest.approx(1.01) and aff["below_floor"] == [2] and aff["n"] == 5
    assert rep["pair_ratios"]["round_robin"]["median"] == pytest.approx(1.0)
    st = rep["runs"]["standalone"]["prefix_affinity"]["requests_per_s"]
    assert (st["median"], st["min"], st["max"]) == (30.0, 28.0, 32.0)
    assert rep["runs"]["flame"]["round_robin"]["cached_share"]["median"] == pytest.approx(0.22)
    assert rep["policy_ratios"]["standalone"]["ratio_of_medians"] == pytest.approx(1 / 0.55)
    flame_aff = [(28.0 + p) * r for p, r in enumerate([0.99, 1.0, 0.98, 0.995, 1.01])]
    assert rep["policy_ratios"]["flame"]["ratio_of_medians"] == pytest.approx(np.median(flame_aff) / (30 * 0.55))
    json.dumps(rep)  # JSON-ready
    text = "\n".join(report_lines(rep))
    assert "flame / standalone, prefix_affinity: median 99.50%, pairs 98.00%-101.00%; pairs below 99%: 1 (pair 2: 98.00%)" in text
    assert "standalone: prefix_affinity / round_robin = 1.818x" in text


def test_pair_report_refuses_broken_records():
    recs = made_up_records()
    with pytest.raises(ValueError, match="pair 3: no run of system flame with policy round_robin"):
        pair_report([r for r in recs if not (r["pair"] == 3 and r["system"] == "flame" and r["policy"] == "round_robin")])
    with pytest.raises(ValueError, match="run record 20: system standalone, policy prefix_affinity, pair 0 appears twice"):
        pair_report(recs + [recs[0]])
    with pytest.raises(ValueError, match="run record 0: missing \\['cached_share'\\]"):
        pair_report([{k: v for k, v in recs[0].items() if k != "cached_share"}])
    one = pair_report([r for r in recs if r["system"] == "standalone"])  # one system: no pair ratios, no error
    assert one["pair_ratios"] == {} and "standalone" in one["policy_ratios"]
    assert ratios_by_pair(recs, ("flame", "prefix_affinity"), ("standalone", "prefix_affinity"))[2] == \
        pytest.approx(0.98)


def test_a_transport_without_cached_token_counts_gives_no_cached_share(tmp_path):
    recs = [dict(r, cached_share=None) if r["system"] == "flame" else r for r in made_up_records()]
    rep = pair_report(recs)
    assert rep["runs"]["flame"]["prefix_affinity"]["cached_share"] is None
    assert rep["runs"]["standalone"]["prefix_affinity"]["cached_share"]["median"] == pytest.approx(0.748)
    assert rep["pair_ratios"]["prefix_affinity"]["median"] == pytest.approx(0.995)
    row = next(line for line in report_lines(rep) if line.startswith("flame        prefix_affinity"))
    assert row.rstrip().endswith("-")
    assert plot_pair_report(recs, tmp_path / "none.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="requests_per_s must be a number >= 0, got None"):
        pair_report([dict(recs[0], requests_per_s=None)])


def test_figure_is_a_png_with_three_panels(tmp_path):
    import matplotlib.image

    out = plot_pair_report(made_up_records(), tmp_path / "pairs.png")
    img = matplotlib.image.imread(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and img.shape[1] > 2.5 * img.shape[0] > 1000
    one = plot_pair_report([r for r in made_up_records() if r["system"] == "flame"], tmp_path / "one.png")
    assert one.stat().st_size > 10_000


# --------------------------------------------------------------------------------------------- CLI
def describe_json(*args):
    cmd = [sys.executable, "-m", "sut.locality", "describe", "--json", *args]
    return subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)


def test_presets_on_the_cli_and_explicit_flags_override_them(tiny_news):
    out = describe_json("--trace-preset", "study-reuse", "--text", "random", "--doc-tokens", "300")
    assert out.returncode == 0, out.stderr[-2000:]
    rec = json.loads(out.stdout)
    assert rec["requests"] == 256 and rec["documents"] == 64
    preset = dict(TRACE_PRESETS["study-reuse"]["trace"], text="random", doc_tokens=300)
    assert rec["trace_hash"] == trace_hash(make_trace(TraceSettings(**preset)))
    assert rec["max_model_len_needed"] == rec["max_prompt_tokens_possible"] + 16
    out = describe_json("--trace-preset", "study-no-reuse", "--dataset", str(tiny_news[0]), "--documents", "4",
                        "--doc-tokens", "200", "--questions", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["requests"] == 8  # news text from the file's ids; --questions overrides
    out = describe_json("--trace-preset", "study-no-reuse")
    assert out.returncode == 2 and "needs a dataset" in out.stderr and "Traceback" not in out.stderr


def test_run_with_a_preset_refuses_missing_news_data_before_starting(tmp_path):
    cmd = [sys.executable, "-m", "sut.locality", "run", "--model", str(TINY_MODEL), "--device", "cpu",
           "--trace-preset", "study-reuse", "--output-dir", str(tmp_path / "out")]
    out = subprocess.run(cmd, env=dict(sut_env(), CUDA_VISIBLE_DEVICES=""), cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "needs a dataset" in out.stderr and not (tmp_path / "out").exists()


@pytest.mark.realdata
def test_describe_study_reuse_with_news_and_the_llama3_tokenizer():
    cmd = [sys.executable, "-m", "sut.locality", "describe", "--trace-preset", "study-reuse", "--text", "news",
           "--dataset", str(SHARED_DATA / "cnn_eval_public.json"), "--tokenizer", str(SHARED_DATA / "llama3_tokenizer")]
    out = subprocess.run(cmd, env=sut_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line[:30].strip(): line[30:].split() for line in out.stdout.splitlines()[1:]}
    assert rows["requests"][0] == "256" and rows["documents"][0] == "64"
    assert rows["output tokens per request"][0] == "16" and "tokenized with" in out.stdout


def test_one_pair_figure_tells_the_policies_apart_and_spans_whole_pairs():
    """A new user's `--pairs 1` CPU run: both policies of the one system had one colour and marker (one point
    each, so line styles showed nothing), on an x axis of -0.045..0.045. Markers now follow the policy."""
    from sut.locality.study import pair_figure

    recs = [r for r in made_up_records() if r["system"] == "standalone" and int(r["pair"]) == 0]
    assert {r["policy"] for r in recs} == {"prefix_affinity", "round_robin"} and len(recs) == 2
    ax1, ax2, _ = pair_figure(recs).axes
    lines = ax1.get_lines()
    assert len(lines) == 2
    assert lines[0].get_marker() != lines[1].get_marker() and lines[0].get_linestyle() != lines[1].get_linestyle()
    assert ax1.get_xlim() == (-0.5, 0.5) and ax2.get_xlim() == (-0.5, 0.5) and list(ax1.get_xticks()) == [0]
    assert "only standalone ran" in ax2.texts[0].get_text()
    # throughput from 0 (a new user read 5.4 vs 9.2 req/s as far more than 1.7x), the highest point not on the
    # border (a recheck found it half cut off)
    top = max(r["requests_per_s"] for r in recs)
    assert ax1.get_ylim()[0] == 0 and ax1.get_ylim()[1] >= 1.1 * top


def test_pair_ratio_lines_take_no_system_colour_nor_the_floor_red():
    """The H100 hot-prefixes figure drew a policy's ratio line in standalone's orange (the first two panels' colour
    for a system) and another in the 99 % floor's red: each ratio line now has a colour of its own, and the policy's
    marker and line style as in the first panel."""
    from matplotlib.colors import to_hex

    from sut.locality.study import pair_figure

    recs = made_up_records()
    ax1, ax2, _ = pair_figure(recs).axes
    systems = {to_hex(line.get_color()) for line in ax1.get_lines()}
    ratios = [line for line in ax2.get_lines() if line.get_label().split(":")[0] in {r["policy"] for r in recs}]
    floor = [line for line in ax2.get_lines() if line.get_label() == "99%"]
    assert len(ratios) >= 2 and len(floor) == 1, [line.get_label() for line in ax2.get_lines()]
    colours = [to_hex(line.get_color()) for line in ratios]
    reds = {to_hex(floor[0].get_color()), to_hex("C3")}  # the floor's red and matplotlib's own red
    assert len(set(colours)) == len(colours) and not set(colours) & (systems | reds)
    assert len({line.get_marker() for line in ratios}) == len(ratios)
