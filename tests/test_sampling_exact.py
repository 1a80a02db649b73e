"""Exact enumeration of the dual-pivot rejection sampler's output distribution (float64).

A sampler is a function from uniforms to a token. One round's token is a step function of its
uniform, with breakpoints at the running sums of the candidates' weights; the round's next state
depends only on that token. So the whole output distribution is a finite sum over the tree of
rounds: for each state, walk the intervals of the uniform, ask the reference's own
``inverse_transform`` which token each interval gives and the reference's own ``pivot_round``
what follows, and weight by the interval's length. States repeat along different paths, so the
walk is memoized on the state. At the round bound the fallback's distribution is enumerated the
same way.

The enumerated distribution must equal the filtered target (``sampling.filters``, the
definition) within 1e-12, for hypothesis-drawn distributions of 1 to 12 tokens (simplex points,
near one-hot, uniform, exact ties, zeros, 1e-30 values) and every filter, both orders and the
parameter edges (k = 1, k = V, top_p tiny, top_p = 1, min_p = 0 and 1). Theorems 2 and 3 of
``proofs/sampling.md``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sampling import reference
from sampling.filters import FilterParams, filtered_distribution
from tests.conftest import enable_x64
from tests.strategies import probability_vectors

TOLERANCE = 1e-12


@functools.cache
def _jitted_round():
    return jax.jit(reference.pivot_round)


@functools.cache
def _jitted_inverse_transform():
    return jax.jit(reference.inverse_transform)


@functools.cache
def _jitted_min_p_sample():
    """``reference.filtered_sample_from_uniforms`` with min-p alone, ``min_p`` as data: one
    compile for every example (traced eagerly, each call compiled its rounds' loop again)."""
    return jax.jit(
        lambda probs, uniforms, min_p: reference.filtered_sample_from_uniforms(
            probs, uniforms, min_p=min_p
        )
    )


def _intervals(weights: jax.Array):
    """The uniform's intervals ``(token, start, end)`` of positive length: token j owns
    ``[F[j-1], F[j])`` of the normalized running sums ``F`` the reference computes (the same
    float operations, so the same floats). Which token an interval gives is asked of the
    reference's own ``inverse_transform`` at the interval's start, a point inside it."""
    cumulative = jnp.cumsum(weights)
    ends = np.asarray(cumulative / cumulative[-1])
    starts = np.concatenate([[0.0], ends[:-1]])
    choose = _jitted_inverse_transform()
    for token in np.flatnonzero(ends > starts):
        chosen = int(choose(weights, starts[token]))
        assert chosen == token, (chosen, token, starts[token], ends[token])
        yield token, starts[token], ends[token]


def enumerate_distribution(probs: np.ndarray, params: FilterParams, order: str, max_rounds: int):
    """float64 ``[V]``: the exact output distribution of
    ``reference.filtered_sample_row_from_uniforms`` with ``max_rounds`` rounds."""
    probs = jnp.asarray(probs, jnp.float64)
    vocab = probs.shape[0]
    params = FilterParams(
        top_k=jnp.asarray(params.top_k, jnp.int32),
        top_p=jnp.asarray(params.top_p, jnp.float64),
        min_p=jnp.asarray(params.min_p, jnp.float64),
    )
    stats = reference.row_stats(probs, params, order)
    kept = jnp.where(reference.kept_mask(probs, params, order), probs, 0)
    fallback = np.zeros(vocab)
    for token, start, end in _intervals(kept):
        fallback[token] += end - start
    step = _jitted_round()

    @functools.cache
    def from_state(low_value: float, low_index: int, high_value: float, rounds: int):
        if rounds == max_rounds:
            return fallback
        state = reference.PivotState(
            low_value=jnp.float64(low_value),
            low_index=jnp.int32(low_index),
            high_value=jnp.float64(high_value),
            token=jnp.int32(-1),
            rounds=jnp.int32(rounds),
        )
        candidates = reference.above(probs, state.low_value, state.low_index)
        result = np.zeros(vocab)
        for token, start, end in _intervals(jnp.where(candidates, probs, 0)):
            after = step(probs, params, stats, state, start)
            if int(after.token) >= 0:
                assert int(after.token) == token
                result[token] += end - start
            else:
                # The rejected token must have left the candidates (termination).
                still = reference.above(probs, after.low_value, after.low_index)
                assert not bool(still[token])
                result += (end - start) * from_state(
                    float(after.low_value),
                    int(after.low_index),
                    float(after.high_value),
                    rounds + 1,
                )
        return result

    start = reference.initial_state(probs, params.min_p)
    return from_state(float(start.low_value), int(start.low_index), float(start.high_value), 0)


FILTER_KINDS = ("top_k", "top_p", "min_p", "joint", "top_k_first", "all")


@st.composite
def filtered_cases(draw):
    vocab = draw(st.integers(1, 12))
    probs = draw(probability_vectors(vocab))
    kind = draw(st.sampled_from(FILTER_KINDS))
    top_k = draw(st.one_of(st.sampled_from([1, vocab]), st.integers(1, vocab)))
    top_p = draw(st.one_of(st.sampled_from([1e-9, 0.5, 0.9, 1.0]), st.floats(1e-6, 1.0)))
    min_p = draw(st.one_of(st.sampled_from([0.0, 0.1, 1.0]), st.floats(0.0, 1.0)))
    params = FilterParams(
        top_k=top_k if kind in ("top_k", "joint", "top_k_first", "all") else vocab,
        top_p=top_p if kind in ("top_p", "joint", "top_k_first", "all") else 1.0,
        min_p=min_p if kind in ("min_p", "all") else 0.0,
    )
    order = "top_k_first" if kind == "top_k_first" else "joint"
    max_rounds = draw(st.sampled_from([1, 2, 32]))
    return probs, params, order, max_rounds


@settings(max_examples=60)
@given(filtered_cases())
def test_enumerated_distribution_equals_the_filtered_target(case):
    probs, params, order, max_rounds = case
    with enable_x64():
        target = np.asarray(
            filtered_distribution(
                jnp.asarray(probs, jnp.float64),
                FilterParams(
                    jnp.int32(params.top_k), jnp.float64(params.top_p), jnp.float64(params.min_p)
                ),
                order,
            )
        )
        enumerated = enumerate_distribution(probs, params, order, max_rounds)
    np.testing.assert_allclose(enumerated, target, rtol=0, atol=TOLERANCE)


def test_ties_at_the_top_k_cut_off_are_resolved_by_index():
    """FlashInfer's known case: [0.4, 0.3, 0.3] with k = 2 keeps tokens 0 and 1 only."""
    with enable_x64():
        enumerated = enumerate_distribution(
            np.array([0.4, 0.3, 0.3]), FilterParams(2, 1.0, 0.0), "joint", 32
        )
    np.testing.assert_allclose(enumerated, [4 / 7, 3 / 7, 0.0], rtol=0, atol=TOLERANCE)


def test_rounds_are_bounded_by_the_rejectable_tokens():
    """Every rejection removes its token from the candidates (asserted inside the enumeration),
    so a row never needs more rounds than it has tokens outside the kept set, plus one."""
    with enable_x64():
        probs = jnp.asarray(np.full(12, 1 / 12), jnp.float64)  # all tied: the hardest case
        uniforms = jnp.full((1, 14), 1 - 1e-9)  # always draw the last candidate
        token, rounds = reference.filtered_sample_from_uniforms(probs[None], uniforms, top_k=1)
    assert int(token[0]) == 0 and int(rounds[0]) <= 12


MIN_P_WIDTH = 12


@settings(max_examples=40)
@given(
    st.integers(1, MIN_P_WIDTH).flatmap(probability_vectors),
    st.one_of(st.sampled_from([1e-9, 0.1, 1.0]), st.floats(1e-6, 1.0)),
    st.floats(1e-6, 1 - 1e-6),
)
def test_min_p_alone_decides_in_one_round_from_its_kept_set(probs, min_p, uniform):
    """With min-p the rounds start from min-p's kept set (``reference.initial_state``): the
    candidates are exactly ``kept_mask``'s tokens, so with no other filter the first draw is
    accepted, whatever its uniform; the enumeration above shows the draw is exact."""
    # Zero-probability tokens pad every row to one width: one shape, so the eager reference
    # compiles its operations once instead of once per vocabulary size (40 s -> a few).
    probs = np.pad(np.asarray(probs, np.float64), (0, MIN_P_WIDTH - len(probs)))
    with enable_x64():
        probs = jnp.asarray(probs, jnp.float64)
        params = FilterParams(jnp.int32(probs.shape[0]), jnp.float64(1.0), jnp.float64(min_p))
        start = reference.initial_state(probs, params.min_p)
        candidates = reference.above(probs, start.low_value, start.low_index)
        kept = reference.kept_mask(probs, params, "joint")
        positive = probs > 0
        np.testing.assert_array_equal(np.asarray(candidates & positive), np.asarray(kept))
        uniforms = jnp.full((1, 33), uniform, jnp.float64)
        token, rounds = _jitted_min_p_sample()(probs[None], uniforms, jnp.float64(min_p))
    assert int(rounds[0]) == 1
    assert bool(kept[int(token[0])])


# ----------------------------------------------------------------------------------------------
# Many exact ties at the cut-off. Weights are integer counts / 64, so every sum is exact in
# float64 and the decisions below are not near a rounding: a block of tied tokens (count
# TIE_COUNT, scattered over the indices) straddles each filter's cut-off, and only the index
# decides which of them are kept. The largest count is 8, so min-p's threshold
# ``(TIE_COUNT / 8) * max`` is exactly the tied value.
TIE_COUNT = 3


@st.composite
def cut_off_tie_cases(draw):
    """``(weights [V], params, order, expected_kept bool [V])`` with the cut-off inside a tie
    block; ``expected_kept`` written from the rule alone (lowest indices of the tie first)."""
    above = [*draw(st.lists(st.sampled_from([5, 6, 7]), max_size=3)), 8]
    ties = draw(st.integers(2, 6))
    below = draw(st.lists(st.sampled_from([0, 1, 2]), max_size=3))
    counts = np.array(above + [TIE_COUNT] * ties + below, np.float64)
    counts = counts[draw(st.permutations(range(counts.size)))]
    weights = counts / 64
    vocab = weights.size
    tied = np.flatnonzero(counts == TIE_COUNT)  # ascending index: the order among the ties
    kept_ties = draw(st.integers(1, ties - 1))  # the cut-off falls after this many
    kind = draw(st.sampled_from(["top_k", "top_p", "joint", "top_k_first", "min_p"]))
    mass_above = weights[counts > TIE_COUNT].sum()
    total = weights.sum()
    tie = TIE_COUNT / 64
    expected = counts > TIE_COUNT
    if kind == "min_p":
        # Exactly the tied value: every tie is kept (p >= min_p * max holds with equality).
        params = FilterParams(vocab, 1.0, TIE_COUNT / 8)
        expected[tied] = True
        return weights, params, "joint", expected
    expected[tied[:kept_ties]] = True
    # top-p halfway into the last kept tie's mass: tokens ranked before it are short of the
    # target, the next tie is past it.
    top_p = (mass_above + (kept_ties - 0.5) * tie) / total
    count_above = int((counts > TIE_COUNT).sum())
    if kind == "top_k":
        params = FilterParams(count_above + kept_ties, 1.0, 0.0)
    elif kind == "top_p":
        params = FilterParams(vocab, top_p, 0.0)
    elif kind == "joint":  # top-k cuts at the same tie, top-p one tie later (k decides)
        expected_p = (mass_above + (kept_ties + 0.5) * tie) / total
        params = FilterParams(count_above + kept_ties, min(expected_p, 1.0), 0.0)
    else:  # top-p of the renormalized top-k, where top-k keeps every tie
        nucleus = mass_above + ties * tie
        params = FilterParams(
            count_above + ties, (mass_above + (kept_ties - 0.5) * tie) / nucleus, 0.0
        )
    return weights, params, kind if kind == "top_k_first" else "joint", expected


@settings(max_examples=60)
@given(cut_off_tie_cases(), st.sampled_from([1, 2, 32]))
def test_ties_at_the_cut_off_are_kept_lowest_index_first_exactly(case, max_rounds):
    """The enumerated output of the rejection sampler is exactly the kept weights renormalized,
    where the kept set is written from the tie rule alone: of the tokens tied at the cut-off,
    the lowest indices are kept (all of them at min-p's threshold)."""
    weights, params, order, expected_kept = case
    target = np.where(expected_kept, weights, 0.0)
    target /= target.sum()
    with enable_x64():
        enumerated = enumerate_distribution(weights, params, order, max_rounds)
        definition = np.asarray(
            filtered_distribution(
                jnp.asarray(weights),
                FilterParams(
                    jnp.int32(params.top_k), jnp.float64(params.top_p), jnp.float64(params.min_p)
                ),
                order,
            )
        )
    np.testing.assert_allclose(definition, target, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(enumerated, target, rtol=0, atol=TOLERANCE)
