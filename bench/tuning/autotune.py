"""Choosing a launch over the default only when the gain is larger than the noise.

``select(candidates, default, measure)`` is the whole decision; it never touches a GPU: it calls
``measure(candidate) -> float`` for one timing sample (microseconds per call) and a test injects
a fake timer. ``python -m bench tune`` (``bench/tuning/tune.py``) passes the harness's timed
programs. Why a guard at all: a tuner that keeps the fastest of many candidates measured once
keeps noise. With eight candidates as fast as the default, the fastest of eight noisy medians is
almost always below the default's, so "best median wins" reports a gain in nearly every cell.

Two stages:

1. Screening: ``stage1_samples`` samples of every candidate and of the default, round robin (one
   sample of each in turn, so a slow drift is spread over all of them). The ``top`` candidates
   with the lowest median, among those whose median beats the default's, are the finalists.
2. Confirmation, on fresh samples: for each finalist, ``rounds`` blocks of four measurements in
   the order default, candidate, candidate, default (ABBA). A block's ratio is
   ``(c1 + c2) / (d1 + d2)``; below 1 the candidate won the block.

The rule (a sign test): a finalist is kept when it wins at least ``required_wins(rounds,
alpha)`` of the ``rounds`` blocks, and its median ratio is below ``1 - min_gain``. Why this rule:

- If the candidate is no faster than the default, and the noise of the four measurements of a
  block is exchangeable (independent and identically distributed, say), a block's ratio is below
  1 with probability at most 1/2, independently across blocks: the wins are at most
  Binomial(rounds, 1/2) and ``required_wins`` makes ``P(wins >= required) <= alpha``, whatever
  the noise's distribution or size. With ``rounds = 20`` the default asks 19 wins: a candidate
  within the noise is kept with probability 21 / 2^20 = 2.0e-5 per finalist.
- ABBA cancels a drift that is linear in time: the candidate's positions (2, 3) and the
  default's (1, 4) have the same sum, so a linear slowdown adds the same to ``c1 + c2`` as to
  ``d1 + d2``. Measuring the default first and then the candidate would credit the candidate
  with any speed-up of the machine.
- Stage 2 uses none of stage 1's samples, so a finalist that was lucky in screening (the very
  reason it is a finalist) faces an unbiased test: selection by stage 1 cannot inflate stage 2.
- ``rounds - required_wins`` losses are allowed so that one outlier block (a clock hiccup) does
  not throw away a real gain.

"More than the measured spread": the decision reports the ratios' range; with the default
parameters a kept candidate beat the default in all but at most one block.

Ties within noise go to the simpler launch: among the kept finalists, those whose ratio range
overlaps the range of the one with the lowest median ratio are tied with it, and the tied one
with the lowest ``simplicity`` (then name) is chosen. A candidate no better than the default
leaves the default (the simplest choice: no table entry changes behaviour).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_STAGE1_SAMPLES = 5
DEFAULT_TOP = 3
DEFAULT_ROUNDS = 20
DEFAULT_ALPHA = 1e-4
BLOCK_ORDER = ("default", "candidate", "candidate", "default")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One launch to try.

    Attributes:
      name: a label unique among the candidates (``"p8_w4_s1"``).
      parameters: the launch parameters (``{"pages_per_step": 8, ...}``).
      simplicity: rank for ties within noise; lower is simpler (fewer stages, fewer warps).
    """

    name: str
    parameters: dict[str, int]
    simplicity: int = 0


@dataclasses.dataclass(frozen=True)
class Screening:
    """Stage 1 of one candidate (or the default): its samples, or the error that stopped it."""

    name: str
    samples_us: tuple[float, ...] = ()
    error: str | None = None

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us) if self.samples_us else math.inf

    @property
    def spread(self) -> float:
        """``(max - min) / median`` of the samples (0 for fewer than two)."""
        if len(self.samples_us) < 2:
            return 0.0
        return (max(self.samples_us) - min(self.samples_us)) / self.median_us

    def to_json(self) -> dict[str, Any]:
        if self.error is not None:
            return {"name": self.name, "error": self.error}
        return {
            "name": self.name,
            "median_us": self.median_us,
            "spread": self.spread,
            "samples_us": list(self.samples_us),
        }


@dataclasses.dataclass(frozen=True)
class Confirmation:
    """Stage 2 of one finalist: the ratio ``candidate / default`` of every ABBA block."""

    name: str
    ratios: tuple[float, ...]
    wins: int
    required_wins: int
    kept: bool

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def ratio_range(self) -> tuple[float, float]:
        return min(self.ratios), max(self.ratios)

    def to_json(self) -> dict[str, Any]:
        low, high = self.ratio_range
        return {
            "name": self.name,
            "median_ratio": self.median_ratio,
            "min_ratio": low,
            "max_ratio": high,
            "wins": self.wins,
            "rounds": len(self.ratios),
            "required_wins": self.required_wins,
            "kept": self.kept,
        }


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``select`` chose and why.

    Attributes:
      chosen: the kept candidate, or the default.
      kept: whether a candidate replaced the default.
      reason: one sentence.
      ratio: the chosen candidate's median block ratio (candidate / default), None if not kept.
      ratio_range: its lowest and highest block ratio, None if not kept.
      screening: stage 1 of the default and every candidate.
      confirmations: stage 2 of every finalist.
    """

    chosen: Candidate
    kept: bool
    reason: str
    ratio: float | None
    ratio_range: tuple[float, float] | None
    screening: tuple[Screening, ...]
    confirmations: tuple[Confirmation, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.name,
            "parameters": dict(self.chosen.parameters),
            "kept": self.kept,
            "reason": self.reason,
            "ratio": self.ratio,
            "ratio_range": list(self.ratio_range) if self.ratio_range else None,
            "screening": [entry.to_json() for entry in self.screening],
            "confirmations": [entry.to_json() for entry in self.confirmations],
        }


def required_wins(rounds: int, alpha: float) -> int:
    """The fewest block wins out of ``rounds`` that a candidate no faster than the default
    reaches with probability at most ``alpha``: the smallest k with
    ``P(Binomial(rounds, 1/2) >= k) <= alpha``.

    Raises:
      ValueError: if even ``rounds`` wins out of ``rounds`` are too likely (``2^-rounds >
        alpha``), naming both, or for ``rounds < 1`` or ``alpha`` outside (0, 1).

    Example:
      >>> required_wins(20, 1e-4), required_wins(10, 1e-3)
      (19, 10)
    """
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    tail = 0.0
    for wins in range(rounds, -1, -1):
        probability = tail + math.comb(rounds, wins) / 2**rounds
        if probability > alpha:
            if wins == rounds:
                raise ValueError(
                    f"rounds={rounds} cannot reach alpha={alpha}: even {rounds} wins of "
                    f"{rounds} happen by chance with probability {2.0**-rounds:.3g}"
                )
            return wins + 1
        tail = probability
    return 0  # unreachable: P(wins >= 0) = 1 > alpha


def _check_candidates(candidates: Sequence[Candidate], default: Candidate) -> None:
    for candidate in [default, *candidates]:
        if not isinstance(candidate, Candidate):
            raise TypeError(f"candidates must be Candidate objects, got {candidate!r}")
    names = [candidate.name for candidate in [default, *candidates]]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"candidate names must be unique (the default's too), got {repeated}")


def _screen(
    entrants: Sequence[Candidate], measure: Callable[[Candidate], float], samples: int
) -> dict[str, Screening]:
    """Round robin: sample s of every entrant, then sample s + 1, ...; a failure (a launch
    that does not compile) stops that entrant and is recorded."""
    collected: dict[str, list[float]] = {entrant.name: [] for entrant in entrants}
    errors: dict[str, str] = {}
    for _ in range(samples):
        for entrant in entrants:
            if entrant.name in errors:
                continue
            try:
                collected[entrant.name].append(_sample(measure, entrant))
            except Exception as error:  # one failing launch must not end the sweep
                errors[entrant.name] = f"{type(error).__name__}: {str(error)[:200]}"
    return {
        entrant.name: Screening(
            entrant.name, tuple(collected[entrant.name]), errors.get(entrant.name)
        )
        for entrant in entrants
    }


def _sample(measure: Callable[[Candidate], float], candidate: Candidate) -> float:
    value = float(measure(candidate))
    if not value > 0 or math.isinf(value):
        raise ValueError(f"measure({candidate.name}) must return a positive time, got {value}")
    return value


def _confirm(
    finalist: Candidate,
    default: Candidate,
    measure: Callable[[Candidate], float],
    rounds: int,
    wins_needed: int,
    min_gain: float,
) -> Confirmation:
    ratios = []
    for _ in range(rounds):
        times = {"default": 0.0, "candidate": 0.0}
        for role in BLOCK_ORDER:
            times[role] += _sample(measure, finalist if role == "candidate" else default)
        ratios.append(times["candidate"] / times["default"])
    wins = sum(ratio < 1 for ratio in ratios)
    kept = wins >= wins_needed and statistics.median(ratios) < 1 - min_gain
    return Confirmation(finalist.name, tuple(ratios), wins, wins_needed, kept)


def select(
    candidates: Sequence[Candidate],
    default: Candidate,
    measure: Callable[[Candidate], float],
    *,
    top: int = DEFAULT_TOP,
    stage1_samples: int = DEFAULT_STAGE1_SAMPLES,
    rounds: int = DEFAULT_ROUNDS,
    alpha: float = DEFAULT_ALPHA,
    min_gain: float = 0.0,
) -> Decision:
    """Chooses a candidate over ``default`` only if it is faster beyond the noise (module
    docstring: the two stages and the rule).

    Args:
      candidates: the launches to try; the default is not among them.
      default: the launch used today.
      measure: ``measure(candidate)`` runs one timing sample and returns microseconds per call
        (> 0). It may raise for a launch that fails; stage 1 records that launch as failed.
      top: finalists re-measured in stage 2 (>= 1).
      stage1_samples: samples of every launch in stage 1 (>= 1).
      rounds: ABBA blocks per finalist in stage 2 (>= 1).
      alpha: the chance, per finalist, that a launch no faster than the default is kept.
      min_gain: a kept candidate's median ratio must also be below ``1 - min_gain``, in [0, 1).

    Returns:
      A ``Decision``.

    Raises:
      ValueError: for bad ``top``, ``stage1_samples``, ``rounds``, ``alpha`` or ``min_gain``,
        repeated names, or when the default itself fails to measure.
      TypeError: for a candidate that is not a ``Candidate``.
    """
    for name, value in (("top", top), ("stage1_samples", stage1_samples)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
    wins_needed = required_wins(rounds, alpha)
    _check_candidates(candidates, default)

    screening = _screen([default, *candidates], measure, stage1_samples)
    baseline = screening[default.name]
    if baseline.error is not None:
        raise ValueError(f"the default launch {default.name} failed: {baseline.error}")
    ranked = sorted(
        (c for c in candidates if screening[c.name].median_us < baseline.median_us),
        key=lambda c: (screening[c.name].median_us, c.simplicity, c.name),
    )
    finalists = ranked[:top]
    ordered_screening = tuple(screening[c.name] for c in [default, *candidates])
    if not finalists:
        return Decision(
            default,
            False,
            "no candidate's screening median beat the default's",
            None,
            None,
            ordered_screening,
            (),
        )
    confirmations = tuple(
        _confirm(finalist, default, measure, rounds, wins_needed, min_gain)
        for finalist in finalists
    )
    kept = [c for c in confirmations if c.kept]
    if not kept:
        best = min(confirmations, key=lambda c: c.median_ratio)
        return Decision(
            default,
            False,
            f"no finalist won {wins_needed} of {rounds} paired blocks (best: {best.name}, "
            f"{best.wins} wins, median ratio {best.median_ratio:.3f}): the gain is noise",
            None,
            None,
            ordered_screening,
            confirmations,
        )
    fastest = min(kept, key=lambda c: c.median_ratio)
    low, _ = fastest.ratio_range
    tied = [
        c for c in kept if c.ratio_range[0] <= fastest.ratio_range[1] and c.ratio_range[1] >= low
    ]
    by_name = {c.name: c for c in candidates}
    winner = min(tied, key=lambda c: (by_name[c.name].simplicity, c.name))
    tie_note = (
        f"; tied within noise with {sorted(c.name for c in tied if c is not winner)}, the "
        "simpler launch wins"
        if len(tied) > 1
        else ""
    )
    return Decision(
        by_name[winner.name],
        True,
        f"{winner.name} won {winner.wins} of {rounds} paired blocks (needed {wins_needed}), "
        f"median ratio {winner.median_ratio:.3f}{tie_note}",
        winner.median_ratio,
        winner.ratio_range,
        ordered_screening,
        confirmations,
    )
