"""The host plan of the cascade's Mosaic GPU shared level (``plan_shared_level``) against the
device-computed layout it replaces, and the planned kernel call against the unplanned one.

The arrays must be equal exactly (they are integer indices); the planned and unplanned calls
run the same kernel on the same arrays, so their outputs must be equal bit for bit. The jaxpr
count is the point of the plan: the small device ops it removes cost ~1 us each on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from kernels_pallas import cascade_shared_mgpu as mod
from kernels_pallas.cascade_shared_mgpu import (
    plan_shared_level,
    shared_level_states_mgpu,
)
from tests.test_cascade_shared_mgpu import NUM_KV_HEADS, PAGE_SIZE, make_level


def device_layout(level, *, batch, rows_per_request, num_tiles, num_splits, pages_per_step):
    """``_tile_rows`` and ``_work_items`` under jit, as the traced path runs them."""

    @functools.partial(jax.jit)
    def layout(group_indptr, group_requests, page_indptr, last_page_len):
        rows = mod._tile_rows(
            group_indptr,
            group_requests,
            batch=batch,
            rows_per_request=rows_per_request,
            num_tiles=num_tiles,
        )
        work = mod._work_items(
            page_indptr,
            last_page_len,
            rows[0],
            num_splits=num_splits,
            pages_per_step=pages_per_step,
            page_size=PAGE_SIZE,
        )
        return rows, work

    pages = level.group_pages
    return layout(level.group_indptr, level.group_requests, pages.page_indptr, pages.last_page_len)


CASES = [
    # (group sizes, prefix lens, batch, q_len, group, num_splits)
    ((3,), (40,), 4, 1, 4, None),  # one group
    ((2, 5, 1), (20, 300, 7), 9, 1, 4, None),  # ragged groups
    ((2, 5, 1), (20, 300, 7), 9, 3, 4, 3),  # q_len 3, split
    ((17, 2), (500, 33), 20, 1, 8, 5),  # a group over several tiles, split
    ((3, 0, 2), (64, 0, 16), 6, 3, 2, 1),  # an empty group, unsplit
]


@pytest.mark.parametrize("padding_entries", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_host_plan_equals_device_layout(case, padding_entries):
    sizes, lens, batch, q_len, group, num_splits = case
    pool = sum(-(-n // PAGE_SIZE) for n in lens) + 4
    _, _, level = make_level(
        0,
        sizes,
        lens,
        batch=batch,
        num_pool_pages=pool,
        group=group,
        q_len=q_len,
        padding_entries=padding_entries,
    )
    plan = plan_shared_level(
        level,
        batch=batch,
        q_len=q_len,
        num_q_heads=NUM_KV_HEADS * group,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=64,
        num_splits=num_splits,
    )
    if num_splits is not None:
        assert plan.num_splits == num_splits
    assert plan.num_tiles == mod.num_query_tiles(level.group_indptr, q_len * group)
    rows, work = device_layout(
        level,
        batch=batch,
        rows_per_request=q_len * group,
        num_tiles=plan.num_tiles,
        num_splits=plan.num_splits,
        pages_per_step=plan.pages_per_step,
    )
    for host, device in zip((*plan.tile_rows, *plan.work), (*rows, *work), strict=True):
        assert host.dtype == np.int32
        np.testing.assert_array_equal(host, np.asarray(device))


def test_host_plan_picks_the_traced_paths_split_count():
    # 16 requests sharing 4096 tokens: choose_num_splits cuts the prefix; the plan must agree
    # with shared_level_states_mgpu's own choice (same rule, same programs a wave).
    queries, _, level = make_level(1, (16,), (4096,), batch=16, num_pool_pages=260, group=4)
    plan = plan_shared_level(
        level, batch=16, q_len=1, num_q_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=64
    )
    smem = mod.validate_mgpu_pipeline_arguments(
        64,
        queries.dtype,
        pages_per_step=4,
        num_stages=3,
        index_window=mod.resolve_index_window(None, 4),
        probs_in_smem=False,
        pipeline="ring",
        interpret=False,
    )
    want = mod.choose_num_splits(
        plan.num_tiles,
        NUM_KV_HEADS,
        256,
        programs_per_wave=mod.H200_NUM_SMS * max(mod.programs_per_sm(smem), 1),
    )
    assert plan.num_splits == want > 1


def _states(queries, cache, level, plan, num_splits=None):
    return shared_level_states_mgpu(
        queries,
        cache,
        level,
        sm_scale=0.125,
        num_splits=num_splits,
        probs_in_smem=True,
        interpret=True,
        plan=plan,
    )


@pytest.mark.parametrize(
    "sizes,lens,batch,q_len,group,num_splits",
    [
        ((2, 3), (40, 70), 6, 3, 4, 2),  # q_len 3, split, a request in no group
        ((17, 2), (40, 20), 20, 1, 8, 1),  # a group over 3 tiles, unsplit
    ],
)
def test_planned_call_equals_unplanned(sizes, lens, batch, q_len, group, num_splits):
    queries, cache, level = make_level(
        2, sizes, lens, batch=batch, q_len=q_len, group=group, padding_entries=True
    )
    plan = plan_shared_level(
        level,
        batch=batch,
        q_len=q_len,
        num_q_heads=NUM_KV_HEADS * group,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=64,
        num_splits=num_splits,
    )
    o_plan, lse_plan = _states(queries, cache, level, plan)
    o, lse = _states(queries, cache, level, None, num_splits=num_splits)
    # The same kernel on the same arrays: equal bit for bit (the reference comparisons of the
    # unplanned path are test_cascade_shared_mgpu.py's).
    np.testing.assert_array_equal(np.asarray(o_plan), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(lse_plan), np.asarray(lse))
    assert np.isneginf(np.asarray(lse_plan)).any() == (batch > sum(sizes))


def test_plan_for_another_shape_is_rejected():
    queries, cache, level = make_level(3, (2,), (40,), batch=4, group=4)
    plan = plan_shared_level(
        level, batch=5, q_len=1, num_q_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=64
    )
    with pytest.raises(ValueError, match="plan was made for"):
        _states(queries, cache, level, plan)
    plan = plan_shared_level(
        level,
        batch=4,
        q_len=1,
        num_q_heads=8,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=64,
        num_splits=1,
    )
    with pytest.raises(ValueError, match=r"num_splits=2 differs from plan\.num_splits=1"):
        _states(queries, cache, level, plan, num_splits=2)
    with pytest.raises(TypeError, match="plan must be a SharedLevelPlan"):
        _states(queries, cache, level, {"num_splits": 1})


# The kernel launch: a Mosaic GPU pallas_call traces to mpmd_map in JAX 0.11 (its body, the
# kernel's own ops, is not a device-side XLA op and is not counted).
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")


def _non_pallas_equations(jaxpr) -> int:
    """Equations of a jaxpr and its sub-jaxprs, the Pallas calls' bodies not counted."""
    count = 0
    for eqn in jaxpr.eqns:
        count += 1
        if eqn.primitive.name in KERNEL_PRIMITIVES:
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _non_pallas_equations(getattr(sub, "jaxpr", sub))
    return count


def test_plan_removes_most_device_side_equations():
    # 8 requests sharing 4096 tokens, the probe's shape: the planned call's jaxpr outside the
    # kernel is the query gather and the split merge; the traced one adds the layout.
    queries, cache, level = make_level(4, (8,), (4096,), batch=8, num_pool_pages=260, group=4)
    plan = plan_shared_level(
        level, batch=8, q_len=1, num_q_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=64
    )

    def count(plan):
        closed = jax.make_jaxpr(lambda q: _states(q, cache, level, plan))(queries)
        return _non_pallas_equations(closed.jaxpr)

    planned, traced = count(plan), count(None)
    print(f"non-Pallas jaxpr equations: planned {planned}, traced {traced}")
    assert planned * 4 < traced  # measured: 85 and 469 (JAX 0.11.2)
    assert planned <= 100


# ---------------------------------------------------------------------------------------------
# The whole pallas_mgpu cascade with a CascadePlan (paged.plan_cascade_levels).


def nested_two_levels(seed=7):
    """Two shared levels (20 tokens shared by requests 0-3; 40 by 0 and 1, 36 by 2 alone),
    request 4 in no group: ``(q, cache, levels, plain table)`` as test_cascade_mgpu_path's."""
    from strategies import pages_needed

    from tests.test_cascade_mgpu_path import random_inputs

    rng = np.random.default_rng(seed)
    outer, inner_pair, inner_single = [11], [4], [9]
    seq_lens = [40 + 5, 40 + 17, 36 + 2, 20 + 6, 19]
    page_lists = [outer + inner_pair, outer + inner_pair, outer + inner_single, list(outer), []]
    free = iter(p for p in rng.permutation(24).tolist() if p not in (11, 4, 9))
    for b, pages in enumerate(page_lists):
        pages.extend(next(free) for _ in range(pages_needed(seq_lens[b], PAGE_SIZE) - len(pages)))
    table = paged.PageTable.from_page_lists(page_lists, seq_lens, PAGE_SIZE)
    levels = paged.cascade_levels_from_nested_prefixes(
        table, [([[0, 1, 2, 3]], [20]), ([[0, 1], [2]], [40, 36])]
    )
    q, cache = random_inputs(rng, len(seq_lens), 1, num_pool_pages=24)
    return q[:, 0], cache, levels, table


def _cascade(q, cache, levels, plan=None, backend="pallas_mgpu"):
    return paged.cascade_decode_attention(
        q, cache, levels, return_lse=True, backend=backend, plan=plan
    )


def test_planned_cascade_equals_unplanned_and_the_oracle():
    from tests.test_cascade import plain_oracle
    from tests.test_cascade_mgpu_path import assert_matches_oracle

    q, cache, levels, table = nested_two_levels()
    plan = paged.plan_cascade_levels(levels, q, cache)
    assert isinstance(plan, paged.CascadePlan) and len(plan.shared) == 2
    o_plan, lse_plan = _cascade(q, cache, levels, plan)
    o, lse = _cascade(q, cache, levels)
    np.testing.assert_array_equal(np.asarray(o_plan), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(lse_plan), np.asarray(lse))
    o_ref, lse_ref = plain_oracle(q[:, None], cache, table, None)
    assert_matches_oracle(o_plan[:, None], lse_plan[:, None], o_ref, lse_ref, q[:, None])
    # A pytree: passed through jit as an argument, the same result.
    o_jit, _ = jax.jit(lambda q, plan: _cascade(q, cache, levels, plan))(q, plan)
    np.testing.assert_array_equal(np.asarray(o_jit), np.asarray(o_plan))


def test_bad_cascade_plans_are_rejected():
    q, cache, levels, _ = nested_two_levels()
    other_batch = paged.plan_cascade_levels(levels, jnp.zeros((6, *q.shape[1:]), q.dtype), cache)
    with pytest.raises(ValueError, match=r"plan\.shared\[0\] was made for"):
        _cascade(q, cache, levels, other_batch)
    one_level = paged.CascadeLevels(shared=levels.shared[:1], own=levels.own)
    with pytest.raises(ValueError, match="plan has 1 shared level plans, levels has 2"):
        _cascade(q, cache, levels, paged.plan_cascade_levels(one_level, q, cache))
    good = paged.plan_cascade_levels(levels, q, cache)
    short_table = paged.PageTable.from_page_lists([[1]] * 4, [3] * 4, PAGE_SIZE)
    wrong_own = paged.CascadePlan(
        shared=good.shared, own=paged.plan_decode(short_table, q.shape[1], 2, q.shape[2])
    )
    with pytest.raises(ValueError, match=r"plan\.own does not fit levels\.own"):
        _cascade(q, cache, levels, wrong_own)
    with pytest.raises(TypeError, match="plan must be a CascadePlan or None, got dict"):
        _cascade(q, cache, levels, {"shared": ()}, backend="reference")


def test_other_backends_ignore_the_plan():
    q, cache, levels, _ = nested_two_levels()
    plan = paged.plan_cascade_levels(levels, q, cache)
    o_plan, _ = _cascade(q, cache, levels, plan, backend="reference")
    o, _ = _cascade(q, cache, levels, None, backend="reference")
    np.testing.assert_array_equal(np.asarray(o_plan), np.asarray(o))


def test_planned_cascade_has_far_fewer_device_side_equations():
    # The brief's probe shape: 8 requests sharing 4096 tokens (one level), own pages ragged.
    from tests.test_cascade_mgpu_path import plain_rows, random_inputs

    rng = np.random.default_rng(5)
    groups, prefix_lens, suffix_lens = [list(range(8))], [4096], [5, 17, 1, 30, 9, 2, 40, 16]
    table, _ = plain_rows(rng, groups, prefix_lens, suffix_lens, num_pool_pages=300)
    levels = paged.cascade_levels_from_shared_prefix(table, groups, prefix_lens)
    q, cache = random_inputs(rng, 8, 1, num_pool_pages=300)
    q = q[:, 0]
    plan = paged.plan_cascade_levels(levels, q, cache)

    def count(plan):
        # The levels traced, as a jitted step (and the probe) passes them.
        jaxpr = jax.make_jaxpr(lambda q, levels, plan: _cascade(q, cache, levels, plan))(
            q, levels, plan
        ).jaxpr
        return _non_pallas_equations(jaxpr)

    planned, traced = count(plan), count(None)
    print(f"cascade non-Pallas jaxpr equations: planned {planned}, traced {traced}")
    assert planned * 4 < traced  # measured: 142 and 586 (JAX 0.11.2)
    assert planned <= 160


@pytest.mark.gpu
def test_planned_call_equals_unplanned_compiled_on_gpu():
    """Compiled, the register path, a split prefix (16 requests sharing 4096 tokens, 2 groups):
    the planned call equals the unplanned one bit for bit."""
    from tests.conftest import ON_GPU

    assert ON_GPU
    queries, cache, level = make_level(
        8, (16, 3), (4096, 100), batch=20, num_pool_pages=280, group=4, q_len=1
    )
    plan = plan_shared_level(
        level, batch=20, q_len=1, num_q_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=64
    )
    assert plan.num_splits > 1

    def states(plan):
        return shared_level_states_mgpu(queries, cache, level, sm_scale=0.125, plan=plan)

    (o_plan, lse_plan), (o, lse) = states(plan), states(None)
    np.testing.assert_array_equal(np.asarray(o_plan), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(lse_plan), np.asarray(lse))
