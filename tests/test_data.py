from lynx.data import VOCAB, StdlibBatches, stdlib_corpus


def test_corpus_is_deterministic_text():
    a, b = stdlib_corpus(1 << 16), stdlib_corpus(1 << 16)
    assert len(a) == 1 << 16 and bool((a == b).all())
    assert int(a.max()) < VOCAB
    assert b"def " in bytes(a.tolist())


def test_batches_are_a_function_of_step_rank_and_microbatch():
    source = StdlibBatches(("idx", "targets"), batch=3, seq=8, max_bytes=1 << 16)
    first, again = source(5, 1, 2), source(5, 1, 2)
    assert all(bool((x["idx"] == y["idx"]).all()) for x, y in zip(first, again))
    other = source(6, 1, 2)
    assert not bool((first[0]["idx"] == other[0]["idx"]).all())
    mb = first[0]
    assert mb["idx"].shape == (3, 8) and bool((mb["targets"][:, :-1] == mb["idx"][:, 1:]).all())
