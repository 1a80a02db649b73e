"""Continuous load for the ``serving`` suite: requests arriving while others decode (issue 18).

The standard scenarios submit every request at once, so after the first step every step is
pure decode and a prefill never competes with decoding. Here requests arrive as a Poisson
process (seeded exponential gaps) at ``rate_per_s`` for ``duration_s`` seconds of wall time,
with prompt lengths drawn from ``prompt_lengths``, each generating ``new_tokens`` tokens; the
engine steps whenever it has work, and a request arriving meanwhile is submitted before the
next step. Each configuration (``prefill_chunk_size``, ``prefill_grant_interval``, with
``max_batched_tokens = parallel + prefill_chunk_size``: room for one chunk beside a full decode
batch, so prompts queued behind an older one are parked and only the grant serves them) runs
the same arrivals on a fresh engine, after a warm-up run of the same requests submitted at once
(which compiles the programs).

Figures of a row (``extra``):

- ``ttft_p50_ms``, ``ttft_p99_ms``: from a request's scheduled arrival (not its submission,
  which waits for the step in progress) to its first token on the host.
- ``itl_p50_ms``, ``itl_p99_ms``: gaps between consecutive tokens of a request, all pooled; and
  ``itl_admission_p50_ms``, ``itl_admission_p99_ms``: only the gaps during which a step
  prefilled (an admission window: the hiccup a prompt causes its neighbours). p99, not p95: the
  hiccups are what the tail is made of.
- ``tokens_per_s``: tokens received over the wall time from the first arrival to the last token.
- ``requests``, ``granted_chunks`` (steps' chunks given by the grant beyond the budget),
  ``compiled_steps`` (measured steps that compiled: their time includes compilation).

The claim to test on the GPU (issue 18, after seed #908): the chunk size shrinks an admission
hiccup (``itl_admission_p99_ms``), the grant interval only moves it (trades the parked prompt's
``ttft_p99_ms`` against how often its neighbours hiccup).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

import numpy as np

from bench.harness import CaseResult
from serving.requests import Request, SamplingParams


@dataclasses.dataclass(frozen=True)
class LoadScenario:
    """A continuous load and the configurations it runs.

    Attributes:
      parallel: the engine's decode slots.
      rate_per_s: mean arrivals per second (Poisson).
      duration_s: arrivals are drawn over this many seconds of wall time.
      prompt_lengths: prompt lengths in tokens, each request one of them (uniformly).
      new_tokens: ``max_tokens`` of every request.
      configs: ``(prefill_chunk_size, prefill_grant_interval)`` pairs, one row each.
      seed: the arrivals', prompt lengths' and prompts' seed.
    """

    parallel: int
    rate_per_s: float
    duration_s: float
    prompt_lengths: tuple[int, ...]
    new_tokens: int
    configs: tuple[tuple[int, int], ...]
    seed: int = 0

    kind = "continuous"

    def case(self, chunk: int, interval: int) -> str:
        return (
            f"continuous B={self.parallel} rate={self.rate_per_s:g}/s chunk={chunk} "
            f"grant={interval}"
        )

    def arrivals(self, vocab: int) -> list[tuple[float, list[int]]]:
        """``(arrival seconds from the start, prompt)``, in arrival order (seeded)."""
        rng = np.random.default_rng(self.seed)
        arrivals, now = [], 0.0
        while True:
            now += rng.exponential(1.0 / self.rate_per_s)
            if now >= self.duration_s:
                return arrivals
            length = int(rng.choice(self.prompt_lengths))
            arrivals.append((now, rng.integers(0, vocab, length).tolist()))


@dataclasses.dataclass
class LoadRun:
    """What one run under load left: per request its arrival (wall clock) and token times, and
    per step (start, end, prefill tokens, granted chunks, compiled)."""

    arrival_s: dict[str, float]
    token_s: dict[str, list[float]]
    steps: list[tuple[float, float, int, int, bool]]


def _requests(scenario: LoadScenario, arrivals, tag: str) -> list[Request]:
    params = dict(temperature=1.0, top_k=50, top_p=0.9, max_tokens=scenario.new_tokens)
    return [
        Request(f"{tag}-{index}", prompt, SamplingParams(seed=index, **params))
        for index, (_, prompt) in enumerate(arrivals)
    ]


def run_load(engine, scenario: LoadScenario, arrivals, tag: str, clock=time.perf_counter):
    """Feeds ``arrivals`` to ``engine`` in real time and steps it until every request is done.

    Args:
      engine: a fresh ``serving.engine.Engine``.
      scenario: the load (its sampling parameters, ``new_tokens``).
      arrivals: ``LoadScenario.arrivals``'s list.
      tag: request ids are ``"<tag>-<index>"``.
      clock: seconds, monotonic.

    Returns:
      The ``LoadRun``.
    """
    requests = _requests(scenario, arrivals, tag)
    start = clock()
    due = [start + offset for offset, _ in arrivals]
    arrival_s = {request.request_id: at for request, at in zip(requests, due, strict=True)}
    steps = []
    next_request = 0
    while next_request < len(requests) or engine.has_unfinished:
        now = clock()
        while next_request < len(requests) and due[next_request] <= now:
            engine.submit(requests[next_request])
            next_request += 1
        if not engine.has_unfinished:  # idle until the next arrival
            time.sleep(max(0.0, due[next_request] - clock()))
            continue
        step_start = clock()
        output = engine.step()
        stats = output.stats
        steps.append(
            (step_start, clock(), stats.num_prefill_tokens, stats.num_granted, stats.compiled)
        )
    token_s = {rid: list(engine.timings[rid].token_s) for rid in arrival_s}
    return LoadRun(arrival_s, token_s, steps)


def _percentile_ms(values, q: float) -> float:
    values = np.asarray(values, np.float64)
    return float(np.percentile(values, q) * 1e3) if values.size else float("nan")


def load_figures(run: LoadRun) -> dict:
    """The row's figures (module docstring) from a ``LoadRun``."""
    ttft = [run.token_s[rid][0] - at for rid, at in run.arrival_s.items() if run.token_s[rid]]
    prefill_ends = np.array([end for _, end, tokens, _, _ in run.steps if tokens], np.float64)
    gaps, admission_gaps = [], []
    for times in run.token_s.values():
        for before, after in itertools.pairwise(times):
            gaps.append(after - before)
            # A gap that a prefilling step ended inside: an admission window.
            if np.any((prefill_ends > before) & (prefill_ends <= after)):
                admission_gaps.append(after - before)
    first = min(run.arrival_s.values())
    last = max((times[-1] for times in run.token_s.values() if times), default=first)
    tokens = sum(len(times) for times in run.token_s.values())
    walls = [end - start for start, end, _, _, compiled in run.steps if not compiled]
    return {
        "ttft_p50_ms": _percentile_ms(ttft, 50),
        "ttft_p99_ms": _percentile_ms(ttft, 99),
        "itl_p50_ms": _percentile_ms(gaps, 50),
        "itl_p99_ms": _percentile_ms(gaps, 99),
        "itl_admission_p50_ms": _percentile_ms(admission_gaps, 50),
        "itl_admission_p99_ms": _percentile_ms(admission_gaps, 99),
        "tokens_per_s": tokens / (last - first) if last > first else float("nan"),
        "requests": len(run.arrival_s),
        "steps": len(run.steps),
        "prefill_steps": int(prefill_ends.size),
        "granted_chunks": sum(granted for _, _, _, granted, _ in run.steps),
        "compiled_steps": sum(compiled for *_, compiled in run.steps),
        "step_samples_us": [wall * 1e6 for wall in walls],
    }


def run_load_case(make_engine, scenario: LoadScenario, chunk: int, interval: int, vocab: int):
    """One configuration: a warm-up run (every request at once), then the measured run.

    Args:
      make_engine: ``(prefill_chunk_size, max_batched_tokens, prefill_grant_interval) ->
        Engine``, a fresh engine each call.

    Returns:
      ``(figures, engine)``: ``load_figures`` of the measured run, and its engine.
    """
    arrivals = scenario.arrivals(vocab)
    budget = scenario.parallel + chunk
    warm = make_engine(chunk, budget, interval)
    warm.generate(_requests(scenario, arrivals, "warm"))
    del warm
    engine = make_engine(chunk, budget, interval)
    run = run_load(engine, scenario, arrivals, "load")
    figures = load_figures(run)
    figures.update(
        prefill_chunk_size=chunk,
        prefill_grant_interval=interval,
        max_batched_tokens=budget,
        rate_per_s=scenario.rate_per_s,
        duration_s=scenario.duration_s,
        prompt_lengths=list(scenario.prompt_lengths),
        new_tokens=scenario.new_tokens,
        parallel=scenario.parallel,
    )
    return figures, engine


def load_row(case: str, arm: str, attribution: str, figures: dict) -> CaseResult:
    """The report row: the step times as its timing; no bytes (a mix of prefill and decode)."""
    samples = figures["step_samples_us"] or [float("nan")]
    return CaseResult(
        case=case,
        arm=arm,
        attribution=attribution,
        median_us=statistics.median(samples),
        min_us=min(samples),
        max_us=max(samples),
        bytes=0,
        achieved_tbps=0.0,
        fraction_of_ceiling=0.0,
        extra=figures,
    )
