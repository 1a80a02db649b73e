"""``paged.mla_decode_attention``: the public MLA decode entry and its backends.

- ``"reference"`` is ``mla_decode_absorbed_reference`` bit for bit (float64, x64 on);
- ``"pallas_mgpu"`` is the Mosaic GPU kernel, here in its interpreter on bfloat16 inputs (16
  heads, R = 128, P = 64: the kernel's smallest sizes), against the float64 reference on the
  same rounded inputs: ``||out - ref|| / ||ref|| < 1e-2`` (testing.md), LSE within 2e-2;
- ``"auto"`` is the reference until ``AUTO_PICKS_MLA_KERNEL`` flips, on a GPU too; the kill
  switch; refused backend names;
- bad input gets the same error on every backend, and the kernel's wrapper gives the
  reference's errors (one validation path).

Two kernel runs (about 7 s each interpreted); everything else runs the reference or raises
before any kernel is traced.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import enable_x64
from reference_dense import relative_error

import paged
from kernels_pallas import platform
from kernels_pallas.mla_decode_mgpu import mla_decode_mgpu, plan_mla_decode
from paged import mla_decode
from paged.mla_decode import choose_mla_backend, mla_decode_attention
from paged.mla_reference import (
    mla_decode_absorbed_reference,
    mla_latent_attention_state,
)

NUM_HEADS, RANK, ROPE, NOPE, V_DIM = 16, 128, 64, 32, 48
PAGE_SIZE, NUM_PAGES = 16, 12
# One token, a page plus one, empty, a length that does not fill a 64-token step.
RAGGED_LENS = (1, 17, 0, 45)
TOLERANCE = 1e-2  # bfloat16 inputs (testing.md)


def scattered_table(rng, seq_lens):
    pages = rng.permutation(NUM_PAGES).tolist()
    lists = []
    for n in seq_lens:
        count = -(-n // PAGE_SIZE)
        lists.append(pages[:count])
        pages = pages[count:]
    return paged.PageTable.from_page_lists(lists, seq_lens=list(seq_lens), page_size=PAGE_SIZE)


def random_inputs(rng, batch, q_len, dtype=jnp.bfloat16, num_heads=NUM_HEADS):
    """Queries (``[B, L, H, D]``), a pool with every slot random, and projections, scaled so
    that the logits spread over a few units."""

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    cache = paged.LatentCache(
        normal(NUM_PAGES, PAGE_SIZE, RANK), normal(NUM_PAGES, PAGE_SIZE, ROPE)
    )
    q_nope = normal(batch, q_len, num_heads, NOPE, scale=3.0)
    q_rope = normal(batch, q_len, num_heads, ROPE, scale=0.5)
    w_uk = normal(num_heads, RANK, NOPE, scale=RANK**-0.5)
    w_uv = normal(num_heads, RANK, V_DIM, scale=RANK**-0.5)
    return q_nope, q_rope, cache, w_uk, w_uv


def as_float64(*arrays):
    """The same (rounded) values in float64; call inside ``enable_x64``."""
    out = []
    for a in arrays:
        if isinstance(a, paged.LatentCache):
            out.append(paged.LatentCache(*as_float64(a.latent_pages, a.rope_key_pages)))
        else:
            out.append(jnp.asarray(np.asarray(a, np.float64)))
    return out


@pytest.mark.parametrize("q_len", [1, 3])
def test_the_reference_backend_is_the_absorbed_reference(float64, q_len):
    """Bit for bit, ``[B, H, D]`` (one token) and ``[B, L, H, D]``, with and without the LSE;
    ``"auto"`` gives the same (here and on a GPU while the kernel is unmeasured)."""
    rng = np.random.default_rng(q_len)
    lens = [n if n == 0 else max(n, q_len) for n in RAGGED_LENS]
    table = scattered_table(rng, lens)
    q_nope, q_rope, cache, w_uk, w_uv = as_float64(
        *random_inputs(rng, len(lens), q_len, dtype=jnp.float32)
    )
    if q_len == 1:
        q_nope, q_rope = q_nope[:, 0], q_rope[:, 0]
    args = (q_nope, q_rope, cache, table, w_uk, w_uv)
    expected_out, expected_lse = mla_decode_absorbed_reference(*args, softmax_scale=0.3)
    assert expected_out.dtype == jnp.float64
    for backend in ("reference", "auto"):
        out, lse = mla_decode_attention(*args, softmax_scale=0.3, return_lse=True, backend=backend)
        np.testing.assert_array_equal(out, expected_out)
        np.testing.assert_array_equal(lse, expected_lse)
    np.testing.assert_array_equal(
        mla_decode_attention(*args, backend="reference"), mla_decode_absorbed_reference(*args)[0]
    )


@pytest.mark.parametrize(("q_len", "fixed_split_pages", "jitted"), [(1, None, False), (2, 1, True)])
def test_the_kernel_backend_matches_the_float64_reference(q_len, fixed_split_pages, jitted):
    """Interpreted on a CPU (compiled on a GPU): a ragged batch with scattered pages, one token
    as ``[B, H, D]`` whole requests, eagerly; two tokens causal with every page its own work
    item (states merged) under ``jit``, the table traced and the host's plan passed in. The
    pool's slots no request owns hold random values, not zeros."""
    rng = np.random.default_rng(10 + q_len)
    lens = [n if n == 0 else max(n, q_len) for n in RAGGED_LENS]
    table = scattered_table(rng, lens)
    q_nope, q_rope, cache, w_uk, w_uv = random_inputs(rng, len(lens), q_len)
    if q_len == 1:
        q_nope, q_rope = q_nope[:, 0], q_rope[:, 0]
    plan = plan_mla_decode(table, NUM_HEADS, q_len, fixed_split_pages=fixed_split_pages)
    assert plan.write_final == (fixed_split_pages is None)

    def attend(page_table):
        return mla_decode_attention(
            q_nope, q_rope, cache, page_table, w_uk, w_uv, return_lse=True, plan=plan,
            backend="pallas_mgpu",
        )  # fmt: skip

    with platform.record_backends() as records:
        out, lse = jax.jit(attend)(table) if jitted else attend(table)
    assert [(r.kernel, r.backend) for r in records] == [("mla_decode_mgpu", "pallas")]
    with enable_x64():
        ref_out, ref_lse = mla_decode_absorbed_reference(
            *as_float64(q_nope, q_rope, cache), table, *as_float64(w_uk, w_uv)
        )
        ref_out, ref_lse = np.asarray(ref_out), np.asarray(ref_lse)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(np.isfinite(out))
    assert relative_error(out, ref_out) < TOLERANCE, relative_error(out, ref_out)
    seen = np.isfinite(ref_lse)
    assert not seen.all()  # the empty request: lse -inf, out 0
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], atol=2e-2, rtol=0)
    np.testing.assert_array_equal(out[~seen], 0.0)


def _pretend_gpu(monkeypatch, *, kernel_measured: bool):
    """What a GPU host decides (``platform.on_gpu`` True), with or without the MLA kernel
    measured; nothing is run, only the decision is read."""
    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    monkeypatch.setattr(mla_decode, "AUTO_PICKS_MLA_KERNEL", kernel_measured)
    monkeypatch.delenv(platform.KILL_SWITCH_VARIABLE, raising=False)


def test_auto_is_the_reference_even_on_a_gpu_until_the_kernel_is_measured(monkeypatch):
    # The committed decision: the kernel has not run on the H200 (flip this with the constant).
    assert mla_decode.AUTO_PICKS_MLA_KERNEL is False
    _pretend_gpu(monkeypatch, kernel_measured=False)
    choice = choose_mla_backend("auto")
    assert choice.backend == "reference"
    assert "not been run and measured faster" in choice.reason
    # The entry follows the decision (the reference runs; no kernel is traced).
    rng = np.random.default_rng(0)
    q_nope, q_rope, cache, w_uk, w_uv = random_inputs(rng, 2, 1)
    table = scattered_table(rng, (5, 20))
    with platform.record_backends() as records:
        out = mla_decode_attention(q_nope, q_rope, cache, table, w_uk, w_uv)
    assert [r.backend for r in records] == ["reference"]
    np.testing.assert_array_equal(
        out, mla_decode_absorbed_reference(q_nope, q_rope, cache, table, w_uk, w_uv)[0]
    )
    # The one constant is the switch: measured, auto picks the kernel on a GPU.
    monkeypatch.setattr(mla_decode, "AUTO_PICKS_MLA_KERNEL", True)
    assert choose_mla_backend("auto").backend == "pallas_mgpu"
    reason = "dtype float32: the kernel takes bfloat16 or float16"
    assert choose_mla_backend("auto", unsupported=reason).backend == "reference"


def test_auto_off_a_gpu_is_the_reference(monkeypatch):
    monkeypatch.setattr(platform, "on_gpu", lambda: False)
    monkeypatch.setattr(mla_decode, "AUTO_PICKS_MLA_KERNEL", True)
    monkeypatch.delenv(platform.KILL_SWITCH_VARIABLE, raising=False)
    choice = choose_mla_backend("auto")
    assert choice.backend == "reference" and "no GPU" in choice.reason


def test_the_kill_switch(monkeypatch):
    """``DECODELAB_BACKEND=reference`` turns "auto" into the reference where it would pick the
    kernel; an explicit backend wins over it; a bad value is refused on every path."""
    _pretend_gpu(monkeypatch, kernel_measured=True)
    assert choose_mla_backend("auto").backend == "pallas_mgpu"
    monkeypatch.setenv(platform.KILL_SWITCH_VARIABLE, "reference")
    choice = choose_mla_backend("auto")
    assert choice.backend == "reference" and "kill switch" in choice.reason
    rng = np.random.default_rng(6)
    q_nope, q_rope, cache, w_uk, w_uv = random_inputs(rng, 1, 1)
    with platform.record_backends() as records:
        mla_decode_attention(q_nope, q_rope, cache, scattered_table(rng, (7,)), w_uk, w_uv)
    assert [(r.kernel, r.backend) for r in records] == [("mla_decode_mgpu", "reference")]
    assert choose_mla_backend("pallas_mgpu").backend == "pallas_mgpu"
    assert choose_mla_backend("pallas").backend == "pallas_mgpu"
    monkeypatch.setenv(platform.KILL_SWITCH_VARIABLE, "triton")
    for backend in ("auto", "reference", "pallas_mgpu"):
        with pytest.raises(ValueError, match="DECODELAB_BACKEND must be 'reference' or unset"):
            choose_mla_backend(backend)


@pytest.mark.parametrize("backend", ["triton", "Pallas", "mgpu", "", None])
def test_an_unknown_backend_is_refused(backend):
    rng = np.random.default_rng(1)
    q_nope, q_rope, cache, w_uk, w_uv = random_inputs(rng, 1, 1)
    table = scattered_table(rng, (3,))
    message = (
        f"backend must be one of ('auto', 'reference', 'pallas_mgpu', 'pallas'), got {backend!r}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        mla_decode_attention(q_nope, q_rope, cache, table, w_uk, w_uv, backend=backend)
    with pytest.raises(ValueError, match=re.escape(message)):
        choose_mla_backend(backend)


def test_what_the_kernel_cannot_run_is_refused_by_name_and_left_to_the_reference_by_auto():
    rng = np.random.default_rng(2)
    table = scattered_table(rng, (3, 20))
    cases = [
        (random_inputs(rng, 2, 1, dtype=jnp.float32), "dtype float32: the kernel takes bfloat16"),
        (
            random_inputs(rng, 2, 1, num_heads=12),
            "num_heads must be a positive multiple of 8, got 12",
        ),
    ]
    for (q_nope, q_rope, cache, w_uk, w_uv), reason in cases:
        args = (q_nope, q_rope, cache, table, w_uk, w_uv)
        for backend in ("pallas_mgpu", "pallas"):
            message = f"backend={backend!r} cannot run mla_decode_attention here: {reason}"
            with pytest.raises(ValueError, match=re.escape(message)):
                mla_decode_attention(*args, backend=backend)
        np.testing.assert_array_equal(
            mla_decode_attention(*args), mla_decode_absorbed_reference(*args)[0]
        )
    # Under jit the table is traced and the kernel's plan is made on the host: a plan is needed.
    q_nope, q_rope, cache, w_uk, w_uv = random_inputs(rng, 2, 1)

    def traced(backend):
        return jax.jit(
            lambda t: mla_decode_attention(q_nope, q_rope, cache, t, w_uk, w_uv, backend=backend)
        )(table)

    with pytest.raises(ValueError, match=re.escape("a traced page table without a plan")):
        traced("pallas_mgpu")
    np.testing.assert_allclose(
        traced("auto"),
        mla_decode_absorbed_reference(q_nope, q_rope, cache, table, w_uk, w_uv)[0],
        rtol=1e-6,
        atol=1e-6,
    )


def test_an_empty_batch_on_both_backends():
    rng = np.random.default_rng(3)
    q_nope, q_rope, cache, w_uk, w_uv = random_inputs(rng, 0, 2)
    table = paged.PageTable.from_page_lists([], seq_lens=[], page_size=PAGE_SIZE)
    for backend in ("reference", "pallas_mgpu"):
        out, lse = mla_decode_attention(
            q_nope, q_rope, cache, table, w_uk, w_uv, return_lse=True, backend=backend
        )
        assert out.shape == (0, 2, NUM_HEADS, V_DIM) and lse.shape == (0, 2, NUM_HEADS)


def _bad_inputs():
    """(name, change to valid kernel-sized inputs, the message every backend must give)."""
    bf16 = lambda *shape: jnp.ones(shape, jnp.bfloat16)
    return [
        (
            "pages that disagree",
            {
                "cache": paged.LatentCache(
                    bf16(NUM_PAGES, PAGE_SIZE, RANK), bf16(3, PAGE_SIZE, ROPE)
                )
            },
            f"cache.latent_pages ({NUM_PAGES}, {PAGE_SIZE}, {RANK}) and cache.rope_key_pages "
            f"(3, {PAGE_SIZE}, {ROPE}) must agree on [num_pages, page_size]",
        ),
        (
            "mixed cache dtypes",
            {
                "cache": paged.LatentCache(
                    bf16(NUM_PAGES, PAGE_SIZE, RANK),
                    jnp.ones((NUM_PAGES, PAGE_SIZE, ROPE), jnp.float16),
                )
            },
            "cache.latent_pages dtype bfloat16 differs from cache.rope_key_pages dtype float16",
        ),
        (
            "RoPE width",
            {"q_rope": bf16(2, NUM_HEADS, 32)},
            f"q_rope has qk_rope_head_dim 32 but the cache has {ROPE}",
        ),
        (
            "head count",
            {"q_nope": bf16(2, 8, NOPE), "q_rope": bf16(2, 8, ROPE)},
            f"q_nope has 8 heads but the projections have {NUM_HEADS} heads",
        ),
        (
            "projection rank",
            {"w_uk": bf16(NUM_HEADS, 64, NOPE)},
            f"w_uk has kv_lora_rank 64 (axis 1 of ({NUM_HEADS}, 64, {NOPE})) but the cache has "
            f"{RANK}",
        ),
        ("scale", {"softmax_scale": 0.0}, "softmax_scale must be finite and > 0, got 0.0"),
        (
            "page outside the pool",
            {"table": paged.PageTable.from_page_lists([[0], [99]], seq_lens=[3, 9], page_size=16)},
            f"page_table.page_indices[1]=99 is outside the pool of {NUM_PAGES} pages",
        ),
        (
            "batch",
            {"table": paged.PageTable.from_page_lists([[0]], seq_lens=[3], page_size=16)},
            "page_table describes 1 requests but the batch has 2",
        ),
        (
            "request shorter than q_len",
            {
                "q_nope": bf16(2, 4, NUM_HEADS, NOPE),
                "q_rope": bf16(2, 4, NUM_HEADS, ROPE),
            },
            "page_table's request 0 has 3 tokens, fewer than the q_len=4 new tokens",
        ),
    ]


@pytest.mark.parametrize(
    ("change", "message"), [c[1:] for c in _bad_inputs()], ids=[c[0] for c in _bad_inputs()]
)
def test_bad_input_gets_the_same_error_on_every_backend(change, message):
    rng = np.random.default_rng(4)
    q_nope, q_rope, cache, w_uk, w_uv = random_inputs(rng, 2, 1)
    args = dict(
        q_nope=q_nope[:, 0],
        q_rope=q_rope[:, 0],
        cache=cache,
        table=scattered_table(rng, (3, 20)),
        w_uk=w_uk,
        w_uv=w_uv,
        softmax_scale=None,
    )
    args.update(change)
    messages = []
    for backend in ("reference", "pallas_mgpu", "auto"):
        with pytest.raises(ValueError) as raised:
            mla_decode_attention(
                args["q_nope"], args["q_rope"], args["cache"], args["table"], args["w_uk"],
                args["w_uv"], softmax_scale=args["softmax_scale"], backend=backend,
            )  # fmt: skip
        messages.append(str(raised.value))
    assert messages == [messages[0]] * 3
    assert message in messages[0]


@pytest.mark.parametrize(
    "name", ["pages that disagree", "mixed cache dtypes", "RoPE width", "page outside the pool"]
)
def test_the_kernel_wrapper_refuses_bad_input_with_the_reference_errors(name):
    """``mla_decode_mgpu`` (the kernel's wrapper over a cache and a table) runs the reference's
    validation first, so its errors are ``mla_latent_attention_state``'s."""
    change, message = next(c[1:] for c in _bad_inputs() if c[0] == name)
    rng = np.random.default_rng(5)
    _, q_rope, cache, _, _ = random_inputs(rng, 2, 1)
    q_latent = jnp.ones((2, NUM_HEADS, RANK), jnp.bfloat16)
    q_rope = change.get("q_rope", q_rope[:, 0])
    cache = change.get("cache", cache)
    table = change.get("table", scattered_table(rng, (3, 20)))
    errors = []
    for attend in (mla_latent_attention_state, mla_decode_mgpu):
        with pytest.raises(ValueError) as raised:
            attend(q_latent, q_rope, cache, table, softmax_scale=0.1)
        errors.append(str(raised.value))
    assert errors[0] == errors[1] and message in errors[0]


def test_the_reference_backend_asks_nothing_of_the_kernel(monkeypatch):
    """``backend="reference"`` never consults the kernel's limits (whose module, imported for
    them, costs about 0.3 s and is needed by no reference call)."""

    def consulted(*args):
        raise AssertionError("the kernel's limits were asked for a reference call")

    monkeypatch.setattr(mla_decode, "kernel_unsupported", consulted)
    rng = np.random.default_rng(7)
    q_nope, q_rope, cache, w_uk, w_uv = random_inputs(rng, 2, 1)
    table = scattered_table(rng, (4, 19))
    out = mla_decode_attention(q_nope, q_rope, cache, table, w_uk, w_uv, backend="reference")
    np.testing.assert_array_equal(
        out, mla_decode_absorbed_reference(q_nope, q_rope, cache, table, w_uk, w_uv)[0]
    )
