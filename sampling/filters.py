"""What each sampling filter keeps, by definition: the contract every sampler is checked against.

Tokens are ordered by (probability descending, index ascending), a total order, so ties are
resolved the same way everywhere. Probabilities are non-negative finite weights, normalized by
their sum. For one row ``p[V]``:

- top-k keeps the first ``k`` tokens of that order;
- top-p keeps the token at rank ``r`` iff the mass ranked before ``r`` is ``< top_p * sum(p)``
  (the token that crosses ``top_p`` is kept, and at least the first token always is);
- min-p keeps tokens with ``p_i >= min_p * max_j p_j``;
- ``order="joint"`` keeps the intersection of the filters given; ``order="top_k_first"`` applies
  top-p to the top-k distribution renormalized (mass before ``r`` ``< top_p * mass(top k)``).

Every kept set is a prefix of the order (the property the rejection samplers rely on,
``proofs/sampling.md``). A disabled filter is ``top_k >= V``, ``top_p >= 1`` or ``min_p <= 0``
here; the public samplers take ``None`` to disable a filter and reject ``top_k > V`` as bad input.

This module computes kept sets the plain way, with a stable sort: it is the definition, written
to be read, and the oracle of the tests. The samplers (``sampling/reference.py``) find the same
sets without sorting.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

ORDERS = ("joint", "top_k_first")


class FilterParams(NamedTuple):
    """One row's filter parameters (scalars; arrays under ``vmap``).

    Attributes:
      top_k: keep the first ``top_k`` tokens (``>= V`` disables).
      top_p: nucleus mass in ``(0, 1]`` (``>= 1`` disables).
      min_p: relative floor in ``[0, 1]`` (``<= 0`` disables).
    """

    top_k: jax.Array | int
    top_p: jax.Array | float
    min_p: jax.Array | float


def disabled(vocab_size: int) -> FilterParams:
    """Parameters that keep every token with positive probability."""
    return FilterParams(top_k=vocab_size, top_p=1.0, min_p=0.0)


def rank_order(probs: jax.Array) -> jax.Array:
    """int32[V]: token indices in the sampling order (probability descending, index ascending)."""
    return jnp.argsort(-probs, stable=True).astype(jnp.int32)


def kept_mask(probs: jax.Array, params: FilterParams, order: str = "joint") -> jax.Array:
    """bool[V]: which tokens of one row the filters keep (the definition above).

    Tokens of probability 0 are never kept: they cannot be drawn.

    Args:
      probs: ``[V]`` non-negative weights, not all zero.
      params: the row's ``FilterParams``.
      order: ``"joint"`` or ``"top_k_first"``.

    Example:
      >>> p = jnp.array([0.4, 0.3, 0.3])
      >>> kept_mask(p, FilterParams(top_k=2, top_p=1.0, min_p=0.0)).tolist()  # tie: index wins
      [True, True, False]
      >>> kept_mask(p, FilterParams(top_k=3, top_p=0.5, min_p=0.0)).tolist()  # crosses 0.5
      [True, True, False]
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    vocab = probs.shape[-1]
    ranked = rank_order(probs)
    sorted_probs = probs[ranked]
    rank = jnp.arange(vocab)
    masses = prefix_mass(probs)
    mass_before = masses[:-1]  # the mass ranked before each rank
    in_top_k = rank < params.top_k
    # The first token is always kept, even where top_p * total underflows to 0.
    in_top_p = (
        (rank == 0)
        | (params.top_p >= 1)
        | (mass_before < params.top_p * nucleus_mass(masses, params, order))
    )
    in_min_p = sorted_probs >= params.min_p * sorted_probs[0]
    keep_sorted = in_top_k & in_top_p & in_min_p & (sorted_probs > 0)
    return jnp.zeros(vocab, bool).at[ranked].set(keep_sorted)


def prefix_mass(probs: jax.Array) -> jax.Array:
    """``[V + 1]``: entry ``n`` is the mass of the ``n`` first tokens of the order.

    The tokens above any position are exactly the first ``n`` of the order for some ``n`` (their
    count), so this one table gives the mass above any position. The samplers' tests and this
    definition both read it, so they agree bit for bit on every top-p decision; a sum of the
    same tokens in another order can round to the other side of ``top_p * total``.
    """
    sorted_probs = probs[rank_order(probs)]
    return jnp.concatenate([jnp.zeros(1, probs.dtype), jnp.cumsum(sorted_probs)])


def nucleus_mass(masses: jax.Array, params: FilterParams, order: str) -> jax.Array:
    """The mass top-p is a fraction of: all of it (``"joint"``), or the top-k mass
    (``"top_k_first"``); ``masses`` from ``prefix_mass``."""
    if order == "joint":
        return masses[-1]
    return masses[jnp.clip(params.top_k, 0, masses.shape[0] - 1)]


def filtered_distribution(
    probs: jax.Array, params: FilterParams, order: str = "joint"
) -> jax.Array:
    """``[V]``: the distribution a filtered sampler must draw from (kept mass, renormalized)."""
    kept = jnp.where(kept_mask(probs, params, order), probs, 0)
    return kept / jnp.sum(kept)
