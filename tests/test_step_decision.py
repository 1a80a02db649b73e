"""``serving.step_decision.decide_step``: the budget, the fairness grant's bound, purity.

The bound: under any decode load and any arrivals and departures of prefills, a prefilling
request goes at most ``N = prefill_grant_interval`` steps in a row without a chunk, so it gets
one at least once every ``N + 1`` steps. Hypothesis drives the decision through random runs,
carrying only what ``decide_step`` returns. The scheduler's own state machine
(``tests/test_scheduler.py``) checks the same bound on real plans, and ``tests/test_engine.py``
on the engine's first token under full decode load.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.step_decision import StepBudget, StepState, decide_step, prefill_budget

budgets = st.builds(
    StepBudget,
    max_batched_tokens=st.one_of(st.none(), st.integers(1, 24)),
    max_prefill_tokens=st.integers(1, 16),
    prefill_chunk_size=st.sampled_from([1, 2, 4, 8]),
    prefill_grant_interval=st.integers(0, 5),
)
# One step of load: the decode rows' tokens, prompts arriving (tokens to prefill), and which of
# the prefills leave (preempted: an index into the current list, modulo its length).
steps = st.tuples(
    st.integers(0, 32),
    st.lists(st.integers(1, 64), max_size=2),
    st.lists(st.integers(0, 7), max_size=1),
)


def _run(budget: StepBudget, load) -> list[tuple[StepState, object]]:
    """Drives ``decide_step`` through ``load``; returns each step's (state, plan)."""
    state = StepState(budget, decode_tokens=0, prefills=())
    next_id = 0
    history = []
    for decode_tokens, arrivals, departures in load:
        prefills = list(state.prefills)
        for index in departures:
            if prefills:
                del prefills[index % len(prefills)]
        for tokens in arrivals:
            prefills.append((next_id, tokens))
            next_id += 1
        state = dataclasses.replace(state, decode_tokens=decode_tokens, prefills=tuple(prefills))
        plan, next_state = decide_step(state)
        history.append((state, plan))
        state = next_state
    return history


@given(budget=budgets, load=st.lists(steps, min_size=1, max_size=40))
def test_a_parked_prefill_waits_at_most_n_steps_for_a_chunk(budget, load):
    """No prefill goes more than N steps in a row without a chunk, whatever the load; and the
    plan keeps the budget (beyond it only one chunk a granted request)."""
    parked: dict[int, int] = {}
    for state, plan in _run(budget, load):
        tokens = dict(plan.prefill_tokens)
        assert [rid for rid, _ in plan.prefill_tokens] == [rid for rid, _ in state.prefills]
        within = sum(count for rid, count in tokens.items() if rid not in plan.granted)
        assert within <= prefill_budget(budget, state.decode_tokens)
        for rid, remaining in state.prefills:
            assert 0 <= tokens[rid] <= remaining
            if rid in plan.granted:
                assert tokens[rid] == min(remaining, budget.prefill_chunk_size)
            parked[rid] = 0 if tokens[rid] else parked.get(rid, 0) + 1
            assert parked[rid] <= budget.prefill_grant_interval, f"request {rid} starves"
        for rid in set(parked) - {rid for rid, _ in state.prefills}:
            del parked[rid]


@given(budget=budgets, load=st.lists(steps, min_size=1, max_size=12))
def test_decide_step_is_a_pure_function_of_its_state(budget, load):
    """The same state gives the same plan and next state, however often it is asked (no
    history kept outside the state)."""
    for state, plan in _run(budget, load):
        assert decide_step(state) == decide_step(state)
        assert decide_step(state)[0] == plan


def test_without_the_grant_a_prefill_under_full_decode_load_starves():
    """The bound is the grant's doing: with decodes filling the budget every step, a prefill
    gets nothing for as long as the interval allows (here 1000 steps), and with N = 2 a chunk
    every third step."""
    for interval, expected in ((1000, [0] * 12), (2, [0, 0, 4] * 4)):
        budget = StepBudget(8, 8, prefill_chunk_size=4, prefill_grant_interval=interval)
        state = StepState(budget, decode_tokens=8, prefills=(("long", 10_000),))
        got = []
        for _ in range(12):
            plan, state = decide_step(dataclasses.replace(state, decode_tokens=8))
            got.append(dict(plan.prefill_tokens)["long"])
        assert got == expected


def test_the_budget_goes_to_the_oldest_prefill_first():
    budget = StepBudget(10, 6, prefill_chunk_size=4, prefill_grant_interval=3)
    state = StepState(budget, decode_tokens=2, prefills=(("old", 4), ("new", 9)))
    plan, after = decide_step(state)
    assert plan.prefill_tokens == (("old", 4), ("new", 2)) and plan.granted == ()
    assert after.prefills == (("new", 7),) and after.waits == (("new", 0),)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_batched_tokens": 0}, "max_batched_tokens must be an integer >= 1, got 0"),
        ({"max_prefill_tokens": 0}, "max_prefill_tokens must be an integer >= 1, got 0"),
        ({"prefill_chunk_size": 2.0}, "prefill_chunk_size must be an integer >= 1, got 2.0"),
        ({"prefill_grant_interval": -1}, "prefill_grant_interval must be an integer >= 0"),
        ({"prefill_grant_interval": True}, "prefill_grant_interval must be an integer >= 0"),
    ],
)
def test_budget_rejects_bad_values_by_name(fields, message):
    base = dict(max_batched_tokens=8, max_prefill_tokens=8, prefill_chunk_size=4)
    with pytest.raises(ValueError, match=message):
        StepBudget(**(base | fields))


@pytest.mark.parametrize(
    ("decode_tokens", "prefills", "message"),
    [
        (-1, (), "decode_tokens must be >= 0, got -1"),
        (0, (("a", 0),), "prefill of 'a' has 0 tokens left"),
        (0, (("a", 3), ("a", 2)), "prefills name a request twice"),
    ],
)
def test_decide_step_rejects_bad_states_by_name(decode_tokens, prefills, message):
    state = StepState(StepBudget(8, 8, 4), decode_tokens=decode_tokens, prefills=prefills)
    with pytest.raises(ValueError, match=message):
        decide_step(state)
