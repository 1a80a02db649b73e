"""The tuner's selection rule (``bench/tuning/autotune.py``) with a fake timer on the CPU.

Every trial is seeded, so a failure reproduces. Bounds, with the default rule (20 ABBA blocks,
19 wins needed, ``alpha = 1e-4``):

- equal speed: a finalist is kept with probability at most 21 / 2^20 = 2.0e-5, so with 3
  finalists a trial keeps one with probability at most 6.0e-5, and 200 trials keep any with
  probability at most 1.2%: the tests assert none (a guard-free "best median wins" keeps one in
  nearly every trial: ``test_without_the_guard_noise_would_win``).
- 10% faster, 3% noise per sample: a block ratio ``(c1 + c2) / (d1 + d2)`` has about 2.1%
  relative noise, so a block is lost with probability ``P(z > 0.1 / 0.021) < 1e-5``; missing
  the kept decision needs 2 lost blocks of 20 (< 2e-8) or a screening miss (the 10% faster
  candidate outside the top 3 of 9 medians of 5 samples: far rarer). The tests ask 200 of 200.
"""

from __future__ import annotations

import random
import statistics

import pytest

from bench.tuning.autotune import Candidate, Decision, required_wins, select

NOISE = 0.03
TRIALS = 200


class FakeTimer:
    """``measure(candidate)``: the candidate's true time x (1 + drift x calls so far) x
    lognormal noise; ``lucky`` candidates' first ``lucky_calls`` samples are 20% fast."""

    def __init__(self, true_us, seed, *, noise=NOISE, drift_per_call=0.0, lucky=(), lucky_calls=0):
        self.true_us = true_us
        self.random = random.Random(seed)
        self.noise = noise
        self.drift_per_call = drift_per_call
        self.lucky = set(lucky)
        self.lucky_calls = lucky_calls
        self.calls = 0
        self.calls_of: dict[str, int] = {}

    def __call__(self, candidate: Candidate) -> float:
        seen = self.calls_of.get(candidate.name, 0)
        self.calls_of[candidate.name] = seen + 1
        time = self.true_us[candidate.name] * (1 + self.drift_per_call * self.calls)
        self.calls += 1
        if candidate.name in self.lucky and seen < self.lucky_calls:
            time *= 0.8
        return time * self.random.lognormvariate(0.0, self.noise)


DEFAULT = Candidate("default", {"pages_per_step": 8}, simplicity=0)
CANDIDATES = [Candidate(f"c{i}", {"pages_per_step": 8 + i}, simplicity=i) for i in range(1, 9)]


def _all_equal(us=100.0):
    return {c.name: us for c in [DEFAULT, *CANDIDATES]}


def test_required_wins_is_the_binomial_tail():
    assert required_wins(20, 1e-4) == 19  # P(>= 19) = 21/2^20 = 2.0e-5; P(>= 18) = 2.0e-4
    assert required_wins(10, 1e-3) == 10  # P(10) = 9.8e-4; P(>= 9) = 1.1e-2
    assert required_wins(1, 0.5) == 1
    with pytest.raises(ValueError, match=r"rounds=5 cannot reach alpha=0\.01"):
        required_wins(5, 0.01)
    with pytest.raises(ValueError, match="rounds must be an integer >= 1, got 0"):
        required_wins(0, 0.1)
    with pytest.raises(ValueError, match="alpha must be in"):
        required_wins(10, 1.5)


def test_a_candidate_inside_the_noise_is_never_kept():
    kept = [
        seed
        for seed in range(TRIALS)
        if select(CANDIDATES, DEFAULT, FakeTimer(_all_equal(), seed)).kept
    ]
    assert kept == []


def test_without_the_guard_noise_would_win():
    """The same trials judged by "the best screening median wins": noise wins nearly always,
    which is what the guard is for (and shows the trials above could fail)."""
    naive_wins = 0
    for seed in range(TRIALS):
        decision = select(CANDIDATES, DEFAULT, FakeTimer(_all_equal(), seed))
        medians = {entry.name: entry.median_us for entry in decision.screening}
        naive_wins += min(medians, key=medians.get) != DEFAULT.name
    assert naive_wins > 0.8 * TRIALS


def test_a_truly_faster_candidate_is_kept():
    true_us = {**_all_equal(), "c5": 90.0}
    decisions = [select(CANDIDATES, DEFAULT, FakeTimer(true_us, seed)) for seed in range(TRIALS)]
    assert all(d.kept and d.chosen.name == "c5" for d in decisions)
    ratios = [d.ratio for d in decisions]
    assert 0.88 < statistics.median(ratios) < 0.92


def test_a_lucky_first_run_is_caught_by_the_paired_stage():
    for seed in range(20):
        timer = FakeTimer(_all_equal(), seed, lucky=["c3"], lucky_calls=5)
        decision = select(CANDIDATES, DEFAULT, timer)
        best_screened = min(decision.screening, key=lambda entry: entry.median_us)
        assert best_screened.name == "c3"  # stage 1 was fooled
        assert "c3" in [c.name for c in decision.confirmations]
        assert not decision.kept and decision.chosen == DEFAULT


@pytest.mark.parametrize("drift_per_call", [2e-3, -2e-3])
def test_drift_over_time_does_not_make_a_false_win(drift_per_call):
    for seed in range(50):
        timer = FakeTimer(_all_equal(), seed, noise=0.005, drift_per_call=drift_per_call)
        decision = select(CANDIDATES, DEFAULT, timer)
        assert not decision.kept, decision.reason
    # The drift is strong enough to fool a comparison that is not interleaved: the candidate
    # timed while the machine is faster looks more than 2% faster than the default.
    naive = FakeTimer(_all_equal(), 0, noise=0.005, drift_per_call=drift_per_call)
    if drift_per_call > 0:
        candidate_us = [naive(CANDIDATES[0]) for _ in range(20)]
        default_us = [naive(DEFAULT) for _ in range(20)]
    else:
        default_us = [naive(DEFAULT) for _ in range(20)]
        candidate_us = [naive(CANDIDATES[0]) for _ in range(20)]
    assert statistics.median(candidate_us) < 0.98 * statistics.median(default_us)


def test_ties_within_noise_go_to_the_simpler_launch():
    true_us = {**_all_equal(), "c2": 90.0, "c6": 90.0}
    for seed in range(10):
        decision = select(CANDIDATES, DEFAULT, FakeTimer(true_us, seed))
        assert decision.kept and decision.chosen.name == "c2", decision.reason
        assert "tied within noise" in decision.reason


def test_a_clearly_faster_less_simple_launch_beats_a_simpler_one():
    true_us = {**_all_equal(), "c2": 90.0, "c6": 75.0}
    for seed in range(10):
        decision = select(CANDIDATES, DEFAULT, FakeTimer(true_us, seed))
        assert decision.kept and decision.chosen.name == "c6", decision.reason


def test_min_gain_rejects_a_real_but_small_gain():
    true_us = {**_all_equal(), "c1": 97.0}
    timer = FakeTimer(true_us, 0, noise=0.002)
    assert select(CANDIDATES, DEFAULT, timer).kept
    timer = FakeTimer(true_us, 0, noise=0.002)
    assert not select(CANDIDATES, DEFAULT, timer, min_gain=0.05).kept


def test_a_failing_candidate_is_recorded_and_skipped():
    true_us = {**_all_equal(), "c4": 90.0}
    timer = FakeTimer(true_us, 0)

    def measure(candidate):
        if candidate.name == "c1":
            raise RuntimeError("does not compile")
        return timer(candidate)

    decision = select(CANDIDATES, DEFAULT, measure)
    screening = {entry.name: entry for entry in decision.screening}
    assert screening["c1"].error == "RuntimeError: does not compile"
    assert decision.kept and decision.chosen.name == "c4"
    assert decision.to_json()["screening"][1] == {"name": "c1", "error": screening["c1"].error}


def test_the_decision_record_says_why():
    decision = select(CANDIDATES, DEFAULT, FakeTimer(_all_equal(), 1))
    assert isinstance(decision, Decision)
    record = decision.to_json()
    assert record["kept"] is False and record["chosen"] == "default" and record["ratio"] is None
    assert "noise" in record["reason"] or "beat the default" in record["reason"]
    assert len(record["screening"]) == 1 + len(CANDIDATES)
    for confirmation in record["confirmations"]:
        assert confirmation["rounds"] == 20 and confirmation["required_wins"] == 19
        assert (
            confirmation["min_ratio"] <= confirmation["median_ratio"] <= confirmation["max_ratio"]
        )


def test_bad_arguments_are_rejected():
    timer = FakeTimer(_all_equal(), 0)
    with pytest.raises(ValueError, match="top must be an integer >= 1, got 0"):
        select(CANDIDATES, DEFAULT, timer, top=0)
    with pytest.raises(ValueError, match="stage1_samples must be an integer >= 1, got 0"):
        select(CANDIDATES, DEFAULT, timer, stage1_samples=0)
    with pytest.raises(ValueError, match="min_gain must be in"):
        select(CANDIDATES, DEFAULT, timer, min_gain=1.0)
    with pytest.raises(ValueError, match=r"unique .*\['default'\]"):
        select([Candidate("default", {})], DEFAULT, timer)
    with pytest.raises(TypeError, match="Candidate objects"):
        select([{"pages_per_step": 4}], DEFAULT, timer)
    with pytest.raises(ValueError, match=r"must return a positive time, got -1\.0"):
        select(CANDIDATES, DEFAULT, lambda candidate: -1.0)
    with pytest.raises(ValueError, match="default launch default failed"):
        select(CANDIDATES, DEFAULT, lambda c: 1 / 0 if c.name == "default" else 1.0)
