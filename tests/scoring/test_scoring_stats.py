"""marscli.scoring.stats: intervals on data with known answers, the paired comparison, loops."""

from __future__ import annotations

import random

import pytest

from marscli.scoring import stats


def test_wilson_interval_matches_published_values():
    # 8 of 10: Wilson 95% interval [0.490, 0.943] (e.g. Newcombe 1998, table I).
    lo, hi = stats.wilson_ci(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert stats.wilson_ci(0, 20)[0] == 0.0 and stats.wilson_ci(20, 20)[1] == 1.0
    assert stats.wilson_ci(20, 20)[0] == pytest.approx(0.8389, abs=1e-4)


def test_mean_ci_picks_wilson_for_binary_and_bootstrap_otherwise():
    b = stats.mean_ci([1, 0, 1, 1])
    assert b.method == "wilson" and b.mean == 0.75
    c = stats.mean_ci([0.2, 0.4, 0.6])
    assert c.method == "bootstrap" and c.mean == pytest.approx(0.4) and c.low < 0.4 < c.high
    assert stats.mean_ci([]).n == 0 and "no scored" in stats.mean_ci([]).describe()


def test_bootstrap_ci_of_normal_data_has_the_textbook_width():
    rng = random.Random(1)
    xs = [rng.gauss(5.0, 2.0) for _ in range(400)]
    lo, hi = stats.bootstrap_mean_ci(xs)
    mean = sum(xs) / len(xs)
    sd = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
    expected = 2 * stats.Z_95 * sd / len(xs) ** 0.5
    assert lo < mean < hi
    assert (hi - lo) == pytest.approx(expected, rel=0.1)
    assert stats.bootstrap_mean_ci(xs) == (lo, hi)  # seeded: the same data, the same interval


def test_bootstrap_ci_covers_the_true_mean_about_95_percent_of_the_time():
    rng = random.Random(7)
    covered = 0
    trials = 200
    for t in range(trials):
        xs = [rng.random() < 0.3 for _ in range(80)]
        lo, hi = stats.bootstrap_mean_ci([float(x) for x in xs], resamples=1000, seed=t)
        covered += lo <= 0.3 <= hi
    assert 0.88 <= covered / trials <= 0.99


def test_paired_bootstrap_of_a_constant_shift_is_exact():
    strict = [0.1 * i for i in range(50)]
    method = [s + 0.25 for s in strict]
    r = stats.paired_bootstrap(method, strict)
    assert r["diff"] == pytest.approx(0.25)
    assert r["diff_ci95"][0] == pytest.approx(0.25) and r["diff_ci95"][1] == pytest.approx(0.25)


def test_paired_comparison_of_known_flips():
    # 100 records, strict passes all; the method fails 10 of them: diff -0.10, and the paired
    # CI is the binomial one, about +-1.96 * sqrt(0.1 * 0.9 / 100) = +-0.059.
    strict = [1.0] * 100
    method = [0.0] * 10 + [1.0] * 90
    c = stats.compare(method, strict)
    assert c["diff"] == pytest.approx(-0.1)
    lo, hi = c["diff_ci95"]
    assert lo == pytest.approx(-0.159, abs=0.015) and hi == pytest.approx(-0.041, abs=0.015)
    assert c["flips"] == {"down": 10, "up": 0, "same": 90}
    assert c["recovery"] == pytest.approx(0.9) and c["recovery_ci95"][1] < 1.0
    assert not c["inside_noise"] and "worse than strict beyond the noise" in stats.verdict(c)


def test_balanced_flips_are_inside_the_noise():
    strict = [1.0] * 5 + [0.0] * 5 + [1.0] * 20
    method = [0.0] * 5 + [1.0] * 5 + [1.0] * 20
    c = stats.compare(method, strict)
    assert c["diff"] == 0.0 and c["flips"]["down"] == 5 and c["flips"]["up"] == 5
    assert c["inside_noise"] and "inside the noise" in stats.verdict(c)
    same = stats.compare([1.0, 0.0], [1.0, 0.0])
    assert "the same score on every record" in stats.verdict(same)


def test_pairing_narrows_the_interval_when_records_share_difficulty():
    # Per-record difficulty dominates; the method differs little. Pairing must cancel the
    # shared part: a paired CI far narrower than resampling the two runs independently.
    rng = random.Random(3)
    strict = [rng.random() for _ in range(200)]
    method = [s + rng.gauss(0.0, 0.02) for s in strict]
    lo, hi = stats.paired_bootstrap(method, strict)["diff_ci95"]
    a_lo, a_hi = stats.bootstrap_mean_ci(method, seed=1)
    b_lo, b_hi = stats.bootstrap_mean_ci(strict, seed=2)
    unpaired_width = ((a_hi - a_lo) ** 2 + (b_hi - b_lo) ** 2) ** 0.5
    assert (hi - lo) < unpaired_width / 5


def test_paired_inputs_must_align():
    with pytest.raises(ValueError, match="differ in length"):
        stats.compare([1.0], [1.0, 0.0])


@pytest.mark.parametrize(("seq", "loops"), [
    ([7, 8, 9] * 6, True),  # a 3-gram five... six times
    ([1, 2, 3, 4, 5] + [7, 8, 9] * 6 + [7], True),  # the last copy cut short, as at max tokens
    ([5] * 16, True),  # one token over and over
    ([5] * 15, False),  # shorter than the minimum span
    (list(range(40)), False),
    ([7, 8, 9] * 6 + [1, 2, 3, 4], False),  # looped, then moved on
    ([1, 2] * 3 + [9] * 2, False),
    (list(range(10)) * 3, True),  # a 10-gram three times
    (list(range(10)) * 2 + list(range(5)), False),  # two and a half copies
])
def test_ends_in_loop_on_tokens(seq, loops):
    assert stats.ends_in_loop(seq) is loops


def test_ends_in_loop_on_text():
    assert stats.ends_in_loop("The answer is " + "the answer is 42. " * 5)
    assert not stats.ends_in_loop("def f(x):\n    return x + 1\n\nprint(f(2))\n")
    assert not stats.ends_in_loop("ha" * 10)  # 20 characters: under the 64-character span
    assert stats.ends_in_loop("ha" * 40)
    assert stats.share([True, False, False, True]) == 0.5 and stats.share([]) is None
