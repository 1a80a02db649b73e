"""The Mosaic GPU MLA absorbed-decode kernel against ``mla_latent_attention_state`` in float64.

On a CPU the kernel runs in Mosaic GPU's interpreter with ``p`` through shared memory
(``probs_in_smem=True``, the only way the interpreter runs), on tiny shapes (R = 128; 16 heads
x 1 or 2 tokens on the transposed path, 16 heads x 4 and 8 x 9 on the 64-row tile); the tile
path's register variant is lowered for CUDA here, and every path runs compiled at DeepSeek's
sizes in the ``gpu``-marked tests (and compiled, at these shapes, in all the others on a GPU). Error measure: ``||out - ref|| / ||ref||``
against the reference in float64 on the same bfloat16-rounded inputs, below 1e-2 (testing.md).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, enable_x64
from reference_dense import relative_error

import paged
from kernels_pallas.mla_decode_mgpu import (
    mla_decode_mgpu,
    mla_decode_mgpu_states,
    plan_mla_decode,
    smem_bytes_per_program,
)
from paged.attention_reference import merge_states
from paged.mla_reference import mla_latent_attention_state

# Programs that run long (interpreted multi-warpgroup kernels run long): compiled with XLA's CPU
# optimizations (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True

TOLERANCE = 1e-2  # bfloat16 inputs (testing.md)
PAGE_SIZE = 16
NUM_PAGES = 24
# One token, a full page, a page plus one, empty, a length that does not divide a 64-token
# step, and one of more than one step (3 steps, 9 pages: longer than a 4-entry index window).
RAGGED_LENS = (1, 16, 17, 0, 45, 130)
SCALE = 0.125
PROBS_IN_SMEM = not ON_GPU  # the interpreter's path on a CPU; the register path on a GPU


def scattered_table(rng, seq_lens, num_pages=NUM_PAGES, page_size=PAGE_SIZE):
    """Each request's pages drawn from a random permutation of the pool."""
    pages = rng.permutation(num_pages).tolist()
    lists = []
    for n in seq_lens:
        count = -(-n // page_size)
        lists.append(pages[:count])
        pages = pages[count:]
    return paged.PageTable.from_page_lists(lists, seq_lens=list(seq_lens), page_size=page_size)


def random_inputs(rng, batch, q_len, num_heads, rank, rope, num_pages=NUM_PAGES, page_size=16):
    """bfloat16 queries and pool, every slot random (used or not), so a stray read shows."""

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)

    cache = paged.LatentCache(
        normal(num_pages, page_size, rank), normal(num_pages, page_size, rope)
    )
    # Scaled so that logits spread over a few units (the softmax is far from uniform).
    q_latent = normal(batch, q_len, num_heads, rank, scale=2.0 / np.sqrt(rank) / SCALE)
    q_rope = normal(batch, q_len, num_heads, rope, scale=1.0)
    return q_latent, q_rope, cache


def reference64(q_latent, q_rope, cache, table):
    with enable_x64():
        as64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        o, lse = mla_latent_attention_state(
            as64(q_latent),
            as64(q_rope),
            paged.LatentCache(as64(cache.latent_pages), as64(cache.rope_key_pages)),
            table,
            softmax_scale=SCALE,
        )
        return np.asarray(o), np.asarray(lse)


def run(q_latent, q_rope, cache, table, **kwargs):
    kwargs.setdefault("probs_in_smem", PROBS_IN_SMEM)
    return mla_decode_mgpu(
        q_latent, q_rope, cache, table, softmax_scale=SCALE, interpret=not ON_GPU, **kwargs
    )


def run_states(q_latent, q_rope, cache, page_indices, plan):
    """The kernel's unmerged states (one a work item) for ``plan``'s items over
    ``page_indices`` (possibly bad numbers: nothing here validates them)."""
    return mla_decode_mgpu_states(
        q_latent,
        q_rope,
        cache.latent_pages,
        cache.rope_key_pages,
        jnp.asarray(page_indices),
        *(jnp.asarray(a) for a in (plan.work_request, plan.work_page_start)),
        *(jnp.asarray(a) for a in (plan.work_page_end, plan.work_last_page_len)),
        softmax_scale=SCALE,
        probs_in_smem=PROBS_IN_SMEM,
        interpret=not ON_GPU,
    )


def assert_matches(o, lse, ref_o, ref_lse):
    o, lse = np.asarray(o), np.asarray(lse)
    assert np.all(np.isfinite(o)), "o has a non-finite value"
    assert relative_error(o, ref_o) < TOLERANCE, relative_error(o, ref_o)
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen)  # -inf exactly where no key is seen
    np.testing.assert_allclose(lse[seen], ref_lse[seen], atol=2e-2, rtol=0)
    np.testing.assert_array_equal(o[~seen], 0.0)


@pytest.fixture(scope="module")
def ragged_case():
    rng = np.random.default_rng(20)
    table = scattered_table(rng, RAGGED_LENS)
    inputs = random_inputs(rng, len(RAGGED_LENS), 4, 16, 128, 64)
    return inputs, table


# Both paths, each unsplit and split: one and two tokens x 16 heads take the transposed path
# by default (one token split is test_split_states_are_the_reference_states_of_each_part's
# case), four tokens x 16 heads the 64-row tile.
@pytest.mark.parametrize(
    ("q_len", "fixed_split_pages", "transposed"),
    [(1, None, None), (1, None, False), (4, None, None), (2, 2, True)],
)
def test_kernel_matches_the_float64_reference(ragged_case, q_len, fixed_split_pages, transposed):
    """Ragged batch, scattered pages, one or four new tokens (causal among themselves), the
    whole request a work item or cut every 2 pages (states merged by merge_states.py). Four
    tokens x 16 heads are exactly one 64-row tile; one token (passed as ``[B, H, R]``) leaves
    48 padding rows on the tile path, none on the transposed one (the 16 rows are its N)."""
    (q_latent, q_rope, cache), table = ragged_case
    q_latent, q_rope = q_latent[:, :q_len], q_rope[:, :q_len]
    if q_len > 1:  # a request must hold its new tokens: drop the ones shorter than 4
        keep = [b for b, n in enumerate(RAGGED_LENS) if n >= q_len or n == 0]
        table = paged.PageTable.from_page_lists(
            [table.page_lists()[b] for b in keep],
            seq_lens=[RAGGED_LENS[b] for b in keep],
            page_size=PAGE_SIZE,
        )
        q_latent, q_rope = q_latent[np.array(keep)], q_rope[np.array(keep)]
    plan = plan_mla_decode(table, 16, q_len, fixed_split_pages=fixed_split_pages)
    assert plan.write_final == (fixed_split_pages is None)
    ref_o, ref_lse = reference64(q_latent, q_rope, cache, table)
    if q_len == 1:  # the one-token form [B, H, R] (the 4-D one is the other tests')
        q_latent, q_rope, ref_o, ref_lse = q_latent[:, 0], q_rope[:, 0], ref_o[:, 0], ref_lse[:, 0]
    o, lse = run(q_latent, q_rope, cache, table, plan=plan, transposed=transposed)
    assert o.shape == q_latent.shape and o.dtype == jnp.float32
    assert_matches(o, lse, ref_o, ref_lse)


def test_nine_tokens_span_two_row_blocks():
    """9 new tokens x 8 heads = 72 rows: two programs a work item, the second with 8 real rows
    (its other 56 belong to the next request or lie past the queries, computed, never kept);
    the causal rule across both blocks; split every 3 pages and merged."""
    rng = np.random.default_rng(5)
    lens = (9, 70, 0, 140)
    table = scattered_table(rng, lens)
    q_latent, q_rope, cache = random_inputs(rng, len(lens), 9, 8, 128, 64)
    plan = plan_mla_decode(table, 8, 9, fixed_split_pages=3)
    o, lse = run(q_latent, q_rope, cache, table, plan=plan)
    assert_matches(o, lse, *reference64(q_latent, q_rope, cache, table))


def test_split_states_are_the_reference_states_of_each_part(ragged_case):
    """Each work item's partial state (natural-log LSE) is the reference's state over that
    part of its request; merged by the reference merge they give the whole request's."""
    (q_latent, q_rope, cache), table = ragged_case
    q_latent, q_rope = q_latent[:, :1], q_rope[:, :1]
    plan = plan_mla_decode(table, 16, 1, fixed_split_pages=3)
    o, lse = run_states(q_latent, q_rope, cache, table.page_indices, plan)
    merge_indptr = np.asarray(plan.merge_indptr)
    indices = np.asarray(table.page_indices)
    ref_o, ref_lse = reference64(q_latent, q_rope, cache, table)
    for b, n in enumerate(RAGGED_LENS):
        items = range(merge_indptr[b], merge_indptr[b + 1])
        for item in items:
            start, end = int(plan.work_page_start[item]), int(plan.work_page_end[item])
            tokens = (end - start - 1) * PAGE_SIZE + int(plan.work_last_page_len[item])
            part_table = paged.PageTable.from_page_lists(
                [indices[start:end].tolist()], seq_lens=[max(tokens, 0)], page_size=PAGE_SIZE
            )
            part_o, part_lse = reference64(
                q_latent[b : b + 1], q_rope[b : b + 1], cache, part_table
            )
            assert_matches(o[item][None], lse[item][None], part_o[:, 0], part_lse[:, 0])
        if n:
            merged_o, merged_lse = merge_states(
                jnp.asarray(np.asarray(o)[list(items)]), jnp.asarray(np.asarray(lse)[list(items)])
            )
            assert_matches(merged_o[None], merged_lse[None], ref_o[b, :1], ref_lse[b, :1])


def test_poisoned_unused_slots_and_bad_page_numbers(ragged_case):
    """NaN in every slot no request owns (the tails of last pages, unlisted pages) changes
    nothing; page numbers outside the pool are clamped into it (no read outside the array)."""
    (q_latent, q_rope, cache), table = ragged_case
    q_latent, q_rope = q_latent[:, :1], q_rope[:, :1]
    owned = np.zeros((NUM_PAGES, PAGE_SIZE), bool)
    for pages, n in zip(table.page_lists(), RAGGED_LENS, strict=True):
        for t in range(n):
            owned[pages[t // PAGE_SIZE], t % PAGE_SIZE] = True
    poison = lambda x: jnp.where(jnp.asarray(owned)[:, :, None], x, jnp.nan)
    poisoned = paged.LatentCache(poison(cache.latent_pages), poison(cache.rope_key_pages))
    o, lse = run(q_latent, q_rope, poisoned, table)
    assert_matches(o, lse, *reference64(q_latent, q_rope, cache, table))

    plan = plan_mla_decode(table, 16, 1)
    bad = np.asarray(table.page_indices).copy()
    bad[0], bad[-1] = 10_000, -5
    o_bad, lse_bad = run_states(q_latent, q_rope, cache, bad, plan)
    # One unsigned minimum: a negative number wraps above the pool, so both read the last page.
    clamped = np.where((bad < 0) | (bad >= NUM_PAGES), NUM_PAGES - 1, bad)
    clamped_table = dataclasses.replace(table, page_indices=jnp.asarray(clamped, jnp.int32))
    ref_o, ref_lse = reference64(q_latent, q_rope, cache, clamped_table)
    real = np.asarray(plan.merge_indptr)[:-1]
    assert_matches(o_bad[real], lse_bad[real], ref_o[:, 0], ref_lse[:, 0])


def test_a_bad_last_page_len_reads_fewer_tokens_and_ends():
    """A work item whose last_page_len is negative (a broken plan under jit) has fewer tokens
    than pages: the kernel attends over those tokens and ends. (Its second 4-entry index window
    is not copied, since no step reads it; the interpreter does not flag a copy left in flight,
    so that part is the kernel's comment, not this test's.)"""
    rng = np.random.default_rng(11)
    table = scattered_table(rng, (80,))
    q_latent, q_rope, cache = random_inputs(rng, 1, 1, 16, 128, 64)
    o, lse = mla_decode_mgpu_states(
        q_latent,
        q_rope,
        cache.latent_pages,
        cache.rope_key_pages,
        jnp.asarray(table.page_indices),
        *(jnp.asarray([v], jnp.int32) for v in (0, 0, 5, -20)),  # 4 x 16 - 20 = 44 tokens
        softmax_scale=SCALE,
        index_window=4,
        probs_in_smem=PROBS_IN_SMEM,
        interpret=not ON_GPU,
    )
    pages = table.page_lists()[0][:3]
    short = paged.PageTable.from_page_lists([pages], seq_lens=[44], page_size=PAGE_SIZE)
    ref_o, ref_lse = reference64(q_latent, q_rope, cache, short)
    assert_matches(o, lse, ref_o[:, 0], ref_lse[:, 0])


def test_no_work_and_empty_batch():
    rng = np.random.default_rng(1)
    q_latent, q_rope, cache = random_inputs(rng, 0, 1, 16, 128, 64, num_pages=2)
    empty = jnp.zeros((0,), jnp.int32)
    o, lse = mla_decode_mgpu_states(
        q_latent,
        q_rope,
        cache.latent_pages,
        cache.rope_key_pages,
        jnp.zeros((4,), jnp.int32),
        empty,
        empty,
        empty,
        empty,
        softmax_scale=SCALE,
        probs_in_smem=True,
        interpret=True,
    )
    assert o.shape == (0, 16, 128) and lse.shape == (0, 16)


@pytest.mark.parametrize(
    ("q_len", "num_heads", "page_size", "probs_in_smem", "transposed"),
    [
        (1, 16, 16, False, None),  # transposed
        (2, 16, 16, False, True),  # transposed, causal
        (1, 16, 16, False, False),
        (2, 128, 64, False, None),
        (4, 128, 32, False, None),
        (9, 16, 16, False, None),
        (4, 16, 16, True, None),
    ],
)
def test_compiled_paths_lower_for_an_h200(q_len, num_heads, page_size, probs_in_smem, transposed):
    """The compiled paths at DeepSeek's sizes, R = 512, P = 64, lower through Mosaic GPU to its
    dialect for CUDA (the PTX stage runs on a GPU): the transposed path with its in-place
    accumulator, the 64-row tile with p from registers (which the interpreter cannot run), and
    with p through shared memory and one ring slot (the probe's fallback)."""
    batch, num_work = 4, 8
    shape = jax.ShapeDtypeStruct
    traced = mla_decode_mgpu_states.trace(
        shape((batch, q_len, num_heads, 512), jnp.bfloat16),
        shape((batch, q_len, num_heads, 64), jnp.bfloat16),
        shape((64, page_size, 512), jnp.bfloat16),
        shape((64, page_size, 64), jnp.bfloat16),
        shape((300,), jnp.int32),
        *[shape((num_work,), jnp.int32)] * 4,
        page_indptr=shape((batch + 1,), jnp.int32),
        last_page_len=shape((batch,), jnp.int32),
        softmax_scale=1 / 192**0.5,
        probs_in_smem=probs_in_smem,
        num_stages=1 if probs_in_smem else 2,
        transposed=transposed,
    )
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_shared_memory_fits_two_stages_at_deepseek_sizes():
    assert smem_bytes_per_program(512, 64, jnp.bfloat16, num_stages=2) <= 227 * 1024
    assert smem_bytes_per_program(512, 64, jnp.bfloat16, num_stages=3) > 227 * 1024


def _bad_call(**overrides):
    """The states kernel on tiny valid arguments, with some replaced."""
    args = dict(
        q_latent=jnp.zeros((1, 1, 16, 128), jnp.bfloat16),
        q_rope=jnp.zeros((1, 1, 16, 64), jnp.bfloat16),
        latent_pages=jnp.zeros((2, 16, 128), jnp.bfloat16),
        rope_key_pages=jnp.zeros((2, 16, 64), jnp.bfloat16),
        page_indices=jnp.zeros((1,), jnp.int32),
        work_request=jnp.zeros((1,), jnp.int32),
        work_page_start=jnp.zeros((1,), jnp.int32),
        work_page_end=jnp.ones((1,), jnp.int32),
        work_last_page_len=jnp.ones((1,), jnp.int32),
        softmax_scale=SCALE,
        probs_in_smem=True,
        interpret=True,
    )
    args.update(overrides)
    positional = [
        args.pop(k)
        for k in (
            "q_latent",
            "q_rope",
            "latent_pages",
            "rope_key_pages",
            "page_indices",
            "work_request",
            "work_page_start",
            "work_page_end",
            "work_last_page_len",
        )
    ]
    return mla_decode_mgpu_states(*positional, **args)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"q_latent": jnp.zeros((1, 1, 16, 128), jnp.float32)}, "bfloat16 or float16"),
        ({"q_latent": jnp.zeros((1, 16, 128), jnp.bfloat16)}, "q_latent and q_rope must be"),
        ({"q_rope": jnp.zeros((1, 1, 8, 64), jnp.bfloat16)}, "must agree on"),
        ({"q_latent": jnp.zeros((1, 1, 16, 256), jnp.bfloat16)}, "kv_lora_rank"),
        ({"latent_pages": jnp.zeros((2, 16, 96), jnp.bfloat16)}, "kv_lora_rank"),
        ({"q_rope": jnp.zeros((1, 1, 16, 32), jnp.bfloat16)}, "qk_rope_head_dim"),
        (
            {
                "latent_pages": jnp.zeros((2, 12, 128), jnp.bfloat16),
                "rope_key_pages": jnp.zeros((2, 12, 64), jnp.bfloat16),
            },
            "page_size must be one of",
        ),
        ({"rope_key_pages": jnp.zeros((3, 16, 64), jnp.bfloat16)}, "must agree on"),
        (
            {
                "q_latent": jnp.zeros((1, 1, 12, 128), jnp.bfloat16),
                "q_rope": jnp.zeros((1, 1, 12, 64), jnp.bfloat16),
            },
            "num_heads must be a positive multiple of 8, got 12",
        ),
        (
            {
                "q_latent": jnp.zeros((1, 0, 16, 128), jnp.bfloat16),
                "q_rope": jnp.zeros((1, 0, 16, 64), jnp.bfloat16),
            },
            "q_len",
        ),
        ({"softmax_scale": 0.0}, "softmax_scale must be finite and > 0, got 0.0"),
        ({"softmax_scale": float("nan")}, "softmax_scale"),
        ({"num_stages": 0}, "num_stages must be an int >= 1, got 0"),
        ({"index_window": 6}, "index_window must be a multiple of 4"),
        ({"index_window": 512}, "index_window"),
        (
            {
                "latent_pages": jnp.zeros((2, 8, 128), jnp.bfloat16),
                "rope_key_pages": jnp.zeros((2, 8, 64), jnp.bfloat16),
                "index_window": 4,
            },
            "index_window must be a multiple of the 8 pages of a step (page_size 8), got 4",
        ),
        ({"interpret": True, "probs_in_smem": False}, "needs probs_in_smem=True"),
        (
            {
                "q_latent": jnp.zeros((1, 5, 16, 128), jnp.bfloat16),
                "q_rope": jnp.zeros((1, 5, 16, 64), jnp.bfloat16),
                "transposed": True,
                "page_indptr": jnp.array([0, 1], jnp.int32),
                "last_page_len": jnp.ones((1,), jnp.int32),
            },
            "transposed must be None, False, or True for at most 32 query rows",
        ),
        ({"interpret": False, "num_stages": 3}, "num_stages=3 needs"),
        (
            {
                "q_latent": jnp.zeros((1, 2, 16, 128), jnp.bfloat16),
                "q_rope": jnp.zeros((1, 2, 16, 64), jnp.bfloat16),
            },
            "q_len=2 needs the table's page_indptr",
        ),
        ({"work_page_end": jnp.ones((2,), jnp.int32)}, "must share one 1-D shape"),
    ],
)
def test_bad_arguments_are_refused_by_name(overrides, message):
    if overrides.get("num_stages") == 3:  # the shared-memory check is at DeepSeek's sizes
        overrides = {
            **overrides,
            "q_latent": jnp.zeros((1, 1, 16, 512), jnp.bfloat16),
            "q_rope": jnp.zeros((1, 1, 16, 64), jnp.bfloat16),
            "latent_pages": jnp.zeros((2, 16, 512), jnp.bfloat16),
        }
    with pytest.raises(ValueError, match=re.escape(message)):
        _bad_call(**overrides)


def test_a_plan_for_another_table_is_refused():
    rng = np.random.default_rng(3)
    q_latent, q_rope, cache = random_inputs(rng, 2, 1, 16, 128, 64)
    table = scattered_table(rng, (20, 40))
    stale = plan_mla_decode(scattered_table(rng, (20, 33)), 16)
    with pytest.raises(ValueError, match="stale"):
        run(q_latent, q_rope, cache, table, plan=stale)
    with pytest.raises(ValueError, match="page_table describes 2 requests but the batch has 1"):
        run(q_latent[:1], q_rope[:1], cache, table)


@pytest.mark.gpu
@pytest.mark.parametrize(("q_len", "num_heads"), [(1, 16), (2, 16), (4, 16), (1, 128), (4, 128)])
@pytest.mark.parametrize("fixed_split_pages", [None, 5])
def test_compiled_kernel_at_deepseek_sizes(q_len, num_heads, fixed_split_pages):
    """Compiled, default paths (transposed at 16 and 32 rows, the 64-row tile with p from
    registers at 64, 128 and 512), R = 512, P = 64, bfloat16: a ragged batch with scattered
    pages (up to 1000 tokens), one to four new tokens, unsplit and split every 5 pages."""
    rng = np.random.default_rng(q_len * 1000 + num_heads)
    lens = (1, 16, 17, 0, 45, 64, 65, 1000)
    num_pages = 128
    table = scattered_table(rng, lens, num_pages=num_pages)
    q_latent, q_rope, cache = random_inputs(
        rng, len(lens), q_len, num_heads, 512, 64, num_pages=num_pages
    )
    if q_len > 1:
        keep = np.array([b for b, n in enumerate(lens) if n >= q_len or n == 0])
        table = paged.PageTable.from_page_lists(
            [table.page_lists()[b] for b in keep],
            seq_lens=[lens[b] for b in keep],
            page_size=PAGE_SIZE,
        )
        q_latent, q_rope = q_latent[keep], q_rope[keep]
    o, lse = run(q_latent, q_rope, cache, table, fixed_split_pages=fixed_split_pages)
    assert_matches(o, lse, *reference64(q_latent, q_rope, cache, table))


@pytest.mark.skipif(ON_GPU, reason="on a GPU the probe runs compiled (bench/run_on_gpu.sh)")
def test_probe_runs_a_smoke_case(capsys):
    """``bench/probes/mla_decode.py --smoke``: its checks and code paths, interpreted."""
    from bench.probes import mla_decode

    assert mla_decode.main(["--smoke"]) == 0
    printed = capsys.readouterr().out
    assert "kernel ok" in printed and "kernel.tile ok" in printed and "xla ok" in printed


@pytest.mark.skipif(ON_GPU, reason="the interpreter's race detector runs on the CPU")
@pytest.mark.parametrize("transposed", [True, False])
def test_interpreter_race_detector_finds_no_race(transposed):
    """Mosaic GPU's interpreter with its happens-before race detector: the producer's ring and
    index windows (9 pages in 4-entry windows: a buffer refilled), the tail rows each compute
    warpgroup zeroes in its half, p in shared memory, and the epilogue's buffers that alias the
    loop's. (It does find one: without the fence before an index window's copy it reports the
    copy racing the earlier reads of the buffer's page numbers.)"""
    # Private JAX module: if a JAX version moves it, the test skips rather than fails.
    gpu_callbacks = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rng = np.random.default_rng(7)
    lens = (130, 17)
    table = scattered_table(rng, lens)
    q_latent, q_rope, cache = random_inputs(rng, len(lens), 1, 16, 128, 64)
    plan = plan_mla_decode(table, 16, 1)
    mla_decode_mgpu_states(
        q_latent,
        q_rope,
        cache.latent_pages,
        cache.rope_key_pages,
        jnp.asarray(table.page_indices),
        *(jnp.asarray(a) for a in (plan.work_request, plan.work_page_start)),
        *(jnp.asarray(a) for a in (plan.work_page_end, plan.work_last_page_len)),
        softmax_scale=SCALE,
        index_window=4,
        probs_in_smem=True,
        transposed=transposed,
        interpret=plgpu.InterpretGPUParams(detect_races=True),
    )[0].block_until_ready()
    assert not gpu_callbacks.get_races().races_found
