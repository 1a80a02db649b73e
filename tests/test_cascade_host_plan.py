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
import numpy as np
import pytest

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
