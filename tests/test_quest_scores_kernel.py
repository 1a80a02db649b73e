"""The Mosaic GPU Quest scoring kernel (``kernels_pallas/quest_scores.py``) against the reference.

The reference is ``paged.sparse_quest.quest_page_scores`` (itself tested against an independent
bound check in ``test_sparse_quest.py``). On a CPU the kernel runs in Mosaic GPU's interpret
mode on small shapes; the ``gpu``-marked test runs it compiled at a decode shape.

Tolerance. Kernel and reference form the same float32 products and maxima; only the order of
the ``D``-term sum may differ. Two float32 sums of the same terms in any orders differ by at most
``2 (D - 1) u sum_i |t_i|`` (``u = 2^-24``), so each score may differ by ``2 D u sum_i |t_i|``
(for ``per="kv_head"``, the largest over the group), computed in float64 from the inputs. An
indexing error (a wrong page, head or query row) moves a score by whole terms, far more; and
``-inf`` must sit exactly where the reference puts it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.quest_scores import quest_page_scores_pallas, quest_work_items
from paged.page_table import PageTable
from paged.sparse_quest import PageKeyBounds, quest_page_scores
from tests.conftest import ON_GPU, enable_x64

UNIT_ROUNDOFF = 2.0**-24  # float32


def random_bounds(rng, num_pages, num_kv_heads, head_dim, empty_pages=()) -> PageKeyBounds:
    """Bounds of random keys (``kmin <= kmax``), ``empty_pages`` left unwritten (+inf, -inf)."""
    kmin = rng.standard_normal((num_pages, num_kv_heads, head_dim)).astype(np.float32)
    kmax = kmin + np.abs(rng.standard_normal(kmin.shape)).astype(np.float32)
    kmin[list(empty_pages)], kmax[list(empty_pages)] = np.inf, -np.inf
    return PageKeyBounds(jnp.asarray(kmin), jnp.asarray(kmax))


def score_tolerance(q, bounds, page_table, per) -> np.ndarray:
    """``2 D u sum_i |t_i|`` per score, shaped like the scores (0 where they are -inf)."""
    q64 = np.asarray(q, np.float64)
    batch, num_q_heads, head_dim = q64.shape
    num_kv_heads = bounds.kmin.shape[1]
    group = num_q_heads // num_kv_heads
    # Cut to the pool as the kernel and the reference's gather do (a table unchecked under jit).
    pages = np.minimum(np.asarray(page_table.page_indices), bounds.kmin.shape[0] - 1)
    magnitude = np.zeros((batch, num_kv_heads, group, pages.shape[0]))
    for kv_head in range(num_kv_heads):  # one head at a time: [G, nnz, D] stays small
        kmin = np.asarray(bounds.kmin[:, kv_head], np.float64)[pages]  # [nnz, D]
        kmax = np.asarray(bounds.kmax[:, kv_head], np.float64)[pages]
        for b in range(batch):
            query = q64[b, kv_head * group : (kv_head + 1) * group, None, :]  # [G, 1, D]
            with np.errstate(invalid="ignore"):  # empty pages: inf * 0; their scores are -inf
                terms = np.maximum(query * kmin, query * kmax)
            magnitude[b, kv_head] = np.nan_to_num(np.abs(terms).sum(-1), posinf=0.0)
    if per == "kv_head":
        magnitude = magnitude.max(axis=2)
    else:
        magnitude = magnitude.reshape(batch, num_q_heads, -1)
    return 2 * head_dim * UNIT_ROUNDOFF * magnitude


def check_matches_reference(scores, q, bounds, page_table, per):
    reference = np.asarray(quest_page_scores(q, bounds, page_table, per=per))
    scores = np.asarray(scores)
    assert scores.shape == reference.shape and scores.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(scores), np.isneginf(reference))
    finite = np.isfinite(reference)
    assert finite.sum() > 0  # the comparison below compares something
    error = np.abs(scores[finite] - reference[finite])
    assert np.all(error <= score_tolerance(q, bounds, page_table, per)[finite])


def scattered_table(rng, lengths, num_pages, page_size):
    """Requests of ``lengths`` tokens on pages drawn at random from the whole pool."""
    order = rng.permutation(num_pages)
    page_lists, used = [], 0
    for length in lengths:
        count = -(-length // page_size)
        page_lists.append(order[used : used + count].tolist())
        used += count
    return PageTable.from_page_lists(page_lists, seq_lens=lengths, page_size=page_size)


# (group, head_dim, per, pages_per_item, num_stages, row_padding): groups 1 and 4, head_dim 64
# and 128, both granularities; items of one and of several 64-page steps, steps prefetched all
# at once (stages >= steps) and refilled inside the loop (stages < steps); padded tile rows.
CONFIGS = [
    (1, 64, "kv_head", 64, 1, 0),
    (1, 128, "query_head", 128, 2, 8),
    (4, 64, "query_head", 192, 2, 0),
    (4, 128, "kv_head", 128, 1, 8),
]


@pytest.mark.parametrize("group, head_dim, per, pages_per_item, num_stages, row_padding", CONFIGS)
def test_scores_match_the_reference(group, head_dim, per, pages_per_item, num_stages, row_padding):
    if row_padding and ON_GPU:
        pytest.skip("row_padding runs interpreted only (compiled, its TMA destinations fault)")
    rng = np.random.default_rng(group * 1000 + head_dim)
    page_size, num_kv_heads, num_pages = 4, 2, 200
    # Ragged: one token, empty, a page plus one, a request of 133 pages (items of several steps
    # and a partial last step), a request ending on a full page.
    lengths = [1, 0, 5, 530, 16]
    table = scattered_table(rng, lengths, num_pages, page_size)
    used = np.asarray(table.page_indices)[: int(table.page_indptr[-1])]
    # Unwritten pages among the listed ones (their score is -inf, whatever the query).
    bounds = random_bounds(rng, num_pages, num_kv_heads, head_dim, empty_pages=used[[3, 40]])
    q = rng.standard_normal((len(lengths), num_kv_heads * group, head_dim)).astype(np.float32)
    q[0, :, :8] = 0.0  # zero query elements: 0 * inf would be NaN on an empty page
    q = jnp.asarray(q)
    scores = quest_page_scores_pallas(
        q,
        bounds,
        table,
        per=per,
        pages_per_item=pages_per_item,
        num_stages=num_stages,
        row_padding=row_padding,
        interpret=not ON_GPU,
    )
    check_matches_reference(scores, q, bounds, table, per)


def test_under_jit_and_x64():
    """Traced tables (jit) and x64 mode give the reference's scores; bfloat16 inputs are scored
    in float32 like the reference's."""
    rng = np.random.default_rng(7)
    table = scattered_table(rng, [9, 70, 0], num_pages=30, page_size=4)
    bounds = random_bounds(rng, 30, 1, 64)
    bounds = PageKeyBounds(bounds.kmin.astype(jnp.bfloat16), bounds.kmax.astype(jnp.bfloat16))
    q = jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.bfloat16)
    score = jax.jit(
        lambda q, bounds, table: quest_page_scores_pallas(
            q, bounds, table, per="query_head", pages_per_item=64, interpret=not ON_GPU
        )
    )
    with enable_x64():
        scores = score(q, bounds, table)
    check_matches_reference(scores, q, bounds, table, "query_head")


def test_work_items_cover_every_entry_once():
    indptr = jnp.array([0, 0, 130, 130, 131, 300], jnp.int32)
    request, start, end, item_indptr = quest_work_items(indptr, 64, 300 // 64 + 5)
    covered = np.zeros(300, int)
    for r, s, e in zip(np.asarray(request), np.asarray(start), np.asarray(end), strict=True):
        assert e - s <= 64
        covered[s:e] += 1
        if e > s:
            assert indptr[r] <= s and e <= indptr[r + 1]
    assert np.all(covered == 1)
    assert item_indptr.tolist() == [0, 0, 3, 3, 4, 7]


def small_case():
    rng = np.random.default_rng(0)
    table = scattered_table(rng, [5, 9], num_pages=8, page_size=4)
    return jnp.ones((2, 4, 64)), random_bounds(rng, 8, 2, 64), table


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(per="head"), "per must be one of"),
        (dict(q=jnp.ones((2, 4, 32))), "q has head_dim 32"),
        (dict(q=jnp.ones((2, 3, 64))), "num_q_heads=3 is not a multiple of num_kv_heads=2"),
        (dict(q=jnp.ones((3, 4, 64))), "describes 2 requests but the batch has 3"),
        (dict(q=np.ones((2, 4, 64))), "q must be float32, bfloat16 or float16"),
        (dict(bounds="short"), "must share a \\[num_pages, num_kv_heads, head_dim\\] shape"),
        (dict(bounds="dim8"), "head_dim must be one of \\(64, 128, 256\\), got 8"),
        (dict(table="outside"), "page_indices\\[1\\]=99 is outside the pool of 8 pages"),
        (dict(pages_per_item=100), "pages_per_item must be a multiple of 64 up to 192, got 100"),
        (dict(pages_per_item=512), "got 512"),
        (dict(num_stages=0), "num_stages must be an int >= 1, got 0"),
        (dict(row_padding=4), "row_padding must be one of \\(0, 8\\), got 4"),
        (dict(num_stages=8), "num_stages=8 at head_dim=64 \\(group 2\\) needs 263624 bytes"),
    ],
)
def test_bad_input_names_argument_and_value(change, message):
    q, bounds, table = small_case()
    kwargs = dict(per="kv_head", interpret=True)
    if "q" in change:
        q = change["q"]
        if isinstance(q, np.ndarray):
            with enable_x64():
                q = jnp.asarray(q, jnp.float64)
                with pytest.raises(ValueError, match=message):
                    quest_page_scores_pallas(q, bounds, table, **kwargs)
            return
    if change.get("bounds") == "short":
        bounds = PageKeyBounds(bounds.kmin, bounds.kmax[:4])
    if change.get("bounds") == "dim8":
        bounds = PageKeyBounds(bounds.kmin[..., :8], bounds.kmax[..., :8])
        q = q[..., :8]
    if change.get("table") == "outside":
        indices = np.asarray(table.page_indices).copy()
        indices[1] = 99
        table = PageTable(table.page_indptr, jnp.asarray(indices), table.last_page_len, 4)
    kwargs.update(
        {
            k: v
            for k, v in change.items()
            if k in ("per", "pages_per_item", "num_stages", "row_padding")
        }
    )
    with pytest.raises(ValueError, match=message):
        quest_page_scores_pallas(q, bounds, table, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("per", ["kv_head", "query_head"])
def test_decode_shape_compiled(per):
    """B = 8 requests of 32K tokens, page size 16, 32 query and 8 KV heads, head_dim 128,
    compiled on the GPU, against the reference."""
    rng = np.random.default_rng(1)
    page_size, num_kv_heads, head_dim = 16, 8, 128
    lengths = [32768] * 7 + [32768 - 5]
    num_pages = 8 * 2048 + 64
    table = scattered_table(rng, lengths, num_pages, page_size)
    bounds = random_bounds(rng, num_pages, num_kv_heads, head_dim)
    q = jnp.asarray(rng.standard_normal((8, 32, head_dim)), jnp.float32)
    scores = quest_page_scores_pallas(q, bounds, table, per=per)
    check_matches_reference(scores, q, bounds, table, per)


def test_padded_rows_are_refused_compiled():
    """row_padding=8 puts each tile row's TMA destination off 128 bytes, which faults on the
    H200: a compiled call refuses it, naming the argument; interpreted it runs."""
    q, bounds, table = small_case()
    with pytest.raises(ValueError, match="row_padding=8 runs interpreted only"):
        quest_page_scores_pallas(q, bounds, table, row_padding=8, interpret=False)
    assert quest_page_scores_pallas(q, bounds, table, row_padding=8, interpret=True).ndim == 3


@pytest.mark.parametrize("per, row_padding", [("kv_head", 0), ("query_head", 0)])
def test_lowers_for_cuda_on_any_machine(per, row_padding):
    """The compiled path's Mosaic GPU lowering (register layouts, TMA descriptors, layout
    inference) runs without a GPU: a layout the compiler cannot build fails here, on a CPU."""
    q, bounds, table = small_case()
    lowered = (
        jax.jit(
            lambda q, bounds, table: quest_page_scores_pallas(
                q, bounds, table, per=per, pages_per_item=128, num_stages=2, row_padding=row_padding
            )
        )
        .trace(q, bounds, table)
        .lower(lowering_platforms=("cuda",))
    )
    assert "mosaic_gpu" in lowered.as_text()


def test_page_numbers_past_the_pool_read_its_last_page_under_jit():
    """Under jit nothing checks the table: a page number past the pool is cut to the pool's last
    page (one unsigned minimum in the kernel), which is what the reference's clamped gather
    reads too, so the scores still agree and nothing outside the bounds is read."""
    rng = np.random.default_rng(3)
    table = scattered_table(rng, [9, 30], num_pages=12, page_size=4)
    indices = np.asarray(table.page_indices).copy()
    indices[[1, 5]] = [12, 10_000]
    table = PageTable(table.page_indptr, jnp.asarray(indices), table.last_page_len, 4)
    bounds = random_bounds(rng, 12, 2, 64)
    q = jnp.asarray(rng.standard_normal((2, 2, 64)), jnp.float32)
    scores = jax.jit(
        lambda q, table: quest_page_scores_pallas(
            q, bounds, table, pages_per_item=64, interpret=not ON_GPU
        )
    )(q, table)
    reference = jax.jit(lambda q, table: quest_page_scores(q, bounds, table))(q, table)
    last_page = quest_page_scores(
        q, bounds, PageTable.from_page_lists([[11], [11]], seq_lens=[4, 4], page_size=4)
    )
    np.testing.assert_array_equal(reference[0, :, 1], last_page[0, :, 0])  # the clamp assumed
    finite = np.isfinite(np.asarray(reference))
    np.testing.assert_array_equal(np.isneginf(scores), np.isneginf(reference))
    error = np.abs(np.asarray(scores)[finite] - np.asarray(reference)[finite])
    assert np.all(error <= score_tolerance(q, bounds, table, "kv_head")[finite])


@pytest.mark.skipif(ON_GPU, reason="the interpreter's race detector runs on the CPU")
def test_interpreter_race_detector_finds_no_race():
    """Mosaic GPU's interpreter with its happens-before race detector, on an item of three
    64-page steps through one stage, so every refill overwrites the slot just read. (It does
    find one without the ``commit_smem`` before a refill: the refill's copies race the reads of
    the step before.)"""
    # Private JAX module: if a JAX version moves it, the test skips rather than fails.
    gpu_callbacks = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rng = np.random.default_rng(0)
    table = scattered_table(rng, [4 * 130], num_pages=140, page_size=4)
    bounds = random_bounds(rng, 140, 1, 64)
    q = jnp.asarray(rng.standard_normal((1, 1, 64)), jnp.float32)
    scores = quest_page_scores_pallas(
        q,
        bounds,
        table,
        pages_per_item=192,
        num_stages=1,
        interpret=plgpu.InterpretGPUParams(detect_races=True),
    )
    check_matches_reference(scores, q, bounds, table, "kv_head")
    assert not gpu_callbacks.get_races().races_found
