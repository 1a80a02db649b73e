"""Page-number windows copied from 16-byte aligned starts (kernels_pallas/index_windows.py).

A Mosaic GPU copy of page numbers from an entry of ``page_indices`` that is not a multiple of 4
faults on the H200 (CUDA_ERROR_ILLEGAL_INSTRUCTION, measured 2026-12-02: decode at B=1 x 32K,
whose planner cuts 63-page chunks; MLA over a ragged batch). The interpreter has no alignment rule, so the CPU
tests here check the arithmetic and that a kernel reading windows at an offset still reads the
right pages; the gpu-marked tests run items that start at every entry modulo 4, compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from kernels_pallas.index_windows import (
    INDEX_ALIGN,
    MAX_INDEX_BUFFER,
    MAX_INDEX_WINDOW,
    aligned_window_start,
    default_index_window,
    index_buffer_entries,
    pad_page_indices,
)
from tests.conftest import ON_GPU
from tests.test_paged_decode_kernel import make_inputs, reference64, relative_error
from tests.test_paged_decode_mgpu import run_mgpu


@pytest.mark.parametrize("pages_per_step", [1, 2, 3, 4, 8, 16])
def test_default_window_is_the_largest_that_fits(pages_per_step):
    window = default_index_window(pages_per_step)
    assert window % INDEX_ALIGN == 0 and window % pages_per_step == 0
    assert index_buffer_entries(window) <= MAX_INDEX_BUFFER
    assert index_buffer_entries(window) % 32 == 0  # a second buffer starts on 128 bytes
    unit = np.lcm(INDEX_ALIGN, pages_per_step)
    assert window + unit + INDEX_ALIGN > MAX_INDEX_BUFFER  # the next one does not fit
    assert default_index_window(1) == MAX_INDEX_WINDOW == 252


def test_aligned_start_and_shift_cover_every_residue():
    aligned = jax.jit(aligned_window_start)  # one program for every scalar below
    pairs = [aligned(jnp.int32(first)) for first in range(13)]
    start = np.array([int(s) for s, _ in pairs])
    shift = np.array([int(t) for _, t in pairs])
    np.testing.assert_array_equal(start % INDEX_ALIGN, 0)
    np.testing.assert_array_equal(start + shift, np.arange(13))
    np.testing.assert_array_equal(shift, np.arange(13) % INDEX_ALIGN)


@pytest.mark.parametrize(
    "entries,window,expected",
    [(256, 252, 256), (1024, 4, 1024), (255, 252, 256), (10, 4, 32), (10, 252, 256), (36, 4, 36)],
)
def test_padding_to_alignment_and_one_buffer(entries, window, expected):
    indices = jnp.arange(1, entries + 1, dtype=jnp.int32)
    padded = pad_page_indices(indices, window)
    assert padded.shape == (expected,)
    np.testing.assert_array_equal(np.asarray(padded[:entries]), np.arange(1, entries + 1))
    np.testing.assert_array_equal(np.asarray(padded[entries:]), 0)
    if expected == entries:
        assert padded is indices  # no copy when nothing is needed


def _decode_at_unaligned_starts(lens, split, window, probs_in_smem):
    """The decode kernel over chunks of ``split`` pages (item starts at every residue mod 4),
    against the float64 reference; returns the relative error and the LSE's largest gap."""
    q, cache, table = make_inputs(
        3, lens, "HND", 4, 128, jnp.bfloat16, num_pool_pages=sum(-(-n // 16) for n in lens) + 8
    )
    plan = paged.plan_decode(table, q.shape[1], 2, 128, fixed_split_pages=split)
    starts = np.asarray(plan.work_page_start)[np.asarray(plan.work_request) >= 0]
    assert set(starts % INDEX_ALIGN) == {0, 1, 2, 3}  # the case covers every shift
    (o, lse), _ = run_mgpu(
        q, cache, table, plan, probs_in_smem=probs_in_smem, index_window=window, num_stages=2
    )
    ref_o, ref_lse = reference64(q, cache, table)
    return relative_error(o, ref_o), np.abs(np.asarray(lse, np.float64) - ref_lse).max()


@pytest.mark.skipif(ON_GPU, reason="the interpreter's path; the compiled one is below")
def test_decode_reads_the_right_pages_from_a_shifted_window():
    """Chunks of 3 pages (starts 0, 3, 6, 9, ...: every shift) in windows of 4 page numbers,
    interpreted: a wrong shift would read a neighbour's page and miss the reference."""
    err, lse_gap = _decode_at_unaligned_starts([16 * 9 - 3, 16 * 4], 3, 4, probs_in_smem=True)
    assert err < 1e-2 and lse_gap < 1e-2


@pytest.mark.gpu
def test_decode_at_unaligned_starts_compiled():
    """The case that faulted before the fix, compiled: 63-page chunks of one 4091-token request
    (starts 0, 63, 126, 189, 252) in full windows, and 3-page chunks in 4-entry windows."""
    assert ON_GPU
    err, lse_gap = _decode_at_unaligned_starts([4091], 63, None, probs_in_smem=False)
    assert err < 1e-2 and lse_gap < 1e-3
    err, lse_gap = _decode_at_unaligned_starts([16 * 9 - 3, 16 * 4], 3, 4, probs_in_smem=False)
    assert err < 1e-2 and lse_gap < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("per", ["kv_head", "query_head"])
def test_quest_scores_at_unaligned_starts_compiled(per):
    """Quest's scoring kernel over requests of 33, 63, 6 and 256 pages (their items start at
    entries 0, 33, 96, 102: three of the four shifts), compiled, against the reference."""
    from kernels_pallas.quest_scores import quest_page_scores_pallas
    from tests.test_quest_scores_kernel import (
        check_matches_reference,
        random_bounds,
        scattered_table,
    )

    assert ON_GPU
    rng = np.random.default_rng(5)
    table = scattered_table(rng, [33 * 16, 1000, 83, 4096], 512, 16)
    bounds = random_bounds(rng, 512, 8, 128)
    q = jnp.asarray(rng.standard_normal((4, 32, 128)), jnp.float32)
    scores = quest_page_scores_pallas(q, bounds, table, per=per)
    check_matches_reference(scores, q, bounds, table, per)


def test_quests_largest_copy_of_page_numbers_lowers_for_cuda():
    """Mosaic GPU refuses a copy of more than 256 entries a dimension when it lowers (on any
    machine): Quest's largest item (its page numbers and the 3 before them) must fit; the decode
    kernels' largest window fits one buffer by arithmetic (their lowering tests run it)."""
    from kernels_pallas.quest_scores import MAX_PAGES_PER_ITEM, quest_page_scores_pallas
    from tests.test_quest_scores_kernel import small_case

    assert index_buffer_entries(MAX_INDEX_WINDOW) <= MAX_INDEX_BUFFER
    q, bounds, table = small_case()
    lowered = (
        jax.jit(
            lambda q, bounds, table: quest_page_scores_pallas(
                q, bounds, table, pages_per_item=MAX_PAGES_PER_ITEM, num_stages=1
            )
        )
        .trace(q, bounds, table)
        .lower(lowering_platforms=("cuda",))
    )
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize(
    "launch, message",
    [
        (dict(index_window=8.0), "index_window must be an int, got 8.0"),
        (dict(index_window=True), "index_window must be an int, got True"),
        (dict(pages_per_step=300), "pages_per_step must be at most 252"),
        (dict(index_window=256), "at most 252, got 256"),
    ],
)
def test_window_arguments_are_named_when_bad(launch, message):
    """A window that is not an int, or pages a step no window holds, is refused naming the
    argument (before, 8.0 passed and failed inside the kernel's trace, and pages_per_step=300
    was reported as an index_window of 0 the caller never passed)."""
    q, cache, table = make_inputs(1, [40], "HND", 4, 64, jnp.bfloat16, num_pool_pages=4)
    plan = paged.plan_decode(table, q.shape[1], 2, 64)
    with pytest.raises(ValueError, match=message):
        run_mgpu(q, cache, table, plan, probs_in_smem=True, **launch)


def test_resolve_index_window_defaults_only_for_a_valid_page_count():
    from kernels_pallas.index_windows import resolve_index_window

    assert resolve_index_window(None, 4) == 252
    assert resolve_index_window(None, np.int64(8)) == 248  # NumPy ints are page counts too
    assert resolve_index_window(12, 4) == 12  # a given window is kept (validated elsewhere)
    assert resolve_index_window(None, 300) is None  # left for validation to name
    assert resolve_index_window(None, True) is None
