"""The causal prefill kernel (``kernels_pallas/paged_prefill.py``) against a float64 oracle.

``paged.decode_attention`` runs query runs longer than ``paged.decode.MAX_KERNEL_Q_LEN`` (prompt
chunks) on this kernel. On a CPU it runs in Pallas interpret mode on small shapes; on a GPU the
same tests run compiled, plus the ``gpu``-marked one at benchmark shapes. The oracle is
``tests/reference_dense.paged_causal_attention_oracle``: NumPy, float64, each request's keys
gathered by walking its page list, a textbook softmax per query token (no code shared with
``paged``). Error measure ``||out - ref|| / ||ref||`` on the same rounded inputs; bounds from
``testing.md``: float32 < 1e-5, bfloat16 < 1e-2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged
from bench.suites import peers
from kernels_pallas import paged_prefill as prefill_kernel
from kernels_pallas import platform
from paged import decode as decode_module
from tests import test_paged_decode_kernel as decode_kernel_tests
from tests.conftest import ON_GPU
from tests.reference_dense import paged_causal_attention_oracle

PAGE_SIZE = 16
NUM_KV_HEADS = 2
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# Longer than the decode kernel's maximum (so the public API runs this kernel), and a multiple
# of no block_q (the last query block is partial).
Q_LEN = 37
# A prefix of 19 tokens (the chunk starts mid-page), the whole prompt (seq_len = q_len), a prefix
# of exactly two pages, an empty request, a long prefix (several unmasked steps before the
# diagonal), and a sequence ending on a full last page (last_page_len = page_size).
LENS = (Q_LEN + 19, Q_LEN, Q_LEN + 32, 0, Q_LEN + 150, Q_LEN + 27)
NUM_POOL_PAGES = 40
# Pairwise cover of layout x group x dtype x soft cap (every pair appears), head_dim 32 or 64.
# Group 3 is not a power of two: its block_q x 3 rows are padded in registers.
CONFIGS = [
    ("HND", 4, jnp.float32, None, 32),
    ("NHD", 1, jnp.float32, 5.0, 64),
    ("HND", 1, jnp.bfloat16, None, 32),
    ("NHD", 4, jnp.bfloat16, 5.0, 32),
    ("HND", 3, jnp.float32, 5.0, 32),
    ("NHD", 3, jnp.bfloat16, None, 64),
]


def make_inputs(seed, lens, q_len, layout, group, head_dim, dtype, num_pool_pages=NUM_POOL_PAGES):
    """Random q ``[B, q_len, H, D]`` and pool (never zeros), pages scattered over the pool in
    random order; page 0 is never listed (masked page loads fetch it: see the NaN test)."""
    return decode_kernel_tests.make_inputs(
        seed,
        lens,
        layout,
        group,
        head_dim,
        dtype,
        num_pool_pages,
        NUM_KV_HEADS,
        q_len=q_len,
        first_page=1,
    )


def oracle(q, cache, table, soft_cap=None):
    return paged_causal_attention_oracle(
        q,
        cache.k_pages,
        cache.v_pages,
        cache.layout,
        table,
        sm_scale=1.0 / np.sqrt(q.shape[-1]),
        logits_soft_cap=soft_cap,
    )


def relative_error(out, ref) -> float:
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out)), "kernel output has NaN or inf"
    if not np.any(ref):  # an all-empty batch: the output must be exactly zero
        return float(np.max(np.abs(out), initial=0.0))
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def check_against_oracle(o, lse, q, cache, table, soft_cap=None):
    """Every output finite and within the dtype's bound; a query that sees no key (an empty
    request, or under jit a position before 0) gets exactly 0 and -inf."""
    ref_o, ref_lse = oracle(q, cache, table, soft_cap)
    assert o.shape == q.shape and lse.shape == q.shape[:-1]
    assert o.dtype == q.dtype and lse.dtype == jnp.float32
    assert relative_error(o, ref_o) < TOLERANCE[q.dtype.type]
    lse, sees_nothing = np.asarray(lse), np.isneginf(ref_lse)
    assert np.all(np.asarray(o)[sees_nothing] == 0)
    assert np.all(np.isneginf(lse[sees_nothing]))
    np.testing.assert_allclose(lse[~sees_nothing], ref_lse[~sees_nothing], rtol=1e-5, atol=1e-5)


def run_kernel(q, cache, table, soft_cap=None, **launch):
    """The raw kernel with explicit launch parameters (interpreted on a CPU)."""
    group = q.shape[2] // NUM_KV_HEADS
    params = {**prefill_kernel.launch_parameters(q.shape[-1], group, PAGE_SIZE), **launch}
    return prefill_kernel.paged_prefill(
        q,
        cache.k_pages,
        cache.v_pages,
        table.page_indices,
        table.page_indptr,
        table.last_page_len,
        layout=cache.layout,
        sm_scale=1.0 / np.sqrt(q.shape[-1]),
        logits_soft_cap=soft_cap,
        interpret=not ON_GPU,
        **params,
    )


@pytest.mark.parametrize("layout,group,dtype,soft_cap,head_dim", CONFIGS)
def test_public_api_runs_the_kernel_and_matches_the_oracle(
    layout, group, dtype, soft_cap, head_dim
):
    """Through ``paged.decode_attention(backend="pallas")`` with its default launch: ragged
    requests with and without a prefix, an empty one, q_len = seq_len, q_len not a multiple of
    block_q, pages scattered."""
    q, cache, table = make_inputs(0, LENS, Q_LEN, layout, group, head_dim, dtype)
    o, lse = paged.decode_attention(
        q, cache, table, return_lse=True, logits_soft_cap=soft_cap, backend="pallas"
    )
    check_against_oracle(o, lse, q, cache, table, soft_cap)


@pytest.mark.parametrize(
    "group,block_q,pages_per_step",
    [(4, 1, 1), (4, 4, 2), (1, 32, 1), (1, 8, 4)],
)
def test_launch_parameters_do_not_change_the_result(group, block_q, pages_per_step):
    """Query blocks of 1 to 32 tokens and steps of 1 to 4 pages: the causal bound falls at
    every offset inside a step, and the unmasked/masked split of the key loop moves."""
    q, cache, table = make_inputs(1, LENS, Q_LEN, "HND", group, 32, jnp.float32)
    o, lse = run_kernel(q, cache, table, block_q=block_q, pages_per_step=pages_per_step)
    check_against_oracle(o, lse, q, cache, table)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_unused_slots_holding_nan_never_reach_the_output(layout):
    """Page tails, unlisted pages and page 0 (which masked page loads fetch) hold NaN: masked,
    never weighted by 0."""
    q, cache, table = make_inputs(2, LENS, Q_LEN, layout, 4, 32, jnp.float32)
    k = np.full(cache.k_pages.shape, np.nan, np.float32)
    v = np.full(cache.v_pages.shape, np.nan, np.float32)
    real_k, real_v = np.asarray(cache.k_pages), np.asarray(cache.v_pages)
    for b, pages in enumerate(table.page_lists()):
        for j, page in enumerate(pages):
            filled = min(PAGE_SIZE, LENS[b] - j * PAGE_SIZE)
            if layout == "HND":
                k[page, :, :filled] = real_k[page, :, :filled]
                v[page, :, :filled] = real_v[page, :, :filled]
            else:
                k[page, :filled], v[page, :filled] = real_k[page, :filled], real_v[page, :filled]
    assert np.isnan(k[0]).all()  # page 0 is unlisted
    poisoned = paged.KVCache(jnp.asarray(k), jnp.asarray(v), layout)
    o, lse = paged.decode_attention(q, poisoned, table, return_lse=True, backend="pallas")
    check_against_oracle(o, lse, q, cache, table)


def test_under_jit_a_request_shorter_than_q_len_sees_nothing_before_position_0():
    """Only jit lets a request of 6 tokens meet 37 queries: queries at negative positions get
    0 and -inf (like the reference), the others attend causally. Its second query block (tokens
    16 to 31) runs one step in which only token 31 sees a key: the other rows' weights must be
    exactly 0 there, not exp2(0)."""
    lens = (6, Q_LEN + 19, 0, Q_LEN)
    q, cache, table = make_inputs(3, lens, Q_LEN, "HND", 4, 32, jnp.float32)
    decode = jax.jit(functools.partial(paged.decode_attention, return_lse=True, backend="pallas"))
    o, lse = decode(q, cache, table)
    check_against_oracle(o, lse, q, cache, table)
    assert np.all(np.isneginf(np.asarray(lse)[0, : Q_LEN - 6]))
    assert np.all(np.isfinite(np.asarray(lse)[0, Q_LEN - 6 :]))


def test_invalid_tables_under_jit_stay_inside_the_arrays():
    """Under jit nothing is validated; the kernel clamps instead of reading past its arrays.
    A request whose table is wrong gets a wrong but finite answer; the others are unaffected.
    (Interpret mode clamps out-of-bounds reads itself, so what this shows on a CPU is the
    outputs; that no access leaves an array is for the GPU run under compute-sanitizer.)"""
    lens = (Q_LEN + 20, Q_LEN + 3, Q_LEN + 40)
    q, cache, table = make_inputs(4, lens, Q_LEN, "HND", 4, 32, jnp.float32)
    decode = jax.jit(functools.partial(paged.decode_attention, backend="pallas"))
    good = np.asarray(decode(q, cache, table))
    bad_indices = table.page_indices.at[0].set(1000)  # request 0's first page: outside the pool
    bad_last = table.last_page_len.at[1].set(PAGE_SIZE + 4)  # request 1: beyond a page
    bad_indptr = table.page_indptr.at[3].set(10_000)  # request 2: pages past page_indices
    out = np.asarray(
        decode(q, cache, paged.PageTable(table.page_indptr, bad_indices, bad_last, PAGE_SIZE))
    )
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out[2], good[2], rtol=1e-5, atol=1e-6)
    out = np.asarray(
        decode(q, cache, paged.PageTable(bad_indptr, table.page_indices, bad_last, PAGE_SIZE))
    )
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out[0], good[0], rtol=1e-5, atol=1e-6)


@given(
    lens=st.lists(st.one_of(st.just(0), st.integers(20, 90)), min_size=3, max_size=3),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_lengths_inside_one_bucket(lens, seed):
    """Hypothesis draws lengths (from exactly q_len up, or empty) and page placements; the
    shapes stay in one bucket, so the kernel compiles once."""
    q, cache, table = make_inputs(seed, lens, 20, "NHD", 2, 32, jnp.float32, num_pool_pages=24)
    table = table.padded(24)
    o, lse = run_kernel(q, cache, table, block_q=8, pages_per_step=2)
    check_against_oracle(o, lse, q, cache, table)


def test_prefill_attention_on_the_kernel_equals_the_reference():
    """``paged.prefill_attention`` over a 90-token prompt in chunks of 32, 32 and 26 (every
    chunk on the prefill kernel), behind a 10-token prefix already in the cache for one request:
    the kernel and the reference write the same cache and give the same outputs."""
    prompt, prefix, chunk = 90, (10, 0), 32
    lens = [prompt + p for p in prefix]
    _, cache, table = make_inputs(5, lens, prompt, "NHD", 4, 32, jnp.float32)
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((2, prompt, NUM_KV_HEADS * 4, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, prompt, NUM_KV_HEADS, 32)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, prompt, NUM_KV_HEADS, 32)), jnp.float32)
    sizes = [c.stop - c.start for c in paged.prefill_chunks(table, prompt, chunk)]
    assert sizes == [32, 32, 26] and min(sizes) > decode_module.MAX_KERNEL_Q_LEN
    outputs = {
        backend: paged.prefill_attention(
            q, k, v, cache, table, chunk_size=chunk, logits_soft_cap=8.0, backend=backend
        )
        for backend in ("reference", "pallas")
    }
    (ref_o, ref_cache), (o, filled) = outputs["reference"], outputs["pallas"]
    np.testing.assert_array_equal(np.asarray(filled.k_pages), np.asarray(ref_cache.k_pages))
    assert relative_error(o, np.asarray(ref_o, np.float64)) < TOLERANCE[jnp.float32]
    # And the whole prompt against the oracle over the filled cache.
    ref64, _ = paged_causal_attention_oracle(
        q,
        filled.k_pages,
        filled.v_pages,
        "NHD",
        table,
        sm_scale=1 / np.sqrt(32),
        logits_soft_cap=8.0,
    )
    assert relative_error(o, ref64) < TOLERANCE[jnp.float32]


def test_empty_batch():
    q = jnp.ones((0, Q_LEN, 8, 32), jnp.float32)
    cache = paged.new_kv_cache(4, PAGE_SIZE, NUM_KV_HEADS, 32, jnp.float32)
    table = paged.PageTable.from_seq_lens([], PAGE_SIZE)
    o, lse = paged.decode_attention(q, cache, table, return_lse=True, backend="pallas")
    assert o.shape == q.shape and lse.shape == q.shape[:-1]


def test_query_runs_choose_their_kernel(monkeypatch):
    """Up to MAX_KERNEL_Q_LEN new tokens run the decode kernel, longer runs the prefill kernel,
    with "auto" on a GPU (simulated, kernels interpreted) and "pallas"; the kill switch and
    shapes no kernel can run (head_dim 48) take the reference under "auto"."""
    calls = []
    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    monkeypatch.setattr(decode_module, "interpret_mode", lambda: True)
    for name in ("paged_decode", "paged_prefill"):
        real = getattr(decode_module, name)
        monkeypatch.setattr(
            decode_module,
            name,
            lambda *a, name=name, real=real, **k: calls.append(name) or real(*a, **k),
        )
    longest = decode_module.MAX_KERNEL_Q_LEN
    q, cache, table = make_inputs(7, (40, 17), longest + 1, "HND", 1, 32, jnp.float32)
    paged.decode_attention(q, cache, table)
    paged.decode_attention(q[:, :longest], cache, table, backend="pallas")
    paged.decode_attention(q, cache, table, backend="pallas")
    assert calls == ["paged_prefill", "paged_decode", "paged_prefill"]
    monkeypatch.setenv("DECODELAB_BACKEND", "reference")
    paged.decode_attention(q, cache, table)
    monkeypatch.delenv("DECODELAB_BACKEND")
    q48, cache48, table48 = make_inputs(7, (40, 17), longest + 1, "HND", 1, 48, jnp.float32)
    paged.decode_attention(q48, cache48, table48)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="head_dim=48 is not a power of two"):
        paged.decode_attention(q48, cache48, table48, backend="pallas")


def test_auto_on_a_cpu_keeps_the_reference_for_long_runs(monkeypatch):
    """Without a GPU, "auto" runs the reference, for long query runs too (no kernel called)."""
    calls = []
    monkeypatch.setattr(
        decode_module, "paged_prefill", lambda *a, **k: calls.append("paged_prefill")
    )
    if ON_GPU:
        pytest.skip("a GPU is present: auto picks the kernel")
    q, cache, table = make_inputs(7, (Q_LEN + 3, Q_LEN), Q_LEN, "HND", 1, 32, jnp.float32)
    paged.decode_attention(q, cache, table)
    assert calls == []


@pytest.mark.parametrize("block_q", [1, 4, 16])
@pytest.mark.parametrize("block_keys", [16, 64])
def test_each_query_block_reads_only_the_keys_its_last_token_sees(block_q, block_keys):
    """The causal early stop (``block_key_range``): a block reads the keys up to its last
    token's bound and less than one step more, never the rest of the sequence; its unmasked
    steps hold only keys every row of the block sees, and all of those. Over a whole prompt
    the keys read are about half the square, and behind a long prefix about the prefix plus half
    the chunk."""
    for seq_len, q_len in ((37, 37), (37 + 150, 37), (512, 64), (5, 9)):
        work = slack = 0
        for first_token in range(0, q_len, block_q):
            block_tokens = min(block_q, q_len - first_token)
            first_position = seq_len - q_len + first_token
            keys_needed, num_steps, unmasked = (
                int(x)
                for x in prefill_kernel.block_key_range(
                    first_position, block_tokens, seq_len, block_keys
                )
            )
            last_bound = min(max(first_position + block_tokens, 0), seq_len)
            assert keys_needed == last_bound
            assert 0 <= num_steps * block_keys - keys_needed < block_keys
            first_bound = min(max(first_position + 1, 0), seq_len)
            assert unmasked * block_keys <= first_bound < (unmasked + 1) * block_keys
            assert unmasked <= num_steps
            # Work in (query token, key) pairs: every token of the block meets every key read.
            work += block_tokens * num_steps * block_keys
            slack += block_tokens * (block_tokens - 1 + block_keys)
        prefix = seq_len - q_len
        causal = sum(min(max(prefix + t + 1, 0), seq_len) for t in range(q_len))
        assert causal <= work < causal + slack


def test_bad_inputs_to_the_raw_kernel_are_named():
    q, cache, table = make_inputs(8, (Q_LEN,), Q_LEN, "HND", 1, 32, jnp.float32)
    arrays = (table.page_indices, table.page_indptr, table.last_page_len)
    options = dict(layout="HND", sm_scale=0.1, logits_soft_cap=None, interpret=True)
    with pytest.raises(ValueError, match="head_dim=32"):
        prefill_kernel.paged_prefill(q, cache.k_pages[..., :16], cache.v_pages, *arrays, **options)
    with pytest.raises(ValueError, match="differ from q's float32"):
        pools = (cache.k_pages.astype(jnp.bfloat16), cache.v_pages.astype(jnp.bfloat16))
        prefill_kernel.paged_prefill(q, *pools, *arrays, **options)
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 16"):
        prefill_kernel.paged_prefill(
            q[..., :8], cache.k_pages[..., :8], cache.v_pages[..., :8], *arrays, **options
        )


def test_a_plan_for_another_table_is_refused_on_long_runs():
    """The prefill kernel needs no plan, but one made for another batch is a caller's bug."""
    q, cache, table = make_inputs(7, (Q_LEN + 3, Q_LEN), Q_LEN, "HND", 1, 32, jnp.float32)
    other = paged.PageTable.from_seq_lens([40], PAGE_SIZE)
    plan = paged.plan_decode(other, q.shape[2], NUM_KV_HEADS, q.shape[3])
    with pytest.raises(ValueError, match="plan"):
        paged.decode_attention(q, cache, table, plan=plan, backend="pallas")


def test_bad_launch_parameters_are_rejected():
    q, cache, table = make_inputs(8, (Q_LEN,), Q_LEN, "HND", 1, 32, jnp.float32)
    with pytest.raises(ValueError, match="block_q must be a power of two, got 12"):
        run_kernel(q, cache, table, block_q=12)
    with pytest.raises(ValueError, match="pages_per_step must be a power of two, got 3"):
        run_kernel(q, cache, table, pages_per_step=3)


def test_flop_count_follows_the_causal_bound():
    # 512 tokens behind a 15872-token prefix: each sees the prefix and its own causal part.
    visible = 512 * 15872 + 512 * 513 // 2
    assert prefill_kernel.prefill_flops([16384], 512, 32, 128) == 4 * 32 * 128 * visible
    assert prefill_kernel.prefill_flops([0, 3], 2, 1, 1) == 4 * (2 + 3)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
def test_prefill_kernel_lowers_to_triton_for_an_h200(monkeypatch, verify_triton_modules):
    """As far as a CPU can follow the GPU path: at the benchmark's head shape (32/8 heads,
    head_dim 128, bfloat16, a 512-token chunk), the kernel lowers to one Triton call for an
    H200 in both layouts, with the default launch and the corners of the benchmark's sweep, and
    every Triton module passes the MLIR verifier (as the GPU host's parser requires).
    Compiling needs the GPU (``python -m bench prefill``)."""
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setitem(gpu_info.registry, jax.devices()[0].device_kind, lambda: h200)
    num_pages = 2048
    int32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    q = jax.ShapeDtypeStruct((1, 512, 32, 128), jnp.bfloat16)
    default = prefill_kernel.launch_parameters(128, 4, PAGE_SIZE)
    assert default == prefill_kernel.DEFAULT_LAUNCH
    launches = [
        ("HND", default, None),
        ("NHD", default, 30.0),
        ("HND", {"block_q": 64, "pages_per_step": 8, "num_warps": 8, "num_stages": 3}, None),
        ("HND", {"block_q": 16, "pages_per_step": 2, "num_warps": 4, "num_stages": 1}, None),
    ]
    for layout, launch, soft_cap in launches:
        shape = (
            (num_pages, 8, PAGE_SIZE, 128) if layout == "HND" else (num_pages, PAGE_SIZE, 8, 128)
        )
        pool = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        lowered = prefill_kernel.paged_prefill.trace(
            q,
            pool,
            pool,
            int32((num_pages,)),
            int32((2,)),
            int32((1,)),
            layout=layout,
            sm_scale=0.088,
            logits_soft_cap=soft_cap,
            **launch,
        )
        names = peers.triton_kernel_names(
            lowered.lower(lowering_platforms=("cuda",)).as_text(), "paged_prefill"
        )
        expected = (
            f"paged_prefill_{layout}_q{launch['block_q']}_p{launch['pages_per_step']}"
            f"_w{launch['num_warps']}_s{launch['num_stages']}"
        )
        assert names == [expected], (layout, launch, names)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_benchmark_shapes_on_gpu(layout):
    """Compiled, at the benchmark's shapes: B=1, 32 query heads, 8 KV heads, head_dim 128, page
    16, bfloat16, a 4096-token prompt prefilled in chunks of 512 on the kernel, against the
    reference prefill in float32 on the same bfloat16-rounded inputs."""
    assert ON_GPU
    prompt, chunk, num_q_heads, num_kv_heads, head_dim = 4096, 512, 32, 8, 128
    num_pool_pages = prompt // PAGE_SIZE + 64
    rng = np.random.default_rng(9)
    pages = (1 + rng.permutation(num_pool_pages - 1)).tolist()
    table = paged.PageTable.from_seq_lens([prompt], PAGE_SIZE, pages=pages)

    def random(shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    q = random((1, prompt, num_q_heads, head_dim))
    k = random((1, prompt, num_kv_heads, head_dim))
    v = random((1, prompt, num_kv_heads, head_dim))
    outputs = {}
    for backend, dtype in (("pallas", jnp.bfloat16), ("reference", jnp.float32)):
        cache = paged.new_kv_cache(
            num_pool_pages, PAGE_SIZE, num_kv_heads, head_dim, dtype, layout=layout
        )
        outputs[backend], _ = paged.prefill_attention(
            q.astype(dtype),
            k.astype(dtype),
            v.astype(dtype),
            cache,
            table,
            chunk_size=chunk,
            backend=backend,
        )
    reference = np.asarray(outputs["reference"], np.float64)
    assert relative_error(outputs["pallas"], reference) < TOLERANCE[jnp.bfloat16]
