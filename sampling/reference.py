"""Reference samplers with explicit randomness: Gumbel-max and dual-pivot rejection.

Plain JAX, written to be checked line by line; every kernel sampler must pick the same token as
these for the same random numbers. Each sampler here takes its random numbers explicitly
(``filtered_sample_from_uniforms``, ``*_from_gumbels``, ``sample_from_probs_from_exponentials``),
so tests can enumerate them and replay draws.
Computation follows the input dtype (float64 in the exact-enumeration tests).

**Gumbel-max (exponential race).** ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` independent
draws token i with probability ``p_i / sum(p)``: no softmax, no normalization, one pass. From
logits, ``argmax_i (logit_i / T - log E_i)`` is the same race on ``exp(logit / T)``.

**Dual-pivot rejection for filtered sampling** (top-k, top-p, min-p, both orders). The kept set
``K`` is a prefix of the order (probability descending, index ascending). A round draws a token
``j`` from ``p`` restricted to the tokens above a threshold ``low`` (inverse transform with one
uniform); if ``j`` is in ``K`` it is returned. Otherwise every token at or below ``j`` is outside
``K``, so ``low`` rises to ``j``, or further to a second pivot halfway up to ``high`` when that
pivot also fails. Thresholds are positions in the total order, ``(value, index)``, not bare
probabilities, so ties at the cut-off are kept or dropped exactly as the definition says.
Proofs of exactness and termination: ``proofs/sampling.md``.

The round is exposed as a state-transition function (``pivot_round``) so the exact enumeration
of the tests can walk the reference's own logic. Rounds are bounded (``max_rounds``); a row still
undecided at the bound draws once more, with its last uniform, from the kept set itself, which is
exact too (``proofs/sampling.md``, Theorem 3).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sampling.filters import FilterParams, kept_mask, nucleus_mass, prefix_mass

DEFAULT_MAX_ROUNDS = 32


# ----------------------------------------------------------------------------------------------
# Gumbel-max


# Below this temperature dividing float32 logits by it can overflow; such rows are greedy (the
# race's limit as the temperature goes to 0).
MIN_TEMPERATURE = 1e-30


def sample_from_probs_from_gumbels(probs: jax.Array, gumbels: jax.Array) -> jax.Array:
    """int32[...]: ``argmax_i (log probs_i + G_i)`` over the last axis (lowest index on ties):
    the race ``argmax_i probs_i / E_i`` with ``G_i = -log E_i``.

    Raced in log space so huge weights cannot overflow ``p / E`` (``E`` can be as small as
    ``2**-33``); a weight of 0 is ``-inf`` and never wins; a NaN score (invalid input that only
    ``jit`` lets through) counts as ``-inf``.

    Args:
      probs: ``[..., V]`` non-negative weights.
      gumbels: ``[..., V]`` Gumbel(0, 1) draws, finite.
    """
    race = jnp.log(probs) + gumbels
    return jnp.argmax(jnp.where(jnp.isnan(race), -jnp.inf, race), axis=-1).astype(jnp.int32)


def sample_from_logits_from_gumbels(
    logits: jax.Array, gumbels: jax.Array, temperature
) -> jax.Array:
    """int32[...]: ``argmax_i (logits_i / T + G_i)``; ``T < MIN_TEMPERATURE`` is greedy (lowest
    index on ties). A logit of ``-inf`` is a masked token and never wins; a NaN score (invalid
    input under ``jit``) counts as ``-inf``.

    The scaled logit is ``logits * (1 / T)``, the form the kernel computes (one multiply-add a
    token), so that both round alike: bit for bit in interpret mode; compiled, a GPU may fuse
    the multiply and the add into one rounding, a difference that can only flip a near-tie.

    Args:
      logits: ``[..., V]``.
      gumbels: ``[..., V]`` Gumbel(0, 1) draws, finite.
      temperature: scalar or ``[...]``, ``>= 0`` and finite.
    """
    temperature = jnp.asarray(temperature, logits.dtype)[..., None]
    greedy = temperature < MIN_TEMPERATURE
    scaled = logits * (1 / jnp.where(greedy, 1, temperature))
    race = jnp.where(greedy, logits, scaled + gumbels)
    return jnp.argmax(jnp.where(jnp.isnan(race), -jnp.inf, race), axis=-1).astype(jnp.int32)


def sample_from_probs_from_exponentials(probs: jax.Array, exponentials: jax.Array) -> jax.Array:
    """int32[...]: ``argmax_i probs_i / E_i``, the race in its exponential form
    (``sample_from_probs_from_gumbels`` on ``G = -log E``).

    Args:
      probs: ``[..., V]`` non-negative weights.
      exponentials: ``[..., V]`` Exp(1) draws, all ``> 0``.
    """
    return sample_from_probs_from_gumbels(probs, -jnp.log(exponentials))


# ----------------------------------------------------------------------------------------------
# Dual-pivot rejection: one row


class PivotState(NamedTuple):
    """Where one row's rejection search stands.

    The candidates are the tokens *above* ``low``: ``p > low_value``, or ``p == low_value`` and
    index ``< low_index`` (the tokens before position ``(low_value, low_index)`` in the order).

    Attributes:
      low_value, low_index: the threshold; every kept token is above it.
      high_value: no token drawn and rejected from now on has probability above it.
      token: the accepted token, ``-1`` while undecided.
      rounds: rounds taken.
    """

    low_value: jax.Array
    low_index: jax.Array
    high_value: jax.Array
    token: jax.Array
    rounds: jax.Array


def initial_state(probs: jax.Array, min_p=0.0) -> PivotState:
    """Candidates: every token that min-p keeps; ``high`` the largest probability.

    With ``min_p > 0`` the candidates start as ``p >= min_p * max(p)`` (threshold position
    ``(f, V)``, ``f`` the smallest probability passing min-p; the kernel uses ``(min_p * max(p),
    V)``, which has the same tokens above it): min-p's cut-off is known from the maximum alone,
    every kept token
    lies above it (``proofs/sampling.md``, Lemma 2), and a round spent rejecting a token below it
    would be wasted. Without min-p (``min_p <= 0``) they are the tokens of positive probability
    (threshold ``(0, 0)``).

    Args:
      probs: ``[V]`` non-negative weights.
      min_p: the row's min-p, a scalar in ``[0, 1]``.
    """
    largest = jnp.max(probs)
    # The smallest probability that passes min-p, compared exactly as ``threshold_passes``
    # compares (same operands, same promotion), so ``p >= floor`` is the min-p test itself.
    passes_min_p = probs >= min_p * largest
    floor = jnp.min(jnp.where(passes_min_p, probs, largest))
    uses_min_p = (min_p > 0) & (floor > 0)
    return PivotState(
        low_value=jnp.where(uses_min_p, floor, 0).astype(probs.dtype),
        low_index=jnp.where(uses_min_p, probs.shape[-1], 0).astype(jnp.int32),
        high_value=largest,
        token=jnp.full((), -1, jnp.int32),
        rounds=jnp.zeros((), jnp.int32),
    )


def above(probs: jax.Array, value, index) -> jax.Array:
    """bool[V]: the tokens before position ``(value, index)`` in the order."""
    positions = jnp.arange(probs.shape[-1])
    return (probs > value) | ((probs == value) & (positions < index))


class RowStats(NamedTuple):
    """What a row's tests read, computed once per row (``row_stats``).

    Attributes:
      prefix_mass: ``[V + 1]``, the mass of the first ``n`` tokens of the order
        (``sampling.filters.prefix_mass``, the same table the definition reads).
      nucleus_total: the mass top-p is a fraction of.
      max_prob: the largest probability (min-p's reference).
    """

    prefix_mass: jax.Array
    nucleus_total: jax.Array
    max_prob: jax.Array


def row_stats(probs: jax.Array, params: FilterParams, order: str) -> RowStats:
    """The per-row table the filter tests read (one sort: this reference is written for
    agreement with the definition, not speed; a kernel finds the same masses without sorting,
    up to rounding)."""
    masses = prefix_mass(probs)
    return RowStats(masses, nucleus_mass(masses, params, order), jnp.max(probs))


def threshold_passes(probs: jax.Array, value, index, params: FilterParams, stats: RowStats):
    """Would a token at position ``(value, index)`` be kept? Monotone: true at one position means
    true at every earlier one, which is why a failed test clears everything at or below it.

    The tokens above the position are the first ``count`` of the order, so their mass is
    ``stats.prefix_mass[count]``: the very number the definition compares for the token at rank
    ``count``.

    Args:
      probs: ``[V]``.
      value, index: the position.
      params: the filters.
      stats: the row's ``RowStats``.
    """
    count_above = jnp.sum(above(probs, value, index))
    mass_above = stats.prefix_mass[count_above]
    passes_top_k = count_above < params.top_k
    passes_top_p = (
        (count_above == 0)  # the first token is always kept
        | (params.top_p >= 1)
        | (mass_above < params.top_p * stats.nucleus_total)
    )
    passes_min_p = value >= params.min_p * stats.max_prob
    return passes_top_k & passes_top_p & passes_min_p


def inverse_transform(weights: jax.Array, uniform) -> jax.Array:
    """int32: the token whose share of the normalized running sums holds ``uniform``.

    With ``c`` the running maximum of the running sums and ``F = c / c[-1]`` (non-decreasing:
    a running maximum is, and dividing by a positive number is monotone in floating point),
    token j is chosen for ``uniform`` in ``[F[j-1], F[j])``: with probability
    ``weights_j / sum(weights)`` up to rounding, and the breakpoints are exactly the floats
    ``F`` (what the exact-enumeration test walks). If rounding leaves
    ``uniform`` at or past ``F[-1]``, the last token of positive weight is taken: never a token of
    zero weight, never an index outside the row. A row with no positive weight (invalid input
    that only ``jit`` lets through) gives token 0.
    """
    # Float running sums are not monotone (XLA's scan reassociates): a dip would hand a zero-weight
    # token an interval that the fallback then gives to the last positive token. The running
    # maximum is monotone, and equals the running sums wherever they do not dip.
    cumulative = jax.lax.cummax(jnp.cumsum(weights))
    normalized = cumulative / cumulative[-1]
    token = jnp.sum(normalized <= uniform).astype(jnp.int32)
    positions = jnp.arange(weights.shape[-1], dtype=jnp.int32)
    last_positive = jnp.max(jnp.where(weights > 0, positions, 0))
    past_the_end = (token >= weights.shape[-1]) | (jnp.take(weights, token, mode="clip") <= 0)
    return jnp.where(past_the_end, last_positive, token).astype(jnp.int32)


def pivot_round(
    probs: jax.Array, params: FilterParams, stats: RowStats, state: PivotState, uniform
) -> PivotState:
    """One round of dual-pivot rejection: the state transition (a decided state is unchanged).

    Draw ``j`` from the candidates by inverse transform with ``uniform``. Accept it if a token at
    its position passes the filters. Otherwise test ``pivot1 = ((p_j + high) / 2, 0)``: if it
    passes, the cut-off lies between, so ``low = (p_j, j)`` and ``high = pivot1``; if it fails,
    ``low = pivot1``. Either way ``j`` leaves the candidates.
    """
    candidates = above(probs, state.low_value, state.low_index)
    token = inverse_transform(jnp.where(candidates, probs, 0), uniform)
    value = probs[token]
    accept = threshold_passes(probs, value, token, params, stats)
    middle = (value + state.high_value) / 2
    middle_passes = threshold_passes(probs, middle, 0, params, stats)
    rejected = PivotState(
        low_value=jnp.where(middle_passes, value, middle).astype(probs.dtype),
        low_index=jnp.where(middle_passes, token, 0).astype(jnp.int32),
        high_value=jnp.where(middle_passes, middle, state.high_value).astype(probs.dtype),
        token=jnp.where(accept, token, -1).astype(jnp.int32),
        rounds=state.rounds + 1,
    )
    accepted = state._replace(token=token, rounds=state.rounds + 1)
    after = jax.tree.map(lambda a, r: jnp.where(accept, a, r), accepted, rejected)
    decided = state.token >= 0
    return jax.tree.map(lambda old, new: jnp.where(decided, old, new), state, after)


def filtered_sample_row_from_uniforms(
    probs: jax.Array, uniforms: jax.Array, params: FilterParams, order: str = "joint"
) -> tuple[jax.Array, jax.Array]:
    """Samples one row through the filters with explicit uniforms.

    Args:
      probs: ``[V]`` non-negative weights, some positive.
      uniforms: ``[R + 1]`` uniforms in ``(0, 1)``: one for each of at most ``R`` rounds, and the
        last for the fallback at the bound.
      params: the filters.
      order: ``"joint"`` or ``"top_k_first"``.

    Returns:
      ``(token int32, rounds int32)``; ``rounds = R + 1`` when the fallback decided.
    """
    max_rounds = uniforms.shape[-1] - 1
    stats = row_stats(probs, params, order)
    state = jax.lax.fori_loop(
        0,
        max_rounds,
        lambda r, s: pivot_round(probs, params, stats, s, uniforms[r]),
        initial_state(probs, params.min_p),
    )
    kept = jnp.where(kept_mask(probs, params, order), probs, 0)
    fallback = inverse_transform(kept, uniforms[max_rounds])
    undecided = state.token < 0
    token = jnp.where(undecided, fallback, state.token)
    rounds = jnp.where(undecided, max_rounds + 1, state.rounds)
    return token.astype(jnp.int32), rounds.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Batched forms


def _row_params(batch: int, top_k, top_p, min_p) -> FilterParams:
    def per_row(value, dtype):
        return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))

    return FilterParams(
        top_k=per_row(top_k, jnp.int32),
        top_p=per_row(
            top_p, jnp.float32 if jnp.asarray(top_p).dtype != jnp.float64 else jnp.float64
        ),
        min_p=per_row(
            min_p, jnp.float32 if jnp.asarray(min_p).dtype != jnp.float64 else jnp.float64
        ),
    )


def filtered_sample_from_uniforms(
    probs: jax.Array,
    uniforms: jax.Array,
    *,
    top_k=None,
    top_p=None,
    min_p=None,
    order: str = "joint",
) -> tuple[jax.Array, jax.Array]:
    """Batched filtered sampling with explicit uniforms (every filter optional).

    Args:
      probs: ``[B, V]``.
      uniforms: ``[B, R + 1]`` in ``(0, 1)``.
      top_k, top_p, min_p: scalars or ``[B]``; None disables a filter.
      order: ``"joint"`` or ``"top_k_first"``.

    Returns:
      ``(tokens int32[B], rounds int32[B])``.

    Example:
      >>> p = jnp.array([[0.4, 0.3, 0.3]])
      >>> u = jnp.array([[0.9, 0.9, 0.5]])  # round 1 draws token 2 (tied, last): rejected
      >>> filtered_sample_from_uniforms(p, u, top_k=2)[0].tolist()
      [1]
    """
    batch, vocab = probs.shape
    params = _row_params(
        batch,
        vocab if top_k is None else top_k,
        1.0 if top_p is None else top_p,
        0.0 if min_p is None else min_p,
    )
    return jax.vmap(
        lambda row, u, params: filtered_sample_row_from_uniforms(row, u, params, order)
    )(probs, uniforms, params)
