"""``paged.cascade_decode_attention(backend="pallas_mgpu")``: the Mosaic GPU kernels wired in.

Every shared level goes through ``kernels_pallas.cascade_shared_mgpu`` (a group's pages read once
per 64-row query tile), the own level through ``paged.decode_attention(backend="pallas_mgpu")``,
the states merged by ``paged.merge_states``. On a CPU both kernels run in Mosaic GPU's interpret
mode (softmax weights through shared memory), on small shapes; the ``gpu``-marked test runs them
compiled at a benchmark shape.

As in ``test_cascade.py``, each case builds plain per-request rows first (groups list the same
pages for their whole prefix pages; a prefix that ends mid-page continues on each request's own
copy), splits them into levels, and compares with the float64 oracle of ``reference_dense`` over
the plain rows. Bounds as in ``test_cascade_shared_mgpu.py``: ``||o - ref|| / ||ref||`` below
1e-2 per request for 16-bit inputs (``docs/testing.md``), the LSE (float32 logits and merge,
never rounded to 16 bits) within 1e-5; on the GPU, against a float32 reference over thousands
of keys, 1e-4 relative and 1e-3 absolute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_dense import relative_error
from strategies import pages_needed

import paged
from kernels_pallas import cascade_shared_mgpu
from kernels_pallas.platform import record_backends
from tests.conftest import ON_GPU
from tests.test_cascade import plain_oracle
from tests.test_cascade import plain_rows as cascade_plain_rows

PAGE_SIZE = 16  # the Mosaic GPU kernels' only page size
NUM_KV_HEADS = 2
GROUP = 4  # query heads a KV head
HEAD_DIM = 64
TOLERANCE = 1e-2  # 16-bit inputs
LSE_TOLERANCE = 1e-5
SOFT_CAP = 5.0
QUERY_SCALE = 3.0  # logits of several units: the soft cap bends them


def plain_rows(rng, groups, prefix_lens, suffix_lens, num_pool_pages):
    """``test_cascade.plain_rows`` at the kernels' page size, the pages scattered over a pool of
    ``num_pool_pages`` in ``rng``'s order, ``page_indices`` not padded. Returns ``(table,
    seq_lens)``."""
    pool_order = rng.permutation(num_pool_pages).tolist()
    return cascade_plain_rows(
        groups, prefix_lens, suffix_lens, pool_order, page_size=PAGE_SIZE, num_indices=None
    )


def random_inputs(rng, batch, q_len, num_pool_pages, *, dtype=jnp.bfloat16, layout="HND"):
    """Queries ``[B, L, KVH x GROUP, D]`` and a pool of random normals (no zeros, no ties)."""
    if layout == "HND":
        shape = (num_pool_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
    else:
        shape = (num_pool_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = paged.KVCache(
        jnp.asarray(rng.standard_normal(shape), dtype),
        jnp.asarray(rng.standard_normal(shape), dtype),
        layout,
    )
    q_shape = (batch, q_len, NUM_KV_HEADS * GROUP, HEAD_DIM)
    q = jnp.asarray(QUERY_SCALE * rng.standard_normal(q_shape), dtype)
    return q, cache


def run_counting_shared_levels(monkeypatch, q, cache, levels, cap, *, jitted=False):
    """The cascade on ``backend="pallas_mgpu"``, with the backend records and the number of
    shared-level kernel calls (a path that fell back to per-request decode would make none).
    ``jitted``: under ``jax.jit`` with the levels traced (the tiles and the split then come from
    the arrays' static sizes, the own level's plan is the traced default)."""
    calls = []
    kernel = cascade_shared_mgpu.shared_level_states_mgpu

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(cascade_shared_mgpu, "shared_level_states_mgpu", counted)

    def cascade(q, levels):
        return paged.cascade_decode_attention(
            q, cache, levels, logits_soft_cap=cap, return_lse=True, backend="pallas_mgpu"
        )

    with record_backends() as records:
        o, lse = (jax.jit(cascade) if jitted else cascade)(q, levels)
    return o, lse, records, calls


def assert_matches_oracle(o, lse, o_ref, lse_ref, q):
    """Per request: ``o`` within the 16-bit bound, the LSE within float32 accuracy."""
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:-1]
    assert lse.dtype == jnp.float32
    o, lse = np.asarray(o), np.asarray(lse)
    assert not np.isnan(o.astype(np.float32)).any() and not np.isnan(lse).any()
    for b in range(q.shape[0]):
        error = relative_error(o[b], o_ref[b])
        assert error < TOLERANCE, f"request {b}: error {error:.3g}"
        np.testing.assert_allclose(lse[b], lse_ref[b], rtol=LSE_TOLERANCE, atol=LSE_TOLERANCE)


def assert_shared_keys_matter(q, cache, own_table, o_ref, lse_ref, cap, requests):
    """The check can fail: attention over the own level alone (a merge that lost the shared
    levels) is far from the oracle for every request in a group."""
    own_o, own_lse = plain_oracle(q, cache, own_table, cap)
    for b in requests:
        assert relative_error(own_o[b], o_ref[b]) > 10 * TOLERANCE
        assert np.abs(own_lse[b] - lse_ref[b]).max() > 100 * LSE_TOLERANCE


@pytest.mark.parametrize("q_len, cap, jitted", [(1, None, True), (3, SOFT_CAP, False)])
def test_two_levels_equal_plain_decode(monkeypatch, q_len, cap, jitted):
    """Two groups (requests 0, 2, 3 sharing 37 tokens, a prefix that ends mid-page, its last 5
    tokens on each request's own copy; request 1 alone in a group of one sharing 20), request 4
    in no group; ragged suffixes; one new token under jit with traced levels, three eagerly.
    The kill switch is on: a kernel asked for by name still runs (recorded as "pallas", as
    ``decode_attention(backend="pallas_mgpu")``)."""
    monkeypatch.setenv("DECODELAB_BACKEND", "reference")
    rng = np.random.default_rng(q_len)
    groups, prefix_lens, suffix_lens = [[0, 2, 3], [1]], [37, 20], [3, 13, 30, 4, 21]
    table, _ = plain_rows(rng, groups, prefix_lens, suffix_lens, num_pool_pages=20)
    levels = paged.cascade_levels_from_shared_prefix(table, groups, prefix_lens)
    assert levels.shared[0].group_pages.page_lists()[1] == [table.page_lists()[1][0]]
    q, cache = random_inputs(rng, len(suffix_lens), q_len, num_pool_pages=20)
    o, lse, records, calls = run_counting_shared_levels(
        monkeypatch, q, cache, levels, cap, jitted=jitted
    )
    assert [(r.operation, r.kernel, r.backend) for r in records] == [
        ("cascade_decode_attention", "cascade_shared_mgpu", "pallas"),
        ("decode_attention", "paged_decode_mgpu", "pallas"),
    ]
    assert len(calls) == 1 and calls[0]["interpret"] == (not ON_GPU)
    assert calls[0]["probs_in_smem"] == (not ON_GPU)
    o_ref, lse_ref = plain_oracle(q, cache, table, cap)
    assert_matches_oracle(o, lse, o_ref, lse_ref, q)
    assert_shared_keys_matter(q, cache, levels.own, o_ref, lse_ref, cap, requests=[0, 1, 2, 3])


def test_three_levels_equal_plain_decode(monkeypatch):
    """Nested prefixes: 20 tokens shared by requests 0 to 3, 40 by requests 0 and 1, 36 by
    request 2 alone (a group of one at the inner level); request 3 has only the outer prefix,
    request 4 none. One new token a request."""
    rng = np.random.default_rng(7)
    outer = [11]  # page of tokens 0-15, listed by requests 0-3
    inner_pair, inner_single = [4], [9]  # tokens 16-31 of requests 0 and 1, and of request 2
    seq_lens = [40 + 5, 40 + 17, 36 + 2, 20 + 6, 19]
    page_lists = [outer + inner_pair, outer + inner_pair, outer + inner_single, list(outer), []]
    free = iter(p for p in rng.permutation(24).tolist() if p not in (11, 4, 9))
    for b, pages in enumerate(page_lists):
        pages.extend(next(free) for _ in range(pages_needed(seq_lens[b], PAGE_SIZE) - len(pages)))
    table = paged.PageTable.from_page_lists(page_lists, seq_lens, PAGE_SIZE)
    levels = paged.cascade_levels_from_nested_prefixes(
        table, [([[0, 1, 2, 3]], [20]), ([[0, 1], [2]], [40, 36])]
    )
    assert [level.group_pages.page_lists() for level in levels.shared] == [[[11]], [[4], [9]]]
    q, cache = random_inputs(rng, len(seq_lens), 1, num_pool_pages=24)
    o, lse, _, calls = run_counting_shared_levels(monkeypatch, q, cache, levels, None)
    assert len(calls) == 2  # one kernel launch a shared level
    o_ref, lse_ref = plain_oracle(q, cache, table, None)
    assert_matches_oracle(o, lse, o_ref, lse_ref, q)
    assert_shared_keys_matter(q, cache, levels.own, o_ref, lse_ref, None, requests=[0, 1, 2, 3])
    # Without the inner level, requests 0 to 2 would miss keys: both shared levels count.
    outer_only = paged.CascadeLevels(shared=levels.shared[:1], own=levels.own)
    o_outer, _ = paged.cascade_decode_attention(
        q, cache, outer_only, return_lse=True, backend="reference"
    )
    for b in range(3):
        assert relative_error(np.asarray(o_outer[b]), o_ref[b]) > 10 * TOLERANCE


def _shapes_the_kernels_cannot_run():
    """(q, cache, levels, the reason's words) for each shape ``"pallas_mgpu"`` refuses."""
    rng = np.random.default_rng(0)
    table, _ = plain_rows(rng, [[0, 1]], [20], [3, 5], num_pool_pages=6)
    levels = paged.cascade_levels_from_shared_prefix(table, [[0, 1]], [20])
    q, cache = random_inputs(rng, 2, 1, num_pool_pages=6)
    nhd_q, nhd = random_inputs(rng, 2, 1, num_pool_pages=6, layout="NHD")
    f32 = paged.KVCache(cache.k_pages.astype(jnp.float32), cache.v_pages.astype(jnp.float32), "HND")
    narrow = paged.KVCache(cache.k_pages[..., :32], cache.v_pages[..., :32], "HND")
    wide_group = jnp.zeros((2, 1, NUM_KV_HEADS * 16, HEAD_DIM), q.dtype)
    long_run = jnp.zeros((2, 17, *q.shape[2:]), q.dtype)
    long_table, _ = plain_rows(rng, [[0, 1]], [20], [20, 25], num_pool_pages=6)
    long_levels = paged.cascade_levels_from_shared_prefix(long_table, [[0, 1]], [20])
    small_pages = paged.KVCache(cache.k_pages[:, :, :8], cache.v_pages[:, :, :8], "HND")
    small_table = paged.PageTable.from_page_lists([[0, 1, 2], [0, 1, 3]], [20, 22], 8)
    small_levels = paged.cascade_levels_from_shared_prefix(small_table, [[0, 1]], [16])
    return [
        (nhd_q, nhd, levels, "layout NHD"),
        (q.astype(jnp.float32), f32, levels, "dtype float32"),
        (q[..., :32], narrow, levels, "head_dim=32"),
        (q, small_pages, small_levels, "page_size=8"),
        (wide_group, cache, levels, "16 query heads a KV head"),
        (long_run, cache, long_levels, "q_len=17"),
    ]


def test_shapes_the_kernels_cannot_run_are_refused_with_the_reason():
    """Each refusal names the path and the reason; the same inputs run on the reference (the
    refusal is the kernels', not the inputs')."""
    for q, cache, levels, reason in _shapes_the_kernels_cannot_run():
        message = rf"backend='pallas_mgpu' cannot run cascade_decode_attention here: {reason}"
        with pytest.raises(ValueError, match=message):
            paged.cascade_decode_attention(q, cache, levels, backend="pallas_mgpu")
        paged.cascade_decode_attention(q, cache, levels, backend="reference")


def test_auto_still_picks_the_triton_path_on_a_gpu(monkeypatch):
    """``"auto"`` is unchanged: on a GPU it runs the per-level Triton path, not Mosaic GPU."""
    from kernels_pallas import platform

    rng = np.random.default_rng(1)
    table, _ = plain_rows(rng, [[0, 1]], [20], [3, 5], num_pool_pages=6)
    levels = paged.cascade_levels_from_shared_prefix(table, [[0, 1]], [20])
    q, cache = random_inputs(rng, 2, 1, num_pool_pages=6)
    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    with record_backends() as records:
        jax.eval_shape(lambda q: paged.cascade_decode_attention(q, cache, levels), q)
    first = records[0]
    assert (first.operation, first.kernel, first.backend) == (
        "cascade_decode_attention",
        "paged_decode",
        "pallas",
    )
    assert all(r.kernel != "cascade_shared_mgpu" for r in records)


# --------------------------------------------------------------------------------------------
# Compiled, at a benchmark shape (GPU only)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_mgpu_path_at_a_benchmark_shape_on_gpu():
    """Compiled: a group of 32 requests sharing a 4096-token prefix, 256 own tokens each, one
    new token, 32 query heads, 8 KV heads, head_dim 128, bfloat16; ``"pallas_mgpu"`` against
    the float32 reference of plain decode over the plain rows and against ``"pallas"``."""
    from paged.attention_reference import decode_attention_reference

    assert ON_GPU
    batch, prefix_len, suffix_len, num_kv_heads, head_dim = 32, 4096, 256, 8, 128
    rng = np.random.default_rng(32)
    shared = list(range(prefix_len // PAGE_SIZE))
    next_page, page_lists = len(shared), []
    for _ in range(batch):
        own = pages_needed(suffix_len, PAGE_SIZE)
        page_lists.append(shared + list(range(next_page, next_page + own)))
        next_page += own
    order = rng.permutation(next_page)  # scatter the pages over the pool
    page_lists = [[int(order[p]) for p in row] for row in page_lists]
    table = paged.PageTable.from_page_lists(page_lists, [prefix_len + suffix_len] * batch, 16)
    levels = paged.cascade_levels_from_shared_prefix(table, [list(range(batch))], [prefix_len])
    shape = (next_page, num_kv_heads, PAGE_SIZE, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    cache = paged.KVCache(k, v, "HND")
    q = jnp.asarray(rng.standard_normal((batch, 1, 32, head_dim)), jnp.bfloat16)
    with record_backends() as records:
        o, lse = paged.cascade_decode_attention(
            q, cache, levels, return_lse=True, backend="pallas_mgpu"
        )
    assert ("cascade_decode_attention", "cascade_shared_mgpu") in [
        (r.operation, r.kernel) for r in records
    ]
    triton_o, triton_lse = paged.cascade_decode_attention(
        q, cache, levels, return_lse=True, backend="pallas"
    )
    f32 = paged.KVCache(k.astype(jnp.float32), v.astype(jnp.float32), "HND")
    ref_o, ref_lse = decode_attention_reference(
        q.astype(jnp.float32), f32, table, sm_scale=head_dim**-0.5
    )
    ref_o = np.asarray(ref_o, np.float64)
    for b in range(batch):
        assert relative_error(o[b], ref_o[b]) < TOLERANCE
        assert relative_error(o[b], np.asarray(triton_o[b], np.float64)) < TOLERANCE
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(triton_lse), rtol=1e-4, atol=1e-3)
    # The check can fail: the own level alone is far from the whole sequence.
    own_o = paged.decode_attention(q, cache, levels.own, backend="pallas")
    assert relative_error(own_o, ref_o) > 10 * TOLERANCE
