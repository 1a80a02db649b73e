"""Rotary position embedding (RoPE): parameters, frequencies, angles and the rotation (reference).

Head dimension ``D`` (even) is cut into ``D / 2`` pairs; pair ``i`` of a token at position ``p``
is rotated by the angle ``p * inv_freq[i]``:
``(a, b) -> (a cos - b sin, b cos + a sin)``. Two conventions say which elements pair up:

- rotate-half (``interleaved=False``; GPT-NeoX, Hugging Face Llama): pair ``i`` is
  ``(x[i], x[i + D/2])``.
- interleaved (``interleaved=True``; GPT-J, Meta's original Llama code): pair ``i`` is
  ``(x[2i], x[2i + 1])``.

Frequencies: ``inv_freq[i] = theta ** (-2i / D)``, optionally rescaled by Llama 3.1's rule
(``Llama3Scaling``): with ``wavelen = 2 pi / freq`` and ``orig`` the original context length,
``wavelen < orig / high_freq_factor`` keeps ``freq``; ``wavelen > orig / low_freq_factor`` gives
``freq / factor``; in between, ``smooth = (orig / wavelen - low_freq_factor) / (high_freq_factor -
low_freq_factor)`` and ``freq = (1 - smooth) * freq / factor + smooth * freq``. They are
computed in float64 on the host and rounded once to float32 (Hugging Face computes them in
float32; the two differ by at most a few float32 ulps).

Angles (the Hugging Face convention, kept by every backend): ``float32(p) * inv_freq`` as one
float32 product, then cos and sin. Precision: the product is rounded to float32, whose spacing
at ``2**17 = 131072`` radians is ``2**-6``, so at position 131072 and ``inv_freq = 1`` the angle
is off the exact one by up to ``2**-7 = 0.0078`` radians (and the float32 rounding of
``inv_freq`` itself moves ``p * inv_freq`` by up to ``p * 2**-24 * inv_freq``, again ``0.0078``).
This is a property of the convention, shared with the models' training code, not an error of
one backend: tests compare backends on the same float32 angles.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def _check_positive(name: str, value, *, integer: bool = False) -> None:
    number_types = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, number_types):
        kind = "an int" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequency rescaling (``rope_scaling`` with ``rope_type="llama3"``).

    Attributes:
      factor: how much the low frequencies are slowed down (8 for Llama 3.1, 32 for 3.2).
      low_freq_factor: wavelengths above ``orig / low_freq_factor`` are divided by ``factor``.
      high_freq_factor: wavelengths below ``orig / high_freq_factor`` are kept.
      original_max_position_embeddings: ``orig``, the context length of pre-training.

    Raises:
      ValueError: for a non-positive or non-finite value, or ``high_freq_factor <=
        low_freq_factor`` (the smooth band would divide by zero or be reversed).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        _check_positive("factor", self.factor)
        _check_positive("low_freq_factor", self.low_freq_factor)
        _check_positive("high_freq_factor", self.high_freq_factor)
        _check_positive(
            "original_max_position_embeddings", self.original_max_position_embeddings, integer=True
        )
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must be > low_freq_factor "
                f"({self.low_freq_factor})"
            )


@dataclasses.dataclass(frozen=True)
class RopeParams:
    """How a model rotates its queries and keys (hashable: a static argument under ``jit``).

    Attributes:
      theta: the base (``rope_theta``): 10000 for Llama 2, 500000 for Llama 3.
      interleaved: pairs ``(2i, 2i + 1)`` (GPT-J) instead of ``(i, i + D/2)`` (NeoX, HF Llama).
      scaling: Llama 3.1's frequency rescaling, or None.

    Raises:
      ValueError: for a non-positive or non-finite theta, a non-bool ``interleaved``, or a
        ``scaling`` that is not a ``Llama3Scaling``.

    Example:
      >>> RopeParams(theta=500000.0, scaling=Llama3Scaling()).scaling.factor
      8.0
    """

    theta: float = 10000.0
    interleaved: bool = False
    scaling: Llama3Scaling | None = None

    def __post_init__(self):
        _check_positive("theta", self.theta)
        if not isinstance(self.interleaved, bool):
            raise ValueError(f"interleaved must be a bool, got {self.interleaved!r}")
        if self.scaling is not None and not isinstance(self.scaling, Llama3Scaling):
            raise ValueError(f"scaling must be a Llama3Scaling or None, got {self.scaling!r}")


def _check_head_dim(head_dim) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)):
        raise ValueError(f"head_dim must be an int, got {head_dim!r}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even and >= 2 (RoPE rotates pairs), got {head_dim}")


def inverse_frequencies(head_dim: int, params: RopeParams) -> np.ndarray:
    """``inv_freq``: float32 ``[head_dim // 2]``, pair ``i``'s angle per position (radians).

    Computed in float64 with the formulas of the module docstring, rounded once to float32.

    Raises:
      ValueError: for an odd or non-positive ``head_dim``.

    Example:
      >>> inverse_frequencies(4, RopeParams(theta=100.0)).tolist()
      [1.0, 0.10000000149011612]
    """
    _check_head_dim(head_dim)
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    frequencies = float(params.theta) ** -exponents
    scaling = params.scaling
    if scaling is not None:
        original = float(scaling.original_max_position_embeddings)
        wavelengths = 2 * math.pi / frequencies
        smooth = (original / wavelengths - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * frequencies / scaling.factor + smooth * frequencies
        short = wavelengths < original / scaling.high_freq_factor
        long = wavelengths > original / scaling.low_freq_factor
        frequencies = np.where(
            short, frequencies, np.where(long, frequencies / scaling.factor, blended)
        )
    return frequencies.astype(np.float32)


def rope_angles(positions: jax.Array, inv_freq) -> jax.Array:
    """float32 ``[T, D/2]``: ``float32(positions[t]) * inv_freq[i]``, one float32 product each.

    Positions are exact in float32 up to ``2**24``.
    """
    return positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]


def pair_halves(x: jax.Array, interleaved: bool) -> tuple[jax.Array, jax.Array]:
    """The first and second member of every pair: two ``[..., D/2]`` arrays."""
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def join_halves(first: jax.Array, second: jax.Array, interleaved: bool) -> jax.Array:
    """The inverse of ``pair_halves``: ``[..., D]`` from the two members of every pair."""
    if interleaved:
        return jnp.stack([first, second], axis=-1).reshape(*first.shape[:-1], -1)
    return jnp.concatenate([first, second], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, params: RopeParams) -> jax.Array:
    """Rotates every head of every token by its position (reference).

    Args:
      x: ``[T, H, D]`` queries or keys, ``D`` even.
      positions: int ``[T]``, each token's position (any integer; negative rotates backwards).
      params: the model's RoPE parameters.

    Returns:
      ``[T, H, D]`` in float32 (float64 for float64 x): the angles are the float32 ones of
      ``rope_angles``; cos, sin and the rotation are computed in that precision. The caller
      rounds to the dtype it stores.

    Raises:
      ValueError: for a shape that is not ``[T, H, D]`` with ``D`` even, or positions not
        ``[T]`` integers.

    Example:
      >>> x = jnp.array([[[1.0, 0.0, 0.0, 0.0]]])  # pair 0 is (x[0], x[2]) in rotate-half
      >>> [round(float(value), 4) for value in apply_rope(x, jnp.array([2]), RopeParams()).ravel()]
      [-0.4161, 0.0, 0.9093, 0.0]
    """
    if x.ndim != 3:
        raise ValueError(f"x must have shape [tokens, heads, head_dim], got {x.shape}")
    _check_head_dim(x.shape[-1])
    if positions.shape != (x.shape[0],) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(
            f"positions must be integers of shape ({x.shape[0]},), got {positions.dtype} "
            f"{positions.shape}"
        )
    compute = jnp.promote_types(x.dtype, jnp.float32)
    angles = rope_angles(positions, inverse_frequencies(x.shape[-1], params)).astype(compute)
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, D/2]
    sin = jnp.sin(angles)[:, None, :]
    first, second = pair_halves(x.astype(compute), params.interleaved)
    return join_halves(first * cos - second * sin, second * cos + first * sin, params.interleaved)
