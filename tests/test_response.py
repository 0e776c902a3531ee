import numpy as np

from sut.ledger.response import cut_at_first_eos, response_buffer

EOS = (128001, 128008, 128009)


def test_cut_keeps_first_eos_and_drops_the_rest():
    out = cut_at_first_eos([5, 6, 128009, 128009, 7], EOS)
    assert out.tolist() == [5, 6, 128009]
    assert out.dtype == np.dtype("<i4")


def test_any_of_the_eos_ids_cuts():
    assert cut_at_first_eos([1, 128008, 2, 128001], EOS).tolist() == [1, 128008]


def test_no_eos_means_unchanged_and_never_padded():
    ids = list(range(1000, 1128))
    out = cut_at_first_eos(ids, EOS)
    assert out.tolist() == ids and len(out) == 128


def test_buffer_is_little_endian_int32_bytes_and_size_in_bytes():
    ids = cut_at_first_eos([1, 256, 128009], EOS)
    buf = response_buffer(ids)
    addr, nbytes = buf.buffer_info()
    assert nbytes == 12 and addr != 0
    assert bytes(buf) == b"\x01\x00\x00\x00\x00\x01\x00\x00\x09\xf4\x01\x00"
    assert np.frombuffer(bytes(buf), "<i4").tolist() == [1, 256, 128009]


def test_int64_input_is_converted_not_reinterpreted():
    arr = np.array([3, 128009], dtype=np.int64)
    assert np.frombuffer(bytes(response_buffer(cut_at_first_eos(arr, EOS))), "<i4").tolist() == [3, 128009]


def test_complete_samples_sends_n_tokens_and_byte_size(monkeypatch):
    import mlperf_loadgen as lg

    from sut.ledger import response

    seen = []

    def fake_complete(responses):
        for r in responses:
            data = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_ubyte * r.size).from_address(r.data)).tobytes() if r.size else b""
            seen.append((r.id, r.size, r.n_tokens, np.frombuffer(data, "<i4").tolist()))

    monkeypatch.setattr(lg, "QuerySamplesComplete", fake_complete)
    response.complete_samples([(11, cut_at_first_eos([9, 8, 128009, 128009], EOS)), (12, np.array([4, 5], np.int32))])
    assert seen == [(11, 12, 3, [9, 8, 128009]), (12, 8, 2, [4, 5])]


def test_a_delivery_is_cut_at_each_answers_first_eos_as_one_answer_at_a_time_would_be():
    """Answers.cut_lengths over a whole batch (empty answers, several EOS ids, EOS first, last, twice, none) gives
    exactly cut_at_first_eos of each answer."""
    from sut.ledger.response import Answers, EosIds

    rng = np.random.default_rng(3)
    for eos in (EOS, (2,), (0, 2), ()):
        arrays = []
        for _ in range(300):
            a = rng.integers(0, 5, int(rng.integers(0, 9))).astype(np.int32)  # small ids: 0 and 2 are EOS ids too
            for _ in range(int(rng.integers(0, 3))):
                if len(a):
                    a[rng.integers(0, len(a))] = rng.choice(EOS)
            arrays.append(a)
        answers, bad = Answers.of(arrays)
        cut = answers.cut_lengths(EosIds(eos))
        assert not bad and answers.le_int32().dtype == np.dtype("<i4")
        for i, a in enumerate(arrays):
            want = cut_at_first_eos(a, eos).tolist()
            assert answers.flat[answers.starts[i]:answers.starts[i] + cut[i]].tolist() == want, (eos, a)


def test_what_is_not_a_row_of_ids_is_named_and_left_out():
    from sut.ledger.response import Answers

    answers, bad = Answers.of([np.array([1, 2], np.int32), "abc", [[1, 2]], [3, 4], [], np.array([1.5])])
    assert bad == [1, 2, 5] and answers.lengths == [2, 2, 0]
    assert answers.flat.tolist() == [1, 2, 3, 4]


def _read(r):
    """A LoadGen response's bytes as ids, read where it points."""
    if not r.size:
        return []
    return np.frombuffer(bytes((np.ctypeslib.ctypes.c_ubyte * r.size).from_address(r.data)), "<i4").tolist()


def test_a_response_batch_goes_to_loadgen_as_one_buffer_each_response_pointing_at_its_cut_ids(monkeypatch):
    import mlperf_loadgen as lg

    from sut.ledger import response
    from sut.ledger.response import Answers, EosIds, ResponseBatch

    seen = []
    monkeypatch.setattr(lg, "QuerySamplesComplete",
                        lambda rs: seen.extend((r.id, r.size, r.n_tokens, _read(r)) for r in rs))
    answers, _ = Answers.of([np.array([9, 8, 128009, 128009], np.int32), np.array([4, 5], np.int64),
                             np.zeros(0, np.int32)])
    batch = ResponseBatch([11, 12, 13], answers.le_int32(), answers.starts, answers.cut_lengths(EosIds(EOS)))
    assert [(sid, ids.tolist()) for sid, ids in batch] == [(11, [9, 8, 128009]), (12, [4, 5]), (13, [])]
    response.complete_samples(batch)
    assert seen == [(11, 12, 3, [9, 8, 128009]), (12, 8, 2, [4, 5]), (13, 0, 0, [])]


def test_first_tokens_go_to_loadgen_in_one_buffer_an_empty_one_with_no_bytes(monkeypatch):
    import mlperf_loadgen as lg

    from sut.ledger import response

    seen = []
    monkeypatch.setattr(lg, "FirstTokenComplete",
                        lambda rs: seen.extend((r.id, r.size, r.n_tokens, _read(r)) for r in rs))
    response.first_token_complete([(11, 128000), (12, None), (13, 7)])
    assert seen == [(11, 4, 1, [128000]), (12, 0, 0, []), (13, 4, 1, [7])]
