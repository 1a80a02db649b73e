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

YaRN (DeepSeek-V2/V3's long-context frequencies and attention temperature) has functions of its
own at the end of this file (``YarnScaling``, ``yarn_inverse_frequencies``, ``yarn_mscale``,
``apply_rope_frequencies``); ``RopeParams`` does not carry it.

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


def _plain_frequencies_float64(head_dim: int, theta: float) -> np.ndarray:
    """float64 ``[head_dim // 2]``: ``theta ** (-2i / head_dim)``, before any rescaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    return float(theta) ** -exponents


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
    frequencies = _plain_frequencies_float64(head_dim, params.theta)
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
    _check_rotation_inputs(x, positions)
    return _rotate(x, positions, inverse_frequencies(x.shape[-1], params), params.interleaved)


def _check_rotation_inputs(x: jax.Array, positions: jax.Array) -> None:
    if x.ndim != 3:
        raise ValueError(f"x must have shape [tokens, heads, head_dim], got {x.shape}")
    _check_head_dim(x.shape[-1])
    if positions.shape != (x.shape[0],) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(
            f"positions must be integers of shape ({x.shape[0]},), got {positions.dtype} "
            f"{positions.shape}"
        )


def _rotate(x: jax.Array, positions: jax.Array, inv_freq, interleaved: bool) -> jax.Array:
    """Pair ``i`` of token ``t`` rotated by ``float32(positions[t]) * inv_freq[i]``."""
    compute = jnp.promote_types(x.dtype, jnp.float32)
    angles = rope_angles(positions, inv_freq).astype(compute)
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, D/2]
    sin = jnp.sin(angles)[:, None, :]
    first, second = pair_halves(x.astype(compute), interleaved)
    return join_halves(first * cos - second * sin, second * cos + first * sin, interleaved)


# --------------------------------------------------------------------------------------------
# YaRN (DeepSeek-V2 / V3's long-context RoPE)
# --------------------------------------------------------------------------------------------
#
# YaRN (Peng, Quesnelle, Fan, Shippole, 2023, arXiv:2309.00071) stretches a model trained on
# ``orig`` positions to ``factor x orig``. Pair i turns ``r_i = orig * inv_freq[i] / (2 pi)``
# times over the original context. Pairs that turn many times (``r_i`` above ``beta_fast``: high
# frequencies, the local position signal) keep their frequency; pairs that turn less than
# ``beta_slow`` times (low frequencies, never seen past ``orig``) are interpolated, the frequency
# divided by ``factor``; between the two, a linear ramp mixes them. The paper writes the ramp
# linear in ``r``; the checkpoints (the YaRN authors' and DeepSeek's released implementations)
# make it linear in the pair index instead, between the (real-valued) indices where ``r``
# equals ``beta_fast`` and ``beta_slow``, rounded outward. Those indices follow from
# ``inv_freq[i] = theta ** (-2i / D)``: solving ``orig * theta ** (-2i / D) = 2 pi n`` gives
#
#     i(n) = D * ln(orig / (2 pi n)) / (2 ln theta)
#
# so ``low = max(floor(i(beta_fast)), 0)``, ``high = min(ceil(i(beta_slow)), D - 1)``, and
# pair i's interpolation weight is ``ramp_i = clip((i - low) / (high - low), 0, 1)`` (a step at
# ``low`` when ``high == low``). Its frequency is
#
#     inv_freq_yarn[i] = (1 - ramp_i) * inv_freq[i] + ramp_i * inv_freq[i] / factor.
#
# The second part of YaRN is a temperature: interpolated attention gets flatter, so logits are
# sharpened by ``mscale ** 2`` with ``mscale = 0.1 * c * ln(factor) + 1`` (1 for ``factor <= 1``;
# the paper's ``sqrt(1 / t)`` with ``c = 1``). DeepSeek-V2's report fits ``c = 0.707``
# (``sqrt(t) = 0.0707 ln s + 1``), DeepSeek-V3 uses ``c = 1``, both as ``mscale_all_dim`` in the
# checkpoint's config, and multiplies the softmax scale by ``mscale ** 2`` (for MLA:
# ``paged.mla_reference.default_softmax_scale(..., yarn=...)``). DeepSeek's code also multiplies
# cos and sin by ``mscale(mscale) / mscale(mscale_all_dim)``, which is 1 wherever the two
# coefficients are equal, as in every released DeepSeek checkpoint; ``YarnScaling`` refuses
# unequal ones rather than rotate with the wrong magnitude.

# DeepSeek-V2, V2-Lite and V3: factor 40 over 4096 pre-training positions (a 160K context).
DEEPSEEK_YARN_FACTOR = 40.0
DEEPSEEK_YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS = 4096


def _check_non_negative(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


def _check_yarn_factor(factor) -> None:
    _check_positive("factor", factor)
    if factor < 1:
        raise ValueError(f"factor must be >= 1 (YaRN stretches the context), got {factor!r}")


def yarn_mscale(factor: float, mscale_coefficient: float = 1.0) -> float:
    """YaRN's attention temperature ``mscale = 0.1 * mscale_coefficient * ln(factor) + 1``.

    1 for ``factor == 1`` (no stretching). The softmax scale is multiplied by ``mscale ** 2``.

    Args:
      factor: the context stretch, >= 1.
      mscale_coefficient: ``c`` in the formula: 1 in the YaRN paper and DeepSeek-V3, 0.707 in
        DeepSeek-V2 (its config's ``mscale_all_dim``).

    Raises:
      ValueError: for ``factor < 1`` or not finite, a negative or non-finite coefficient.

    Example:
      >>> round(yarn_mscale(40.0), 6)
      1.368888
      >>> yarn_mscale(1.0)
      1.0
    """
    _check_yarn_factor(factor)
    _check_non_negative("mscale_coefficient", mscale_coefficient)
    return 0.1 * float(mscale_coefficient) * math.log(float(factor)) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN's rescaling of RoPE frequencies and its attention temperature (the fields of a
    DeepSeek checkpoint's ``rope_scaling`` with ``type="yarn"``).

    Attributes:
      factor: the context stretch ``s`` (40 for DeepSeek-V2/V3), >= 1; 1 leaves RoPE unchanged.
      original_max_position_embeddings: ``orig``, the pre-training context (4096 for DeepSeek).
      beta_fast: pairs turning more than this many times over ``orig`` keep their frequency.
      beta_slow: pairs turning fewer times are interpolated (frequency / factor).
      mscale: DeepSeek's coefficient of the cos/sin magnitude, ``mscale(mscale) /
        mscale(mscale_all_dim)``; must equal ``mscale_all_dim`` (a magnitude of 1).
      mscale_all_dim: the coefficient ``c`` of the softmax temperature ``yarn_mscale(factor, c)``
        (1 for DeepSeek-V3, 0.707 for DeepSeek-V2 and V2-Lite).

    Raises:
      ValueError: naming the field, for ``factor < 1``, a non-positive or non-finite value,
        ``beta_fast <= beta_slow``, a negative coefficient, or ``mscale != mscale_all_dim``.

    Example:
      >>> YarnScaling(mscale=0.707, mscale_all_dim=0.707).softmax_scale_multiplier > 1
      True
    """

    factor: float = DEEPSEEK_YARN_FACTOR
    original_max_position_embeddings: int = DEEPSEEK_YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self):
        _check_yarn_factor(self.factor)
        _check_positive(
            "original_max_position_embeddings", self.original_max_position_embeddings, integer=True
        )
        _check_positive("beta_fast", self.beta_fast)
        _check_positive("beta_slow", self.beta_slow)
        if not self.beta_fast > self.beta_slow:
            raise ValueError(
                f"beta_fast ({self.beta_fast}) must be > beta_slow ({self.beta_slow}): pairs "
                "turning more often keep their frequency"
            )
        _check_non_negative("mscale", self.mscale)
        _check_non_negative("mscale_all_dim", self.mscale_all_dim)
        if self.mscale != self.mscale_all_dim:
            raise ValueError(
                f"mscale ({self.mscale}) must equal mscale_all_dim ({self.mscale_all_dim}): the "
                "cos/sin magnitude mscale(mscale) / mscale(mscale_all_dim) other than 1 is not "
                "implemented (it is 1 in every released DeepSeek checkpoint)"
            )

    @property
    def softmax_scale_multiplier(self) -> float:
        """``yarn_mscale(factor, mscale_all_dim) ** 2``: what the softmax scale is multiplied by."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_ramp_bounds(head_dim: int, theta: float, scaling: YarnScaling) -> tuple[int, int]:
    """``(low, high)``: the pair indices where YaRN's ramp starts and ends (module comment).

    Pairs ``i <= low`` keep their frequency, pairs ``i >= high`` are divided by the factor.

    Example:
      >>> yarn_ramp_bounds(64, 10000.0, YarnScaling())  # DeepSeek's RoPE dimensions
      (10, 23)
    """
    _check_head_dim(head_dim)
    _check_positive("theta", theta)
    if not theta > 1:
        raise ValueError(f"theta must be > 1 (frequencies fall with the pair index), got {theta}")

    def pair_index(rotations: float) -> float:  # i(n), where pair i turns n times over orig
        original = float(scaling.original_max_position_embeddings)
        return head_dim * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(theta))

    low = max(math.floor(pair_index(scaling.beta_fast)), 0)
    high = min(math.ceil(pair_index(scaling.beta_slow)), head_dim - 1)
    return low, high


def yarn_inverse_frequencies(head_dim: int, theta: float, scaling: YarnScaling) -> np.ndarray:
    """float32 ``[head_dim // 2]``: YaRN's rescaled ``inv_freq`` (module comment's formulas).

    Computed in float64, rounded once to float32, like ``inverse_frequencies``; the ends of the
    ramp are exact: pairs with weight 0 (and every pair at ``factor == 1``) get exactly
    ``inverse_frequencies(head_dim, RopeParams(theta))``, pairs with weight 1 exactly the
    float32 rounding of ``theta ** (-2i / D) / factor``. Rotate with ``apply_rope_frequencies``.

    Args:
      head_dim: the rotary width ``D`` (even): ``qk_rope_head_dim`` = 64 for DeepSeek.
      theta: the RoPE base (10000 for DeepSeek), > 1.
      scaling: the YaRN parameters.

    Raises:
      ValueError: for an odd or non-positive ``head_dim``, ``theta <= 1``, or a ``scaling``
        that is not a ``YarnScaling``.

    Example:
      >>> yarn = yarn_inverse_frequencies(64, 10000.0, YarnScaling())
      >>> plain = inverse_frequencies(64, RopeParams(theta=10000.0))
      >>> bool(yarn[0] == plain[0]), bool(yarn[31] < plain[31])
      (True, True)
    """
    if not isinstance(scaling, YarnScaling):
        raise ValueError(f"scaling must be a YarnScaling, got {scaling!r}")
    low, high = yarn_ramp_bounds(head_dim, theta, scaling)
    frequencies = _plain_frequencies_float64(head_dim, theta)
    pair = np.arange(head_dim // 2, dtype=np.float64)
    if high > low:
        ramp = np.clip((pair - low) / (high - low), 0.0, 1.0)
    else:
        ramp = (pair > low).astype(np.float64)
    # (1 - ramp) f + ramp f / factor, written so that ramp 0 and factor 1 give f exactly.
    blended = frequencies - frequencies * ramp * (1.0 - 1.0 / scaling.factor)
    frequencies = np.where(ramp >= 1.0, frequencies / scaling.factor, blended)
    return frequencies.astype(np.float32)


def apply_rope_frequencies(
    x: jax.Array, positions: jax.Array, inv_freq, *, interleaved: bool
) -> jax.Array:
    """``apply_rope`` with given frequencies (e.g. ``yarn_inverse_frequencies``).

    Args:
      x: ``[T, H, D]`` queries or keys, ``D`` even.
      positions: int ``[T]``.
      inv_freq: float32 ``[D / 2]``.
      interleaved: pairs ``(2i, 2i + 1)`` (DeepSeek's checkpoints) or ``(i, i + D/2)``.

    Returns:
      ``[T, H, D]`` in float32 (float64 for float64 x), as ``apply_rope``.

    Raises:
      ValueError: as ``apply_rope``, and for ``inv_freq`` not of shape ``[D / 2]`` or a
        non-bool ``interleaved``.
    """
    _check_rotation_inputs(x, positions)
    if np.shape(inv_freq) != (x.shape[-1] // 2,):
        raise ValueError(
            f"inv_freq must have shape ({x.shape[-1] // 2},) (head_dim / 2), got "
            f"{np.shape(inv_freq)}"
        )
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved must be a bool, got {interleaved!r}")
    return _rotate(x, positions, inv_freq, interleaved)
