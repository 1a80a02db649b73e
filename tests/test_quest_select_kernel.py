"""The Quest selection kernel (``kernels_pallas/quest_select.py``) against the reference.

The reference is ``paged.sparse_quest.quest_selected_pages`` (tested on its own in
``test_sparse_quest.py``). The kernel must agree bit for bit: same pages kept, including which of
several equal scores win (the earlier), NaN below ``-inf``, ``-0.0`` tied with ``+0.0``, the
first and last page forced. Scores are drawn from a handful of values so that ties are the rule,
not the exception. On a CPU the kernel runs in Pallas interpret mode; shapes are fixed per test
(only the page table's values and the scores vary), so each test compiles once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernels_pallas.quest_select import quest_selected_pages_pallas, selection_keys
from paged.page_table import PageTable
from paged.sparse_quest import quest_selected_pages
from tests.conftest import ON_GPU, enable_x64

BATCH, ROWS, NUM_INDICES, PAGE_SIZE, BLOCK = 4, 2, 72, 4, 32
# Few values, so many ties; -inf is an empty page's score; both zeros; NaN.
SCORE_VALUES = [np.nan, -np.inf, -2.5, -0.0, 0.0, 1.0, 3.0, np.inf]


def table_of(lengths, num_indices=NUM_INDICES) -> PageTable:
    """Requests of ``lengths`` pages, consecutive in ``page_indices`` (the page numbers do not
    matter to the selection), padded to ``num_indices`` entries."""
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    assert indptr[-1] <= num_indices
    return PageTable(
        jnp.asarray(indptr),
        jnp.arange(num_indices, dtype=jnp.int32),
        jnp.full((len(lengths),), PAGE_SIZE, jnp.int32),
        PAGE_SIZE,
    )


def check_matches_reference(scores, table, token_budget, **kwargs):
    kept = quest_selected_pages_pallas(scores, table, token_budget, interpret=not ON_GPU, **kwargs)
    reference = quest_selected_pages(scores, table, token_budget)
    assert kept.shape == reference.shape and kept.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(reference))
    return np.asarray(kept)


@given(
    # Requests of 0, 1, 2 and many pages (up to 2 blocks of 32 and a bit), fitting 72 entries.
    lengths=st.lists(
        st.sampled_from([0, 1, 2, 3, 5, 17, 33, 40]), min_size=BATCH, max_size=BATCH
    ).filter(lambda lengths: sum(lengths) <= NUM_INDICES),
    # Budgets from under 2 pages (still 2 kept) to more than any request has.
    token_budget=st.integers(1, 4 * 45),
    value_indices=st.lists(
        st.integers(0, len(SCORE_VALUES) - 1),
        min_size=BATCH * ROWS * NUM_INDICES,
        max_size=BATCH * ROWS * NUM_INDICES,
    ),
)
def test_matches_reference_with_ties_infinities_and_nan(lengths, token_budget, value_indices):
    scores = np.asarray(SCORE_VALUES, np.float32)[value_indices].reshape(BATCH, ROWS, NUM_INDICES)
    check_matches_reference(jnp.asarray(scores), table_of(lengths), token_budget, block=BLOCK)


def test_selection_keys_order_like_the_reference():
    values = jnp.array([np.nan, -np.inf, -1e30, -1.0, -1e-30, -0.0, 0.0, 1e-30, 2.0, np.inf])
    keys = np.asarray(selection_keys(values))
    assert keys[0] < keys[1]  # NaN below -inf
    assert keys[5] == keys[6]  # -0.0 ties +0.0
    assert np.all(np.diff(keys[[1, 2, 3, 4, 5, 7, 8, 9]]) > 0)


def test_every_score_tied_keeps_the_earliest_pages():
    """All equal: the first and last page, then the earliest of the middle ones."""
    table = table_of([40, 0, 1, 2])
    kept = check_matches_reference(
        jnp.ones((BATCH, ROWS, NUM_INDICES)), table, token_budget=5 * PAGE_SIZE, block=BLOCK
    )
    assert np.flatnonzero(kept[0, 0]).tolist() == [0, 1, 2, 3, 39]


def test_long_request_default_block_and_bfloat16_under_jit_and_x64():
    """A 1500-page request (two 1024-column blocks), random bfloat16 scores with ties, traced
    table under jit, x64 on."""
    rng = np.random.default_rng(0)
    table = table_of([1500, 7], num_indices=1536)
    scores = jnp.asarray(rng.integers(-50, 50, (2, 1, 1536)), jnp.bfloat16)
    select = jax.jit(
        lambda scores, table: quest_selected_pages_pallas(
            scores, table, 300 * PAGE_SIZE, interpret=not ON_GPU
        )
    )
    with enable_x64():
        kept = select(scores, table)
    reference = quest_selected_pages(scores, table, 300 * PAGE_SIZE)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(reference))
    assert np.asarray(kept)[0, 0].sum() == 300 and np.asarray(kept)[1, 0].sum() == 7


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(token_budget=0), ValueError, "token_budget must be >= 1, got 0"),
        (dict(token_budget=2.5), TypeError, "token_budget must be an int, got 2.5"),
        (dict(scores=(4, 2, 71)), ValueError, "scores must have shape \\[4, R, 72\\]"),
        (dict(scores=(4, 72)), ValueError, "got \\(4, 72\\)"),
        (dict(scores="int"), ValueError, "scores must be float32, bfloat16 or float16.*int32"),
        (dict(block=48), ValueError, "block must be a power of two >= 32, got 48"),
        (dict(block=16), ValueError, "got 16"),
    ],
)
def test_bad_input_names_argument_and_value(change, error, message):
    table = table_of([3, 0, 1, 2])
    scores = jnp.zeros((BATCH, ROWS, NUM_INDICES))
    if isinstance(change.get("scores"), tuple):
        scores = jnp.zeros(change["scores"])
    elif change.get("scores") == "int":
        scores = jnp.zeros((BATCH, ROWS, NUM_INDICES), jnp.int32)
    kwargs = dict(token_budget=8, block=BLOCK, interpret=True)
    kwargs.update({k: v for k, v in change.items() if k in ("token_budget", "block")})
    with pytest.raises(error, match=message):
        quest_selected_pages_pallas(scores, table, **kwargs)


def test_float64_scores_refused():
    with enable_x64():
        scores = jnp.zeros((BATCH, ROWS, NUM_INDICES), jnp.float64)
        with pytest.raises(ValueError, match=r"scores must be float32.*float64"):
            quest_selected_pages_pallas(scores, table_of([3, 0, 1, 2]), 8, interpret=True)


@pytest.mark.gpu
def test_decode_shape_compiled():
    """B = 8 requests of 32K tokens, page size 16 (2048 pages each), 8 rows, budget 2048 tokens,
    compiled on the GPU, against the reference."""
    rng = np.random.default_rng(1)
    lengths = [2048] * 7 + [2000]
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    table = PageTable(
        jnp.asarray(indptr),
        jnp.arange(8 * 2048, dtype=jnp.int32),
        jnp.full((8,), 16, jnp.int32),
        16,
    )
    scores = jnp.asarray(rng.integers(-1000, 1000, (8, 8, 8 * 2048)), jnp.float32)
    kept = quest_selected_pages_pallas(scores, table, 2048)
    np.testing.assert_array_equal(
        np.asarray(kept), np.asarray(quest_selected_pages(scores, table, 2048))
    )


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
@pytest.mark.parametrize("block", [32, 1024])
def test_lowers_to_triton_for_an_h200(monkeypatch, verify_triton_modules, block):
    """The compiled path as far as a CPU can follow it: the kernel lowers to one Triton module
    for an H200 that the MLIR verifier accepts (the interpreter never exercises the Triton
    lowering rules: a loop with mixed bound types, say, fails only here)."""
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setitem(gpu_info.registry, jax.devices()[0].device_kind, lambda: h200)
    table = table_of([40, 0, 1, 2])

    def select(scores, indptr):
        table_traced = PageTable(indptr, table.page_indices, table.last_page_len, PAGE_SIZE)
        return quest_selected_pages_pallas(scores, table_traced, 64, block=block)

    scores = jnp.zeros((BATCH, ROWS, NUM_INDICES))
    text = jax.jit(select).trace(scores, table.page_indptr).lower(lowering_platforms=("cuda",))
    assert f"quest_select_b{block}" in text.as_text()


@pytest.mark.skipif(ON_GPU, reason="the smoke run is interpreted; on the GPU the probe times")
def test_probe_smoke_run(capsys):
    """``bench/probes/quest_select.py --smoke``: the probe's check and code paths, interpreted."""
    from bench.probes import quest_select as probe

    assert probe.main(["--smoke"]) == 0
    assert "kernel.b32 ok" in capsys.readouterr().out
