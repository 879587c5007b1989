"""Sampling: config validation, exact distributions on hand-made logits, penalties, seeds, stops."""

import numpy as np
import pytest

from ds4_app.engine.sampling import (SamplerConfig, StopMatcher, apply_penalties, probabilities,
                                     sample, sample_rows)


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


# ---- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"top_k": -1}, {"top_k": 1.5},
    {"top_p": 0.0}, {"top_p": 1.1}, {"min_p": -0.1}, {"min_p": 1.5},
    {"repetition_penalty": 0.0}, {"presence_penalty": float("inf")}, {"penalty_last_n": -2},
    {"seed": -1}, {"seed": 1.0}, {"max_tokens": 0}, {"stop": ("",)}, {"ignore_eos": 1},
    {"top_k": True},
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="^sampler: "):
        SamplerConfig(**kwargs)


def test_config_defaults_and_normalisation():
    cfg = SamplerConfig(stop=["</s>", "\n\n"], seed=0)
    assert cfg.stop == ("</s>", "\n\n")
    assert cfg.seed == 0 and cfg.greedy and not cfg.uses_penalties
    assert SamplerConfig(stop="END").stop == ("END",)
    with pytest.raises(AttributeError):
        cfg.temperature = 1.0  # frozen


# ---- greedy ---------------------------------------------------------------------------------

def test_greedy_takes_lowest_id_on_ties_and_leaves_rng_alone():
    logits = np.array([0.5, 2.0, -1.0, 2.0], dtype=np.float32)
    rng = np.random.default_rng(5)
    state = rng.bit_generator.state
    assert sample(logits, SamplerConfig(), rng) == 1
    assert rng.bit_generator.state == state
    assert probabilities(logits, SamplerConfig()).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_argmax_only_means_greedy_without_penalties():
    assert SamplerConfig(temperature=0).argmax_only
    assert not SamplerConfig(temperature=0.7).argmax_only
    assert not SamplerConfig(temperature=0, repetition_penalty=1.3).argmax_only
    assert SamplerConfig(temperature=0, repetition_penalty=1.3, penalty_last_n=0).argmax_only  # penalties off


def test_greedy_applies_penalties_first():
    logits = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    cfg = SamplerConfig(presence_penalty=0.5)
    assert sample(logits, cfg, np.random.default_rng(0), history=[0]) == 1
    assert sample(logits, cfg, np.random.default_rng(0), history=[2]) == 0


def test_greedy_sample_is_the_argmax_of_its_distribution_even_with_nan():
    # sample's greedy path skips the one-hot vector; it must pick what probabilities() marks.
    rng = np.random.default_rng(3)
    for trial in range(200):
        x = rng.integers(-3, 4, size=int(rng.integers(1, 40))).astype(np.float32)  # many ties
        if trial % 4 == 0:
            x[rng.integers(0, x.shape[0], size=2)] = np.nan
        cfg = SamplerConfig(presence_penalty=0.5) if trial % 3 == 0 else SamplerConfig()
        hist = rng.integers(0, x.shape[0], size=5).tolist()
        assert sample(x, cfg, rng, hist) == int(np.argmax(probabilities(x, cfg, hist)))


# ---- a step's rows --------------------------------------------------------------------------

ROW_CONFIGS = [SamplerConfig(), SamplerConfig(repetition_penalty=1.3),
               SamplerConfig(temperature=0.8, top_k=5, seed=1), SamplerConfig(temperature=1.1, top_p=0.9)]


@pytest.mark.parametrize("mix", [(0, 0, 0), (0, 1, 0), (2, 0, 3, 0), (2, 3), (1,), ()])
def test_sample_rows_is_sample_row_by_row(mix):
    data = np.random.default_rng(len(mix))
    for _ in range(50):
        logits = data.integers(-2, 3, size=(len(mix), 33)).astype(np.float32)  # ties in every row
        if len(mix) and data.random() < 0.3:
            logits[0, data.integers(0, 33)] = np.nan
        cfgs = [ROW_CONFIGS[k] for k in mix]
        hists = [data.integers(0, 33, size=8).tolist() for _ in mix]
        seeds = data.integers(0, 1000, size=len(mix)).tolist()
        rngs_a = [np.random.default_rng(s) for s in seeds]
        rngs_b = [np.random.default_rng(s) for s in seeds]
        want = [sample(logits[i], cfgs[i], rngs_a[i], hists[i]) for i in range(len(mix))]
        assert sample_rows(logits, cfgs, rngs_b, hists) == want
        # the same draws were taken from every generator
        assert [r.bit_generator.state for r in rngs_b] == [r.bit_generator.state for r in rngs_a]


def test_sample_rows_checks_its_shapes():
    with pytest.raises(ValueError):
        sample_rows(np.zeros((2, 4), np.float32), [SamplerConfig()], [np.random.default_rng()], [[]])
    with pytest.raises(ValueError):
        sample_rows(np.zeros((1, 0), np.float32), [SamplerConfig()], [np.random.default_rng()], [[]])


# ---- filters --------------------------------------------------------------------------------

def test_temperature_one_is_the_softmax():
    p = probabilities(logits_of([0.5, 0.3, 0.2]), SamplerConfig(temperature=1.0))
    np.testing.assert_allclose(p, [0.5, 0.3, 0.2], rtol=1e-6)


def test_temperature_sharpens_and_flattens():
    x = np.array([1.0, 0.0], dtype=np.float32)
    e = np.exp(1.0 / 0.5)
    np.testing.assert_allclose(probabilities(x, SamplerConfig(temperature=0.5)),
                               [e / (e + 1), 1 / (e + 1)], rtol=1e-12)
    e = np.exp(1.0 / 2.0)
    np.testing.assert_allclose(probabilities(x, SamplerConfig(temperature=2.0)),
                               [e / (e + 1), 1 / (e + 1)], rtol=1e-12)


def test_top_k_keeps_k_largest_with_lowest_id_on_boundary_ties():
    x = logits_of([0.1, 0.4, 0.2, 0.2, 0.1])
    p = probabilities(x, SamplerConfig(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0, 2 / 3, 1 / 3, 0, 0], rtol=1e-6)
    p = probabilities(x, SamplerConfig(temperature=1.0, top_k=4))
    np.testing.assert_allclose(p, [1 / 9, 4 / 9, 2 / 9, 2 / 9, 0], rtol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_p():
    x = logits_of([0.1, 0.5, 0.3, 0.1])
    # 0.5 < 0.75, 0.5 + 0.3 >= 0.75: tokens 1 and 2.
    np.testing.assert_allclose(probabilities(x, SamplerConfig(temperature=1.0, top_p=0.75)),
                               [0, 0.625, 0.375, 0], rtol=1e-6)
    np.testing.assert_allclose(probabilities(x, SamplerConfig(temperature=1.0, top_p=0.4)),
                               [0, 1, 0, 0], rtol=1e-6)
    # 0.85 is reached only with one of the two 0.1 tokens: the lower id wins the tie.
    np.testing.assert_allclose(probabilities(x, SamplerConfig(temperature=1.0, top_p=0.85)),
                               [1 / 9, 5 / 9, 3 / 9, 0], rtol=1e-6)


def reference_top_p(x: np.ndarray, top_p: float) -> np.ndarray:
    """Full-sort top-p, written the obvious way."""
    p = np.exp(x.astype(np.float64) - x.max())
    p /= p.sum()
    order = sorted(range(p.shape[0]), key=lambda i: (-p[i], i))
    out, total = np.zeros_like(p), 0.0
    for i in order:
        out[i] = p[i]
        total += p[i]
        if total >= top_p:
            break
    return out / out.sum()


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_matches_a_full_sort_on_a_large_vocab_with_ties(top_p):
    rng = np.random.default_rng(int(top_p * 1000))
    x = np.round(rng.standard_normal(3000) * 2, 1).astype(np.float32)  # rounding makes many ties
    got = probabilities(x, SamplerConfig(temperature=1.0, top_p=top_p))
    want = reference_top_p(x, top_p)
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)


def test_min_p_drops_tokens_below_fraction_of_the_best():
    x = logits_of([0.05, 0.5, 0.3, 0.15])
    # threshold 0.4 * 0.5 = 0.2: keeps 0.5 and 0.3.
    np.testing.assert_allclose(probabilities(x, SamplerConfig(temperature=1.0, min_p=0.4)),
                               [0, 0.625, 0.375, 0], rtol=1e-6)


def test_filters_compose_in_order_top_k_then_top_p_then_min_p():
    x = logits_of([0.4, 0.3, 0.2, 0.1])
    cfg = SamplerConfig(temperature=1.0, top_k=3, top_p=0.7, min_p=0.8)
    # top-k 3 -> (4,3,2)/9; top-p 0.7 -> 4/9+3/9 >= 0.7 -> (4,3)/7; min-p 0.8*4/7 -> 3/7 < 3.2/7.
    np.testing.assert_allclose(probabilities(x, cfg), [1, 0, 0, 0], rtol=1e-6)
    cfg = SamplerConfig(temperature=1.0, top_k=3, top_p=0.7, min_p=0.7)
    np.testing.assert_allclose(probabilities(x, cfg), [4 / 7, 3 / 7, 0, 0], rtol=1e-6)


def test_masked_tokens_are_never_drawn():
    x = logits_of([0.1, 0.5, 0.3, 0.1])
    cfg = SamplerConfig(temperature=1.0, top_p=0.75, seed=3)
    rng = np.random.default_rng(3)
    drawn = {sample(x, cfg, rng) for _ in range(500)}
    assert drawn == {1, 2}


def test_draw_frequencies_follow_the_distribution():
    x = logits_of([0.2, 0.5, 0.3])
    rng = np.random.default_rng(11)
    cfg = SamplerConfig(temperature=1.0)
    n = 20000
    freq = np.bincount([sample(x, cfg, rng) for _ in range(n)], minlength=3) / n
    np.testing.assert_allclose(freq, [0.2, 0.5, 0.3], atol=0.015)


def test_neg_inf_logits_are_excluded():
    x = np.array([-np.inf, 0.0, -np.inf, 0.0], dtype=np.float32)
    np.testing.assert_allclose(probabilities(x, SamplerConfig(temperature=1.0)), [0, 0.5, 0, 0.5])
    with pytest.raises(ValueError):
        probabilities(np.full(3, -np.inf, dtype=np.float32), SamplerConfig(temperature=1.0))


# ---- penalties ------------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_multiplies_negative():
    x = np.array([2.0, -2.0, 2.0, -2.0], dtype=np.float32)
    out = apply_penalties(x, SamplerConfig(repetition_penalty=2.0), history=[0, 1, 1])
    assert out.tolist() == [1.0, -4.0, 2.0, -2.0]
    assert out.dtype == np.float32 and x.tolist() == [2.0, -2.0, 2.0, -2.0]  # input untouched


def test_presence_and_frequency_penalties_subtract():
    x = np.zeros(4, dtype=np.float32)
    cfg = SamplerConfig(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(x, cfg, history=[1, 2, 2, 2, 99])  # 99 is outside the vocab: ignored
    assert out.tolist() == [0.0, -0.75, -1.25, 0.0]


def test_penalty_window_is_the_last_n_tokens():
    x = np.zeros(3, dtype=np.float32)
    hist = [0, 1, 2]
    assert apply_penalties(x, SamplerConfig(presence_penalty=1.0, penalty_last_n=2),
                           hist).tolist() == [0.0, -1.0, -1.0]
    assert apply_penalties(x, SamplerConfig(presence_penalty=1.0, penalty_last_n=-1),
                           hist).tolist() == [-1.0, -1.0, -1.0]
    assert apply_penalties(x, SamplerConfig(presence_penalty=1.0, penalty_last_n=0),
                           hist).tolist() == [0.0, 0.0, 0.0]


# ---- seeds ----------------------------------------------------------------------------------

def draw_stream(seed: int | None, n: int = 64) -> list[int]:
    x = np.random.default_rng(99).standard_normal(50).astype(np.float32)
    cfg = SamplerConfig(temperature=1.3, top_k=20, top_p=0.95, seed=seed)
    rng = np.random.default_rng(cfg.seed)
    return [sample(x, cfg, rng) for _ in range(n)]


def test_same_seed_same_tokens_and_seed_zero_is_real():
    assert draw_stream(0) == draw_stream(0)
    assert draw_stream(7) == draw_stream(7)
    assert draw_stream(0) != draw_stream(1)
    assert len(set(draw_stream(0))) > 5  # really sampling, not collapsing to one token


# ---- stop strings ---------------------------------------------------------------------------

def run_stops(stops, pieces):
    m = StopMatcher(stops)
    out, stopped = [], False
    for p in pieces:
        text, stopped = m.feed(p)
        out.append(text)
        if stopped:
            break
    return out, stopped, m


def test_stop_string_split_across_tokens_is_caught_and_not_emitted():
    out, stopped, _ = run_stops(["</end>"], ["Hello", " wor", "ld</", "en", "d> tail"])
    assert stopped and "".join(out) == "Hello world"
    assert out == ["Hello", " wor", "ld", "", ""]


def test_false_start_is_released_when_it_stops_matching():
    out, stopped, m = run_stops(["STOP"], ["a ST", "ART b", " S"])
    assert not stopped and out == ["a ", "START b", " "]
    assert m.flush() == "S"
    assert m.flush() == ""


def test_earliest_stop_wins_and_feed_after_stop_emits_nothing():
    out, stopped, m = run_stops(["cd", "b"], ["abcd"])
    assert stopped and out == ["a"]
    assert m.feed("more") == ("", True) and m.flush() == ""


def test_overlapping_prefixes_hold_the_longest_candidate():
    m = StopMatcher(["aab"])
    assert m.feed("xaa") == ("x", False)
    assert m.feed("a") == ("a", False)  # "aaa": only the last "aa" can still start "aab"
    assert m.feed("b") == ("", True)


def test_no_stops_passes_everything_through():
    m = StopMatcher()
    assert m.feed("abc") == ("abc", False)
    assert m.feed("") == ("", False)
    assert not m.stopped
    assert m.flush() == ""
