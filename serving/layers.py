"""The model's building blocks: RMSNorm and fused residual-add RMSNorm, with ``backend=``.

Definitions (the references below; ``kernels_pallas/norm.py`` must agree with them):

- ``rmsnorm(x) = x / sqrt(mean(x^2) + eps) * w`` over the last axis, ``w = weight`` (Llama) or
  ``w = 1 + weight`` (Gemma, ``gemma=True``), computed in float32 and rounded once to x's dtype.
- ``fused_add_rmsnorm(x, residual) = (rmsnorm(r), r)`` with ``r = x + residual`` formed in
  float32 and stored in x's dtype: the norm is of the stored (rounded) residual, the value the
  next layer reads (vLLM's choice; FlashInfer normalizes the float32 sum, about one ulp of x's
  dtype away).

Backends, chosen when the function is traced (``kernels_pallas.platform.choose_backend``):
``"reference"`` is plain JAX (one XLA fusion or a few); ``"pallas"`` is the one-pass kernel
(interpreted on a CPU). ``"auto"`` runs the kernel on a GPU (compiled, checked and timed on the
H200: ``platform.AUTO_PICKS_KERNEL``) and the reference elsewhere or where the kernel cannot run
the shapes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import norm as norm_kernels
from kernels_pallas.platform import choose_backend, interpret_mode

# ----------------------------------------------------------------------------------------------
# References


def _compute_dtype(dtype) -> jnp.dtype:
    """float32, or float64 when the inputs are (the tests' float64 references)."""
    return jnp.promote_types(dtype, jnp.float32)


def rmsnorm_reference(x: jax.Array, weight: jax.Array, eps: float, *, gemma: bool = False):
    """The definition of ``rmsnorm``, in float32 (float64 for float64 inputs), plain JAX.

    Args:
      x: ``[..., H]``.
      weight: ``[H]``.
      eps: added to the mean square.
      gemma: scale by ``1 + weight``.

    Returns:
      ``[..., H]`` in x's dtype.
    """
    compute = _compute_dtype(x.dtype)
    values = x.astype(compute)
    mean_square = jnp.mean(values * values, axis=-1, keepdims=True)
    scale = weight.astype(compute)
    if gemma:
        scale = 1 + scale
    return (values * lax.rsqrt(mean_square + eps) * scale).astype(x.dtype)


def fused_add_rmsnorm_reference(
    x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float, *, gemma: bool = False
):
    """The definition of ``fused_add_rmsnorm``: the sum in float32, stored in x's dtype, then
    ``rmsnorm_reference`` of the stored sum.

    Returns:
      ``(normed, new_residual)``, both ``[..., H]`` in x's dtype.
    """
    compute = _compute_dtype(x.dtype)
    new_residual = (x.astype(compute) + residual.astype(compute)).astype(x.dtype)
    return rmsnorm_reference(new_residual, weight, eps, gemma=gemma), new_residual


# ----------------------------------------------------------------------------------------------
# Validation and backend choice


def _static_eps(eps) -> float:
    if isinstance(eps, jax.core.Tracer):
        raise ValueError("eps must be a Python float, not a traced value (it is static)")
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"eps must be a float > 0, got {eps!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    return value


def _validate_norm_inputs(x, residual, weight) -> None:
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have shape [..., hidden] with hidden >= 1, got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating array, got dtype {x.dtype}")
    hidden = x.shape[-1]
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"residual must have x's shape {x.shape}, got {residual.shape}"
                + (f" (hidden {residual.shape[-1]} vs {hidden})" if residual.ndim else "")
            )
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} differs from x dtype {x.dtype}")
    if weight.shape != (hidden,):
        raise ValueError(
            f"weight must have shape ({hidden},) (x's hidden size), got {weight.shape}"
        )
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise ValueError(f"weight must be a floating array, got dtype {weight.dtype}")


def kernel_supports(x: jax.Array) -> str | None:
    """Why the Pallas kernel cannot normalize ``x``, or None if it can."""
    hidden = x.shape[-1]
    if hidden > norm_kernels.MAX_HIDDEN:
        return f"it holds a row in registers: hidden={hidden} is above {norm_kernels.MAX_HIDDEN}"
    if jnp.dtype(x.dtype).itemsize > 4:
        return f"it computes in float32: x dtype {x.dtype} would lose precision"
    return None


# ----------------------------------------------------------------------------------------------
# Public functions


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float = 1e-6, *, gemma=False, backend="auto"):
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * weight``.

    Statistics in float32, one rounding to x's dtype at the end. The Pallas kernel makes one
    pass (reads x and weight, writes the output) and, inside a jitted program where x dies here,
    writes the output into x's buffer.

    Args:
      x: ``[..., H]`` floating (bfloat16, float16, float32).
      weight: ``[H]`` floating.
      eps: a finite Python float > 0 (static).
      gemma: Gemma's norm, ``* (1 + weight)``.
      backend: ``"auto"``, ``"reference"`` or ``"pallas"`` (module docstring).

    Returns:
      ``[..., H]`` in x's dtype.

    Raises:
      ValueError: for ``eps <= 0``, NaN, infinite or traced; a weight whose shape is not
        ``(H,)``; non-floating inputs; an unknown backend; ``backend="pallas"`` with
        ``H > kernels_pallas.norm.MAX_HIDDEN`` or float64 inputs.

    Example:
      >>> x = jnp.array([[3.0, 4.0]])
      >>> normed = rmsnorm(x, jnp.ones(2), eps=1e-6, backend="reference")
      >>> [round(float(value), 4) for value in normed.ravel()]  # [3, 4] / sqrt(12.5)
      [0.8485, 1.1314]
    """
    eps = _static_eps(eps)
    _validate_norm_inputs(x, None, weight)
    chosen = choose_backend("rmsnorm", backend, unsupported=kernel_supports(x)).backend
    if chosen == "reference" or x.size == 0:
        return rmsnorm_reference(x, weight, eps, gemma=gemma)
    rows = x.reshape(-1, x.shape[-1])
    normed = norm_kernels.rmsnorm(rows, weight, eps, gemma=gemma, interpret=interpret_mode())
    return normed.reshape(x.shape)


def fused_add_rmsnorm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    eps: float = 1e-6,
    *,
    gemma: bool = False,
    backend: str = "auto",
):
    """Residual add then RMSNorm: ``r = x + residual``; returns ``(rmsnorm(r), r)``.

    ``r`` is formed in float32 and stored in x's dtype; the norm is of the stored ``r``. The
    Pallas kernel does both in one pass (reads x, residual, weight; writes both outputs), and
    inside a jitted program where x and residual die here (a model's layer; a caller donating
    them) the outputs take their buffers: the in-place update of serving engines, in JAX style.

    Args:
      x: ``[..., H]`` floating, e.g. the attention or MLP output of a layer.
      residual: the residual stream, x's shape and dtype.
      weight: ``[H]`` floating.
      eps: a finite Python float > 0 (static).
      gemma: Gemma's norm, ``* (1 + weight)``.
      backend: ``"auto"``, ``"reference"`` or ``"pallas"`` (module docstring).

    Returns:
      ``(normed, new_residual)``, both x's shape and dtype.

    Raises:
      ValueError: for ``eps <= 0``, NaN, infinite or traced; residual's shape or dtype unlike
        x's (mismatched hidden sizes included); a weight whose shape is not ``(H,)``; an unknown
        backend; ``backend="pallas"`` with ``H > kernels_pallas.norm.MAX_HIDDEN`` or float64
        inputs.

    Example:
      >>> x, residual = jnp.array([[1.0, 2.0]]), jnp.array([[2.0, 2.0]])
      >>> normed, new_residual = fused_add_rmsnorm(x, residual, jnp.ones(2), backend="reference")
      >>> new_residual.tolist(), [round(float(value), 4) for value in normed.ravel()]
      ([[3.0, 4.0]], [0.8485, 1.1314])
    """
    eps = _static_eps(eps)
    _validate_norm_inputs(x, residual, weight)
    chosen = choose_backend("fused_add_rmsnorm", backend, unsupported=kernel_supports(x)).backend
    if chosen == "reference" or x.size == 0:
        return fused_add_rmsnorm_reference(x, residual, weight, eps, gemma=gemma)
    hidden = x.shape[-1]
    normed, new_residual = norm_kernels.fused_add_rmsnorm(
        x.reshape(-1, hidden),
        residual.reshape(-1, hidden),
        weight,
        eps,
        gemma=gemma,
        interpret=interpret_mode(),
    )
    return normed.reshape(x.shape), new_residual.reshape(x.shape)
