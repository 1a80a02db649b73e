"""What an engine step reports: its outputs, where its time went, speculative acceptance, and
when each request's tokens arrived.

Time: host and device apart
---------------------------
``StepStats`` splits a step's wall time into host work (``plan_step``, inputs and split-KV plans,
``commit_step``) and device work (the prefill chunks until their caches are ready; the decode
program from dispatch until its tokens are on the host). A step in which a program was compiled
says so (``compiled``), so benchmarks can drop it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import numpy as np

from serving.requests import RequestOutput


@dataclasses.dataclass(frozen=True)
class StepStats:
    """Where one step's time went.

    Attributes:
      index: the scheduler's step number.
      num_prefill_chunks, num_prefill_tokens: prompt work run before the decode batch.
      num_decode_rows: requests in the decode batch (its active rows).
      num_emitted: tokens the step added to requests (stop and ``max_tokens`` applied).
      host_s: host work: ``plan_step``, building the program's inputs and the split-KV plans,
        the Python around the decode program's call, ``commit_step``.
      prefill_s: the prefill chunks, dispatched and finished (device time plus dispatch).
      decode_s: the decode program, dispatched until its tokens reached the host; the sum of
        the three parts below.
      compiled: whether a program was compiled during the step (its times include compilation).
      dispatch_s: part of ``decode_s``: the jitted call until it returned (cache lookup,
        argument transfers, launch), before the device is done.
      device_wait_s: part of ``decode_s``: from then until the step's outputs were ready.
      fetch_s: part of ``decode_s``: copying the outputs to the host.
      plan_s: part of ``host_s``: ``plan_step`` and the decode program's host inputs (split-KV
        plans included).
      commit_s: part of ``host_s``: committing the tokens (stop tokens, rewinds, finishes).
      num_granted: prefilling requests whose chunks the fairness grant gave beyond the step's
        budget (``Step.granted``).
      num_decode_steps: decode steps the step's decode program ran (``K`` of
        ``Engine(max_steps_per_program=K)``: 1 for a single step, 0 without a decode batch);
        ``decode_s`` and ``dispatch_s`` cover all of them. Overlapped, this step's program (like
        ``num_decode_rows``), not the previous one whose tokens were fetched.
      overlapped: whether the step ran overlapped (``Engine(overlap=True)``): its prefill and
        decode were dispatched without waiting, and ``device_wait_s``, ``fetch_s`` and
        ``num_emitted`` belong to the PREVIOUS step's tokens, fetched after this step was
        dispatched (the device ran the previous step while this one was planned).
    """

    index: int
    num_prefill_chunks: int
    num_prefill_tokens: int
    num_decode_rows: int
    num_emitted: int
    host_s: float
    prefill_s: float
    decode_s: float
    compiled: bool
    dispatch_s: float = 0.0
    device_wait_s: float = 0.0
    fetch_s: float = 0.0
    plan_s: float = 0.0
    commit_s: float = 0.0
    overlapped: bool = False
    num_granted: int = 0
    num_decode_steps: int = 1

    @property
    def total_s(self) -> float:
        return self.host_s + self.prefill_s + self.decode_s


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one step did: ``Scheduler.commit_step`` fills the first three fields, and
    ``Engine.step`` adds the step's ``stats``.

    Attributes:
      new_token_ids: per request that decoded, the tokens it kept this step (stop and
        ``max_tokens`` applied), for streaming.
      finished: requests that finished in this step.
      num_accepted: per request that decoded with speculation, drafts accepted (before stop and
        ``max_tokens`` were applied); empty without speculation.
      stats: the step's ``StepStats`` (None from the scheduler alone).
    """

    new_token_ids: dict[Hashable, tuple[int, ...]]
    finished: tuple[RequestOutput, ...]
    num_accepted: dict[Hashable, int] = dataclasses.field(default_factory=dict)
    stats: StepStats | None = None


@dataclasses.dataclass
class AcceptanceStats:
    """Speculative acceptance counted over verification rows (requests' rows of decode steps).

    ``accepted_at[i]`` rows accepted draft ``i + 1``; ``reached_at[i]`` rows tested it (those
    that accepted drafts ``1..i``). With independent acceptances of rate ``alpha``, a step emits
    ``(1 - alpha^(n + 1)) / (1 - alpha)`` tokens on average (Leviathan et al. 2023).

    Attributes:
      num_speculative: ``n``.
      rows: verification rows counted.
      emitted: tokens emitted by those rows (``num_accepted + 1`` each, before stop tokens and
        ``max_tokens`` cut a row short).
      reached_at, accepted_at: int64[n].
    """

    num_speculative: int
    rows: int = 0
    emitted: int = 0
    reached_at: np.ndarray = None
    accepted_at: np.ndarray = None

    def __post_init__(self):
        if self.reached_at is None:
            self.reached_at = np.zeros(self.num_speculative, np.int64)
        if self.accepted_at is None:
            self.accepted_at = np.zeros(self.num_speculative, np.int64)

    def record(self, num_accepted: np.ndarray) -> None:
        """Counts rows that accepted ``num_accepted`` (int[R]) drafts each."""
        num_accepted = np.asarray(num_accepted, np.int64)
        draft = np.arange(self.num_speculative)
        self.rows += num_accepted.size
        self.emitted += int(np.sum(num_accepted + 1))
        self.reached_at += np.sum(num_accepted[:, None] >= draft[None, :], axis=0)
        self.accepted_at += np.sum(num_accepted[:, None] > draft[None, :], axis=0)

    def rate_at(self) -> np.ndarray:
        """float[n]: acceptance rate of each draft position given that it was tested (NaN if
        never tested)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.accepted_at / self.reached_at

    @property
    def alpha(self) -> float:
        """Acceptances over tests, all positions pooled: the maximum-likelihood rate of
        independent acceptances (NaN before any test)."""
        tested = int(self.reached_at.sum())
        return float(self.accepted_at.sum()) / tested if tested else float("nan")

    @property
    def predicted_tokens_per_step(self) -> float:
        """``(1 - alpha^(n + 1)) / (1 - alpha)``: tokens a row emits per step if acceptances
        were independent with rate ``alpha`` (``n + 1`` at ``alpha = 1``)."""
        alpha, n = self.alpha, self.num_speculative
        if np.isnan(alpha):
            return float("nan")
        if alpha == 1.0:
            return float(n + 1)
        return (1 - alpha ** (n + 1)) / (1 - alpha)

    @property
    def measured_tokens_per_step(self) -> float:
        return self.emitted / self.rows if self.rows else float("nan")


@dataclasses.dataclass
class RequestTiming:
    """When a request was submitted and when each of its tokens reached the host
    (``time.perf_counter`` seconds).

    Tokens fetched together share their arrival time: a speculative step's, and the ``K``
    tokens of a block of decode steps (``Engine(max_steps_per_program=K)``), whose gaps
    (``inter_token_s``) are then ``K - 1`` zeros and one block's time. These are the times a
    streaming client sees; the time of a decode step is ``StepStats``'s.
    """

    submitted_s: float
    token_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def time_to_first_token_s(self) -> float:
        return self.token_s[0] - self.submitted_s if self.token_s else float("nan")

    def inter_token_s(self) -> np.ndarray:
        """float[T - 1]: gaps between consecutive tokens."""
        return np.diff(np.asarray(self.token_s, np.float64))
