"""RMSNorm and fused residual-add RMSNorm: the Pallas kernels (``kernels_pallas/norm.py``) through
the public API (``serving/layers.py``) against float64 references.

On a CPU the kernels run in Pallas interpret mode; on a GPU the same tests run compiled, plus the
``gpu``-marked ones at benchmark shapes. What is compared:

- ``new_residual`` must be bit for bit ``dtype(float32(x) + float32(residual))``: the kernel does
  exactly that one float32 addition and one rounding.
- ``normed`` against ``rmsnorm`` computed in float64 from the *stored* residual (the value the
  kernel normalizes, by definition) and the same weight, with two bounds: the relative L2 error
  of ``testing.md`` (float32 < 1e-5, bfloat16 < 1e-2) and a per-element worst case
  (``elementwise_bound``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental import pallas as pl

from kernels_pallas import norm as norm_kernels
from kernels_pallas import platform
from serving import layers
from tests.conftest import ON_GPU, enable_x64

# Programs that run long (large hidden sizes): compiled with XLA's CPU optimizations
# (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True

# testing.md's bounds on ||out - ref|| / ||ref||.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# Unit roundoff: the largest relative error of rounding to nearest (2**-p, p significant bits).
UNIT_ROUNDOFF = {jnp.float32: 2.0**-24, jnp.bfloat16: 2.0**-8}
EPS = 1e-6


def elementwise_bound(dtype, hidden: int) -> float:
    """The largest relative error of one output element against the float64 norm of the same
    stored residual.

    Worst case, in float32 units u = 2**-24: the squares and their sum over ``hidden`` terms
    (non-negative, so at most ``hidden`` u whatever the order of summation), the division by
    ``hidden`` and the addition of eps (float32(eps) included): ``(hidden + 3) u`` on the mean
    square, halved by the square root; the reciprocal square root itself (libdevice's
    ``rsqrtf``: 2 ulp; XLA's CPU one is tighter), the two products (and ``1 + w`` for Gemma):
    ``5 u``. Then one rounding to the output dtype: its unit roundoff. The first term dominates
    the float32 bound at large ``hidden``; the measured errors are ~50x smaller (the L2 bound
    of testing.md is the tight check).
    """
    return UNIT_ROUNDOFF[dtype] + ((hidden + 3) / 2 + 5) * 2.0**-24


def make_inputs(seed: int, shape, dtype, *, weight_scale=0.5):
    """Random x and residual (never zeros; the residual ~4x larger, as a residual stream is),
    and a weight around 1."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    residual = jnp.asarray(4 * rng.standard_normal(shape), dtype)
    weight = jnp.asarray(1 + weight_scale * rng.standard_normal(shape[-1]), dtype)
    return x, residual, weight


def stored_sum(x, residual) -> np.ndarray:
    """The definition of new_residual, in NumPy: one float32 addition, one rounding."""
    total = np.asarray(x, np.float32) + np.asarray(residual, np.float32)
    return np.asarray(jnp.asarray(total).astype(x.dtype))


def rmsnorm64(values, weight, eps, gemma) -> np.ndarray:
    """The float64 reference of ``rmsnorm`` on the given (already rounded) values."""
    with enable_x64():
        out = layers.rmsnorm_reference(
            jnp.asarray(np.asarray(values, np.float64)),
            jnp.asarray(np.asarray(weight, np.float64)),
            eps,
            gemma=gemma,
        )
        return np.asarray(out)


def check_normed(normed, reference: np.ndarray, dtype, hidden: int) -> None:
    assert normed.dtype == dtype
    out = np.asarray(jnp.asarray(normed).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out)), "kernel output has NaN or inf"
    error = np.linalg.norm(out - reference) / np.linalg.norm(reference)
    assert error < TOLERANCE[dtype], error
    # A zero reference element (a zero stored residual) must come out exactly zero.
    excess = np.abs(out - reference) - elementwise_bound(dtype, hidden) * np.abs(reference)
    assert np.all(excess <= 0), float(np.max(excess))


# Pairwise cover of hidden size x token count x dtype x Gemma: hidden sizes from 64 to 8192,
# powers of two and not (96, 3000, 5120), token counts 1 to 4096 (the 4096-token case at a small
# hidden size, where one program holds 64 rows, keeps interpret mode cheap).
FUSED_CONFIGS = [
    (64, 4096, jnp.bfloat16, False),
    (96, 33, jnp.float32, True),
    (3000, 5, jnp.bfloat16, True),
    (5120, 1, jnp.float32, False),
    (8192, 3, jnp.bfloat16, False),
    (8192, 2, jnp.float32, True),
    (4096, 64, jnp.bfloat16, True),
    (1000, 300, jnp.float32, False),
    (16384, 2, jnp.bfloat16, True),  # MAX_HIDDEN, Llama 3 405B
]


@pytest.mark.parametrize("hidden,tokens,dtype,gemma", FUSED_CONFIGS)
def test_fused_add_rmsnorm_kernel_matches_float64_reference(hidden, tokens, dtype, gemma):
    x, residual, weight = make_inputs(hidden + tokens, (tokens, hidden), dtype)
    normed, new_residual = layers.fused_add_rmsnorm(
        x, residual, weight, EPS, gemma=gemma, backend="pallas"
    )
    assert new_residual.dtype == dtype and new_residual.shape == x.shape
    expected_residual = stored_sum(x, residual)
    np.testing.assert_array_equal(np.asarray(new_residual), expected_residual)
    check_normed(normed, rmsnorm64(expected_residual, weight, EPS, gemma), dtype, hidden)


@pytest.mark.parametrize(
    "hidden,tokens,dtype,gemma",
    [(96, 17, jnp.bfloat16, False), (5120, 2, jnp.float32, True), (200, 1024, jnp.float32, False)],
)
def test_rmsnorm_kernel_matches_float64_reference(hidden, tokens, dtype, gemma):
    x, _, weight = make_inputs(hidden * 7 + tokens, (tokens, hidden), dtype)
    normed = layers.rmsnorm(x, weight, EPS, gemma=gemma, backend="pallas")
    check_normed(normed, rmsnorm64(x, weight, EPS, gemma), dtype, hidden)


def test_leading_dimensions_and_jit():
    """``[..., H]`` inputs are flattened to rows and back, also under jit."""
    x, residual, weight = make_inputs(3, (2, 3, 160), jnp.bfloat16)
    fused = jax.jit(lambda x, r, w: layers.fused_add_rmsnorm(x, r, w, EPS, backend="pallas"))
    normed, new_residual = fused(x, residual, weight)
    assert normed.shape == new_residual.shape == (2, 3, 160)
    expected_residual = stored_sum(x, residual)
    np.testing.assert_array_equal(np.asarray(new_residual), expected_residual)
    reference = rmsnorm64(expected_residual.reshape(6, 160), weight, EPS, False)
    check_normed(normed.reshape(6, 160), reference, jnp.bfloat16, 160)


ROW_SCALES = st.lists(st.floats(-4.0, 4.0), min_size=8, max_size=8)


@given(
    seed=st.integers(0, 2**31 - 1),
    log10_scales=ROW_SCALES,
    cancelled=st.lists(st.booleans(), min_size=8, max_size=8),
    eps=st.sampled_from([1e-6, 1e-2]),
    gemma=st.booleans(),
)
def test_random_values_in_one_bucket(seed, log10_scales, cancelled, eps, gemma):
    """Hypothesis draws the values (rows from 1e-4 to 1e4, rows whose sum cancels to exactly 0,
    eps, Gemma); the shape stays fixed (one compilation per eps and Gemma)."""
    x, residual, weight = make_inputs(seed, (8, 160), jnp.bfloat16)
    scales = jnp.asarray(10.0 ** np.array(log10_scales), jnp.float32)[:, None]
    x = (x.astype(jnp.float32) * scales).astype(jnp.bfloat16)
    residual = (residual.astype(jnp.float32) * scales).astype(jnp.bfloat16)
    residual = jnp.where(jnp.asarray(cancelled)[:, None], -x, residual)
    normed, new_residual = layers.fused_add_rmsnorm(
        x, residual, weight, eps, gemma=gemma, backend="pallas"
    )
    expected_residual = stored_sum(x, residual)
    np.testing.assert_array_equal(np.asarray(new_residual), expected_residual)
    reference = rmsnorm64(expected_residual, weight, eps, gemma)
    if np.any(reference):
        check_normed(normed, reference, jnp.bfloat16, 160)
    assert np.all(np.asarray(normed)[np.array(cancelled)] == 0)  # 0 * rsqrt(eps), not NaN


def test_donated_buffers_are_updated_in_place():
    """With x and residual donated to a jitted call, the outputs are written into their buffers
    (input_output_aliases; checked by buffer address)."""
    x, residual, weight = make_inputs(5, (16, 96), jnp.bfloat16)
    expected_residual = stored_sum(x, residual)
    # Fresh buffers that nothing else holds: an array sharing memory with NumPy (made from it,
    # or read by np.asarray) is not donated.
    x, residual = jnp.copy(x), jnp.copy(residual)
    x_address, residual_address = x.unsafe_buffer_pointer(), residual.unsafe_buffer_pointer()
    fused = jax.jit(
        lambda x, r, w: layers.fused_add_rmsnorm(x, r, w, EPS, backend="pallas"),
        donate_argnums=(0, 1),
    )
    normed, new_residual = fused(x, residual, weight)
    assert x.is_deleted() and residual.is_deleted()
    assert normed.unsafe_buffer_pointer() == x_address
    assert new_residual.unsafe_buffer_pointer() == residual_address
    np.testing.assert_array_equal(np.asarray(new_residual), expected_residual)


def test_row_window_reads_rows_in_place_and_clamps_the_offset():
    x, residual, weight = make_inputs(11, (12, 64), jnp.float32)

    def window(offset):
        return norm_kernels.fused_add_rmsnorm(
            x, residual, weight, EPS, row_offset=offset, num_rows=4, interpret=not ON_GPU
        )

    full_normed, full_residual = layers.fused_add_rmsnorm_reference(x, residual, weight, EPS)
    for offset, first in [(5, 5), (8, 8), (11, 8), (-3, 0)]:  # past either end: clamped
        normed, new_residual = jax.jit(window)(jnp.int32(offset))
        np.testing.assert_array_equal(new_residual, full_residual[first : first + 4])
        np.testing.assert_allclose(normed, full_normed[first : first + 4], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="num_rows"):
        norm_kernels.rmsnorm(x, weight, EPS, row_offset=0, num_rows=13, interpret=True)


def test_empty_batch_launches_nothing():
    x = jnp.zeros((0, 64), jnp.bfloat16)
    normed, new_residual = layers.fused_add_rmsnorm(x, x, jnp.ones(64), backend="pallas")
    assert normed.shape == new_residual.shape == (0, 64)


# ----------------------------------------------------------------------------------------------
# Backend choice and bad input


def _calls_pallas(function, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(function)(*args))


def test_auto_picks_the_kernel_on_a_gpu_only(monkeypatch):
    """The kernels were checked and timed on the H200, so "auto" runs them there; on a CPU (and
    under the kill switch) it keeps the reference."""
    x, residual, weight = make_inputs(1, (2, 64), jnp.float32)
    assert platform.AUTO_PICKS_KERNEL["rmsnorm"] and platform.AUTO_PICKS_KERNEL["fused_add_rmsnorm"]
    assert _calls_pallas(
        lambda *a: layers.fused_add_rmsnorm(*a, backend="pallas"), x, residual, weight
    )
    monkeypatch.setattr(platform, "on_gpu", lambda: False)
    assert not _calls_pallas(lambda *a: layers.fused_add_rmsnorm(*a), x, residual, weight)
    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    assert _calls_pallas(lambda *a: layers.fused_add_rmsnorm(*a), x, residual, weight)
    assert _calls_pallas(lambda *a: layers.rmsnorm(*a), x, weight)
    monkeypatch.setenv(platform.KILL_SWITCH_VARIABLE, "reference")
    assert not _calls_pallas(lambda *a: layers.fused_add_rmsnorm(*a), x, residual, weight)
    monkeypatch.setenv(platform.KILL_SWITCH_VARIABLE, "fast")
    with pytest.raises(ValueError, match="DECODELAB_BACKEND"):
        layers.rmsnorm(x, weight)


def test_hidden_sizes_above_the_kernel_limit():
    hidden = norm_kernels.MAX_HIDDEN + 1
    x, weight = jnp.ones((1, hidden)), jnp.ones(hidden)
    with pytest.raises(ValueError, match=f"hidden={hidden}"):
        layers.rmsnorm(x, weight, backend="pallas")
    assert layers.rmsnorm(x, weight, backend="reference").shape == (1, hidden)


def test_float64_inputs_are_not_run_in_float32(float64):
    x = jnp.ones((2, 64), jnp.float64)
    with pytest.raises(ValueError, match="float64 would lose precision"):
        layers.rmsnorm(x, jnp.ones(64), backend="pallas")
    assert layers.rmsnorm(x, jnp.ones(64), backend="reference").dtype == jnp.float64


@pytest.mark.parametrize(
    "eps,match",
    [(0.0, "eps"), (-1e-6, "eps"), (float("nan"), "nan"), (float("inf"), "inf"), ("a", "'a'")],
)
def test_bad_eps_is_rejected(eps, match):
    x, residual, weight = make_inputs(0, (2, 64), jnp.float32)
    for call in (
        lambda: layers.rmsnorm(x, weight, eps),
        lambda: layers.fused_add_rmsnorm(x, residual, weight, eps),
    ):
        with pytest.raises(ValueError, match=match):
            call()


def test_traced_eps_is_rejected():
    x, _, weight = make_inputs(0, (2, 64), jnp.float32)
    with pytest.raises(ValueError, match="eps must be a Python float"):
        jax.jit(lambda eps: layers.rmsnorm(x, weight, eps))(1e-6)


@pytest.mark.parametrize(
    "residual_shape,weight_shape,residual_dtype,match",
    [
        ((2, 96), (64,), jnp.float32, r"residual must have x's shape \(2, 64\), got \(2, 96\)"),
        ((3, 64), (64,), jnp.float32, r"residual must have x's shape"),
        ((2, 64), (96,), jnp.float32, r"weight must have shape \(64,\).*got \(96,\)"),
        ((2, 64), (1, 64), jnp.float32, r"weight must have shape \(64,\)"),
        ((2, 64), (64,), jnp.bfloat16, "residual dtype bfloat16 differs from x dtype float32"),
    ],
)
def test_mismatched_shapes_are_rejected(residual_shape, weight_shape, residual_dtype, match):
    x = jnp.ones((2, 64), jnp.float32)
    residual, weight = jnp.ones(residual_shape, residual_dtype), jnp.ones(weight_shape)
    with pytest.raises(ValueError, match=match):
        layers.fused_add_rmsnorm(x, residual, weight, backend="pallas")


def test_non_floating_inputs_are_rejected():
    with pytest.raises(ValueError, match="x must be a floating array"):
        layers.rmsnorm(jnp.ones((2, 4), jnp.int32), jnp.ones(4))
    with pytest.raises(ValueError, match="weight must be a floating array"):
        layers.rmsnorm(jnp.ones((2, 4)), jnp.ones(4, jnp.int32))
    with pytest.raises(ValueError, match="backend must be one of"):
        layers.rmsnorm(jnp.ones((2, 4)), jnp.ones(4), backend="triton")


# ----------------------------------------------------------------------------------------------
# The GPU path


BENCHMARK_SHAPES = [(tokens, hidden) for hidden in (4096, 8192) for tokens in (1, 64, 4096)]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Pallas Triton backend's
def test_kernels_lower_to_triton_for_an_h200(monkeypatch, verify_triton_modules):
    """As far as a CPU can follow the GPU path: at every benchmark shape (and a hidden size that
    is not a power of two) both kernels lower to a Triton call for an H200, named after their
    block, with x and residual aliased to the outputs. Compiling needs the GPU."""
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h200 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    monkeypatch.setitem(gpu_info.registry, jax.devices()[0].device_kind, lambda: h200)
    for tokens, hidden in [*BENCHMARK_SHAPES, (7, 3000)]:
        x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
        weight = jax.ShapeDtypeStruct((hidden,), jnp.bfloat16)
        for function, args in [
            (norm_kernels.fused_add_rmsnorm, (x, x, weight)),
            (norm_kernels.rmsnorm, (x, weight)),
        ]:
            lowered = function.trace(*args, EPS, interpret=False)
            text = lowered.lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text, (tokens, hidden)
            block = pl.next_power_of_2(hidden)
            assert f"rmsnorm_h{block}_r" in text
            # Operand 0 is the row offset; x (operand 1) becomes output 0 (the only output of
            # rmsnorm, which has no tuple index), residual (operand 2) output 1.
            aliases = re.findall(
                r"output_operand_alias<output_tuple_indices = \[(\d?)\], operand_index = (\d)",
                text,
            )
            assert aliases == ([("0", "1"), ("1", "2")] if len(args) == 3 else [("", "1")])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,hidden", BENCHMARK_SHAPES)
def test_benchmark_shapes_on_gpu(tokens, hidden):
    """Compiled at the benchmark's shapes, against the float32 reference (float64 would hold a
    second copy of 4096 x 8192 values on the host for no gain at this tolerance)."""
    x, residual, weight = make_inputs(tokens, (tokens, hidden), jnp.bfloat16, weight_scale=0.1)
    normed, new_residual = layers.fused_add_rmsnorm(x, residual, weight, 1e-5, backend="pallas")
    ref_normed, ref_residual = layers.fused_add_rmsnorm_reference(x, residual, weight, 1e-5)
    np.testing.assert_array_equal(np.asarray(new_residual), np.asarray(ref_residual))
    out = np.asarray(normed.astype(jnp.float32), np.float64)
    ref = np.asarray(ref_normed.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out))
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOLERANCE[jnp.bfloat16]
