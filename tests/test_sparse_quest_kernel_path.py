"""Quest's scoring and selection kernels inside ``paged.sparse_decode_attention``.

``backend="pallas"`` scores pages with ``kernels_pallas/quest_scores.py`` and keeps the top ones
with ``kernels_pallas/quest_select.py`` (interpret mode here); ``"reference"``, ``"auto"`` (until
the kernels are measured on the H200) and the kill switch keep ``quest_page_scores`` and
``quest_selected_pages``. The kernels are tested against those references on their own
(``test_quest_scores_kernel.py``, ``test_quest_select_kernel.py``); here, the wiring:

- The kernel path builds the reference's virtual table, entry for entry. The queries and keys
  are small multiples of 1/8, so every product and every sum of the scores is exact in float32
  and the scoring kernel's other summation order cannot move a score: any difference in the
  selected pages is a wiring error, not rounding.
- Its attention output equals the reference path's within the decode kernel's float32 tolerance
  (``test_sparse_decode.py``'s), and with a budget of every page it equals dense decode.
- ``"reference"`` and the kill switch never reach the kernels (they are replaced by functions
  that raise), and ``record_backends`` shows which backend each of the three steps ran.
- A shape the scoring kernel cannot run is refused under ``"pallas"``, naming the reason, and
  falls back to the reference under ``"auto"``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_dense import relative_error

import kernels_pallas.platform
import kernels_pallas.quest_scores
import kernels_pallas.quest_select
import paged
import paged.sparse
from kernels_pallas.platform import record_backends
from paged.sparse import choose_quest_backend
from paged.sparse_quest import page_key_bounds
from tests.conftest import ON_GPU, enable_x64

NUM_KV_HEADS = 2
GROUP = 2
NUM_HEADS = NUM_KV_HEADS * GROUP
HEAD_DIM = 64  # the scoring kernel's smallest head_dim
PAGE_SIZE = 4
NUM_POOL_PAGES = 16
# Requests of 5, 1, 0 and 2 pages, scattered over the pool; the first is long enough for a
# budget of 3 pages to leave a real choice among its 3 middle pages.
PAGE_LISTS = [[3, 9, 1, 14, 6], [0], [], [11, 2]]
SEQ_LENS = [19, 1, 0, 6]
BUDGET = 3 * PAGE_SIZE
# The decode kernel against the reference, float32 (test_sparse_decode.py's Pallas tolerance).
OUTPUT_TOLERANCE = 1e-5
STEPS = ("quest_scores", "quest_select", "paged_decode")


def exact_inputs(seed: int, head_dim: int = HEAD_DIM):
    """``(q, cache, table)``: keys and queries multiples of 1/8 in [-1/2, 1/2] (exact scores in
    float32), values standard normal, HND float32."""
    rng = np.random.default_rng(seed)
    table = paged.PageTable.from_page_lists(PAGE_LISTS, SEQ_LENS, PAGE_SIZE, num_indices=16)
    shape = (NUM_POOL_PAGES, NUM_KV_HEADS, PAGE_SIZE, head_dim)
    k = rng.integers(-4, 5, shape) / 8
    v = rng.standard_normal(shape)
    cache = paged.KVCache(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), "HND")
    q = jnp.asarray(rng.integers(-4, 5, (len(SEQ_LENS), NUM_HEADS, head_dim)) / 8, jnp.float32)
    return q, cache, table


def table_entries(table: paged.PageTable):
    """Each row's page list and last-page length, the padding past ``indptr[-1]`` left out."""
    indptr = np.asarray(table.page_indptr)
    indices = np.asarray(table.page_indices)
    rows = [indices[indptr[r] : indptr[r + 1]].tolist() for r in range(len(indptr) - 1)]
    return rows, np.asarray(table.last_page_len).tolist()


@pytest.mark.parametrize("per", ["kv_head", "query_head"])
def test_pallas_selects_the_reference_pages_and_attends_alike(per):
    q, cache, table = exact_inputs(seed=3)
    selection = paged.QuestSelection(page_key_bounds(cache, table), BUDGET, per)
    with record_backends() as records:
        q_view, _, kernel_table = paged.sparse.sparse_page_table(
            q, cache, table, selection, backend="pallas"
        )
    assert [(r.kernel, r.backend) for r in records] == [
        ("quest_scores", "pallas"),
        ("quest_select", "pallas"),
    ]
    _, _, reference_table = paged.sparse.sparse_page_table(
        q, cache, table, selection, backend="reference"
    )
    rows, last_lens = table_entries(kernel_table)
    assert (rows, last_lens) == table_entries(reference_table)
    # The case is not trivial: request 0's rows keep 3 of 5 pages, and not all the same 3.
    num_rows = NUM_KV_HEADS if per == "kv_head" else NUM_HEADS
    assert q_view.shape == (len(SEQ_LENS) * num_rows, NUM_HEADS // num_rows, HEAD_DIM)
    first_request = rows[:num_rows]
    assert all(len(row) == 3 for row in first_request)
    assert len({tuple(row) for row in first_request}) > 1

    with record_backends() as records:
        o, lse = paged.sparse_decode_attention(
            q, cache, table, selection, return_lse=True, backend="pallas"
        )
    assert [(r.kernel, r.backend) for r in records] == [(name, "pallas") for name in STEPS]
    want_o, want_lse = paged.sparse_decode_attention(
        q, cache, table, selection, return_lse=True, backend="reference"
    )
    for b in range(len(SEQ_LENS)):
        assert relative_error(o[b], want_o[b]) < OUTPUT_TOLERANCE, b
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))  # request 2: empty
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=OUTPUT_TOLERANCE)


def test_pallas_under_jit_with_a_budget_of_every_page_equals_dense_decode():
    """Every page kept (per query head, the finer table): dense decode, output and LSE, also
    with the table traced (the kernels' wrappers take traced tables)."""
    q, cache, table = exact_inputs(seed=5)
    selection = paged.QuestSelection(
        page_key_bounds(cache, table), max(SEQ_LENS) + PAGE_SIZE, "query_head"
    )
    sparse = jax.jit(
        lambda q, table: paged.sparse_decode_attention(
            q, cache, table, selection, return_lse=True, backend="pallas"
        )
    )
    o, lse = sparse(q, table)
    want_o, want_lse = paged.decode_attention(q, cache, table, return_lse=True, backend="reference")
    for b in range(len(SEQ_LENS)):
        assert relative_error(o[b], want_o[b]) < OUTPUT_TOLERANCE, b
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=OUTPUT_TOLERANCE)


def refuse_kernels(monkeypatch):
    """Replaces both Quest kernels' entries (looked up when called) with functions that raise."""

    def refuse(*args, **kwargs):
        raise AssertionError("a Quest kernel was called")

    monkeypatch.setattr(kernels_pallas.quest_scores, "quest_page_scores_pallas", refuse)
    monkeypatch.setattr(kernels_pallas.quest_select, "quest_selected_pages_pallas", refuse)


@pytest.mark.parametrize(
    ("backend", "kill_switch", "reason"),
    [
        ("reference", False, "backend='reference' was asked for"),
        ("auto", True, "kill switch"),
        ("auto", False, "auto: no GPU"),
    ],
)
def test_reference_kill_switch_and_auto_off_a_gpu_never_call_the_kernels(
    monkeypatch, backend, kill_switch, reason
):
    if kill_switch:
        monkeypatch.setenv("DECODELAB_BACKEND", "reference")
    monkeypatch.setattr(kernels_pallas.platform, "on_gpu", lambda: False)
    refuse_kernels(monkeypatch)
    q, cache, table = exact_inputs(seed=3)
    selection = paged.QuestSelection(page_key_bounds(cache, table), BUDGET)
    with pytest.raises(AssertionError, match="a Quest kernel was called"):  # the trap works
        paged.sparse.sparse_page_table(q, cache, table, selection, backend="pallas")
    with record_backends() as records:
        _, _, table_view = paged.sparse.sparse_page_table(
            q, cache, table, selection, backend=backend
        )
    assert [(r.kernel, r.backend) for r in records] == [
        ("quest_scores", "reference"),
        ("quest_select", "reference"),
    ]
    assert all(reason in r.reason for r in records), records
    assert table_entries(table_view)[0][0]  # a table was built: request 0, KV head 0 has pages


def test_auto_on_a_gpu_keeps_the_references_until_the_kernels_are_measured(monkeypatch):
    """The decision alone (no kernel runs): on a GPU, "auto" gives the reference while
    ``AUTO_PICKS_QUEST_KERNELS`` is False, the kernel once it is True, and the reference again
    where the kernel cannot run the call."""
    monkeypatch.setattr(kernels_pallas.platform, "on_gpu", lambda: True)
    choice = choose_quest_backend("auto", kernel="quest_scores")
    assert choice.backend == "reference"
    assert paged.sparse.QUEST_NOT_MEASURED_REASON in choice.reason
    monkeypatch.setattr(paged.sparse, "AUTO_PICKS_QUEST_KERNELS", True)
    assert choose_quest_backend("auto", kernel="quest_scores").backend == "pallas"
    declined = choose_quest_backend("auto", kernel="quest_scores", unsupported="head_dim=16")
    assert declined.backend == "reference" and "head_dim=16" in declined.reason
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_quest_backend("kernel", kernel="quest_scores")


def test_explicit_pallas_refuses_a_head_dim_the_scoring_kernel_cannot_run():
    q, cache, table = exact_inputs(seed=3, head_dim=16)
    selection = paged.QuestSelection(page_key_bounds(cache, table), BUDGET)
    message = (
        "backend='pallas' cannot run Quest's quest_scores kernel here: "
        "head_dim must be one of (64, 128, 256), got 16"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        paged.sparse_decode_attention(q, cache, table, selection, backend="pallas")
    # "auto" takes the reference for the same call (and the decode follows its own choice).
    with record_backends() as records:
        paged.sparse.sparse_page_table(q, cache, table, selection, backend="auto")
    assert [r.backend for r in records] == ["reference", "reference"]


def test_an_unknown_backend_is_named():
    q, cache, table = exact_inputs(seed=3)
    selection = paged.QuestSelection(page_key_bounds(cache, table), BUDGET)
    with pytest.raises(ValueError, match=re.escape("backend must be one of")):
        paged.sparse.sparse_page_table(q, cache, table, selection, backend="triton")


def test_explicit_pallas_refuses_float64():
    with enable_x64():
        q, cache, table = exact_inputs(seed=3)
        cache = paged.KVCache(
            cache.k_pages.astype(jnp.float64), cache.v_pages.astype(jnp.float64), "HND"
        )
        selection = paged.QuestSelection(page_key_bounds(cache, table), BUDGET)
        with pytest.raises(ValueError, match=re.escape("q must be float32, bfloat16 or float16")):
            paged.sparse.sparse_page_table(
                q.astype(jnp.float64), cache, table, selection, backend="pallas"
            )


@pytest.mark.gpu
@pytest.mark.parametrize("per", ["kv_head", "query_head"])
def test_compiled_kernel_path_at_a_decode_shape_on_gpu(per):
    """Compiled on the H200: 32 query heads, 8 KV heads, head_dim 128, pages of 16, bfloat16,
    two requests of about 8K tokens, a 2048-token budget. Keys and queries are multiples of 1/8
    in [-1/2, 1/2] (exact in bfloat16, exact scores), so the tables must be equal."""
    assert ON_GPU
    num_kv_heads, num_heads, head_dim, page_size = 8, 32, 128, 16
    lens = [8192 - 5, 6000]
    num_pages = sum(-(-n // page_size) for n in lens)
    rng = np.random.default_rng(13)
    pages = rng.permutation(num_pages + 32)[:num_pages].tolist()
    table = paged.PageTable.from_seq_lens(lens, page_size, pages=pages)
    shape = (num_pages + 32, num_kv_heads, page_size, head_dim)
    k = jnp.asarray(rng.integers(-4, 5, shape) / 8, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    cache = paged.KVCache(k, v, "HND")
    q = jnp.asarray(rng.integers(-4, 5, (2, num_heads, head_dim)) / 8, jnp.bfloat16)
    selection = paged.QuestSelection(page_key_bounds(cache, table), 2048, per)
    _, _, kernel_table = paged.sparse.sparse_page_table(
        q, cache, table, selection, backend="pallas"
    )
    _, _, reference_table = paged.sparse.sparse_page_table(
        q, cache, table, selection, backend="reference"
    )
    assert table_entries(kernel_table) == table_entries(reference_table)
    o, lse = paged.sparse_decode_attention(
        q, cache, table, selection, return_lse=True, backend="pallas"
    )
    as_f32 = paged.KVCache(cache.k_pages.astype(jnp.float32), v.astype(jnp.float32), "HND")
    want_o, want_lse = paged.sparse_decode_attention(
        q.astype(jnp.float32), as_f32, table, selection, return_lse=True, backend="reference"
    )
    for b in range(2):
        assert relative_error(o[b], np.asarray(want_o[b], np.float64)) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-4, atol=1e-3)
