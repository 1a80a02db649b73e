"""Merging attention states: any split of the keys, merged in any order, is attention over all.

The claims and their proofs are in ``proofs/merge_states.md``; each theorem there names the tests
here that check it. States of key subsets come from the independent float64 oracle
(``reference_dense.dense_attention``) or from ``paged.decode_attention`` itself, and are merged
with ``paged.merge_states`` (all at once) and ``paged.merge_state`` (pairwise, in random trees).
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jitted_reference import reference_decode
from reference_dense import dense_attention, merge_oracle, paged_attention_oracle, relative_error

import paged

NUM_KEYS, NUM_PARTS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 24, 4, 4, 2, 8
# Relative error of float64 merges against float64 attention over all keys.
FLOAT64_TOLERANCE = 1e-12

# The ``float64`` fixture switches x64 on for the whole test, every hypothesis example included,
# which is what these tests want; hypothesis warns about function-scoped fixtures regardless.
with_float64_fixture = settings(
    suppress_health_check=[
        *settings.default.suppress_health_check,
        HealthCheck.function_scoped_fixture,
    ]
)


def _random_attention_inputs(seed: int, query_scale: float):
    rng = np.random.default_rng(seed)
    q = query_scale * rng.standard_normal((NUM_HEADS, HEAD_DIM))
    keys = rng.standard_normal((NUM_KEYS, NUM_KV_HEADS, HEAD_DIM))
    values = rng.standard_normal((NUM_KEYS, NUM_KV_HEADS, HEAD_DIM))
    return q, keys, values


def _part_states(q, keys, values, parts):
    """The oracle's state ``(v [H, D], s [H])`` over each list of key indices in ``parts``."""
    return [dense_attention(q, keys[part], values[part], sm_scale=HEAD_DIM**-0.5) for part in parts]


def _merge_in_random_tree(data, states):
    """Merges ``states`` pairwise with ``paged.merge_state``: hypothesis picks which two to merge
    next and in which argument order, so every merge tree and every order can occur."""
    pending = [(jnp.asarray(v), jnp.asarray(s)) for v, s in states]
    while len(pending) > 1:
        i, j = data.draw(
            st.lists(st.integers(0, len(pending) - 1), min_size=2, max_size=2, unique=True),
            label="merge pair (first argument, second argument)",
        )
        merged = paged.merge_state(*pending[i], *pending[j])
        pending = [state for k, state in enumerate(pending) if k not in (i, j)] + [merged]
    return pending[0]


def _assert_state_close(state, expected, tolerance=FLOAT64_TOLERANCE):
    (v, s), (v_expected, s_expected) = state, expected
    v, s = np.asarray(v), np.asarray(s)
    assert not np.isnan(v).any() and not np.isnan(s).any()
    assert relative_error(v, v_expected) < tolerance
    np.testing.assert_allclose(s, s_expected, rtol=tolerance, atol=tolerance)


def _check_merges_of_parts(data, q, keys, values, parts):
    """Merge the parts' states all at once (in a shuffled order) and in a random tree; both must
    equal attention over every key."""
    whole = dense_attention(q, keys, values, sm_scale=HEAD_DIM**-0.5)
    states = _part_states(q, keys, values, parts)
    order = data.draw(st.permutations(range(len(states))), label="order for merge_states")
    stacked_v = jnp.asarray(np.stack([states[i][0] for i in order]))  # [S, H, D]
    stacked_s = jnp.asarray(np.stack([states[i][1] for i in order]))  # [S, H]
    merged = paged.merge_states(stacked_v, stacked_s)
    assert merged[0].dtype == jnp.float64
    _assert_state_close(merged, whole)
    _assert_state_close(_merge_in_random_tree(data, states), whole)


@with_float64_fixture
@given(
    cuts=st.lists(st.integers(0, NUM_KEYS), min_size=NUM_PARTS - 1, max_size=NUM_PARTS - 1).map(
        sorted
    ),
    seed=st.integers(0, 2**32 - 1),
    query_scale=st.sampled_from([0.1, 1.0, 30.0]),
    data=st.data(),
)
def test_merge_of_any_split_equals_attention_over_all_keys(float64, cuts, seed, query_scale, data):
    """Keys cut at random points into contiguous parts (repeated cuts give empty parts), as
    split-KV decode and cascade attention cut them."""
    q, keys, values = _random_attention_inputs(seed, query_scale)
    bounds = [0, *cuts, NUM_KEYS]
    parts = [list(range(bounds[i], bounds[i + 1])) for i in range(NUM_PARTS)]
    _check_merges_of_parts(data, q, keys, values, parts)


@with_float64_fixture
@given(
    labels=st.lists(st.integers(0, NUM_PARTS - 1), min_size=NUM_KEYS, max_size=NUM_KEYS),
    seed=st.integers(0, 2**32 - 1),
    query_scale=st.sampled_from([0.1, 1.0, 30.0]),
    data=st.data(),
)
def test_merge_of_any_partition_equals_attention_over_all_keys(
    float64, labels, seed, query_scale, data
):
    """Keys dealt to parts arbitrarily (not contiguous; parts may be empty), as sparse decode
    selects them."""
    q, keys, values = _random_attention_inputs(seed, query_scale)
    parts = [[t for t, label in enumerate(labels) if label == part] for part in range(NUM_PARTS)]
    _check_merges_of_parts(data, q, keys, values, parts)


PAGE_SIZE = 4
SPLIT_POOL_PAGES = 12


@given(
    part_pages=st.lists(st.integers(0, 3), min_size=NUM_PARTS, max_size=NUM_PARTS),
    last_page_len=st.integers(1, PAGE_SIZE),
    pool_order=st.permutations(range(SPLIT_POOL_PAGES)),
    seed=st.integers(0, 2**32 - 1),
)
def test_split_kv_decode_merges_to_full_decode(part_pages, last_page_len, pool_order, seed):
    """Split-KV decode as a kernel does it: one request's pages dealt, in order, to ``S`` parts
    (some empty); ``decode_attention`` on each part (the parts form one batch), then
    ``merge_states``. Float32 throughout, so the bound is float32's 1e-5."""
    rng = np.random.default_rng(seed)
    num_pages = sum(part_pages)
    if num_pages == 0:
        part_pages = [0, 1, 0, 0]  # the request must have a token for the comparison to mean much
        num_pages = 1
    pages = list(pool_order[:num_pages])
    seq_len = PAGE_SIZE * (num_pages - 1) + last_page_len
    shape = (SPLIT_POOL_PAGES, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
    cache = paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
    )
    q = jnp.asarray(rng.standard_normal((1, NUM_HEADS, HEAD_DIM)), jnp.float32)

    # Every part but the one holding the last page has only full pages.
    part_lists, part_lens, start = [], [], 0
    for count in part_pages:
        part_lists.append(pages[start : start + count])
        start += count
        holds_last_page = count and start == num_pages
        part_lens.append(PAGE_SIZE * count - (PAGE_SIZE - last_page_len if holds_last_page else 0))
    parts_table = paged.PageTable.from_page_lists(
        part_lists, part_lens, PAGE_SIZE, num_indices=SPLIT_POOL_PAGES
    )
    whole_table = paged.PageTable.from_page_lists(
        [pages], [seq_len], PAGE_SIZE, num_indices=SPLIT_POOL_PAGES
    )
    part_o, part_lse = reference_decode(jnp.repeat(q, NUM_PARTS, axis=0), cache, parts_table)
    merged_o, merged_lse = paged.merge_states(part_o, part_lse)  # [S, H, D] -> [H, D]

    o_ref, lse_ref = paged_attention_oracle(
        q, cache.k_pages, cache.v_pages, "HND", whole_table, sm_scale=HEAD_DIM**-0.5
    )
    assert relative_error(merged_o, o_ref[0]) < 1e-5
    np.testing.assert_allclose(np.asarray(merged_lse), lse_ref[0], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Empty states, extreme log-sum-exps, algebra
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_empty_states_merge_to_zero_and_minus_inf(float64, dtype):
    """``(v, -inf)`` is the state of no keys; its ``v`` is ignored (here it is not even 0)."""
    v_empty = jnp.full((NUM_HEADS, HEAD_DIM), 7.0, dtype)
    s_empty = jnp.full((NUM_HEADS,), -jnp.inf, dtype)
    v, s = paged.merge_state(v_empty, s_empty, v_empty, s_empty)
    assert not np.isnan(np.asarray(v)).any()
    assert (np.asarray(v) == 0).all() and (np.asarray(s) == -np.inf).all()
    v, s = paged.merge_states(jnp.stack([v_empty] * NUM_PARTS), jnp.stack([s_empty] * NUM_PARTS))
    assert (np.asarray(v) == 0).all() and (np.asarray(s) == -np.inf).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_empty_state_is_the_identity_of_merge(float64, dtype):
    """Merging with the empty state returns the other state bit for bit, in either order."""
    rng = np.random.default_rng(11)
    v_a = jnp.asarray(rng.standard_normal((NUM_HEADS, HEAD_DIM)), dtype)
    s_a = jnp.asarray(rng.standard_normal(NUM_HEADS) * 50, dtype)
    v_empty = jnp.full((NUM_HEADS, HEAD_DIM), -3.0, dtype)
    s_empty = jnp.full((NUM_HEADS,), -jnp.inf, dtype)
    for v, s in (
        paged.merge_state(v_a, s_a, v_empty, s_empty),
        paged.merge_state(v_empty, s_empty, v_a, s_a),
    ):
        np.testing.assert_array_equal(np.asarray(v), np.asarray(v_a))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s_a))


# (s_a, s_b) pairs whose exponentials overflow (or underflow to 0) in the dtype: a merge that
# exponentiated without subtracting the maximum would return inf, 0/0 or a lost state.
EXTREME_PAIRS = {
    jnp.float32: [(100.0, 100.0), (-120.0, -120.0), (1e4, 0.0), (100.0, -100.0), (-1e4, 1e4)],
    jnp.float64: [(800.0, 800.0), (-800.0, -800.0), (1e4, 0.0), (700.0, -700.0), (-1e4, 1e4)],
}


@pytest.mark.parametrize(
    "dtype, s_a, s_b", [(dtype, *pair) for dtype, pairs in EXTREME_PAIRS.items() for pair in pairs]
)
def test_extreme_log_sum_exps_do_not_overflow(float64, dtype, s_a, s_b):
    """The merged state equals the closed form ``v = (v_a + e^{s_b - s_a} v_b) / (1 + e^{s_b - s_a})``
    (``s_a >= s_b``) and ``s = logaddexp(s_a, s_b)``, computed in float64 from the difference only."""
    rng = np.random.default_rng(int(abs(s_a) + abs(s_b)))
    v_a, v_b = rng.standard_normal((2, NUM_HEADS, HEAD_DIM))
    high, low = (v_a, v_b) if s_a >= s_b else (v_b, v_a)
    ratio = np.exp(-abs(s_a - s_b))
    v_expected = (high + ratio * low) / (1 + ratio)
    s_expected = np.full(NUM_HEADS, np.logaddexp(s_a, s_b))
    tolerance = 1e-6 if dtype == jnp.float32 else FLOAT64_TOLERANCE

    v, s = paged.merge_state(
        jnp.asarray(v_a, dtype),
        jnp.full(NUM_HEADS, s_a, dtype),
        jnp.asarray(v_b, dtype),
        jnp.full(NUM_HEADS, s_b, dtype),
    )
    assert np.isfinite(np.asarray(v)).all() and np.isfinite(np.asarray(s)).all()
    _assert_state_close((v, s), (v_expected, s_expected), tolerance)

    # merge_states with a third, empty state must agree.
    stacked_v = jnp.asarray(np.stack([v_a, v_b, np.ones_like(v_a)]), dtype)
    stacked_s = jnp.asarray(np.stack([np.full(NUM_HEADS, x) for x in (s_a, s_b, -np.inf)]), dtype)
    _assert_state_close(
        paged.merge_states(stacked_v, stacked_s), (v_expected, s_expected), tolerance
    )


def _random_state(rng_seed: int, empty: bool):
    rng = np.random.default_rng(rng_seed)
    v = rng.standard_normal((NUM_HEADS, HEAD_DIM))
    s = np.full(NUM_HEADS, -np.inf) if empty else rng.uniform(-50, 50, NUM_HEADS)
    return v, s


states_strategy = st.builds(_random_state, st.integers(0, 2**32 - 1), st.booleans())


@with_float64_fixture
@given(a=states_strategy, b=states_strategy)
def test_merge_state_is_commutative(float64, a, b):
    """``merge(a, b)`` and ``merge(b, a)`` are equal bit for bit (the same two terms are added)."""
    ab = paged.merge_state(*map(jnp.asarray, a), *map(jnp.asarray, b))
    ba = paged.merge_state(*map(jnp.asarray, b), *map(jnp.asarray, a))
    np.testing.assert_array_equal(np.asarray(ab[0]), np.asarray(ba[0]))
    np.testing.assert_array_equal(np.asarray(ab[1]), np.asarray(ba[1]))
    _assert_state_close(ab, merge_oracle([a[0], b[0]], [a[1], b[1]]))


@with_float64_fixture
@given(a=states_strategy, b=states_strategy, c=states_strategy)
def test_merge_state_is_associative(float64, a, b, c):
    """``merge(merge(a, b), c) = merge(a, merge(b, c))`` up to float64 rounding, and both equal
    the oracle's one-step merge of all three."""
    a, b, c = ((jnp.asarray(v), jnp.asarray(s)) for v, s in (a, b, c))
    left = paged.merge_state(*paged.merge_state(*a, *b), *c)
    right = paged.merge_state(*a, *paged.merge_state(*b, *c))
    expected = merge_oracle(
        [np.asarray(x[0]) for x in (a, b, c)], [np.asarray(x[1]) for x in (a, b, c)]
    )
    _assert_state_close(left, expected)
    _assert_state_close(right, expected)


@with_float64_fixture
@given(
    states=st.lists(states_strategy, min_size=NUM_PARTS, max_size=NUM_PARTS),
    shift=st.floats(-600, 600),
)
def test_shifting_every_log_sum_exp_shifts_only_the_merged_one(float64, states, shift):
    """Adding ``c`` to every ``s_i`` leaves the merged ``v`` unchanged and adds ``c`` to ``s``:
    the merge depends on the differences ``s_i - s_j`` alone, which is why subtracting the
    maximum is free (Theorem 3)."""
    v = jnp.asarray(np.stack([state[0] for state in states]))
    s = np.stack([state[1] for state in states])
    v_plain, s_plain = paged.merge_states(v, jnp.asarray(s))
    v_shifted, s_shifted = paged.merge_states(v, jnp.asarray(s + shift))
    assert relative_error(v_shifted, v_plain) < FLOAT64_TOLERANCE
    # The shift itself is rounded when added to s (|s| + |c| up to ~650): an absolute bound.
    np.testing.assert_allclose(np.asarray(s_shifted), np.asarray(s_plain) + shift, atol=1e-12 * 700)


def test_merge_states_merges_along_the_state_axis_under_leading_axes():
    """``v [B, S, H, D]``, ``s [B, S, H]`` merge each batch row separately."""
    rng = np.random.default_rng(2)
    v = rng.standard_normal((3, NUM_PARTS, NUM_HEADS, HEAD_DIM)).astype(np.float32)
    s = rng.uniform(-5, 5, (3, NUM_PARTS, NUM_HEADS)).astype(np.float32)
    s[1, 2] = -np.inf
    merged_v, merged_s = paged.merge_states(jnp.asarray(v), jnp.asarray(s))
    assert merged_v.shape == (3, NUM_HEADS, HEAD_DIM) and merged_s.shape == (3, NUM_HEADS)
    for b in range(3):
        _assert_state_close((merged_v[b], merged_s[b]), merge_oracle(v[b], s[b]), tolerance=1e-6)


SHAPE_ERRORS = [
    (
        lambda: paged.merge_state(jnp.ones((2, 8)), jnp.ones(3), jnp.ones((2, 8)), jnp.ones(2)),
        "s_a must have shape (2,) (that of v_a without its last axis), got (3,)",
    ),
    (
        lambda: paged.merge_state(
            jnp.ones((2, 8)), jnp.ones(2), jnp.ones((2, 8)), jnp.ones((2, 1))
        ),
        "s_b must have shape (2,) (that of v_b without its last axis), got (2, 1)",
    ),
    (
        lambda: paged.merge_state(jnp.ones((2, 8)), jnp.ones(2), jnp.ones((2, 4)), jnp.ones(2)),
        "v_a (2, 8) and v_b (2, 4) differ",
    ),
    (
        lambda: paged.merge_states(jnp.ones((4, 2, 8)), jnp.ones((4, 3))),
        "s must have shape (4, 2) (that of v without its last axis), got (4, 3)",
    ),
    (
        lambda: paged.merge_states(jnp.ones((4, 8)), jnp.ones(4)),
        "v must have shape [..., S, H, D], got (4, 8)",
    ),
]


@pytest.mark.parametrize("call, message", SHAPE_ERRORS)
def test_merge_shape_errors_name_the_argument_and_shape(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


# ------------------------------------------------------------------------------------------------
# The merge kernel over several of its steps
#
# ``merge_partial_states`` folds a request's partial states ``items_per_step`` at a time (8 by
# default, as decode calls it): the rescaling of the running sum between steps, a count that
# does not divide the step, and a step whose states are all empty are what a bug there would get
# wrong. These merge several steps' worth of states per request against the float64 oracle.

KERNEL_KV_HEADS, KERNEL_GROUP, KERNEL_HEAD_DIM = 2, 3, 8
KERNEL_PARTIAL_ROWS = 4  # the group of 3 padded to a power of two, as paged_decode writes it
KERNEL_TOLERANCE = 1e-5  # float32 kernel against the float64 oracle (testing conventions)


def _ragged_counts(items_per_step: int) -> list[int]:
    """States per request: one, one step, a step plus one, two steps plus one, three steps minus
    one (counts that do not divide the step), and a count below one step."""
    step = items_per_step
    return [1, step, step + 1, 2 * step + 1, 3 * step - 1, max(step - 1, 1)]


@pytest.mark.parametrize("items_per_step", [4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_merge_kernel_over_several_steps_matches_the_float64_oracle(
    interpret, items_per_step, seed
):
    from kernels_pallas.merge_states import merge_partial_states

    rng = np.random.default_rng(seed)
    counts = _ragged_counts(items_per_step)
    counts.append(items_per_step + 2)  # a request whose states are all empty
    merge_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    num_work = int(merge_indptr[-1])
    shape = (num_work, KERNEL_KV_HEADS, KERNEL_PARTIAL_ROWS)
    partial_o = rng.standard_normal((*shape, KERNEL_HEAD_DIM)).astype(np.float32)
    # Log-sum-exps far apart, so that every step rescales what came before.
    partial_lse = rng.uniform(-40.0, 40.0, shape).astype(np.float32)
    empty = rng.random(shape) < 0.25  # empty states scattered among the others
    second = slice(merge_indptr[3] + items_per_step, merge_indptr[3] + 2 * items_per_step)
    empty[second] = True  # request 3's whole second step is empty
    empty[merge_indptr[-2] :] = True  # the last request is empty throughout
    partial_lse[empty] = -np.inf
    partial_o[..., KERNEL_GROUP:, :] = np.nan  # padding rows: never read into a result
    partial_lse[..., KERNEL_GROUP:] = np.nan

    o, lse = merge_partial_states(
        jnp.asarray(partial_o),
        jnp.asarray(partial_lse),
        jnp.asarray(merge_indptr),
        num_q_heads=KERNEL_KV_HEADS * KERNEL_GROUP,
        out_dtype=jnp.float32,
        items_per_step=items_per_step,
        interpret=interpret,
    )
    o, lse = np.asarray(o), np.asarray(lse)
    heads = KERNEL_KV_HEADS * KERNEL_GROUP
    assert o.shape == (len(counts), heads, KERNEL_HEAD_DIM) and lse.shape == (len(counts), heads)
    for b in range(len(counts)):
        items = slice(merge_indptr[b], merge_indptr[b + 1])
        expected_o, expected_lse = merge_oracle(
            partial_o[items, :, :KERNEL_GROUP].reshape(counts[b], heads, KERNEL_HEAD_DIM),
            partial_lse[items, :, :KERNEL_GROUP].reshape(counts[b], heads),
        )
        assert not np.isnan(o[b]).any() and not np.isnan(lse[b]).any()
        assert relative_error(o[b], expected_o) < KERNEL_TOLERANCE, f"request {b}"
        np.testing.assert_allclose(lse[b], expected_lse, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(o[-1], 0.0)
    np.testing.assert_array_equal(lse[-1], -np.inf)
