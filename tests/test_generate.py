"""Generation: sampling, seeds, stop strings, streaming."""
import pytest

import waste


@pytest.fixture(scope="module")
def eng(releases):
    return waste.load(releases["qwen3_moe"][2], dtype="float32")


def test_streaming_equals_blocking(eng):
    blocking = eng.generate("def f(x):", max_tokens=24)
    pieces = list(eng.generate("def f(x):", max_tokens=24, stream=True))
    assert "".join(pieces) == blocking.text and len(blocking.token_ids) > 0


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(eng):
    kw = dict(max_tokens=24, temperature=1.5, top_p=0.95, top_k=50, min_p=0.01)
    a = eng.generate("hello", seed=7, **kw).token_ids
    b = eng.generate("hello", seed=7, **kw).token_ids
    c = eng.generate("hello", seed=8, **kw).token_ids
    greedy = eng.generate("hello", max_tokens=24).token_ids
    assert a == b and a != c and a != greedy and c != greedy and len(a) == len(greedy) == 24


def test_stop_string_cuts_the_text(eng):
    full = eng.generate("hello", max_tokens=24, temperature=1.0, seed=3)
    stop = full.text[5:8]
    assert len(stop) == 3
    g = eng.generate("hello", max_tokens=24, temperature=1.0, seed=3, stop=[stop])
    assert g.finish_reason == "stop" and g.text == full.text[:full.text.find(stop)]
    assert "".join(eng.generate("hello", max_tokens=24, temperature=1.0, seed=3, stop=[stop], stream=True)) == g.text


def test_eos_ends_generation(eng):
    ids = eng.generate("hello", max_tokens=16).token_ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])   # a token not seen before it
    saved = eng.eos_ids
    eng.eos_ids = {ids[k]}
    try:
        g = eng.generate("hello", max_tokens=16)
    finally:
        eng.eos_ids = saved
    assert g.finish_reason == "stop" and g.token_ids == ids[:k + 1]


def test_length_limit(eng):
    saved, eng.eos_ids = eng.eos_ids, set()
    try:
        g = eng.generate("hello", max_tokens=5)
    finally:
        eng.eos_ids = saved
    assert g.finish_reason == "length" and len(g.token_ids) == 5 and g.stats.generated_tokens == 5
