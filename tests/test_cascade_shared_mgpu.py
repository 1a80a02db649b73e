"""The Mosaic GPU shared-level kernel of cascade attention against the float64 reference.

On a CPU it runs in Mosaic GPU's interpret mode with the softmax weights in shared memory (the
only path the interpreter runs), on small shapes; the register path lowers for CUDA here and
runs compiled, at the benchmark's shapes, in the ``gpu``-marked test. Error measure and bounds
as in ``test_paged_decode_kernel.py``: ``||out - ref|| / ||ref||`` against the reference in
float64 on the same rounded inputs, below 1e-2 for 16-bit inputs (``testing.md``'s bound: the
softmax weights are rounded to 16 bits before ``p @ V``). The LSE is never rounded to 16 bits:
float32 logits of 16-bit inputs over at most a hundred keys, so 1e-5 (absolute and relative)
is float32 rounding with a margin; the gpu tests, over thousands of keys against a float32
reference, allow 1e-4 relative and 1e-3 absolute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from kernels_pallas.cascade_shared_mgpu import (
    MIN_CHUNK_PAGES,
    cascade_shared_mgpu,
    choose_num_splits,
    num_query_tiles,
    shared_level_states_mgpu,
)
from paged.attention_reference import decode_attention_reference, merge_states
from paged.cascade import (
    SharedLevel,
    cascade_levels_from_shared_prefix,
    shared_level_state_reference,
)
from tests.conftest import ON_GPU
from tests.test_paged_decode_kernel import relative_error

PAGE_SIZE = 16
NUM_KV_HEADS = 2
TOLERANCE = 1e-2  # 16-bit inputs (testing.md)
PROBS_PATHS = (True, False) if ON_GPU else (True,)


def make_level(
    seed,
    group_sizes,
    prefix_lens,
    *,
    batch,
    num_pool_pages=24,
    head_dim=64,
    group=4,
    q_len=1,
    dtype=jnp.bfloat16,
    num_kv_heads=NUM_KV_HEADS,
    padding_entries=False,
):
    """Random queries and pool (never zeros) and a shared level whose groups list scattered
    pages; the groups' requests are drawn from the batch in random order (requests left over
    are in no group). ``prefix_lens[g]`` tokens a group (0: a group without pages).
    ``padding_entries``: ``group_requests`` ends with two entries past ``group_indptr[-1]``
    (ignored), naming a request in no group and a group's first member."""
    rng = np.random.default_rng(seed)
    pool_order = rng.permutation(num_pool_pages).tolist()
    page_lists = []
    for length in prefix_lens:
        count = -(-length // PAGE_SIZE)
        page_lists.append([pool_order.pop() for _ in range(count)])
    order = rng.permutation(batch)
    members = order[: sum(group_sizes)]
    if padding_entries:
        members = np.concatenate([members, [order[-1], members[0]]])
    level = SharedLevel(
        group_pages=paged.PageTable.from_page_lists(page_lists, list(prefix_lens), PAGE_SIZE),
        group_indptr=np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int32),
        group_requests=members.astype(np.int32),
    )
    shape = (num_pool_pages, num_kv_heads, PAGE_SIZE, head_dim)
    cache = paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), dtype),
        jnp.asarray(rng.standard_normal(shape), dtype),
        "HND",
    )
    queries = jnp.asarray(
        rng.standard_normal((batch, q_len, num_kv_heads * group, head_dim)), dtype
    )
    return queries, cache, level


# Jitted: run eagerly, the reference's lax.map body is traced and compiled again every call.
_shared_level_state_reference = jax.jit(
    shared_level_state_reference, static_argnames=("sm_scale", "logits_soft_cap")
)


def default_scale(queries):
    return float(1.0 / np.sqrt(queries.shape[-1]))


def reference64(queries, cache, level, soft_cap=None, sm_scale=None):
    with jax.enable_x64(True):
        cache64 = paged.KVCache(
            cache.k_pages.astype(jnp.float64), cache.v_pages.astype(jnp.float64), "HND"
        )
        o, lse = _shared_level_state_reference(
            queries.astype(jnp.float64),
            cache64,
            level,
            sm_scale=sm_scale or default_scale(queries),
            logits_soft_cap=soft_cap,
        )
        return np.asarray(o), np.asarray(lse)


def run_kernel(queries, cache, level, soft_cap=None, probs_in_smem=True, sm_scale=None, **launch):
    return shared_level_states_mgpu(
        queries,
        cache,
        level,
        sm_scale=sm_scale or default_scale(queries),
        logits_soft_cap=soft_cap,
        probs_in_smem=probs_in_smem,
        interpret=not ON_GPU,
        **launch,
    )


def poison_unused_slots(cache, level):
    """The cache with NaN in the slots past each group's last token (its last page's tail): the
    kernel must mask their logits and zero their V rows (0 x NaN is NaN)."""
    k_pages, v_pages = np.asarray(cache.k_pages, np.float32), np.asarray(cache.v_pages, np.float32)
    pages = level.group_pages
    for g in range(level.num_groups):
        if pages.page_indptr[g + 1] > pages.page_indptr[g]:
            last_page = pages.page_indices[pages.page_indptr[g + 1] - 1]
            k_pages[last_page, :, pages.last_page_len[g] :] = np.nan
            v_pages[last_page, :, pages.last_page_len[g] :] = np.nan
    dtype = cache.k_pages.dtype
    return paged.KVCache(jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype), "HND")


def check(o, lse, ref_o, ref_lse):
    assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape
    assert relative_error(o, ref_o) < TOLERANCE
    lse = np.asarray(lse)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty), "a row's emptiness differs"
    assert np.all(np.asarray(o)[empty] == 0)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-5)


# (group sizes, prefix tokens a group, batch, q_len, G, KV heads, dtype, soft cap, sm_scale
# (None: 1 / sqrt(D)), splits, pipeline, pages a step, stages). Case 0: emit_pipeline; a group of 17 requests x G = 4 (68
# rows: two tiles) and groups of one whose prefixes are a full page and a page plus one token;
# 3 splits of a 4-page prefix (the last chunk empty); requests in no group, one of them named
# by a padding entry of group_requests (past group_indptr[-1]). Case 1: the ring;
# q_len 3 (a request's 6 rows cross the tile boundary at 64 in the group of 11); a group with
# no pages; a prefix ending mid-page; a soft cap that bends most logits (5 against logits of
# standard deviation 2.4 at sm_scale 0.3, not 1 / sqrt(D)); float16; 2 splits of 3 pages (the second one
# page, ending mid-page); two KV heads (the query heads' order in a tile). NaN in every group's
# slots past its
# last token. One split and the ring's index windows: the race detector's test; the ring at one
# page a step and a traced level: test_merged_with_own_level_equals_plain_decode.
CASES = [
    ((17, 1, 1), (60, 16, 17), 21, 1, 4, 1, jnp.bfloat16, None, None, 3, "emit", 2, 2),
    ((11, 1), (45, 0), 14, 3, 2, 2, jnp.float16, 5.0, 0.3, 2, "ring", 2, 3),
]


def case_inputs(case):
    """The case's queries, cache and level, and its launch parameters."""
    sizes, prefix_lens, batch, q_len, group, kv_heads, dtype, soft_cap, scale, splits, *launch = (
        case
    )
    queries, cache, level = make_level(
        sum(sizes) + q_len,
        sizes,
        prefix_lens,
        batch=batch,
        group=group,
        q_len=q_len,
        dtype=dtype,
        num_kv_heads=kv_heads,
        padding_entries=case is CASES[0],
    )
    pipeline, pages, stages = launch
    launch = dict(
        sm_scale=scale,
        num_splits=splits,
        pipeline=pipeline,
        pages_per_step=pages,
        num_stages=stages,
    )
    return queries, cache, level, soft_cap, launch


@pytest.mark.parametrize("probs_in_smem", PROBS_PATHS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_float64_reference(case, probs_in_smem):
    queries, cache, level, soft_cap, launch = case_inputs(CASES[case])
    o, lse = run_kernel(
        queries,
        poison_unused_slots(cache, level),  # the reference reads the clean pool
        level,
        soft_cap,
        probs_in_smem,
        **launch,
    )
    check(o, lse, *reference64(queries, cache, level, soft_cap, launch["sm_scale"]))


def test_merged_with_own_level_equals_plain_decode():
    """Cascade, kernel for the shared level: the kernel's state merged (``paged.merge_states``)
    with each request's own level (the reference, float32) equals plain decode over the whole
    sequences in float64. The prefix (37 tokens) ends mid-page, so its last 5 tokens lie on
    each request's own copy; three new tokens a request; one request in no group. The level is
    traced (under jit): its tiles and split come from its arrays' static sizes, so the launch
    has a padding tile (2 for the 36 rows of one group) whose rows are never read."""
    rng = np.random.default_rng(3)
    # Pages 0 and 1 are the shared prefix's whole pages; pages 3, 5, 6 each request's copy of
    # the partly filled third page (the prefix's last 5 tokens, then its own); request 3 has
    # its own prompt.
    rows = [[0, 1, 3, 4], [0, 1, 5], [0, 1, 6, 7], [8, 9, 10]]
    table = paged.PageTable.from_page_lists(rows, [57, 46, 60, 44], PAGE_SIZE)
    levels = cascade_levels_from_shared_prefix(table, [[0, 1, 2]], prefix_lens=[37])
    shape = (16, NUM_KV_HEADS, PAGE_SIZE, 64)
    cache = paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
        "HND",
    )
    queries = jnp.asarray(rng.standard_normal((4, 3, 8, 64)), jnp.bfloat16)
    sm_scale = 1.0 / 8.0
    shared = jax.jit(
        lambda level: run_kernel(queries, cache, level, num_splits=2, pages_per_step=1)
    )(levels.shared[0])
    f32 = paged.KVCache(cache.k_pages.astype(jnp.float32), cache.v_pages.astype(jnp.float32), "HND")
    own = jax.jit(decode_attention_reference, static_argnames="sm_scale")(
        queries.astype(jnp.float32), f32, levels.own, sm_scale=sm_scale
    )
    o = jnp.stack([shared[0], own[0]], axis=2)
    lse = jnp.stack([shared[1], own[1]], axis=2)
    merged_o, merged_lse = merge_states(o, lse)
    with jax.enable_x64(True):
        f64 = paged.KVCache(
            cache.k_pages.astype(jnp.float64), cache.v_pages.astype(jnp.float64), "HND"
        )
        plain_o, plain_lse = jax.jit(decode_attention_reference, static_argnames="sm_scale")(
            queries.astype(jnp.float64), f64, table, sm_scale=sm_scale
        )
    assert relative_error(merged_o, np.asarray(plain_o)) < TOLERANCE
    np.testing.assert_allclose(np.asarray(merged_lse), np.asarray(plain_lse), rtol=1e-5)


def raw_launch(queries, cache, level, soft_cap, launch):
    """run_kernel's launch of this level for the raw entry."""
    rows_per_request = queries.shape[1] * queries.shape[2] // cache.num_kv_heads
    return dict(
        sm_scale=launch["sm_scale"] or default_scale(queries),
        logits_soft_cap=soft_cap,
        num_tiles=num_query_tiles(np.asarray(level.group_indptr), rows_per_request),
        num_splits=launch["num_splits"],
        pages_per_step=launch["pages_per_step"],
        num_stages=launch["num_stages"],
        probs_in_smem=True,
        pipeline=launch["pipeline"],
        interpret=not ON_GPU,
    )


def test_invalid_values_under_jit_stay_inside_the_arrays():
    """Values the public entry refuses when concrete, through the raw entry (case 1's launch),
    all in one table: a page number past the pool or negative reads the pool's last page, a
    member outside the batch (or negative) is dropped, and a group's page range
    past ``page_indices`` is cut to it: the last group (no pages of its own) then reads the
    entries from its start to the end of ``page_indices`` (the padding ones page 0), all as
    full pages, as no chunk ends at the group's end (99)."""
    queries, cache, level, soft_cap, launch = case_inputs(CASES[1])
    pages = level.group_pages
    num_indices = pages.page_indices.shape[0]
    bad_pages = np.asarray(pages.page_indices).copy()
    bad_pages[1] = 1000  # past the 24-page pool
    bad_pages[2] = -5  # wraps to a large unsigned number: the last page too
    members = np.asarray(level.group_requests).copy()
    members[3] = 77  # outside the batch
    members[4] = -3
    past = np.asarray(pages.page_indptr).copy()
    past[-1] = 99
    assert past[-2] < num_indices - 1  # the cut range holds entries
    o, lse = cascade_shared_mgpu(
        queries,
        cache.k_pages,
        cache.v_pages,
        jnp.asarray(past),
        jnp.asarray(bad_pages),
        jnp.asarray(pages.last_page_len),
        jnp.asarray(level.group_indptr),
        jnp.asarray(members),
        **raw_launch(queries, cache, level, soft_cap, launch),
    )
    cut_indptr = np.asarray(pages.page_indptr).copy()
    cut_indptr[-1] = num_indices
    cut_last = np.asarray(pages.last_page_len).copy()
    cut_last[-1] = PAGE_SIZE
    expected = SharedLevel(
        group_pages=paged.PageTable(
            cut_indptr,
            np.where(bad_pages.astype(np.uint32) > 23, 23, bad_pages),
            cut_last,
            PAGE_SIZE,
        ),
        group_indptr=level.group_indptr,
        group_requests=members,
    )
    check(o, lse, *reference64(queries, cache, expected, soft_cap, launch["sm_scale"]))


def test_empty_batch_and_empty_level():
    """A level with no groups gives every request the empty state; a batch of 0 its shapes."""
    queries, cache, _ = make_level(7, (2,), (20,), batch=3)
    empty_level = SharedLevel(
        group_pages=paged.PageTable.from_page_lists([], [], PAGE_SIZE),
        group_indptr=np.zeros((1,), np.int32),
        group_requests=np.zeros((0,), np.int32),
    )
    o, lse = run_kernel(queries, cache, empty_level)
    assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))
    o, lse = run_kernel(queries[:0], cache, empty_level)
    assert o.shape == (0, 1, 8, 64) and lse.shape == (0, 1, 8)


def test_x64_mode_gives_float32_states():
    """With x64 on (researchers' float64 references) the kernel runs in 32 bits and returns
    float32 states equal to the reference's (case 1: interpreted, the same compiled kernel)."""
    queries, cache, level, soft_cap, launch = case_inputs(CASES[1])
    with jax.enable_x64(True):
        o, lse = run_kernel(queries, cache, level, soft_cap, **launch)
    check(o, lse, *reference64(queries, cache, level, soft_cap, launch["sm_scale"]))


def test_tiles_and_splits():
    """A group's rows fill 64-row tiles (a request's rows may cross a tile boundary); the split
    minimizes waves over chunks, with chunks of at least MIN_CHUNK_PAGES pages."""
    assert num_query_tiles(np.array([0, 1, 17, 49]), 4) == 1 + 1 + 2
    assert num_query_tiles(np.array([0, 11]), 6) == 2  # 66 rows
    assert num_query_tiles(np.array([0, 0]), 4) == 0
    # The grid at G = 4, L = 1, 8 KV heads, one program an SM.
    assert choose_num_splits(2, 8, 256, programs_per_wave=132) == 8  # 32 requests, 4K
    assert choose_num_splits(8, 8, 2048, programs_per_wave=132) == 2  # 128 requests, 32K
    assert choose_num_splits(4, 8, 2048, programs_per_wave=132) == 4  # 64 requests
    assert choose_num_splits(2, 8, MIN_CHUNK_PAGES - 1, programs_per_wave=132) == 1


BAD_ARGUMENTS = [
    (dict(layout="NHD"), "cache.layout must be 'HND'"),
    (dict(dtype=jnp.float32), "bfloat16 or float16"),
    (dict(queries_3d=True), "queries must be \\[batch, q_len"),
    (dict(head_dim_q=32), "head_dim must be one of"),
    (dict(num_q_heads=3), "num_q_heads=3 must be a multiple of num_kv_heads=2"),
    (dict(launch=dict(num_splits=0)), "num_splits must be an int >= 1"),
    (dict(launch=dict(logits_soft_cap=0.0)), "logits_soft_cap must be > 0 or None, got 0.0"),
    (dict(launch=dict(logits_soft_cap=-30.0)), "logits_soft_cap must be > 0 or None, got -30.0"),
    (dict(launch=dict(pipeline="tma")), "pipeline must be one of"),
    (dict(launch=dict(pages_per_step=3)), "pages_per_step must be one of"),
    (dict(launch=dict(pages_per_step=8, num_stages=8)), "KiB of shared memory"),
    (dict(launch=dict(index_window=6)), "index_window must be a multiple of 4"),
    # 256 page numbers and the 4 before an unaligned start are one copy of 288: over Mosaic
    # GPU's 256 a dimension (index_windows.py), refused as the decode kernel refuses it.
    (dict(launch=dict(index_window=256)), "index_window must be .* at most 252, got 256"),
    (dict(compiled_on_cpu=True), "interpret=True needs probs_in_smem=True"),
    (dict(bad_page=99), "^level.group_pages.page_indices.*99"),
    (dict(member_outside=9), "^level.group_requests.*9 is outside the batch"),
]


@pytest.mark.parametrize("change,message", BAD_ARGUMENTS)
def test_bad_arguments_are_rejected_with_their_values(change, message):
    queries, cache, level = make_level(9, (2,), (20,), batch=3)
    launch = dict(probs_in_smem=True, interpret=True, **change.get("launch", {}))
    if "layout" in change:
        cache = paged.KVCache(
            cache.k_pages.transpose(0, 2, 1, 3), cache.v_pages.transpose(0, 2, 1, 3), "NHD"
        )
    if "dtype" in change:
        queries = queries.astype(change["dtype"])
    if change.get("queries_3d"):
        queries = queries[:, 0]
    if "head_dim_q" in change:
        queries = queries[..., : change["head_dim_q"]]
    if "num_q_heads" in change:
        queries = queries[:, :, : change["num_q_heads"]]
    if change.get("compiled_on_cpu"):
        launch["probs_in_smem"] = False
    if "bad_page" in change:
        pages = np.asarray(level.group_pages.page_indices).copy()
        pages[0] = change["bad_page"]
        level = SharedLevel(
            paged.PageTable(
                level.group_pages.page_indptr, pages, level.group_pages.last_page_len, PAGE_SIZE
            ),
            level.group_indptr,
            level.group_requests,
        )
    if "member_outside" in change:
        members = np.asarray(level.group_requests).copy()
        members[0] = change["member_outside"]
        level = SharedLevel(level.group_pages, level.group_indptr, members)
    with pytest.raises(ValueError, match=message):
        shared_level_states_mgpu(queries, cache, level, sm_scale=0.125, **launch)


def test_traced_scale_is_rejected_with_its_name():
    """sm_scale and the soft cap are static (they shape the kernel's code): a traced one (or
    no sm_scale) is refused by name, as paged.decode_attention does, rather than failing
    inside float()."""
    queries, cache, level = make_level(9, (2,), (20,), batch=3)
    launch = dict(probs_in_smem=True, interpret=True)
    with pytest.raises(ValueError, match="sm_scale must be a Python float, got None"):
        shared_level_states_mgpu(queries, cache, level, sm_scale=None, **launch)
    with pytest.raises(ValueError, match="sm_scale must be a Python float, not a traced"):
        jax.jit(lambda s: shared_level_states_mgpu(queries, cache, level, sm_scale=s, **launch))(
            0.125
        )
    with pytest.raises(ValueError, match="logits_soft_cap must be a Python float"):
        jax.jit(
            lambda c: shared_level_states_mgpu(
                queries, cache, level, sm_scale=0.125, logits_soft_cap=c, **launch
            )
        )(30.0)


def test_wrong_types_are_rejected():
    queries, cache, level = make_level(10, (2,), (20,), batch=3)
    with pytest.raises(TypeError, match="level must be a SharedLevel"):
        shared_level_states_mgpu(queries, cache, level.group_pages, sm_scale=0.1)
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        shared_level_states_mgpu(queries, cache.k_pages, level, sm_scale=0.1)


def test_every_variant_lowers_for_an_h200():
    """As far as a CPU can follow the GPU path: the decode kernel's body as this file launches
    it (a 64-row "group", one token, 64-row partial blocks, which plain decode never uses), at
    the benchmark's head shape (32/8 heads, bfloat16), lowers through Mosaic GPU's layout
    inference to its dialect for CUDA: the ring from registers (the probe's arms; soft cap,
    three new tokens, two splits), emit_pipeline from registers (the probe's fallback), and the
    ring through shared memory (what the interpreted tests run). The pipelines' other pages a
    step and stages lower in test_paged_decode_mgpu.py; PTX and the shared-memory limit are
    checked when compiling on the GPU."""

    def int32(n):
        return jax.ShapeDtypeStruct((n,), jnp.int32)

    head_dim = 128
    pool = jax.ShapeDtypeStruct((1024, 8, PAGE_SIZE, head_dim), jnp.bfloat16)
    # (probs_in_smem, pipeline, pages_per_step, num_stages, num_splits, q_len, soft cap)
    cases = (
        (False, "ring", 4, 3, 2, 3, 30.0),
        (False, "emit", 2, 3, 2, 1, None),
        (True, "ring", 4, 3, 1, 1, None),
    )
    for probs_in_smem, pipeline, pages, stages, splits, q_len, soft_cap in cases:
        traced = cascade_shared_mgpu.trace(
            jax.ShapeDtypeStruct((64, q_len, 32, head_dim), jnp.bfloat16),
            pool,
            pool,
            int32(3),
            int32(512),
            int32(2),
            int32(3),
            int32(64),
            sm_scale=0.088,
            logits_soft_cap=soft_cap,
            num_tiles=4 * q_len + 2,
            num_splits=splits,
            pages_per_step=pages,
            num_stages=stages,
            probs_in_smem=probs_in_smem,
            pipeline=pipeline,
        )
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, (probs_in_smem, pipeline, pages, q_len)


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the probe itself (run_on_gpu.sh cascade-shared)")
def test_probe_runs_a_smoke_case(tmp_path, capsys, monkeypatch):
    """bench/probes/cascade_shared.py --smoke: a tiny case interpreted, its checks (cascade
    against plain decode, then against the float32 reference). The timed loop's program
    is not run (a compilation of interpreted kernels, the harness's own tested code): its call
    is checked against ``TimedLoop.time``'s signature."""
    import inspect
    import json

    from bench.harness.timing import TimedLoop
    from bench.probes import cascade_shared

    timed = []

    def time_without_running(self, **kwargs):
        inspect.signature(TimedLoop.time).bind(self, **kwargs)
        timed.append(self)

    monkeypatch.setattr(cascade_shared.TimedLoop, "time", time_without_running)

    arguments = ["--smoke", "--variants", "ring.smem.p2.s2", "--out", str(tmp_path)]
    assert cascade_shared.main(arguments) == 0
    printed = capsys.readouterr().out
    assert (
        "cascade:ring.smem.p2.s2 vs float32 reference" in printed
        and "MISMATCH" not in printed
        and "FAILED" not in printed
    )
    rows = json.loads((tmp_path / "cascade_shared_probe.json").read_text())["rows"]
    # The cascade arm runs the shared level with its host plan, the traced arm without.
    assert {row["arm"] for row in rows} == {
        "plain",
        "cascade:ring.smem.p2.s2",
        "cascade-traced:ring.smem.p2.s2",
    }
    traced = next(row for row in rows if row["arm"].startswith("cascade-traced:"))
    assert traced["max_abs_diff_o"] <= cascade_shared.MAX_DIFFERENCE
    assert all(row["status"] == "ok" for row in rows) and len(timed) == 1
    with pytest.raises(ValueError, match="must read"):
        cascade_shared.main(["--smoke", "--variants", "ring.p2"])
    with pytest.raises(ValueError, match=r"case 4x4091: .* multiple of 16 tokens"):
        cascade_shared.main(["--smoke", "--cases", "4x4091"])


@pytest.mark.skipif(ON_GPU, reason="the interpreter's race detector runs on the CPU")
def test_interpreter_race_detector_finds_no_race():
    """Mosaic GPU's interpreter with its race detector, on the decode kernel's ring as this
    file drives it: one work item of a group's 7 pages, in two 4-entry index windows (the next
    fetched while the ring streams the current one), p in shared memory; no race, and the
    states (one split: no merge) equal the reference's."""
    gpu_callbacks = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    queries, cache, level = make_level(11, (3,), (100,), batch=3, num_kv_heads=1)
    o, lse = shared_level_states_mgpu(
        queries,
        cache,
        level,
        sm_scale=1.0 / np.sqrt(queries.shape[-1]),
        probs_in_smem=True,
        num_splits=1,
        pages_per_step=2,
        num_stages=3,
        index_window=4,
        interpret=plgpu.InterpretGPUParams(detect_races=True),
    )
    assert not gpu_callbacks.get_races().races_found
    check(o, lse, *reference64(queries, cache, level))


# (requests a group, prefix tokens, q_len, pipeline, pages a step, stages): the groups
# with a ragged prefix end, and a verification step; the probe's arms (ring p4 s3 and s2, its
# fallback emit p2 s3; the split its own choice, as there) and the ring at 8 pages a step.
GPU_CASES = [
    (32, 4096 - 5, 1, "ring", 4, 3),
    (128, 16384, 1, "ring", 4, 2),
    (64, 4096, 3, "ring", 8, 2),
    (32, 4096, 1, "emit", 2, 3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("probs_in_smem", PROBS_PATHS)
@pytest.mark.parametrize("members,prefix,q_len,pipeline,pages,stages", GPU_CASES)
def test_benchmark_shapes_on_gpu(members, prefix, q_len, pipeline, pages, stages, probs_in_smem):
    """Compiled, at the benchmark's head shape (32 query heads, 8 KV heads, head_dim 128, bf16),
    two groups (the issue's group and a group of 3) against the reference in float32."""
    assert ON_GPU
    num_pages = -(-prefix // PAGE_SIZE) + -(-1000 // PAGE_SIZE)
    queries, cache, level = make_level(
        12,
        (members, 3),
        (prefix, 1000),
        batch=members + 5,
        num_pool_pages=num_pages + 8,
        head_dim=128,
        q_len=q_len,
        num_kv_heads=8,
    )
    o, lse = run_kernel(
        queries,
        cache,
        level,
        None,
        probs_in_smem,
        pipeline=pipeline,
        pages_per_step=pages,
        num_stages=stages,
    )
    f32 = paged.KVCache(cache.k_pages.astype(jnp.float32), cache.v_pages.astype(jnp.float32), "HND")
    ref_o, ref_lse = shared_level_state_reference(
        queries.astype(jnp.float32), f32, level, sm_scale=1.0 / np.sqrt(128)
    )
    assert relative_error(o, np.asarray(ref_o, np.float64)) < TOLERANCE
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(
        np.asarray(lse)[finite], np.asarray(ref_lse)[finite], rtol=1e-4, atol=1e-3
    )


@pytest.mark.gpu
def test_cascade_with_the_kernel_equals_plain_decode_on_gpu():
    """Compiled, at the benchmark's head shape: 48 requests sharing a 2000-token prefix (ending
    mid-page, so its last 0 .. 15 tokens lie on each request's own copy) with ragged suffixes
    of 1 to 300 tokens; the kernel's shared state merged with the own level's decode
    (``paged.decode_attention``) equals plain decode over the whole rows (float32 reference)."""
    assert ON_GPU
    rng = np.random.default_rng(21)
    group, prefix = 48, 2000
    shared_pages = prefix // PAGE_SIZE  # 125 whole pages; the 126th is each request's copy
    suffixes = rng.integers(1, 301, size=group)
    lens = [prefix + int(s) for s in suffixes]
    next_page = shared_pages
    rows = []
    for length in lens:
        own = -(-length // PAGE_SIZE) - shared_pages
        rows.append(list(range(shared_pages)) + list(range(next_page, next_page + own)))
        next_page += own
    order = rng.permutation(next_page)  # scatter the pages over the pool
    rows = [[int(order[p]) for p in row] for row in rows]
    table = paged.PageTable.from_page_lists(rows, lens, PAGE_SIZE)
    levels = cascade_levels_from_shared_prefix(table, [list(range(group))], [prefix])
    shape = (next_page, 8, PAGE_SIZE, 128)
    cache = paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
        "HND",
    )
    queries = jnp.asarray(rng.standard_normal((group, 1, 32, 128)), jnp.bfloat16)
    sm_scale = 1.0 / np.sqrt(128)
    shared = run_kernel(queries, cache, levels.shared[0], probs_in_smem=False)
    own = paged.decode_attention(
        queries, cache, levels.own, sm_scale=sm_scale, return_lse=True, backend="pallas"
    )
    o, lse = merge_states(
        jnp.stack([shared[0], own[0].astype(jnp.float32)], axis=2),
        jnp.stack([shared[1], own[1]], axis=2),
    )
    f32 = paged.KVCache(cache.k_pages.astype(jnp.float32), cache.v_pages.astype(jnp.float32), "HND")
    ref_o, ref_lse = decode_attention_reference(
        queries.astype(jnp.float32), f32, table, sm_scale=sm_scale
    )
    assert relative_error(o, np.asarray(ref_o, np.float64)) < TOLERANCE
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-3)
