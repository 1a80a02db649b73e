"""How a row of logits reads at a temperature: ``softmax(logits / T)``, invalid rows included.

One idea, used by every place that needs the distribution a sampler draws from rather than a
draw from it: ``sample_from_logits(..., return_logprob=True)`` (the log-probability of the token
drawn) and ``speculative.tempered_probs`` (the ``p`` and ``q`` of a verification, and the serving
engine's plain decoding).

Under ``jit`` the public functions cannot refuse invalid logits, so this says what they mean, the
same way the samplers' races read them:

- a NaN logit is a masked token (``-inf``);
- a row without a finite maximum (every logit ``-inf``, or a ``+inf`` among them) is a point mass
  on its arg max (token 0, or the first ``+inf``): the token every sampler returns for it, where
  a softmax would be ``0 / 0``;
- a temperature below ``sampling.reference.MIN_TEMPERATURE`` (0 included) is greedy: a point
  mass on the lowest-index arg max.

Point-mass rows are divided by 1 and their ``-inf`` set to 0 before the softmax, so that no
``inf - inf`` is computed even in the lanes that ``jnp.where`` then discards (a NaN there would
poison gradients and trip NaN checkers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sampling.reference import MIN_TEMPERATURE


def tempered_logits(logits: jax.Array, temperature: jax.Array):
    """The logits a sampler draws from at ``temperature``, and which rows are point masses.

    Args:
      logits: float ``[R, V]``, float32 or wider (the caller upcasts narrower dtypes).
      temperature: ``[R]`` of ``logits``' dtype, ``>= 0``.

    Returns:
      ``(scaled [R, V], point_mass bool[R], masked [R, V])``: ``scaled = logits / T`` where the
      row is a proper distribution (all zeros on point-mass rows); ``point_mass`` marks greedy
      rows and rows without a finite maximum; ``masked`` is ``logits`` with NaN read as
      ``-inf`` (its arg max is the point mass's token).
    """
    masked = jnp.where(jnp.isnan(logits), -jnp.inf, logits)
    point_mass = (temperature < MIN_TEMPERATURE) | ~jnp.isfinite(jnp.max(masked, axis=-1))
    finite = jnp.where(point_mass[:, None], 0, masked)
    scaled = finite / jnp.where(point_mass, 1, temperature)[:, None]
    return scaled, point_mass, masked


def tempered_probs(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """``softmax(logits / T)`` per row, in ``logits``' dtype, read as the module docstring says:
    a point-mass row is one-hot at its arg max (greedy rows at the lowest-index one).

    Args:
      logits: float ``[R, V]``, float32 or wider (the softmax runs in this dtype).
      temperature: ``[R]`` of ``logits``' dtype, ``>= 0``.

    Returns:
      ``[R, V]`` rows summing to 1, never NaN.

    Example:
      >>> probs = tempered_probs(jnp.array([[0.0, 1.0], [0.0, 1.0]]), jnp.array([1.0, 0.0]))
      >>> [[round(p, 3) for p in row] for row in probs.tolist()]
      [[0.269, 0.731], [0.0, 1.0]]
    """
    scaled, point_mass, masked = tempered_logits(logits, temperature)
    one_hot = jax.nn.one_hot(jnp.argmax(masked, axis=-1), masked.shape[-1], dtype=logits.dtype)
    return jnp.where(point_mass[:, None], one_hot, jax.nn.softmax(scaled, axis=-1))


def tempered_logprob(logits: jax.Array, temperature: jax.Array, tokens: jax.Array) -> jax.Array:
    """``log softmax(logits / T)[token]`` per row, read as the module docstring says: 0 on a
    point-mass row (the token drawn there is the point mass's, with probability 1).

    Args:
      logits: float ``[R, V]``, float32 or wider.
      temperature: ``[R]`` of ``logits``' dtype, ``>= 0``.
      tokens: int ``[R]``, in ``[0, V)``.

    Returns:
      float32 ``[R]``.

    Example:
      >>> logprob = tempered_logprob(jnp.array([[0.0, 0.0]]), jnp.array([2.0]), jnp.array([1]))
      >>> round(float(logprob[0]), 4)  # log(1/2)
      -0.6931
    """
    scaled, point_mass, _ = tempered_logits(logits, temperature)
    log_probs = jax.nn.log_softmax(scaled, axis=-1)
    logprob = jnp.take_along_axis(log_probs, tokens[:, None].astype(jnp.int32), 1)[:, 0]
    return jnp.where(point_mass, 0.0, logprob).astype(jnp.float32)
