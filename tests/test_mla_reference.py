"""MLA decode references: absorbed equals un-absorbed, split states merge exactly, porting mistakes.

Three computations of the same function, sharing no attention code:

- the NumPy oracle here (``mla_oracle``): each request's tokens gathered by walking its page list
  (``reference_dense.gather_tokens``), the latent expanded per head, a textbook softmax;
- ``mla_decode_unabsorbed_reference``: the pool expanded to K/V pages, then the project's GQA
  decode reference;
- ``mla_decode_absorbed_reference``: attention in latent space.

All in float64: agreement is to 1e-12 relative (``reference_dense.relative_error``), far below
what any of the porting mistakes tested at the end produces (1e-2 and more).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import enable_x64
from hypothesis import given
from hypothesis import strategies as st
from reference_dense import gather_tokens, relative_error
from strategies import PagedBucket, scattered_page_tables, sequence_lengths

import paged
from paged.attention_reference import merge_states
from paged.mla_cache import LatentCache
from paged.mla_reference import (
    absorb_query,
    default_softmax_scale,
    mla_decode_absorbed_reference,
    mla_decode_unabsorbed_reference,
    mla_latent_attention_state,
    project_latent_output,
)
from paged.prefill import new_token_positions

# Programs that run long (long contexts run through the float64 reference): compiled with XLA's CPU
# optimizations (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True

# Small but distinct sizes: every width differs, so an axis mixed up is a shape error or a
# wrong number, never a silent match. V != N, and R + P != N + P.
NUM_HEADS = 4
KV_LORA_RANK = 24
QK_ROPE_HEAD_DIM = 8
QK_NOPE_HEAD_DIM = 16
V_HEAD_DIM = 12
MAX_Q_LEN = 9
BUCKET = PagedBucket(batch_size=3, page_size=4, max_seq_len=22)
FLOAT64_TOLERANCE = 1e-12
# Each porting mistake moves the result by far more than this (the tests assert it), and the
# right computation stays within FLOAT64_TOLERANCE.
MISTAKE_MIN_ERROR = 1e-2


def _weights(rng, num_heads=NUM_HEADS, rank=KV_LORA_RANK, nope=QK_NOPE_HEAD_DIM, v=V_HEAD_DIM):
    # Scaled so that logits spread over a few units: the softmax is far from uniform, and a
    # wrong scale changes it visibly.
    w_uk = jnp.asarray(rng.standard_normal((num_heads, rank, nope)) / math.sqrt(rank) * 2.0)
    w_uv = jnp.asarray(rng.standard_normal((num_heads, rank, v)))
    return w_uk, w_uv


def _random_cache(rng, num_pages, page_size, rank=KV_LORA_RANK, rope=QK_ROPE_HEAD_DIM):
    """Every slot random (used or not), so a stray read shows."""
    return LatentCache(
        jnp.asarray(rng.standard_normal((num_pages, page_size, rank))),
        jnp.asarray(rng.standard_normal((num_pages, page_size, rope))),
    )


def _queries(rng, batch, q_len, num_heads=NUM_HEADS, nope=QK_NOPE_HEAD_DIM, rope=QK_ROPE_HEAD_DIM):
    leading = (batch, num_heads) if q_len is None else (batch, q_len, num_heads)
    q_nope = jnp.asarray(rng.standard_normal((*leading, nope)) * 2.0)
    q_rope = jnp.asarray(rng.standard_normal((*leading, rope)) * 2.0)
    return q_nope, q_rope


def natural_softmax(logits):
    """``(weights, lse)`` of a row of scaled logits, textbook float64, natural log."""
    peak = logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits - peak)
    total = weights.sum(axis=-1, keepdims=True)
    return weights / total, (peak + np.log(total))[..., 0]


def base2_softmax(logits, *, multiply_by_log2e=True, convert_lse_to_natural=True):
    """A base-2 kernel's softmax, as FlashInfer and FlashMLA compute it: ``exp2`` of logits
    pre-multiplied by ``log2(e)``, the LSE kept in base 2 (``log2 sum exp2``). The two flags
    switch off the two steps a port forgets: the ``log2(e)`` factor, and converting the LSE back
    to natural log (times ``ln 2``) before handing it to ``merge_states``."""
    logits2 = logits * (math.log2(math.e) if multiply_by_log2e else 1.0)
    peak = logits2.max(axis=-1, keepdims=True)
    weights = np.exp2(logits2 - peak)
    total = weights.sum(axis=-1, keepdims=True)
    lse2 = (peak + np.log2(total))[..., 0]
    return weights / total, lse2 * math.log(2.0) if convert_lse_to_natural else lse2


def mla_oracle(
    q_nope, q_rope, cache, page_lists, seq_lens, w_uk, w_uv, *, softmax_scale, softmax=None
):
    """float64 MLA attention, un-absorbed, one request and head at a time, on the host.

    Args:
      q_nope: ``[B, L, H, N]``, ``q_rope``: ``[B, L, H, P]``.
      page_lists, seq_lens: the requests as drawn (not read back from ``paged``).
      softmax: ``natural_softmax`` (default) or a variant; returns ``(weights, lse)``.

    Returns:
      ``(out [B, L, H, V], lse [B, L, H])``; a query that sees no key: ``0, -inf``.
    """
    softmax = softmax or natural_softmax
    q_nope, q_rope = np.asarray(q_nope), np.asarray(q_rope)
    w_uk, w_uv = np.asarray(w_uk), np.asarray(w_uv)
    batch, q_len, num_heads, _ = q_nope.shape
    out = np.zeros((batch, q_len, num_heads, w_uv.shape[2]))
    lse = np.full((batch, q_len, num_heads), -np.inf)
    for b, (page_list, seq_len) in enumerate(zip(page_lists, seq_lens, strict=True)):
        latent = gather_tokens(cache.latent_pages[:, :, None], "NHD", page_list, seq_len)[:, 0]
        rope_key = gather_tokens(cache.rope_key_pages[:, :, None], "NHD", page_list, seq_len)[:, 0]
        for h in range(num_heads):
            keys = np.concatenate([latent @ w_uk[h], rope_key], axis=1)  # [T, N + P]
            values = latent @ w_uv[h]  # [T, V]
            for token in range(q_len):
                visible = seq_len - q_len + token + 1
                if visible <= 0:
                    continue
                query = np.concatenate([q_nope[b, token, h], q_rope[b, token, h]])
                logits = keys[:visible] @ query * softmax_scale
                weights, lse[b, token, h] = softmax(logits)
                out[b, token, h] = weights @ values[:visible]
    return out, lse


def _as_4d(q):
    return q[:, None] if q.ndim == 3 else q


def _jitted(function):
    """The reference compiled once per shape and scale (run eagerly, its ``lax.map`` body would
    be traced again on every call). Under ``jit`` the value checks are skipped; the tests of bad
    input call the references eagerly."""
    return jax.jit(function, static_argnames="softmax_scale")


ABSORBED = _jitted(mla_decode_absorbed_reference)
UNABSORBED = _jitted(mla_decode_unabsorbed_reference)
LATENT_STATE = _jitted(mla_latent_attention_state)


def _lengths_for_q_len(q_len: int):
    """A ragged batch whose requests are empty or hold at least ``q_len`` tokens."""
    return st.lists(
        st.one_of(
            st.just(0), sequence_lengths(BUCKET.page_size, BUCKET.max_seq_len, min_len=q_len)
        ),
        min_size=BUCKET.batch_size,
        max_size=BUCKET.batch_size,
    )


@st.composite
def _mla_batches(draw, q_len: int):
    return draw(scattered_page_tables(BUCKET, seq_lens=_lengths_for_q_len(q_len)))


# q_len None is the [B, H, D] form of one token; 1 the [B, 1, H, D] form; 9 the most drafts.
@pytest.mark.parametrize("q_len", [None, 1, 3, MAX_Q_LEN])
@given(data=st.data())
def test_absorbed_equals_unabsorbed_equals_oracle(q_len, data):
    batch = data.draw(_mla_batches(q_len or 1))
    with enable_x64():
        _check_absorbed_equals_unabsorbed_equals_oracle(q_len, batch)


def _check_absorbed_equals_unabsorbed_equals_oracle(q_len, batch):
    rng = np.random.default_rng(sum(batch.seq_lens) * 7 + (q_len or 0))
    cache = _random_cache(rng, BUCKET.num_pool_pages, BUCKET.page_size)
    w_uk, w_uv = _weights(rng)
    q_nope, q_rope = _queries(rng, BUCKET.batch_size, q_len)

    absorbed, absorbed_lse = ABSORBED(q_nope, q_rope, cache, batch.page_table, w_uk, w_uv)
    unabsorbed, unabsorbed_lse = UNABSORBED(q_nope, q_rope, cache, batch.page_table, w_uk, w_uv)
    expected, expected_lse = mla_oracle(
        _as_4d(q_nope),
        _as_4d(q_rope),
        cache,
        batch.page_lists,
        batch.seq_lens,
        w_uk,
        w_uv,
        softmax_scale=1 / math.sqrt(QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM),
    )
    assert absorbed.dtype == jnp.float64 and absorbed.shape == unabsorbed.shape
    expected_shape = (BUCKET.batch_size,) + (() if q_len is None else (q_len,))
    assert absorbed.shape == (*expected_shape, NUM_HEADS, V_HEAD_DIM)
    assert absorbed_lse.shape == unabsorbed_lse.shape == (*expected_shape, NUM_HEADS)
    if q_len is None:  # compare as [B, 1, H, ...], the oracle's shape
        absorbed, absorbed_lse = absorbed[:, None], absorbed_lse[:, None]
        unabsorbed, unabsorbed_lse = unabsorbed[:, None], unabsorbed_lse[:, None]
    for b, seq_len in enumerate(batch.seq_lens):
        if seq_len == 0:  # sees no key: the documented empty state
            assert np.all(np.asarray(absorbed[b]) == 0)
            assert np.all(np.isneginf(np.asarray(absorbed_lse[b])))
            continue
        assert relative_error(absorbed[b], expected[b]) < FLOAT64_TOLERANCE
        assert relative_error(unabsorbed[b], expected[b]) < FLOAT64_TOLERANCE
        assert relative_error(absorbed[b], unabsorbed[b]) < FLOAT64_TOLERANCE
        # The LSE is the natural-log one of the same scaled logits, in both formulations.
        np.testing.assert_allclose(absorbed_lse[b], expected_lse[b], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(unabsorbed_lse[b], expected_lse[b], rtol=1e-13, atol=1e-13)


def test_deepseek_sizes_with_default_scale(float64):
    """At the real widths (16 heads, R = 512, P = 64, N = V = 128) the default scale is
    1/sqrt(192) in both formulations, and they agree."""
    rng = np.random.default_rng(5)
    table = paged.PageTable.from_page_lists([[3, 0], [1]], seq_lens=[6, 2], page_size=4)
    cache = _random_cache(rng, 4, 4, rank=512, rope=64)
    w_uk, w_uv = _weights(rng, num_heads=16, rank=512, nope=128, v=128)
    q_nope, q_rope = _queries(rng, 2, 2, num_heads=16, nope=128, rope=64)
    absorbed, absorbed_lse = ABSORBED(q_nope, q_rope, cache, table, w_uk, w_uv)
    unabsorbed, _ = UNABSORBED(q_nope, q_rope, cache, table, w_uk, w_uv)
    expected, expected_lse = mla_oracle(
        q_nope, q_rope, cache, [[3, 0], [1]], [6, 2], w_uk, w_uv, softmax_scale=1 / math.sqrt(192)
    )
    assert default_softmax_scale(128, 64) == 1 / math.sqrt(192)
    assert relative_error(absorbed, expected) < FLOAT64_TOLERANCE
    assert relative_error(unabsorbed, expected) < FLOAT64_TOLERANCE
    np.testing.assert_allclose(absorbed_lse, expected_lse, rtol=1e-13)


# --------------------------------------------------------------------------------------------
# Split states merge exactly
# --------------------------------------------------------------------------------------------


def _split_at_pages(page_lists, seq_lens, first_pages, page_size, num_indices):
    """Two tables over each request's pages ``[0, first_pages[b])`` and the rest, and the
    position of the second part's first token (a split-KV plan's two chunks)."""
    head_lists, tail_lists, head_lens, tail_lens = [], [], [], []
    for pages, seq_len, split in zip(page_lists, seq_lens, first_pages, strict=True):
        head_len = min(seq_len, split * page_size)
        head_lists.append(pages[:split])
        tail_lists.append(pages[split:])
        head_lens.append(head_len)
        tail_lens.append(seq_len - head_len)
    head = paged.PageTable.from_page_lists(
        head_lists, head_lens, page_size, num_indices=num_indices
    )
    tail = paged.PageTable.from_page_lists(
        tail_lists, tail_lens, page_size, num_indices=num_indices
    )
    return head, tail, jnp.asarray(head_lens, jnp.int32)


@functools.partial(jax.jit, static_argnames="softmax_scale")
def _split_and_merge(q_latent, q_rope, cache, table, head, tail, tail_start, *, softmax_scale):
    """The unsplit latent state, and the merge of the states over ``head`` and ``tail``."""
    whole = mla_latent_attention_state(q_latent, q_rope, cache, table, softmax_scale=softmax_scale)
    query_positions = new_token_positions(table, q_latent.shape[1])
    parts = [
        mla_latent_attention_state(
            q_latent,
            q_rope,
            cache,
            part,
            softmax_scale=softmax_scale,
            query_positions=query_positions,
            first_key_position=start,
        )
        for part, start in [(head, jnp.zeros_like(tail_start)), (tail, tail_start)]
    ]
    return whole, parts


SPLIT_Q_LEN = 4


@given(
    batch=_mla_batches(SPLIT_Q_LEN),
    first_pages=st.lists(
        st.integers(0, BUCKET.max_pages_per_request),
        min_size=BUCKET.batch_size,
        max_size=BUCKET.batch_size,
    ),
)
def test_split_states_merge_to_the_unsplit_state(batch, first_pages):
    with enable_x64():
        _check_split_states_merge_to_the_unsplit_state(batch, first_pages)


def _check_split_states_merge_to_the_unsplit_state(batch, first_pages):
    """Any page boundary, including one among the new tokens (the causal mask then cuts both
    parts) and an empty part (LSE -inf): ``merge_states`` of the two natural-log states is the
    unsplit state, and projecting with ``W_UV`` before or after the merge is the same."""
    rng = np.random.default_rng(sum(batch.seq_lens) + 31 * sum(first_pages))
    cache = _random_cache(rng, BUCKET.num_pool_pages, BUCKET.page_size)
    w_uk, w_uv = _weights(rng)
    q_nope, q_rope = _queries(rng, BUCKET.batch_size, SPLIT_Q_LEN)
    q_latent = absorb_query(q_nope, w_uk)
    scale = default_softmax_scale(QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM)
    head, tail, tail_start = _split_at_pages(
        batch.page_lists, batch.seq_lens, first_pages, BUCKET.page_size, BUCKET.num_indices
    )
    (whole, whole_lse), parts = _split_and_merge(
        q_latent, q_rope, cache, batch.page_table, head, tail, tail_start, softmax_scale=scale
    )
    states = jnp.stack([o for o, _ in parts], axis=2)  # [B, L, S=2, H, R]
    lses = jnp.stack([lse for _, lse in parts], axis=2)  # [B, L, S=2, H]
    merged, merged_lse = merge_states(states, lses)
    projected_parts = jnp.stack([project_latent_output(o, w_uv) for o, _ in parts], axis=2)
    merged_projected, _ = merge_states(projected_parts, lses)

    np.testing.assert_array_equal(np.isneginf(merged_lse), np.isneginf(whole_lse))
    np.testing.assert_allclose(merged_lse, whole_lse, rtol=1e-13, atol=1e-13)
    assert relative_error(merged, whole) < FLOAT64_TOLERANCE
    assert relative_error(merged_projected, project_latent_output(whole, w_uv)) < FLOAT64_TOLERANCE


# --------------------------------------------------------------------------------------------
# The known porting mistakes each fail a test
# --------------------------------------------------------------------------------------------


def _one_request_case(seed=11):
    rng = np.random.default_rng(seed)
    page_lists, seq_lens = [[2, 5, 0]], [11]
    table = paged.PageTable.from_page_lists(page_lists, seq_lens, page_size=4)
    cache = _random_cache(rng, 6, 4)
    w_uk, w_uv = _weights(rng)
    q_nope, q_rope = _queries(rng, 1, 2)
    return q_nope, q_rope, cache, table, page_lists, seq_lens, w_uk, w_uv


def test_the_latent_width_scale_1_over_sqrt_576_is_caught(float64):
    """``1/sqrt(R + P)`` (576 at DeepSeek's widths) instead of ``1/sqrt(N + P)`` (192): the
    absorbed kernel's dot product is R + P wide, but the model's scale is not."""
    q_nope, q_rope, cache, table, page_lists, seq_lens, w_uk, w_uv = _one_request_case()
    right = 1 / math.sqrt(QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM)
    latent_width = 1 / math.sqrt(KV_LORA_RANK + QK_ROPE_HEAD_DIM)
    expected, _ = mla_oracle(
        q_nope, q_rope, cache, page_lists, seq_lens, w_uk, w_uv, softmax_scale=right
    )
    default, _ = ABSORBED(q_nope, q_rope, cache, table, w_uk, w_uv)
    wrong, _ = ABSORBED(q_nope, q_rope, cache, table, w_uk, w_uv, softmax_scale=latent_width)
    assert relative_error(default, expected) < FLOAT64_TOLERANCE
    assert relative_error(wrong, expected) > MISTAKE_MIN_ERROR
    assert default_softmax_scale(128, 64) != 1 / math.sqrt(576)


def test_yarn_mscale_enters_through_softmax_scale(float64):
    """Under YaRN the scale is ``mscale**2 / sqrt(N + P)``: passed as ``softmax_scale``, both
    formulations use it and still agree with the oracle at that scale."""
    q_nope, q_rope, cache, table, page_lists, seq_lens, w_uk, w_uv = _one_request_case()
    mscale = 0.1 * math.log(40.0) + 1.0  # DeepSeek-V3's YaRN: factor 40, mscale_all_dim 1
    scale = mscale**2 / math.sqrt(QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM)
    expected, _ = mla_oracle(
        q_nope, q_rope, cache, page_lists, seq_lens, w_uk, w_uv, softmax_scale=scale
    )
    for reference in (ABSORBED, UNABSORBED):
        out, _ = reference(q_nope, q_rope, cache, table, w_uk, w_uv, softmax_scale=scale)
        assert relative_error(out, expected) < FLOAT64_TOLERANCE
    plain, _ = ABSORBED(q_nope, q_rope, cache, table, w_uk, w_uv)
    assert relative_error(plain, expected) > MISTAKE_MIN_ERROR


def test_a_base2_kernel_without_the_log2e_factor_is_caught(float64):
    """A kernel in base 2 must compute ``exp2(s * log2 e)``; ``exp2(s)`` alone is a softmax at
    ``ln 2`` times the scale. With the factor, the base-2 softmax (LSE converted back by ``ln 2``)
    is the reference's; without it, the output fails the comparison the kernel's test makes."""
    q_nope, q_rope, cache, table, page_lists, seq_lens, w_uk, w_uv = _one_request_case()
    scale = default_softmax_scale(QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM)
    reference, reference_lse = ABSORBED(q_nope, q_rope, cache, table, w_uk, w_uv)
    args = (q_nope, q_rope, cache, page_lists, seq_lens, w_uk, w_uv)
    right, right_lse = mla_oracle(*args, softmax_scale=scale, softmax=base2_softmax)
    forgot, _ = mla_oracle(
        *args,
        softmax_scale=scale,
        softmax=functools.partial(base2_softmax, multiply_by_log2e=False),
    )
    assert relative_error(right, reference) < FLOAT64_TOLERANCE
    np.testing.assert_allclose(right_lse, reference_lse, rtol=1e-13)
    assert relative_error(forgot, reference) > MISTAKE_MIN_ERROR


def test_a_base2_lse_breaks_the_merge(float64):
    """States whose LSE is left in base 2 (``log2 sum exp``, a base-2 kernel's own) merge with
    the wrong weights in ``merge_states``, which weighs by ``exp(lse)``: the merged output is
    off. In natural log, as the reference returns it, they merge exactly."""
    q_nope, q_rope, cache, table, page_lists, seq_lens, w_uk, _ = _one_request_case()
    scale = default_softmax_scale(QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM)
    q_latent = absorb_query(q_nope, w_uk)
    whole, _ = LATENT_STATE(q_latent, q_rope, cache, table, softmax_scale=scale)
    # The 11 tokens split at page 2 (token 8): both new tokens (positions 9, 10) see keys on
    # both sides, so the merge weighs two non-empty states.
    head, tail, tail_start = _split_at_pages(page_lists, seq_lens, [2], 4, num_indices=16)
    query_positions = new_token_positions(table, 2)
    parts = [
        LATENT_STATE(
            q_latent,
            q_rope,
            cache,
            part,
            softmax_scale=scale,
            query_positions=query_positions,
            first_key_position=start,
        )
        for part, start in [(head, jnp.zeros_like(tail_start)), (tail, tail_start)]
    ]
    states = jnp.stack([o for o, _ in parts], axis=2)
    natural = jnp.stack([lse for _, lse in parts], axis=2)
    assert np.all(np.isfinite(natural))
    merged, _ = merge_states(states, natural)
    merged_base2, _ = merge_states(states, natural * math.log2(math.e))
    assert relative_error(merged, whole) < FLOAT64_TOLERANCE
    assert relative_error(merged_base2, whole) > MISTAKE_MIN_ERROR


def test_values_wider_than_keys(float64):
    """``v_head_dim > qk_nope + qk_rope``: the expansion pads the keys instead of the values."""
    rng = np.random.default_rng(3)
    page_lists, seq_lens = [[1, 3], [0]], [7, 2]
    table = paged.PageTable.from_page_lists(page_lists, seq_lens, page_size=4)
    cache = _random_cache(rng, 4, 4)
    wide = QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM + 6
    w_uk, w_uv = _weights(rng, v=wide)
    q_nope, q_rope = _queries(rng, 2, 2)
    scale = default_softmax_scale(QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM)
    expected, _ = mla_oracle(
        q_nope, q_rope, cache, page_lists, seq_lens, w_uk, w_uv, softmax_scale=scale
    )
    for reference in (ABSORBED, UNABSORBED):
        out, _ = reference(q_nope, q_rope, cache, table, w_uk, w_uv)
        assert out.shape == (2, 2, NUM_HEADS, wide)
        assert relative_error(out, expected) < FLOAT64_TOLERANCE


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def _good_inputs():
    """Two requests (6 and 3 tokens), q_len 2: the start every bad case changes once."""
    rng = np.random.default_rng(2)
    table = paged.PageTable.from_page_lists([[3, 0], [1]], seq_lens=[6, 3], page_size=4)
    cache = _random_cache(rng, 4, 4)
    w_uk, w_uv = _weights(rng)
    q_nope, q_rope = _queries(rng, 2, 2)
    return dict(q_nope=q_nope, q_rope=q_rope, cache=cache, page_table=table, w_uk=w_uk, w_uv=w_uv)


def _changed(**overrides):
    return lambda: _good_inputs() | overrides


BAD_MLA_INPUTS = [
    (
        "q_nope_width",
        _changed(q_nope=jnp.zeros((2, 2, NUM_HEADS, 15))),
        "q_nope has qk_nope_head_dim 15 but w_uk has 16 (its last axis)",
    ),
    (
        "q_rope_width",
        _changed(q_rope=jnp.zeros((2, 2, NUM_HEADS, 64))),
        "q_rope has qk_rope_head_dim 64 but the cache has 8",
    ),
    (
        "q_heads",
        _changed(
            q_nope=jnp.zeros((2, 2, 5, QK_NOPE_HEAD_DIM)),
            q_rope=jnp.zeros((2, 2, 5, QK_ROPE_HEAD_DIM)),
        ),
        "q_nope has 5 heads but the projections have 4 heads",
    ),
    (
        "q_rope_q_len_differs",
        _changed(q_rope=jnp.zeros((2, 3, NUM_HEADS, QK_ROPE_HEAD_DIM))),
        "q_nope (2, 2, 4, 16) and q_rope (2, 3, 4, 8) must agree on every axis but the last",
    ),
    (
        "q_rope_single_token_form",
        _changed(q_rope=jnp.zeros((2, NUM_HEADS, QK_ROPE_HEAD_DIM))),
        "q_nope (2, 2, 4, 16) and q_rope (2, 4, 8) must agree on every axis but the last",
    ),
    (
        "q_len_zero",
        _changed(
            q_nope=jnp.zeros((2, 0, NUM_HEADS, QK_NOPE_HEAD_DIM)),
            q_rope=jnp.zeros((2, 0, NUM_HEADS, QK_ROPE_HEAD_DIM)),
        ),
        "q_nope's q_len (axis 1 of (2, 0, 4, 16)) must be >= 1, got 0",
    ),
    (
        "q_len_longer_than_a_request",
        _changed(
            q_nope=jnp.zeros((2, 4, NUM_HEADS, QK_NOPE_HEAD_DIM)),
            q_rope=jnp.zeros((2, 4, NUM_HEADS, QK_ROPE_HEAD_DIM)),
        ),
        "request 1 has 3 tokens, fewer than the q_len=4 new tokens",
    ),
    (
        "q_five_axes",
        _changed(q_nope=jnp.zeros((2, 2, 1, NUM_HEADS, QK_NOPE_HEAD_DIM))),
        "q_nope must have shape [B, H, D] or [B, q_len, H, D], got (2, 2, 1, 4, 16)",
    ),
    (
        "w_uk_heads_differ_from_w_uv",
        _changed(w_uk=jnp.zeros((3, KV_LORA_RANK, QK_NOPE_HEAD_DIM))),
        "w_uk has 3 heads but w_uv has 4",
    ),
    (
        "w_uv_rank",
        _changed(w_uv=jnp.zeros((NUM_HEADS, 512, V_HEAD_DIM))),
        "w_uv has kv_lora_rank 512 (axis 1 of (4, 512, 12)) but the cache has 24",
    ),
    (
        "w_uk_two_axes",
        _changed(w_uk=jnp.zeros((KV_LORA_RANK, QK_NOPE_HEAD_DIM))),
        "w_uk must have shape [heads, kv_lora_rank, qk_nope_head_dim], got (24, 16)",
    ),
    (
        "batch_differs_from_table",
        _changed(page_table=paged.PageTable.from_page_lists([[3, 0]], seq_lens=[6], page_size=4)),
        "page_table describes 1 requests but the batch has 2",
    ),
    (
        "page_size_differs",
        _changed(
            page_table=paged.PageTable.from_page_lists([[3], [1]], seq_lens=[6, 3], page_size=8)
        ),
        "page_table.page_size=8 differs from the cache's page_size=4",
    ),
    (
        "page_outside_pool",
        _changed(
            page_table=paged.PageTable.from_page_lists([[3, 7], [1]], seq_lens=[6, 3], page_size=4)
        ),
        "page_table.page_indices[1]=7 is outside the pool of 4 pages",
    ),
]

BAD_SCALES = [
    (0.0, "softmax_scale must be finite and > 0, got 0.0"),
    (-0.1, "softmax_scale must be finite and > 0, got -0.1"),
    (float("nan"), "softmax_scale must be finite and > 0, got nan"),
    ("0.1", "softmax_scale must be a float, got '0.1'"),
]

BOTH_REFERENCES = [mla_decode_absorbed_reference, mla_decode_unabsorbed_reference]


@pytest.mark.parametrize("reference", BOTH_REFERENCES, ids=["absorbed", "unabsorbed"])
@pytest.mark.parametrize(
    "make_inputs, message",
    [case[1:] for case in BAD_MLA_INPUTS],
    ids=[case[0] for case in BAD_MLA_INPUTS],
)
def test_references_refuse_bad_input(reference, make_inputs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        reference(**make_inputs())


@pytest.mark.parametrize("reference", BOTH_REFERENCES, ids=["absorbed", "unabsorbed"])
@pytest.mark.parametrize("scale, message", BAD_SCALES)
def test_references_refuse_bad_softmax_scale(reference, scale, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        reference(**_good_inputs(), softmax_scale=scale)


def test_the_good_inputs_the_bad_cases_start_from_are_accepted():
    """Each bad case differs from these in one argument, so its error names its own cause."""
    for reference in BOTH_REFERENCES:
        out, lse = reference(**_good_inputs())
        assert out.shape == (2, 2, NUM_HEADS, V_HEAD_DIM) and lse.shape == (2, 2, NUM_HEADS)


def _state_inputs(**overrides):
    inputs = _good_inputs()
    args = dict(
        q_latent=absorb_query(inputs["q_nope"], inputs["w_uk"]),
        q_rope=inputs["q_rope"],
        cache=inputs["cache"],
        page_table=inputs["page_table"],
        softmax_scale=0.2,
    )
    return args | overrides


BAD_STATE_INPUTS = [
    (
        dict(q_latent=jnp.zeros((2, 2, NUM_HEADS, 576))),
        "q_latent has width 576 but the cache's kv_lora_rank is 24",
    ),
    (
        dict(query_positions=jnp.zeros((2, 3), jnp.int32)),
        "query_positions must have shape [2, 2] ([B, q_len]), got (2, 3)",
    ),
    (
        dict(first_key_position=jnp.zeros((3,), jnp.int32)),
        "first_key_position must have shape [2] ([B]), got (3,)",
    ),
    (dict(softmax_scale=None), "softmax_scale must be a float, got None"),
]


@pytest.mark.parametrize("overrides, message", BAD_STATE_INPUTS)
def test_latent_state_refuses_bad_input(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        mla_latent_attention_state(**_state_inputs(**overrides))
