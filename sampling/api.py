"""Public samplers: keys in, tokens out, with ``backend=`` like every decodelab operation.

Randomness comes from ``kernels_pallas/rng.py``, so the reference here and the Pallas kernels
draw the very same numbers for the same key. ``key`` is one JAX key (row ``b`` draws
its own stream, derived from the key and ``b``) or ``B`` keys (row ``b`` uses key ``b``, so a
request's tokens do not depend on its batch slot; an engine passes
``jax.random.fold_in(request_key, step)`` per row). Within a row:

- Gumbel-max noise: stream ``EXPONENTIAL_STREAM``, column = token index;
- rejection rounds: stream ``ROUND_STREAM``, column = round index (``max_rounds + 1`` uniforms,
  the last for the exact fallback at the bound).

Changing these streams changes every sampled token: the change log records it.

Semantics (``sampling/filters.py``): tokens ordered by (probability descending, index
ascending); probabilities are non-negative weights normalized by their sum; temperature applies
to logits first, temperature 0 is greedy (lowest index on ties); a logit of ``-inf`` is masked.

Backends: every function here has a Pallas kernel (``kernels_pallas/sampling.py``): the
Gumbel-max race, dual-pivot rejection for the filtered samplers, and radix selection for the
renorm and mask functions. ``backend="pallas"`` runs it (interpreted on a CPU).
``backend="auto"`` runs, on a GPU, whichever was faster on the H200 in the committed reports,
per function (``kernels_pallas.platform.AUTO_PICKS_KERNEL``): the dual-pivot kernel for the
filtered samplers; the Gumbel-max kernel from batch ``GUMBEL_KERNEL_MIN_BATCH`` up and the XLA
reference below it, where XLA's fusion of the reference is as fast or faster
(``docs/benchmark_results/archive/2026-12-01-gumbel-tuning.md``); the reference for renorm and
mask, not yet timed beside it. The figures are in the sampling reports
(``docs/benchmark_results/README.md`` lists them). Elsewhere ``"auto"`` is the reference, and
``DECODELAB_BACKEND=reference`` forces it everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import rng
from kernels_pallas import sampling as sampling_kernels
from kernels_pallas.platform import choose_backend, interpret_mode
from sampling import reference, validation
from sampling.filters import ORDERS, filtered_distribution, rank_order
from sampling.tempered import tempered_logprob

EXPONENTIAL_STREAM = 0
ROUND_STREAM = 1
# Below this batch "auto" runs the XLA reference for Gumbel-max even on a GPU: in the tuning
# probe's loop on the H200 the kernel was 1.4x faster at batch 128 and 2.3x at 256, level at 64
# and slower below (docs/benchmark_results/archive/2026-12-01-gumbel-tuning.md). The sampling
# suite's loop timed the reference far slower (the kernel ahead at every batch); until that
# disagreement is explained, "auto" follows the figure less favourable to the kernel.
GUMBEL_KERNEL_MIN_BATCH = 128


def _gumbels(key, batch: int, vocab: int) -> jax.Array:
    """float32 ``[B, V]`` Gumbel(0, 1) noise, one per (row, token): Philox bits
    (``rng.noise_bits``) through ``rng.gumbel``, the numbers the kernel computes in registers."""
    words = rng.row_keys(key, batch)[:, None, :]
    bits = rng.noise_bits(words, jnp.arange(vocab)[None, :], stream=EXPONENTIAL_STREAM)
    return rng.gumbel(bits)


def _kernel_key_words(key, batch: int) -> jax.Array:
    """What the Gumbel kernel takes: one key's two words (it derives the rows' itself, sparing
    an XLA launch) or the ``B`` rows' words."""
    words = rng.key_words(key)
    return words if words.ndim == 1 else rng.row_keys(key, batch)


def _round_uniforms(key, batch: int, max_rounds: int) -> jax.Array:
    """float32 ``[B, max_rounds + 1]`` uniforms in ``(0, 1)``, one per rejection round."""
    words = rng.row_keys(key, batch)[:, None, :]
    bits = rng.random_bits(words, jnp.arange(max_rounds + 1)[None, :], stream=ROUND_STREAM)
    return rng.uniform_open(bits)


def _gumbel_backend(operation: str, backend: str, batch: int) -> str:
    """``choose_backend`` for the Gumbel-max kernel: ``"auto"`` declines it below
    ``GUMBEL_KERNEL_MIN_BATCH`` rows (module docstring)."""
    small = f"batch {batch} is below GUMBEL_KERNEL_MIN_BATCH={GUMBEL_KERNEL_MIN_BATCH}"
    declines = small if batch < GUMBEL_KERNEL_MIN_BATCH else None
    return choose_backend(operation, backend, auto_declines=declines, kernel="gumbel").backend


def sample_from_logits(
    key, logits: jax.Array, *, temperature=1.0, return_logprob: bool = False, backend="auto"
):
    """Samples one token per row from ``softmax(logits / temperature)`` by Gumbel-max.

    ``argmax(logits / T + G)`` with ``G = -log E``, ``E ~ Exp(1)`` per token: no softmax, one pass
    (``proofs/sampling.md``, Theorem 1). bfloat16 logits are upcast to float32 first.

    Invalid input under ``jit`` (not checked there): a NaN logit is a masked token; a row
    without a finite maximum (every logit ``-inf``, or a ``+inf``) returns its arg max (token
    0, or its first ``+inf``) with log-probability 0, as a greedy row does; a NaN or negative
    temperature is greedy, one above ``validation.MAX_TEMPERATURE`` (``+inf`` too) is
    ``MAX_TEMPERATURE``. The token is always inside ``[0, V)``.

    Args:
      key: one JAX key or ``B`` keys.
      logits: ``[B, V]`` (an array or array-like); ``-inf`` masks a token.
      temperature: scalar or ``[B]``, ``>= 0`` and finite; 0 (below
        ``reference.MIN_TEMPERATURE``) is greedy.
      return_logprob: also return ``log q(token)`` under the distribution drawn from (0 for
        greedy rows).
      backend: ``"auto"``, ``"reference"`` or ``"pallas"`` (module docstring).

    Returns:
      ``int32[B]`` tokens (and ``float32[B]`` log-probabilities).

    Raises:
      ValueError: bad shapes; concrete NaN or ``+inf`` logits, a row of only ``-inf``, a negative
        or non-finite temperature.
      TypeError: ``logits`` that is not an array-like.

    Example:
      >>> tokens = sample_from_logits(jax.random.key(0), jnp.array([[0.0, -jnp.inf, 5.0]]))
      >>> tokens.shape, int(tokens[0]) != 1
      ((1,), True)
    """
    logits = validation.as_array("logits", logits)
    batch, vocab = validation.check_rows("logits", logits)
    chosen = _gumbel_backend("sample_from_logits", backend, batch)
    validation.check_logits_values(logits)
    one_temperature = jnp.ndim(temperature) == 0
    temperature = validation.temperature_per_row(temperature, batch)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    temperature = temperature.astype(logits.dtype)
    if chosen == "pallas":
        tokens = sampling_kernels.gumbel_sample(
            logits,
            _kernel_key_words(key, batch),
            # One temperature for all rows travels as [1]: no [B] array to build per call.
            temperature[:1] if one_temperature else temperature,
            from_logits=True,
            stream=EXPONENTIAL_STREAM,
            interpret=interpret_mode(),
        )
    else:
        tokens = reference.sample_from_logits_from_gumbels(
            logits, _gumbels(key, batch, vocab), temperature
        )
    if not return_logprob:
        return tokens
    # The distribution drawn from, invalid rows read as the race reads them (sampling/tempered.py).
    return tokens, tempered_logprob(logits, temperature, tokens)


def sample_from_probs(key, probs: jax.Array, *, return_logprob: bool = False, backend="auto"):
    """Samples one token per row in proportion to ``probs`` by the exponential race
    ``argmax(probs / E)``.

    Invalid input under ``jit`` (not checked there): NaN and negative weights weigh 0 (on every
    backend); a row without positive weight returns token 0, a row with a ``+inf`` weight its
    first ``+inf``; a row without positive finite mass gets a NaN log-probability. The token is
    always inside ``[0, V)``.

    Args:
      key: one JAX key or ``B`` keys.
      probs: ``[B, V]`` non-negative weights (normalized by their sum), an array or array-like.
      return_logprob: also return ``log(probs[token] / sum(probs))``.
      backend: ``"auto"``, ``"reference"`` or ``"pallas"`` (module docstring).

    Returns:
      ``int32[B]`` tokens (and ``float32[B]`` log-probabilities).

    Raises:
      ValueError: bad shapes; concrete NaN, infinite or negative probabilities, a row summing
        to 0.
      TypeError: ``probs`` that is not an array-like.
    """
    probs = validation.as_array("probs", probs)
    batch, vocab = validation.check_rows("probs", probs)
    chosen = _gumbel_backend("sample_from_probs", backend, batch)
    validation.check_probs_values(probs)
    probs = probs.astype(jnp.promote_types(probs.dtype, jnp.float32))
    if chosen == "pallas":
        tokens = sampling_kernels.gumbel_sample(
            probs,
            _kernel_key_words(key, batch),
            jnp.ones((1,), jnp.float32),
            from_logits=False,
            stream=EXPONENTIAL_STREAM,
            interpret=interpret_mode(),
        )
    else:
        tokens = reference.sample_from_probs_from_gumbels(
            probs, _gumbels(key, batch, vocab).astype(probs.dtype)
        )
    if not return_logprob:
        return tokens
    weights = validation.as_weights(probs)
    chosen = jnp.take_along_axis(weights, tokens[:, None], 1)[:, 0]
    return tokens, jnp.log(chosen / jnp.sum(weights, axis=-1)).astype(jnp.float32)


def filtered_sample(
    key,
    probs: jax.Array,
    *,
    top_k=None,
    top_p=None,
    min_p=None,
    order: str = "joint",
    max_rounds: int = reference.DEFAULT_MAX_ROUNDS,
    return_logprob: bool = False,
    return_rounds: bool = False,
    backend="auto",
):
    """Samples one token per row from ``probs`` restricted to the filters' kept set, by
    dual-pivot rejection (no sort; ``proofs/sampling.md``, Theorems 2 and 3).

    Invalid input under ``jit`` (not checked there): per-row parameters are clamped into range
    (``top_k`` to ``[1, V]``; ``top_p`` to ``(0, 1]``, NaN meaning 1; ``min_p`` to ``[0, 1]``,
    NaN meaning 0); NaN and negative weights weigh 0 on every backend. A row without positive
    finite mass (all 0, or a ``+inf``) returns some token inside ``[0, V)``, which one is
    unspecified (backends may differ), and its log-probability is NaN.

    Args:
      key: one JAX key or ``B`` keys.
      probs: ``[B, V]`` non-negative weights, an array or array-like.
      top_k: an integer, scalar or ``[B]``, in ``[1, V]``; None disables.
      top_p: scalar or ``[B]`` in ``(0, 1]``; None disables.
      min_p: scalar or ``[B]`` in ``[0, 1]``; None disables.
      order: ``"joint"`` (intersection) or ``"top_k_first"`` (top-p of the renormalized top-k).
      max_rounds: rejection rounds before the exact fallback (static).
      return_logprob: also return ``log q(token)`` under the filtered distribution (computed
        from the definition, ``sampling/filters.py``, with a sort, whatever the backend). On
        the kernel, a token kept only by a float32 rounding flip at the cut-off (a block-order
        sum on the other side of ``top_p * N`` than the sorted one) gets ``-inf``.
      return_rounds: also return the rounds each row took (``max_rounds + 1`` at the fallback).
      backend: ``"auto"``, ``"reference"`` or ``"pallas"`` (module docstring; the kernel picks
        the reference's token for the same key up to float32 summation order,
        ``kernels_pallas/dual_pivot.py``).

    Returns:
      ``int32[B]`` tokens, then the requested extras in the order above.

    Raises:
      ValueError: bad shapes or order; concrete bad probabilities or parameters out of range; a
        ``top_k`` that is not of an integer dtype.
      TypeError: ``probs`` that is not an array-like.
    """
    chosen = choose_backend("filtered_sample", backend, kernel="dual_pivot").backend
    probs = validation.as_array("probs", probs)
    batch, vocab = validation.check_rows("probs", probs)
    validation.check_probs_values(probs)
    if not isinstance(max_rounds, int) or max_rounds < 0:
        raise ValueError(f"max_rounds must be an integer >= 0, got {max_rounds!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    params = validation.filter_params(batch, vocab, top_k, top_p, min_p)
    # At least float32: bfloat16 running sums and uniforms (8 significant bits) would bias the
    # inverse transform (a 0.003 token drawn at twice its rate).
    probs = probs.astype(jnp.promote_types(probs.dtype, jnp.float32))
    if chosen == "pallas":
        tokens, rounds = sampling_kernels.dual_pivot_sample(
            probs,
            rng.row_keys(key, batch),
            params.top_k,
            params.top_p,
            params.min_p,
            order=order,
            max_rounds=max_rounds,
            stream=ROUND_STREAM,
            interpret=interpret_mode(),
        )
    else:
        probs = validation.as_weights(probs)
        uniforms = _round_uniforms(key, batch, max_rounds)
        tokens, rounds = jax.vmap(
            lambda row, u, params: reference.filtered_sample_row_from_uniforms(
                row, u, params, order
            )
        )(probs, uniforms.astype(probs.dtype), params)
    extras = []
    if return_logprob:
        kept = jax.vmap(lambda row, params: filtered_distribution(row, params, order))(
            validation.as_weights(probs), params
        )
        chosen = jnp.take_along_axis(kept, tokens[:, None], 1)[:, 0]
        extras.append(jnp.log(chosen).astype(jnp.float32))
    if return_rounds:
        extras.append(rounds)
    return (tokens, *extras) if extras else tokens


def top_k_sample(key, probs, top_k, **options):
    """``filtered_sample`` with top-k only: the first ``top_k`` tokens of the order.

    Arguments, errors and invalid input under ``jit``: as ``filtered_sample``."""
    return filtered_sample(key, probs, top_k=top_k, **options)


def top_p_sample(key, probs, top_p, **options):
    """``filtered_sample`` with top-p only: the tokens ranked before the mass ``top_p`` is
    reached, and the one that crosses it.

    Arguments, errors and invalid input under ``jit``: as ``filtered_sample``."""
    return filtered_sample(key, probs, top_p=top_p, **options)


def min_p_sample(key, probs, min_p, **options):
    """``filtered_sample`` with min-p only: tokens with ``p >= min_p * max(p)``.

    Arguments, errors and invalid input under ``jit``: as ``filtered_sample``."""
    return filtered_sample(key, probs, min_p=min_p, **options)


def top_k_top_p_sample(key, probs, top_k, top_p, *, order="joint", **options):
    """``filtered_sample`` with top-k and top-p, ``order="joint"`` or ``"top_k_first"``.

    Arguments, errors and invalid input under ``jit``: as ``filtered_sample``."""
    return filtered_sample(key, probs, top_k=top_k, top_p=top_p, order=order, **options)


def _renorm(probs: jax.Array, top_k, top_p, backend: str) -> jax.Array:
    """``probs`` restricted to each row's kept set and renormalized (float32 inside)."""
    operation, kernel = (
        ("top_k_renorm_probs", "top_k_renorm")
        if top_k is not None
        else ("top_p_renorm_probs", "top_p_renorm")
    )
    chosen = choose_backend(operation, backend, kernel=kernel).backend
    probs = validation.as_array("probs", probs)
    batch, vocab = validation.check_rows("probs", probs)
    validation.check_probs_values(probs)
    params = validation.filter_params(batch, vocab, top_k, top_p, None)
    if chosen == "pallas":
        if top_k is not None:
            parameter, mode = params.top_k, "top_k_renorm"
        else:
            parameter, mode = params.top_p, "top_p_renorm"
        out = sampling_kernels.filter_rows(
            probs.astype(jnp.float32), parameter, mode=mode, interpret=interpret_mode()
        )
        return out.astype(probs.dtype)
    compute = validation.as_weights(probs.astype(jnp.promote_types(probs.dtype, jnp.float32)))
    return jax.vmap(filtered_distribution)(compute, params).astype(probs.dtype)


def top_k_renorm_probs(probs: jax.Array, top_k, *, backend="auto") -> jax.Array:
    """``[B, V]``: ``probs`` restricted to each row's top-k and renormalized to sum to 1.

    ``probs``: ``[B, V]`` non-negative weights (an array or array-like); ``top_k``: an integer in ``[1, V]``,
    scalar or ``[B]``. Errors: as ``filtered_sample``. Invalid input under ``jit``: ``top_k``
    is clamped as in ``filtered_sample``, NaN and negative weights weigh 0 (output 0); a row
    without positive finite mass (all 0, or a ``+inf``) has no distribution to renormalize:
    its output holds NaN (where, unspecified: backends differ).
    """
    return _renorm(probs, top_k, None, backend)


def top_p_renorm_probs(probs: jax.Array, top_p, *, backend="auto") -> jax.Array:
    """``[B, V]``: ``probs`` restricted to each row's top-p set and renormalized.

    ``probs``: ``[B, V]`` non-negative weights (an array or array-like); ``top_p``: in ``(0, 1]``,
    scalar or ``[B]``. Errors: as ``filtered_sample``. Invalid input under ``jit``: ``top_p``
    is clamped as in ``filtered_sample``, NaN and negative weights weigh 0 (output 0); a row
    without positive finite mass (all 0, or a ``+inf``) has no distribution to renormalize:
    its output holds NaN (where, unspecified: backends differ).
    """
    return _renorm(probs, None, top_p, backend)


def top_k_mask_logits(logits: jax.Array, top_k, *, backend="auto") -> jax.Array:
    """``[B, V]``: each row's top-k logits kept, the rest ``-inf`` (ties by index).

    ``logits``: ``[B, V]`` (an array or array-like); ``top_k``: an integer in ``[1, V]``, scalar
    or ``[B]``. Errors: as ``filtered_sample`` (NaN or ``+inf`` logits, an all ``-inf`` row, when
    concrete). Invalid input under ``jit``: ``top_k`` is clamped into ``[1, V]``; ``+inf``
    ranks first; where a NaN logit ranks is unspecified (the kernel ranks it first, the
    reference last): it may be kept, as NaN, and push a finite logit out.
    """
    chosen = choose_backend("top_k_mask_logits", backend, kernel="top_k_mask").backend
    logits = validation.as_array("logits", logits)
    batch, vocab = validation.check_rows("logits", logits)
    validation.check_logits_values(logits)
    k = validation.top_k_per_row(top_k, batch, vocab)
    if chosen == "pallas":
        out = sampling_kernels.filter_rows(
            logits.astype(jnp.float32), k, mode="top_k_mask", interpret=interpret_mode()
        )
        return out.astype(logits.dtype)

    def mask_row(row, k):
        rank = (
            jnp.zeros(vocab, jnp.int32).at[rank_order(row)].set(jnp.arange(vocab, dtype=jnp.int32))
        )
        return jnp.where(rank < k, row, -jnp.inf)

    return jax.vmap(mask_row)(logits, k)
