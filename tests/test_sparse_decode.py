"""``paged.sparse_decode_attention`` against float64 oracles.

- Selecting everything (every page, every token, every block) equals dense decode: output and
  LSE, against ``paged.decode_attention`` and the independent NumPy oracle.
- Any selection equals dense attention restricted to exactly the selected keys, computed in
  NumPy by walking each request's page list (``reference_dense.gather_tokens``) and masking; the
  keys and values of everything not selected are NaN, so a read of one fails the test.
- The Pallas path (interpret mode here) runs the existing decode kernel on the virtual tables.
- Bad input raises errors naming the argument; the kill switch reaches the decode it calls.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_dense import gather_tokens, paged_attention_oracle, relative_error
from strategies import PagedBucket, scattered_page_tables

import paged
from kernels_pallas.platform import record_backends
from paged.sparse_quest import page_key_bounds, quest_page_scores, quest_selected_pages
from tests.conftest import ON_GPU, enable_x64

NUM_KV_HEADS = 2
GROUP = 2
NUM_HEADS = NUM_KV_HEADS * GROUP
HEAD_DIM = 16
BUCKET = PagedBucket(batch_size=3, page_size=4, max_seq_len=19)
SM_SCALE = 1 / math.sqrt(HEAD_DIM)
FLOAT64_TOLERANCE = 1e-12
# decode_attention returns its LSE in float32 whatever the inputs: rounding, 6e-8 relative.
LSE_TOLERANCE = 2e-7
# Jitted once per shape: the reference decode maps over requests, which eagerly recompiles.
sparse_reference = jax.jit(
    functools.partial(paged.sparse_decode_attention, return_lse=True, backend="reference")
)
dense_reference = jax.jit(
    functools.partial(paged.decode_attention, return_lse=True, backend="reference")
)


def random_inputs(seed: int, layout: str, dtype=jnp.float64):
    """Queries scaled so logits spread over several units, and a pool of random keys/values."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BUCKET.batch_size, NUM_HEADS, HEAD_DIM)) * 3
    shape = (BUCKET.num_pool_pages, BUCKET.page_size, NUM_KV_HEADS, HEAD_DIM)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    return q, k, v, layout, dtype


def make_cache(k_nhd, v_nhd, layout, dtype) -> paged.KVCache:
    if layout == "HND":
        k_nhd, v_nhd = k_nhd.transpose(0, 2, 1, 3), v_nhd.transpose(0, 2, 1, 3)
    return paged.KVCache(jnp.asarray(k_nhd, dtype), jnp.asarray(v_nhd, dtype), layout)


def restricted_oracle(q, k_nhd, v_nhd, page_lists, seq_lens, visible):
    """float64 attention of each query head over the keys ``visible[b][h]`` (bool [seq_len])
    marks, the tokens gathered by walking the page list. Returns ``(o [B, H, D], lse [B, H])``."""
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for b, (pages, length) in enumerate(zip(page_lists, seq_lens, strict=True)):
        keys = gather_tokens(k_nhd, "NHD", pages, length)
        values = gather_tokens(v_nhd, "NHD", pages, length)
        for h in range(NUM_HEADS):
            seen = np.flatnonzero(visible[b][h])
            if not len(seen):
                continue
            logits = keys[seen, h // GROUP] @ q[b, h] * SM_SCALE
            peak = logits.max()
            weights = np.exp(logits - peak)
            o[b, h] = weights @ values[seen, h // GROUP] / weights.sum()
            lse[b, h] = peak + np.log(weights.sum())
    return o, lse


def poison_unselected(k_nhd, v_nhd, page_lists, seq_lens, visible):
    """NaN in every pool slot that no head of any request selected (unowned slots included)."""
    read = np.zeros(k_nhd.shape[:3], bool)  # [pages, slots, KVH]
    for b, (pages, _) in enumerate(zip(page_lists, seq_lens, strict=True)):
        for h in range(NUM_HEADS):
            for t in np.flatnonzero(visible[b][h]):
                read[pages[t // 4], t % 4, h // GROUP] = True
    k, v = k_nhd.copy(), v_nhd.copy()
    k[~read] = np.nan
    v[~read] = np.nan
    return k, v


def assert_matches(o, lse, want_o, want_lse):
    o, lse = np.asarray(o), np.asarray(lse)
    assert np.all(np.isfinite(o))
    for b in range(o.shape[0]):
        assert relative_error(o[b], want_o[b]) < FLOAT64_TOLERANCE, b
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=LSE_TOLERANCE)


def select_everything(kind: str, batch, bounds):
    if kind.startswith("quest"):
        per = kind.split(":")[1]
        return paged.QuestSelection(bounds, token_budget=BUCKET.max_seq_len + 1, per=per)
    if kind == "tokens":
        positions = np.zeros((len(batch.seq_lens), BUCKET.max_seq_len), np.int32)
        for b, length in enumerate(batch.seq_lens):
            positions[b, :length] = np.arange(length)
        return paged.TokenSelection(jnp.asarray(positions), jnp.asarray(batch.seq_lens, jnp.int32))
    counts = [len(pages) for pages in batch.page_lists]
    indptr = np.cumsum([0, *counts]).astype(np.int32)
    indices = np.concatenate([np.arange(c) for c in counts] + [np.zeros(16 - sum(counts))])
    return paged.BlockSelection(jnp.asarray(indptr), jnp.asarray(indices, jnp.int32), 4)


KINDS = ["quest:kv_head", "quest:query_head", "tokens", "blocks"]
# Each example runs the float64 reference and the NumPy oracle over a batch; eight a kind keep the
# file within its share of the suite's time (the ci profile's 25 would triple it).
EXAMPLES_PER_KIND = 8


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=EXAMPLES_PER_KIND)
@given(
    batch=scattered_page_tables(BUCKET),
    seed=st.integers(0, 2**16),
    layout=st.sampled_from(["HND", "NHD"]),
)
def test_selecting_everything_equals_dense_decode(kind, batch, seed, layout):
    with enable_x64():
        q, k, v, layout, dtype = random_inputs(seed, layout)
        cache = make_cache(k, v, layout, dtype)
        selection = select_everything(kind, batch, page_key_bounds(cache, batch.page_table))
        o, lse = sparse_reference(jnp.asarray(q), cache, batch.page_table, selection)
        dense_o, dense_lse = dense_reference(jnp.asarray(q), cache, batch.page_table)
        assert_matches(o, lse, np.asarray(dense_o), np.asarray(dense_lse))
        want_o, want_lse = paged_attention_oracle(
            q, cache.k_pages, cache.v_pages, layout, batch.page_table, sm_scale=SM_SCALE
        )
        assert_matches(o, lse, want_o, want_lse)


# One layout a kind here (each is one more compilation); both layouts of every kind run in the
# test above, and each view's layouts in test_sparse_quest.py and test_sparse_tokens.py.
RESTRICTED_LAYOUT = {
    "quest:kv_head": "HND",
    "quest:query_head": "NHD",
    "tokens": "HND",
    "blocks": "NHD",
}


@st.composite
def sparse_cases(draw, kind: str):
    """A batch and a selection of that kind, with the visibility it implies per head."""
    batch = draw(scattered_page_tables(BUCKET))
    seed = draw(st.integers(0, 2**16))
    q, k, v, layout, dtype = random_inputs(seed, RESTRICTED_LAYOUT[kind])
    visible = []
    if kind == "tokens":
        positions = np.zeros((BUCKET.batch_size, 8), np.int32)
        counts = np.zeros(BUCKET.batch_size, np.int32)
        for b, length in enumerate(batch.seq_lens):
            chosen = sorted(draw(st.sets(st.integers(0, max(length - 1, 0)), max_size=8)))
            chosen = [t for t in chosen if t < length]
            positions[b, : len(chosen)], counts[b] = chosen, len(chosen)
            mask = np.isin(np.arange(length), chosen)
            visible.append([mask] * NUM_HEADS)
        selection = paged.TokenSelection(jnp.asarray(positions), jnp.asarray(counts))
        return batch, q, k, v, layout, dtype, selection, visible
    if kind == "blocks":
        rows = []
        for pages, length in zip(batch.page_lists, batch.seq_lens, strict=True):
            blocks = sorted(draw(st.sets(st.integers(0, len(pages) - 1)))) if pages else []
            rows.append(blocks)
            mask = np.isin(np.arange(length) // 4, blocks)
            visible.append([mask] * NUM_HEADS)
        indptr = np.cumsum([0] + [len(r) for r in rows]).astype(np.int32)
        indices = np.zeros(16, np.int32)
        indices[: indptr[-1]] = [i for r in rows for i in r]
        selection = paged.BlockSelection(jnp.asarray(indptr), jnp.asarray(indices), 4)
        return batch, q, k, v, layout, dtype, selection, visible
    per = kind.split(":")[1]
    # Two budgets (each compiles once): one page, which still keeps the first and last, and
    # three pages and a bit (rounded down to three).
    budget = draw(st.sampled_from([4, 13]))
    return batch, q, k, v, layout, dtype, (per, budget), None


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=EXAMPLES_PER_KIND)
@given(data=st.data())
def test_any_selection_equals_attention_restricted_to_the_selected_keys(kind, data):
    batch, q, k, v, layout, dtype, selection, visible = data.draw(sparse_cases(kind))
    with enable_x64():
        if visible is None:  # Quest: the selection is the module's (tested on its own)
            per, budget = selection
            cache = make_cache(k, v, layout, dtype)
            bounds = page_key_bounds(cache, batch.page_table)
            scores = quest_page_scores(jnp.asarray(q), bounds, batch.page_table, per=per)
            kept = np.asarray(quest_selected_pages(scores, batch.page_table, budget))
            rows = kept.shape[1]
            visible = []
            for b, length in enumerate(batch.seq_lens):
                start = int(batch.page_table.page_indptr[b])
                page_of_token = start + np.arange(length) // 4
                visible.append(
                    [kept[b, h * rows // NUM_HEADS, page_of_token] for h in range(NUM_HEADS)]
                )
            selection = paged.QuestSelection(bounds, budget, per)  # bounds of the clean keys
        k_read, v_read = poison_unselected(k, v, batch.page_lists, batch.seq_lens, visible)
        cache = make_cache(k_read, v_read, layout, dtype)
        o, lse = sparse_reference(jnp.asarray(q), cache, batch.page_table, selection)
        want_o, want_lse = restricted_oracle(q, k, v, batch.page_lists, batch.seq_lens, visible)
        assert_matches(o, lse, want_o, want_lse)


def test_quest_keeps_first_and_last_page_even_when_they_score_lowest():
    """Keys of the first and last page point away from the query; the budget is one page.
    Their values are the only ones that are 1, so the output shows they were read."""
    page_size, num_pages = 4, 5
    k = np.zeros((num_pages, page_size, 1, HEAD_DIM))
    v = np.zeros_like(k)
    k[[0, 4], :, 0, 0] = -5.0  # q . k = -5 on the end pages, 5 in the middle
    k[1:4, :, 0, 0] = 5.0
    v[[0, 4]] = 1.0
    cache = paged.KVCache(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), "NHD")
    table = paged.PageTable.from_page_lists([[0, 1, 2, 3, 4]], [18], page_size)
    q = jnp.zeros((1, 1, HEAD_DIM), jnp.float32).at[0, 0, 0].set(1.0)
    selection = paged.QuestSelection(page_key_bounds(cache, table), token_budget=1)
    o, _ = sparse_reference(q, cache, table, selection)
    np.testing.assert_allclose(np.asarray(o), 1.0, rtol=1e-6)  # only end pages: all v = 1


# The two views the kernel had never seen: one KV head per page of a head-split pool, and pages
# of one token. (A block mask's table is an ordinary table over the pool itself.) The head-split
# view is tested in test_sparse_quest_kernel_path.py: backend="pallas" runs Quest's scoring
# kernel too, which takes head_dim 64, 128 or 256, not this file's 16.
@pytest.mark.parametrize("kind", ["tokens"])
def test_pallas_backend_runs_the_existing_kernel_on_the_virtual_table(kind):
    """Interpret mode on the CPU, float32, against the reference on the same selection."""
    batch_lists = [[3, 9, 1, 14, 6], [0], [], [11, 2]]
    seq_lens = [19, 1, 0, 6]
    table = paged.PageTable.from_page_lists(batch_lists, seq_lens, 4, num_indices=16)
    batch = type(
        "Batch", (), {"page_table": table, "page_lists": batch_lists, "seq_lens": seq_lens}
    )
    q, k, v, layout, _ = random_inputs(7, "HND")
    q = np.concatenate([q, q[:1]])
    cache = make_cache(k, v, layout, jnp.float32)
    selection = select_everything(kind, batch, page_key_bounds(cache, table))
    if kind == "tokens":  # a sparse subset: every other token
        positions = np.zeros((4, 19), np.int32)
        counts = np.array([10, 1, 0, 3], np.int32)
        for b, c in enumerate(counts):
            positions[b, :c] = np.arange(0, 2 * c, 2)
        selection = paged.TokenSelection(jnp.asarray(positions), jnp.asarray(counts))
    with record_backends() as records:
        o, lse = paged.sparse_decode_attention(
            jnp.asarray(q, jnp.float32), cache, table, selection, return_lse=True, backend="pallas"
        )
    assert [r.backend for r in records] == ["pallas"]
    ref_o, ref_lse = paged.sparse_decode_attention(
        jnp.asarray(q, jnp.float32), cache, table, selection, return_lse=True, backend="reference"
    )
    for b in range(4):
        assert relative_error(o[b], ref_o[b]) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5)


def test_kill_switch_sends_auto_to_the_reference(monkeypatch):
    monkeypatch.setenv("DECODELAB_BACKEND", "reference")
    cache = paged.new_kv_cache(4, 4, NUM_KV_HEADS, HEAD_DIM, jnp.float32)
    table = paged.PageTable.from_seq_lens([6], page_size=4)
    selection = paged.TokenSelection(jnp.array([[0, 5]], jnp.int32), jnp.array([2], jnp.int32))
    with record_backends() as records:
        paged.sparse_decode_attention(jnp.ones((1, NUM_HEADS, HEAD_DIM)), cache, table, selection)
    assert [(r.operation, r.backend) for r in records] == [("decode_attention", "reference")]
    assert "kill switch" in records[0].reason


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_batch_gives_empty_outputs(kind):
    cache = paged.new_kv_cache(4, 4, NUM_KV_HEADS, HEAD_DIM, jnp.float32)
    table = paged.PageTable.from_seq_lens([], page_size=4)
    empty = type("Batch", (), {"page_table": table, "page_lists": [], "seq_lens": []})
    selection = select_everything(kind, empty, page_key_bounds(cache, table))
    o, lse = paged.sparse_decode_attention(
        jnp.zeros((0, NUM_HEADS, HEAD_DIM)), cache, table, selection, return_lse=True
    )
    assert o.shape == (0, NUM_HEADS, HEAD_DIM) and lse.shape == (0, NUM_HEADS)


def bad_call_inputs():
    cache = paged.new_kv_cache(4, 4, NUM_KV_HEADS, HEAD_DIM, jnp.float32)
    table = paged.PageTable.from_seq_lens([6], page_size=4)
    return jnp.ones((1, NUM_HEADS, HEAD_DIM)), cache, table


@pytest.mark.parametrize(
    ("make_selection", "error", "message"),
    [
        (
            lambda c, t: paged.QuestSelection(page_key_bounds(c, t), 0),
            ValueError,
            "token_budget must be >= 1, got 0",
        ),
        (
            lambda c, t: paged.QuestSelection(page_key_bounds(c, t), 16.0),
            TypeError,
            "token_budget must be an int, got 16.0",
        ),
        (
            lambda c, t: paged.QuestSelection(page_key_bounds(c, t), 16, per="group"),
            ValueError,
            "per must be one of ('kv_head', 'query_head'), got 'group'",
        ),
        (
            lambda c, t: paged.TokenSelection(jnp.array([[0, 6]]), jnp.array([2])),
            ValueError,
            "selection.positions[0, 1]=6 is outside request 0's positions [0, 6)",
        ),
        (
            lambda c, t: paged.TokenSelection(jnp.array([[4, 1]]), jnp.array([2])),
            ValueError,
            "selection.positions[0] must be strictly increasing",
        ),
        (
            lambda c, t: paged.TokenSelection(jnp.array([[0], [1]]), jnp.array([1, 1])),
            ValueError,
            "selection.positions must have shape [1, K]",
        ),
        (
            lambda c, t: paged.BlockSelection(
                jnp.array([0, 1], jnp.int32), jnp.array([2], jnp.int32), 4
            ),
            ValueError,
            "selection.block_indices[0]=2 is outside request 0's key blocks [0, 2)",
        ),
        (lambda c, t: "every page", TypeError, "selection must be a QuestSelection"),
    ],
)
def test_bad_selection_is_named(make_selection, error, message):
    q, cache, table = bad_call_inputs()
    with pytest.raises(error, match=re.escape(message)):
        paged.sparse_decode_attention(q, cache, table, make_selection(cache, table))


def test_more_than_one_new_token_is_refused():
    q, cache, table = bad_call_inputs()
    selection = paged.TokenSelection(jnp.array([[0]]), jnp.array([1]))
    with pytest.raises(
        ValueError, match=re.escape("q must have shape [batch, num_q_heads, head_dim]")
    ):
        paged.sparse_decode_attention(q[:, None], cache, table, selection)


def test_bounds_of_another_pool_are_refused():
    q, cache, table = bad_call_inputs()
    bounds = paged.PageKeyBounds(jnp.zeros((4, 2, 8)), jnp.zeros((4, 2, 8)))
    with pytest.raises(ValueError, match=re.escape("q has head_dim 16 but the bounds have 8")):
        paged.sparse_decode_attention(q, cache, table, paged.QuestSelection(bounds, 8))


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "layout"), [("quest:kv_head", "HND"), ("tokens", "NHD")])
def test_pallas_on_sparse_tables_at_benchmark_like_shapes_on_gpu(kind, layout):
    """Compiled: 32 query heads, 8 KV heads, head_dim 128, pages of 16, bfloat16, two requests
    of about 8K tokens, a 2048-token budget (Quest) or 2048 chosen tokens (one-token pages)."""
    assert ON_GPU
    num_kv_heads, num_heads, head_dim, page_size = 8, 32, 128, 16
    lens = [8192 - 5, 6000]
    num_pages = sum(-(-n // page_size) for n in lens)
    rng = np.random.default_rng(11)
    pages = rng.permutation(num_pages + 32)[:num_pages].tolist()
    table = paged.PageTable.from_seq_lens(lens, page_size, pages=pages)
    shape = (num_pages + 32, page_size, num_kv_heads, head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    cache = make_cache(k, v, layout, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((2, num_heads, head_dim)), jnp.bfloat16)
    if kind == "tokens":
        positions = np.stack([np.sort(rng.choice(n, 2048, replace=False)) for n in lens])
        selection = paged.TokenSelection(
            jnp.asarray(positions, jnp.int32), jnp.full(2, 2048, jnp.int32)
        )
    else:
        selection = paged.QuestSelection(page_key_bounds(cache, table), token_budget=2048)
    o, lse = paged.sparse_decode_attention(
        q, cache, table, selection, return_lse=True, backend="pallas"
    )
    as_f32 = paged.KVCache(
        cache.k_pages.astype(jnp.float32), cache.v_pages.astype(jnp.float32), layout
    )
    ref_o, ref_lse = paged.sparse_decode_attention(
        q.astype(jnp.float32), as_f32, table, selection, return_lse=True, backend="reference"
    )
    for b in range(2):
        assert relative_error(o[b], np.asarray(ref_o[b], np.float64)) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-3)
