"""Quest's key bounds kept by the append (issue 19): ``paged.append_kv(..., key_bounds=)`` and
``paged.rope_append_kv(..., key_bounds=)``, the reference and the Pallas kernel's two paths.

The oracle is ``paged.page_key_bounds`` recomputed from the pool over the live requests' pages:
after any sequence of appends (requests starting, growing by ragged chunks, finishing and giving
their pages back to be reused by others, tokens in any order, padding tokens the append drops),
the kept bounds of every page a live request lists must equal it bit for bit (min and max are
exact; the pool's keys are widened exactly to the bounds' float32). Pages no live request lists
keep stale bounds, by design (``serving/sparse_step.py``), and are not compared.

Every call here is jitted with fixed shapes (a fixed token count, padded with tokens the append
drops; a fixed table size), so a whole hypothesis run compiles each program once. Kernels run in
interpret mode on a CPU, at small shapes; the ``gpu``-marked test runs the compiled kernel at a
benchmark-like shape.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged
from kernels_pallas import rope_append as rope_append_kernels
from paged import rope_append as rope_append_module
from paged.sparse_quest import PageKeyBounds, empty_page_key_bounds

ROPE = paged.RopeParams(theta=500000.0)
NUM_TOKENS = 8  # every call's token count, padding included (one program per combination)


class Requests:
    """A host's requests over a small pool: rows start, grow and finish; finished rows' pages
    go back to the front of the free list, so the next row to grow reuses them (and opens them
    again at slot 0)."""

    def __init__(self, rng, num_pages, page_size, num_rows):
        self.rng = rng
        self.page_size = page_size
        self.num_pages = num_pages
        self.free = [int(p) for p in rng.permutation(num_pages)]
        self.pages = [[] for _ in range(num_rows)]
        self.lengths = [0] * num_rows

    def step(self, max_new: int):
        """One append: ``(table, batch_indices, positions)`` of ``NUM_TOKENS`` tokens, in a
        random order, the ones past the real tokens dropped by the append (a position past the
        row's length, a row outside the batch)."""
        rng, num_rows = self.rng, len(self.lengths)
        if rng.random() < 0.4:  # a request finishes: its pages go back, to be reused first
            live = [b for b in range(num_rows) if self.lengths[b]]
            if live:
                b = int(rng.choice(live))
                self.free = self.pages[b] + self.free
                self.pages[b], self.lengths[b] = [], 0
        batch, positions = [], []
        for b in rng.permutation(num_rows):
            new = int(rng.integers(0, max_new + 1))
            new = min(new, NUM_TOKENS - len(batch))
            need = -(-(self.lengths[b] + new) // self.page_size) - len(self.pages[b])
            if need > len(self.free):
                new = 0
                need = 0
            self.pages[b] += self.free[:need]
            self.free = self.free[need:]
            batch += [int(b)] * new
            positions += range(self.lengths[b], self.lengths[b] + new)
            self.lengths[b] += new
        for i in range(NUM_TOKENS - len(batch)):  # dropped: past the row's length, or no row
            b = int(rng.integers(0, num_rows))
            batch.append(b if i % 2 else num_rows)
            positions.append(self.lengths[b] + int(rng.integers(0, 3)))
        order = rng.permutation(NUM_TOKENS)
        table = paged.host_page_table(
            self.pages, self.lengths, self.page_size, num_indices=self.num_pages
        )
        as_array = functools.partial(np.asarray, dtype=np.int32)
        return table, as_array(batch)[order], as_array(positions)[order]

    def listed_pages(self) -> list[int]:
        """Pages some live request holds a token in (not the pages of a list past its length)."""
        size = self.page_size
        held = [pages[: -(-n // size)] for pages, n in zip(self.pages, self.lengths, strict=True)]
        return sorted({p for pages in held for p in pages})


def assert_bounds_of_the_pool(bounds, cache, requests: Requests):
    """Kept bounds == bounds recomputed from the pool, on every listed page, bit for bit."""
    table = paged.host_page_table(requests.pages, requests.lengths, requests.page_size)
    expected = paged.page_key_bounds(cache, table)
    listed = requests.listed_pages()
    for kept, recomputed in zip(bounds, expected, strict=True):
        kept = np.asarray(kept.astype(jnp.float32))[listed]
        recomputed = np.asarray(recomputed.astype(jnp.float32))[listed]
        np.testing.assert_array_equal(kept, recomputed)


def stale_bounds(num_pages, hkv, head_dim, dtype=jnp.float32):
    """Bounds that hold nothing of the pool: whatever a page's previous owner left (wider and
    narrower than any key here), so a page that failed to restart shows."""
    rng = np.random.default_rng(7)
    kmin = rng.uniform(-0.5, 0.5, (num_pages, hkv, head_dim)) - 50.0 * (rng.random() < 0.5)
    return PageKeyBounds(jnp.asarray(kmin, dtype), jnp.asarray(kmin + 0.25, dtype))


@functools.cache
def jitted_append(function, backend="reference", path="auto"):
    """The public call with key_bounds, jitted (one program per shape and argument)."""

    def call(q, k, v, positions, batch, cache, table, bounds):
        if function == "append_kv":
            cache, bounds = paged.append_kv(cache, table, k, v, batch, positions, key_bounds=bounds)
            return q, cache, bounds
        return paged.rope_append_kv(
            q,
            k,
            v,
            positions,
            batch,
            cache,
            table,
            rope=ROPE,
            backend=backend,
            key_bounds=bounds,
            key_bounds_path=path,
        )

    return jax.jit(call)


def new_tokens(rng, hq, hkv, head_dim):
    """q, k, v of ``NUM_TOKENS`` tokens; the dropped ones far outside the real keys' range, so
    one that touched a bound would show."""
    q = rng.standard_normal((NUM_TOKENS, hq, head_dim)).astype(np.float32)
    k = rng.standard_normal((NUM_TOKENS, hkv, head_dim)).astype(np.float32)
    v = rng.standard_normal((NUM_TOKENS, hkv, head_dim)).astype(np.float32)
    return q, k, v


def run_appends(
    seed, layout, dtype, calls, *, steps=5, hq=4, hkv=2, head_dim=8, page_size=4, num_rows=3
):
    """Appends ``steps`` times through each of ``calls`` (jitted functions) from the same start;
    after every step each call's bounds are checked against its pool. Returns each call's
    ``(q, cache, bounds)`` of every step."""
    rng = np.random.default_rng(seed)
    num_pages = 10
    requests = Requests(rng, num_pages, page_size, num_rows)
    cache = paged.new_kv_cache(num_pages, page_size, hkv, head_dim, dtype, layout)
    start = (cache, stale_bounds(num_pages, hkv, head_dim))
    states = [start] * len(calls)
    history = []
    for _ in range(steps):
        table, batch, positions = requests.step(max_new=3)
        q, k, v = new_tokens(rng, hq, hkv, head_dim)
        k[positions >= np.asarray([*requests.lengths, 0])[batch]] = 1e4  # dropped: huge keys
        outputs = []
        for index, call in enumerate(calls):
            cache, bounds = states[index]
            q_out, cache, bounds = call(q, k, v, positions, batch, cache, table, bounds)
            assert bounds.kmin.dtype == jnp.float32  # the bounds keep their own dtype
            assert_bounds_of_the_pool(bounds, cache, requests)
            states[index] = (cache, bounds)
            outputs.append((q_out, cache, bounds))
        history.append(outputs)
    return history


@given(
    seed=st.integers(0, 2**31 - 1),
    layout=st.sampled_from(["HND", "NHD"]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    function=st.sampled_from(["append_kv", "rope_append_kv"]),
)
def test_reference_keeps_the_bounds_of_the_pool(seed, layout, dtype, function):
    """The reference, after random sequences of appends (rows starting, growing by ragged
    chunks, finishing, their pages reused; tokens in any order; dropped padding tokens), keeps
    the bounds ``page_key_bounds`` recomputes from the pool, bit for bit, for both layouts and
    both functions; in bfloat16 pools the bounds hold the rounded keys the pool holds."""
    run_appends(seed, layout, dtype, [jitted_append(function)])


def test_a_reopened_page_restarts():
    """A page freed and given to another request forgets its first owner's keys when the new
    owner writes slot 0, and a page this call opens at slot 0 restarts even when the token of
    slot 0 comes after the page's other tokens in the call."""
    cache = paged.new_kv_cache(4, 2, 1, 2, jnp.float32, "NHD")
    bounds = empty_page_key_bounds(4, 1, 2)
    table = paged.PageTable.from_page_lists([[3]], seq_lens=[2], page_size=2)
    big = jnp.array([[[10.0, -10.0]], [[20.0, -20.0]]])
    rows, positions = jnp.zeros(2, jnp.int32), jnp.arange(2)
    cache, bounds = paged.append_kv(cache, table, big, big, rows, positions, key_bounds=bounds)
    assert bounds.kmax[3, 0].tolist() == [20.0, -10.0]
    # Page 3 freed; request 1 (row 1 of the next table) gets it, its tokens in reverse order.
    table = paged.PageTable.from_page_lists([[], [3]], seq_lens=[0, 2], page_size=2)
    small = jnp.array([[[1.0, 2.0]], [[-1.0, 0.5]]])
    cache, bounds = paged.append_kv(
        cache, table, small, small, jnp.ones(2, jnp.int32), jnp.array([1, 0]), key_bounds=bounds
    )
    assert bounds.kmin[3, 0].tolist() == [-1.0, 0.5]
    assert bounds.kmax[3, 0].tolist() == [1.0, 2.0]
    # A later append into slot 1 only widens.
    table = paged.PageTable.from_page_lists([[3]], seq_lens=[2], page_size=2)
    one = jnp.array([[[5.0, -5.0]]])
    _, widened = paged.append_kv(
        cache, table, one, one, jnp.zeros(1, jnp.int32), jnp.array([1]), key_bounds=bounds
    )
    assert widened.kmin[3, 0].tolist() == [-1.0, -5.0]
    assert widened.kmax[3, 0].tolist() == [5.0, 2.0]


def test_dropped_tokens_touch_no_bound():
    """Under ``jit`` a token outside the table is not written, and its key widens nothing: in
    the reference (``append_kv``, ``rope_append_kv``) and the fused kernel."""
    table = paged.PageTable.from_page_lists([[1]], seq_lens=[1], page_size=2)
    keys = jnp.array([1.0, 1e4, -1e4, 1e4]).reshape(4, 1, 1).repeat(8, axis=2)
    rows = jnp.array([0, 0, 1, -1])  # position 1 is past the length; rows 1 and -1 do not exist
    positions = jnp.array([0, 1, 0, 0])
    stale = stale_bounds(3, 1, 8)

    def append(function, backend, path):
        call = jitted_append(function, backend, path)
        cache = paged.new_kv_cache(3, 2, 1, 8, jnp.float32, "HND")
        return call(jnp.zeros((4, 1, 8)), keys, keys, positions, rows, cache, table, stale)

    calls = [("append_kv", "reference", "auto"), ("rope_append_kv", "reference", "auto")]
    for function, backend, path in [*calls, ("rope_append_kv", "pallas", "fused")]:
        _, cache, kept = append(function, backend, path)
        for field in range(2):  # pages 0 and 2 untouched; page 1 holds its one real key
            untouched = np.array([0, 2])
            np.testing.assert_array_equal(kept[field][untouched], stale[field][untouched])
            np.testing.assert_array_equal(
                kept[field][1], paged.page_key_bounds(cache, table)[field][1]
            )
        assert float(jnp.max(jnp.abs(kept.kmax[1]))) <= 1.0


@pytest.mark.parametrize(
    "layout,dtype,hkv,head_dim",
    [("HND", jnp.float32, 2, 8), ("NHD", jnp.bfloat16, 2, 8), ("NHD", jnp.bfloat16, 3, 12)],
)
def test_fused_kernel_equals_the_two_step_path_bit_for_bit(layout, dtype, hkv, head_dim):
    """Interpreted: over a sequence of appends, the fused kernel (bounds widened by atomics in
    the launch) and the two-step path (the plain kernel, then XLA's update) give the same pools,
    q and bounds bit for bit, both equal to the pool's recomputed bounds; with exact blocks and
    with blocks padded past 3 heads and 6 pairs (the masked widening)."""
    fused = jitted_append("rope_append_kv", "pallas", "fused")
    two_step = jitted_append("rope_append_kv", "pallas", "two_step")
    for step in run_appends(
        3, layout, dtype, [fused, two_step], steps=3, hkv=hkv, head_dim=head_dim
    ):
        (q_fused, cache_fused, bounds_fused), (q_two, cache_two, bounds_two) = step
        for a, b in zip(
            jax.tree.leaves((q_fused, cache_fused, bounds_fused)),
            jax.tree.leaves((q_two, cache_two, bounds_two)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_without_key_bounds_the_returns_are_unchanged():
    """No ``key_bounds``: ``append_kv`` returns a ``KVCache``, ``rope_append_kv`` the pair
    ``(q_rotated, cache)``, whatever the backend; with them, a pair and a triple."""
    cache = paged.new_kv_cache(2, 2, 1, 8, jnp.float32)  # head_dim 8: GPU-sized blocks
    table = paged.PageTable.from_page_lists([[1]], seq_lens=[1], page_size=2)
    x = jnp.ones((1, 1, 8))
    rows, positions = jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32)
    assert isinstance(paged.append_kv(cache, table, x, x, rows, positions), paged.KVCache)
    for backend in ("reference", "pallas"):
        out = paged.rope_append_kv(x, x, x, positions, rows, cache, table, backend=backend)
        assert len(out) == 2 and isinstance(out[1], paged.KVCache)
    bounds = empty_page_key_bounds(2, 1, 8)
    out = paged.append_kv(cache, table, x, x, rows, positions, key_bounds=bounds)
    assert len(out) == 2 and isinstance(out[1], PageKeyBounds)
    out = paged.rope_append_kv(x, x, x, positions, rows, cache, table, key_bounds=bounds)
    assert len(out) == 3 and isinstance(out[2], PageKeyBounds)
    empty = paged.rope_append_kv(
        x[:0], x[:0], x[:0], positions[:0], rows[:0], cache, table, key_bounds=bounds
    )
    assert empty[2] is bounds  # nothing appended: nothing restarts or widens


def _bad_bounds_cases():
    good = empty_page_key_bounds(2, 1, 2)
    return [
        ((good.kmin, good.kmax), {}, r"key_bounds must be a paged.PageKeyBounds .*got tuple"),
        (PageKeyBounds(good.kmin[:1], good.kmax), {}, r"key_bounds.kmin must have .*\(2, 1, 2\)"),
        (PageKeyBounds(good.kmin, good.kmax[..., :1]), {}, r"key_bounds.kmax must have"),
        (
            PageKeyBounds(good.kmin.astype(jnp.int32), good.kmax.astype(jnp.int32)),
            {},
            "key_bounds.kmin must be a floating array, got dtype int32",
        ),
        (
            PageKeyBounds(good.kmin, good.kmax.astype(jnp.bfloat16)),
            {},
            "key_bounds.kmin dtype float32 differs from key_bounds.kmax dtype bfloat16",
        ),
        (good, {"key_bounds_path": "atomic"}, "key_bounds_path must be one of .*'atomic'"),
        (
            PageKeyBounds(good.kmin.astype(jnp.bfloat16), good.kmax.astype(jnp.bfloat16)),
            {"key_bounds_path": "fused", "backend": "pallas"},
            "key_bounds_path='fused' needs float32 bounds .* bfloat16",
        ),
    ]


@pytest.mark.parametrize("bounds,options,match", _bad_bounds_cases())
def test_bad_key_bounds_are_rejected(bounds, options, match):
    """Errors name the argument and the value, from both functions."""
    cache = paged.new_kv_cache(2, 2, 1, 2, jnp.float32)
    table = paged.PageTable.from_page_lists([[1]], seq_lens=[1], page_size=2)
    x = jnp.ones((1, 1, 2))
    rows, positions = jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32)
    with pytest.raises(ValueError, match=match):
        paged.rope_append_kv(x, x, x, positions, rows, cache, table, key_bounds=bounds, **options)
    if not options:
        with pytest.raises(ValueError, match=match):
            paged.append_kv(cache, table, x, x, rows, positions, key_bounds=bounds)


def test_kernel_rejects_bad_bounds():
    """The kernel's own check: float32 ``[P, Hkv, D]`` bounds, both or neither."""
    cache = paged.new_kv_cache(2, 2, 1, 2, jnp.float32)
    x, index = jnp.ones((1, 1, 2)), jnp.zeros(1, jnp.int32)
    kmin = jnp.zeros((2, 1, 2), jnp.bfloat16)
    for bounds, match in [((kmin, kmin), "kmin must be float32"), ((None, kmin), "kmin .*None")]:
        with pytest.raises(ValueError, match=match):
            rope_append_kernels.rope_append(
                x, x, x, index, index, np.ones(1, np.float32), jnp.ones(1, jnp.int32),
                jnp.array([0, 1]), jnp.array([1]), cache.k_pages, cache.v_pages, *bounds,
                layout="HND", interleaved=False, interpret=True,
            )  # fmt: skip


def test_auto_keeps_the_two_step_path_the_h100_measured_faster(monkeypatch):
    """``key_bounds_path="auto"`` fuses only while ``AUTO_FUSES_KEY_BOUNDS`` says so, and only
    float32 bounds (the atomics' type)."""
    float32 = empty_page_key_bounds(2, 1, 2)
    bfloat16 = PageKeyBounds(*(b.astype(jnp.bfloat16) for b in float32))
    assert not rope_append_module.AUTO_FUSES_KEY_BOUNDS
    assert not rope_append_module._fuses_key_bounds(float32, "auto")
    assert rope_append_module._fuses_key_bounds(float32, "fused")
    assert not rope_append_module._fuses_key_bounds(bfloat16, "two_step")
    monkeypatch.setattr(rope_append_module, "AUTO_FUSES_KEY_BOUNDS", True)
    assert rope_append_module._fuses_key_bounds(float32, "auto")
    assert not rope_append_module._fuses_key_bounds(bfloat16, "auto")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
def test_fused_kernel_lowers_to_one_triton_call_for_an_h200(monkeypatch, verify_triton_modules):
    """As far as a CPU follows the GPU path: at the benchmark's shape (64 tokens, 32 and 8
    heads, head_dim 128, pages of 16) and a padded one, both layouts, the bounds variant lowers
    to one verified Triton call with the pools and the bounds aliased to its outputs; the
    public fused path adds the restart's scatter and nothing that touches the pool."""
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setitem(gpu_info.registry, jax.devices()[0].device_kind, lambda: h200)
    monkeypatch.setattr(rope_append_module, "interpret_mode", lambda: False)
    for tokens, hq, hkv, head_dim, page_size, pages in [(64, 32, 8, 128, 16, 1024), (5, 6, 3, 12, 5, 40)]:  # fmt: skip
        for layout in ("HND", "NHD"):

            def array(*shape, dtype=jnp.int32):
                return jax.ShapeDtypeStruct(shape, dtype)

            def step(q, k, v, positions, batch, k_pages, v_pages, indptr, indices, last, kmin, kmax, layout=layout, page_size=page_size):  # fmt: skip
                out = paged.rope_append_kv(
                    q, k, v, positions, batch, paged.KVCache(k_pages, v_pages, layout),
                    paged.PageTable(indptr, indices, last, page_size), rope=ROPE,
                    backend="pallas", key_bounds=PageKeyBounds(kmin, kmax),
                    key_bounds_path="fused",
                )  # fmt: skip
                return jax.tree.leaves(out)

            pool = (pages, hkv, page_size, head_dim) if layout == "HND" else (pages, page_size, hkv, head_dim)  # fmt: skip
            text = (
                jax.jit(step, donate_argnums=(5, 6, 10, 11))
                .trace(
                    array(tokens, hq, head_dim, dtype=jnp.bfloat16),
                    array(tokens, hkv, head_dim, dtype=jnp.bfloat16),
                    array(tokens, hkv, head_dim, dtype=jnp.bfloat16),
                    array(tokens),
                    array(tokens),
                    array(*pool, dtype=jnp.bfloat16),
                    array(*pool, dtype=jnp.bfloat16),
                    array(tokens + 1),
                    array(pages),
                    array(tokens),
                    array(pages, hkv, head_dim, dtype=jnp.float32),
                    array(pages, hkv, head_dim, dtype=jnp.float32),
                )
                .lower(lowering_platforms=("cuda",))
                .as_text()
            )
            name = f"rope_append_{layout}_half_bounds"
            assert re.findall(r'name = "(rope_append\w*)"', text) == [name]
            aliases = re.findall(
                r"output_operand_alias<output_tuple_indices = \[(\d)\], operand_index = (\d+)",
                text,
            )
            assert aliases == [("1", "9"), ("2", "10"), ("3", "11"), ("4", "12")]


def prefill_then_decode(layout, *, rows, prefilled, chunk, page_size, hq, hkv, head_dim, pool):
    """A prefill chunk of ``chunk`` tokens for the first ``prefilled`` of ``rows`` requests, then
    a decode step of all ``rows`` (the prefilled ones reach ``chunk + 1`` tokens: with ``chunk``
    a multiple of ``page_size``, a page more each, opened at slot 0), over stale bounds,
    bfloat16 pools, through the fused and the two-step Pallas paths. After each call both paths'
    pools, q and bounds are equal bit for bit, and the bounds equal the pool's recomputed ones on
    every listed page."""
    rng = np.random.default_rng(1)
    pages_per_row = -(-(chunk + 1) // page_size)  # the decode step's token included
    assert pool >= rows * pages_per_row, "the pool must hold every request's pages"
    cache = paged.new_kv_cache(pool, page_size, hkv, head_dim, jnp.bfloat16, layout)
    start = (cache, stale_bounds(pool, hkv, head_dim))
    states = {"fused": start, "two_step": start}
    requests = Requests(rng, pool, page_size, rows)
    order = rng.permutation(pool)
    requests.pages = [
        order[b * pages_per_row : (b + 1) * pages_per_row].tolist() for b in range(rows)
    ]
    for new in ([chunk] * prefilled + [0] * (rows - prefilled), [1] * rows):
        before = list(requests.lengths)
        requests.lengths = [b + n for b, n in zip(before, new, strict=True)]
        table = paged.host_page_table(requests.pages, requests.lengths, page_size)
        batch = np.repeat(np.arange(rows), new).astype(np.int32)
        positions = np.concatenate(
            [np.arange(b, a) for b, a in zip(before, requests.lengths, strict=True)]
        ).astype(np.int32)
        q = jnp.asarray(rng.standard_normal((len(batch), hq, head_dim)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((len(batch), hkv, head_dim)), jnp.bfloat16)
        outputs = {}
        for path in ("fused", "two_step"):
            cache, bounds = states[path]
            outputs[path] = jitted_append("rope_append_kv", "pallas", path)(
                q, k, k, positions, batch, cache, table, bounds
            )
            states[path] = outputs[path][1:]
            assert_bounds_of_the_pool(outputs[path][2], outputs[path][1], requests)
        for a, b in zip(
            jax.tree.leaves(outputs["fused"]), jax.tree.leaves(outputs["two_step"]), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_prefill_then_decode_at_small_shapes():
    """``prefill_then_decode`` (the GPU test's body), interpreted at small shapes: a chunk of
    8 tokens over pages of 4 (4 programs racing on each page), then a decode step opening a
    page for the prefilled request."""
    prefill_then_decode(
        "NHD", rows=3, prefilled=1, chunk=8, page_size=4, hq=4, hkv=2, head_dim=8, pool=12
    )


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_compiled_kernel_keeps_the_bounds_at_benchmark_shapes(layout):
    """Compiled, ``prefill_then_decode`` at a benchmark-like shape: a chunk of 256 tokens for 4
    of 64 requests (16 programs racing on each page), then a decode step of the 64 (the 4 reach
    257 tokens: 17 pages of 16 each, the 17th opened at slot 0), 32 query and 8 KV heads of 128;
    2048 pages in the pool (64 x 17 = 1088 listed)."""
    prefill_then_decode(
        layout, rows=64, prefilled=4, chunk=256, page_size=16, hq=32, hkv=8, head_dim=128,
        pool=2048,
    )  # fmt: skip
