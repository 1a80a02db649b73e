"""What a step carries: decodes first, then prefill up to a token budget, and a fairness grant.

``decide_step(state) -> (plan, next_state)`` is a pure function. Everything it decides from is in
``state``, the grant counters included, and the counters it leaves for the next step are in
``next_state``: nothing is remembered anywhere else. The scheduler (``serving/scheduler.py``)
fills in the load of the step (decode rows, prefills still to run) and carries the counters from
one call to the next.

Why a grant
-----------
A step always runs every decoding row (the decode batch is static), so decodes come first and a
prefill gets what is left of the step's token budget: ``min(max_prefill_tokens,
max_batched_tokens - decode_tokens)``, oldest prefill first. Under a heavy decode load, or behind
an older prompt that takes the whole prefill budget, a prefill may get nothing step after step.
A decision that looks only at the current load cannot alternate (the same load gives the same
answer forever), so a parked prefill could starve. The state therefore carries, per prefilling
request, the steps it has waited without a chunk; when that count reaches
``prefill_grant_interval`` (``N``), the request gets one chunk (``prefill_chunk_size`` tokens,
or what it has left) in this step whatever the budget says. So a prefilling request gets a chunk
at least once every ``N + 1`` steps, under any decode load and any arrivals
(``tests/test_step_decision.py`` checks that bound as a property).

The price: a granted chunk goes beyond the budget, so a step that grants is longer. The chunk
size sets how much longer (the hiccup's height); the interval only sets how often.

Example:
  >>> budget = StepBudget(max_batched_tokens=4, max_prefill_tokens=4, prefill_chunk_size=8,
  ...                     prefill_grant_interval=1)
  >>> state = StepState(budget, decode_tokens=4, prefills=(("a", 20),))
  >>> plan, state = decide_step(state)  # the decodes fill the budget: "a" waits
  >>> plan.prefill_tokens, state.waits
  ((('a', 0),), (('a', 1),))
  >>> plan, state = decide_step(state)  # waited N = 1 step: granted a chunk
  >>> plan.prefill_tokens, plan.granted, state.waits
  ((('a', 8),), ('a',), (('a', 0),))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

# Steps a prefill may wait without a chunk before the grant gives it one (``N``; the
# engine's and the command line's default). A first guess: the GPU measurement of
# docs/adr/0001-mixed-prefill-decode.md is to tune it.
DEFAULT_PREFILL_GRANT_INTERVAL = 4


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class StepBudget:
    """The limits of one step (fixed for an engine).

    Attributes:
      max_batched_tokens: tokens a step carries at most, decode rows (``n + 1`` tokens each)
        and prefill chunks together; None for no limit beyond ``max_prefill_tokens``. Granted
        chunks may go beyond it (module docstring).
      max_prefill_tokens: prompt tokens a step prefills at most (granted chunks aside).
      prefill_chunk_size: the longest chunk, and the size of a granted chunk.
      prefill_grant_interval: ``N``: a prefill that got no chunk in ``N`` consecutive steps
        gets one in the next.

    Raises:
      ValueError: naming the field and the bad value (sizes below 1, an interval below 0).
    """

    max_batched_tokens: int | None
    max_prefill_tokens: int
    prefill_chunk_size: int
    prefill_grant_interval: int = DEFAULT_PREFILL_GRANT_INTERVAL

    def __post_init__(self):
        if self.max_batched_tokens is not None:
            _check_int("max_batched_tokens", self.max_batched_tokens, 1)
        _check_int("max_prefill_tokens", self.max_prefill_tokens, 1)
        _check_int("prefill_chunk_size", self.prefill_chunk_size, 1)
        _check_int("prefill_grant_interval", self.prefill_grant_interval, 0)


@dataclasses.dataclass(frozen=True)
class StepState:
    """Everything ``decide_step`` decides from.

    Attributes:
      budget: the step's limits.
      decode_tokens: tokens of the rows that decode in this step (``n + 1`` a row).
      prefills: ``(request id, prompt tokens still to prefill)`` of every prefilling request,
        oldest first; each count ``>= 1``.
      waits: ``(request id, steps waited without a chunk)``: the grant counters, as the last
        decision left them. Requests not in ``prefills`` are ignored (finished or preempted);
        a request in ``prefills`` but not here has waited 0 steps (just admitted).
    """

    budget: StepBudget
    decode_tokens: int
    prefills: tuple[tuple[Hashable, int], ...]
    waits: tuple[tuple[Hashable, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a step prefills.

    Attributes:
      prefill_tokens: ``(request id, tokens to prefill in this step)`` for every request of
        ``state.prefills``, in that order (0: it waits).
      granted: the requests whose tokens the grant gave beyond the budget.
    """

    prefill_tokens: tuple[tuple[Hashable, int], ...]
    granted: tuple[Hashable, ...]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(tokens for _, tokens in self.prefill_tokens)


def prefill_budget(budget: StepBudget, decode_tokens: int) -> int:
    """Prompt tokens a step may prefill within its budget after ``decode_tokens`` (>= 0)."""
    left = budget.max_prefill_tokens
    if budget.max_batched_tokens is not None:
        left = min(left, budget.max_batched_tokens - decode_tokens)
    return max(left, 0)


def decide_step(state: StepState) -> tuple[StepPlan, StepState]:
    """Decides a step's prefill tokens: the budget left after the decodes, oldest prefill
    first, then a grant of one chunk to each prefill that has waited ``N`` steps.

    Args:
      state: the step's ``StepState``.

    Returns:
      ``(plan, next_state)``: ``next_state`` has the prefills' remaining counts after this
      step (those done dropped) and the updated grant counters; the caller replaces the load
      (``decode_tokens``, ``prefills``) with the next step's before deciding it.

    Raises:
      ValueError: a negative ``decode_tokens``, a prefill with nothing left, a request twice.
    """
    if isinstance(state.decode_tokens, bool) or state.decode_tokens < 0:
        raise ValueError(f"decode_tokens must be >= 0, got {state.decode_tokens!r}")
    ids = [request_id for request_id, _ in state.prefills]
    if len(set(ids)) != len(ids):
        raise ValueError(f"prefills name a request twice: {ids}")
    for request_id, remaining in state.prefills:
        if remaining < 1:
            raise ValueError(f"prefill of {request_id!r} has {remaining} tokens left; needs >= 1")
    budget = state.budget
    waited = dict(state.waits)
    left = prefill_budget(budget, state.decode_tokens)
    tokens = {}
    for request_id, remaining in state.prefills:  # oldest first, within the budget
        tokens[request_id] = min(remaining, left)
        left -= tokens[request_id]
    granted = []
    for request_id, remaining in state.prefills:
        if tokens[request_id] == 0 and waited.get(request_id, 0) >= budget.prefill_grant_interval:
            tokens[request_id] = min(remaining, budget.prefill_chunk_size)
            granted.append(request_id)
    plan = StepPlan(tuple((rid, tokens[rid]) for rid, _ in state.prefills), tuple(granted))
    next_waits = tuple(
        (rid, 0 if tokens[rid] else waited.get(rid, 0) + 1)
        for rid, remaining in state.prefills
        if remaining > tokens[rid]
    )
    next_prefills = tuple(
        (rid, remaining - tokens[rid])
        for rid, remaining in state.prefills
        if remaining > tokens[rid]
    )
    return plan, dataclasses.replace(state, prefills=next_prefills, waits=next_waits)
