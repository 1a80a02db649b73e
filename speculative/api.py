"""Chain speculative sampling: keys in, tokens out, with ``backend=`` like every decodelab operation.

``chain_speculative_sampling`` verifies ``n`` drafted tokens against the target model's
distributions and emits between 1 and ``n + 1`` tokens distributed exactly as the target's
autoregressive sampling (``speculative/reference.py`` says how, ``proofs/chain_speculative.md``
why). ``chain_greedy_verify`` is the temperature-0 counterpart.

**Exactness is a contract about the inputs.** ``draft_probs[b, i]`` must be the distribution
draft ``i`` was actually drawn from, after the draft's temperature and filters, and
``target_probs[b, i]`` the distribution the user asked for (the target's logits at the user's
temperature, through the user's filters). Engines have shipped each half wrong
(``docs/peers.md``). ``sampling_distribution`` builds either from logits and sampling
parameters with the samplers' own definitions (``sampling/filters.py``), and ``sample_draft``
draws a draft token from the very array it returns as ``q``, so both hold by construction.

Randomness comes from ``kernels_pallas/rng.py``, stream ``SPECULATIVE_STREAM``: position ``i`` of
a row owns columns ``4i`` (the accept test of draft ``i``), ``4i + 1`` and ``4i + 2`` (the chunk
and the token of the two-level draw, used where the chain stops at ``i``); ``4i + 3`` is unused.
A position's numbers do not depend on ``n``. ``key`` is one key (row ``b`` draws its own stream)
or ``B`` keys (row ``b`` uses key ``b``; an engine passes ``fold_in(request_key, step)``). The
samplers use streams 0 and 1 (``sampling/api.py``), so a key may serve a step's sampler and its
verification alike. Changing a stream, a column or ``DEFAULT_CHUNK_SIZE`` changes every token.

Inputs are checked: shapes and dtypes always; values (token ids inside the vocabulary,
probabilities finite and non-negative, rows that are distributions, drafted tokens of positive
draft probability) when concrete, outside ``jit``, with ``ValueError`` naming the argument and
the bad value. Under ``jit`` token ids are clipped into the vocabulary and bad probabilities
weigh 0, so an emitted token is always inside ``[0, V)``. A row is a distribution if its sum is
within ``row_sum_tolerance(dtype)`` of 1: a target row summing to ``S`` moves the token it emits by
a total variation of at most ``|1 - S|`` (Theorem 6 of the proof): the tolerance is the bias
accepted.

Backends: ``backend="pallas"`` runs ``kernels_pallas/spec_accept.py`` (interpreted on a CPU);
``"reference"`` the pure JAX of ``speculative/reference.py``. ``"auto"`` is the kernel on a GPU
and the reference elsewhere (``kernels_pallas.platform.AUTO_PICKS_KERNEL``: set once the kernel
was compiled, checked and timed on an H200); ``DECODELAB_BACKEND=reference`` forces the
reference. The choice is made when the function is traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import rng
from kernels_pallas import spec_accept as spec_accept_kernels
from kernels_pallas.platform import choose_backend, interpret_mode, is_concrete
from sampling import api as sampling_api
from sampling import validation
from sampling.filters import ORDERS, FilterParams, filtered_distribution
from sampling.tempered import tempered_probs
from speculative import reference
from speculative.reference import DEFAULT_CHUNK_SIZE

SPECULATIVE_STREAM = 2
COLUMNS_PER_POSITION = spec_accept_kernels.COLUMNS_PER_POSITION
# How far from 1 a float32 (or wider) row's sum may be: softmax rows of 128256 tokens sum to 1
# within about 1e-6; this still refuses a filtered row that was not renormalized and lost more
# than 1e-4 of its mass. Narrower dtypes add half their epsilon (rounding each entry to nearest).
ROW_SUM_TOLERANCE = 1e-4


def row_sum_tolerance(dtype) -> float:
    """How far from 1 a row of ``dtype`` may sum: ``ROW_SUM_TOLERANCE + eps(dtype) / 2``.

    Rounding every entry of a distribution to the nearest ``dtype`` value moves each by at most
    half an epsilon of itself, so the sum by at most ``eps / 2``.

    Example:
      >>> f"{row_sum_tolerance(jnp.float32):.6f}", f"{row_sum_tolerance(jnp.bfloat16):.6f}"
      ('0.000100', '0.004006')
    """
    return ROW_SUM_TOLERANCE + float(jnp.finfo(dtype).eps) / 2


# ----------------------------------------------------------------------------------------------
# Input checks


def _check_shapes(
    draft_probs, draft_token_ids, target, target_name: str = "target_probs"
) -> tuple[int, int, int]:
    """``(B, n, V)`` from the inputs' shapes and dtypes (``target`` is ``target_name``)."""
    if getattr(target, "ndim", None) != 3:
        raise ValueError(
            f"{target_name} must have shape [batch, num_drafts + 1, vocab], got "
            f"{getattr(target, 'shape', type(target).__name__)}"
        )
    if not jnp.issubdtype(target.dtype, jnp.floating):
        raise ValueError(f"{target_name} must be a floating array, got {target.dtype}")
    batch, positions, vocab = target.shape
    if positions < 1 or vocab < 1:
        raise ValueError(f"{target_name} needs a position and a token, got shape {target.shape}")
    if getattr(draft_token_ids, "ndim", None) != 2:
        raise ValueError(
            "draft_token_ids must have shape [batch, num_drafts], got "
            f"{getattr(draft_token_ids, 'shape', type(draft_token_ids).__name__)}"
        )
    if not jnp.issubdtype(draft_token_ids.dtype, jnp.integer):
        raise ValueError(f"draft_token_ids must be integers, got {draft_token_ids.dtype}")
    if draft_token_ids.shape != (batch, positions - 1):
        raise ValueError(
            f"draft_token_ids has shape {draft_token_ids.shape} but {target_name} "
            f"{target.shape} needs [{batch}, {positions - 1}] (num_drafts + 1 positions)"
        )
    if draft_probs is not None:
        if getattr(draft_probs, "ndim", None) != 3:
            raise ValueError(
                "draft_probs must be None or have shape [batch, num_drafts, vocab], got "
                f"{getattr(draft_probs, 'shape', type(draft_probs).__name__)}"
            )
        if not jnp.issubdtype(draft_probs.dtype, jnp.floating):
            raise ValueError(f"draft_probs must be a floating array, got {draft_probs.dtype}")
        if draft_probs.shape != (batch, positions - 1, vocab):
            raise ValueError(
                f"draft_probs has shape {draft_probs.shape}, expected "
                f"[{batch}, {positions - 1}, {vocab}] to match {target_name} {target.shape}"
            )
    return batch, positions - 1, vocab


def _first_bad(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(bad)[0])


def check_distribution_rows(name: str, probs: jax.Array) -> None:
    """Concrete ``probs[..., V]``: every row finite, non-negative, summing to 1 within
    ``row_sum_tolerance``; ``ValueError`` naming ``name[index]`` otherwise."""
    if not is_concrete(probs):
        return
    values = np.asarray(probs, np.float64)
    tolerance = row_sum_tolerance(probs.dtype)
    sums = values.sum(axis=-1)
    checks = [
        (np.isnan(values).any(axis=-1), "contains NaN"),
        (np.isinf(values).any(axis=-1), "contains an infinity"),
        ((values < 0).any(axis=-1), "contains a negative probability"),
        (np.abs(sums - 1) > tolerance, None),
    ]
    for bad_rows, what in checks:
        if bad_rows.any():
            index = _first_bad(bad_rows)
            where = f"{name}[{', '.join(map(str, index))}]"
            if what is None:
                raise ValueError(
                    f"{where} sums to {sums[index]:.6g}, not a distribution "
                    f"(|sum - 1| > {tolerance:g}; renormalize filtered rows)"
                )
            raise ValueError(f"{where} {what}: {values[index][:8].tolist()}...")


def _check_token_ids(draft_token_ids, vocab: int) -> None:
    if not is_concrete(draft_token_ids):
        return
    ids = np.asarray(draft_token_ids)
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        index = _first_bad(bad)
        raise ValueError(
            f"draft_token_ids[{index[0]}, {index[1]}]={ids[index]} is outside [0, {vocab})"
        )


def _check_values(draft_probs, draft_token_ids, target_probs, vocab: int) -> None:
    _check_token_ids(draft_token_ids, vocab)
    check_distribution_rows("target_probs", target_probs)
    if draft_probs is None:
        return
    check_distribution_rows("draft_probs", draft_probs)
    if is_concrete(draft_probs, draft_token_ids):
        ids = np.asarray(draft_token_ids)
        drafted = np.take_along_axis(np.asarray(draft_probs), ids[..., None], axis=-1)[..., 0]
        bad = ~(drafted > 0)
        if bad.any():
            b, i = _first_bad(bad)
            raise ValueError(
                f"draft_probs[{b}, {i}, {ids[b, i]}]={drafted[b, i]} for the drafted token "
                f"draft_token_ids[{b}, {i}]={ids[b, i]}: a token the drafter cannot draw "
                "(draft_probs must be the distribution the drafts were sampled from)"
            )


# ----------------------------------------------------------------------------------------------
# Verification


def speculative_uniforms(key, batch: int, num_drafts: int):
    """The step's uniforms from the generator (module docstring, column layout).

    Returns:
      ``(accept float32[B, n], chunk float32[B, n + 1], token float32[B, n + 1])``.
    """
    words = rng.row_keys(key, batch)[:, None, :]
    columns = jnp.arange(COLUMNS_PER_POSITION * (num_drafts + 1))
    bits = rng.random_bits(words, columns[None, :], stream=SPECULATIVE_STREAM)
    uniforms = rng.uniform_open(bits).reshape(batch, num_drafts + 1, COLUMNS_PER_POSITION)
    accept = uniforms[:, :num_drafts, spec_accept_kernels.ACCEPT_COLUMN]
    chunk = uniforms[:, :, spec_accept_kernels.CHUNK_COLUMN]
    token = uniforms[:, :, spec_accept_kernels.TOKEN_COLUMN]
    return accept, chunk, token


def chain_speculative_sampling(
    key,
    draft_probs: jax.Array | None,
    draft_token_ids: jax.Array,
    target_probs: jax.Array,
    *,
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Verifies drafted tokens against the target and emits tokens distributed as the target's.

    Drafts are tested in order; draft ``i`` is accepted with probability
    ``min(1, p_i(t_i) / q_i(t_i))``. At the first rejection a token is drawn from
    ``normalize(max(p_i - q_i, 0))`` (from ``p_i`` where that has no mass); if all ``n`` are
    accepted, a bonus token is drawn from ``p_n``. Fast because it reads only two probabilities
    per test and the two rows at the stopping position (the kernel: ``kernels_pallas/
    spec_accept.py``).

    Invalid input under ``jit`` (not checked there): draft ids are clipped into ``[0, V)``; NaN
    and negative probabilities weigh 0; a drafted token of draft probability 0 is accepted
    whenever its target probability is positive; a target row summing to ``S`` moves the
    emitted token's distribution by at most ``|1 - S|`` in total variation (Theorem 6); a
    stopping position without residual or target mass emits token 0. Emitted tokens are always
    inside ``[0, V)``, on both backends alike.

    Args:
      key: one JAX key or ``B`` keys.
      draft_probs: ``[B, n, V]``, the distributions the drafts were drawn from (after the
        draft's temperature and filters), or None for a deterministic drafter (``q`` one-hot at
        the drafted token). bfloat16 is upcast to float32.
      draft_token_ids: int ``[B, n]`` inside ``[0, V)``.
      target_probs: ``[B, n + 1, V]``: position ``i`` is the target's distribution (at the
        user's temperature and filters) after the prompt and drafts ``0 .. i-1``.
      backend: ``"auto"``, ``"reference"`` or ``"pallas"`` (module docstring).
      Arrays may be given as array-likes (lists, NumPy arrays).

    Returns:
      ``(output_token_ids int32[B, n + 1], num_accepted int32[B])``: the first
      ``num_accepted + 1`` entries of a row are its emitted tokens, the rest ``-1``.

    Raises:
      ValueError: bad shapes or dtypes; concrete token ids outside the vocabulary, rows that are
        not distributions (NaN, infinite, negative, or summing away from 1), a drafted token of
        draft probability 0.
      TypeError: an input that is not an array-like.

    Example:
      >>> p = jnp.array([[[0.5, 0.5], [0.9, 0.1]]])   # B=1, n=1, V=2
      >>> out, accepted = chain_speculative_sampling(jax.random.key(0), p[:, :1], jnp.array([[1]]), p)
      >>> int(accepted[0]), int(out[0, 0])  # q = p: the draft is always accepted
      (1, 1)
    """
    chosen = choose_backend("chain_speculative_sampling", backend, kernel="spec_accept").backend
    if draft_probs is not None:
        draft_probs = validation.as_array("draft_probs", draft_probs)
    draft_token_ids = validation.as_array("draft_token_ids", draft_token_ids)
    target_probs = validation.as_array("target_probs", target_probs)
    batch, num_drafts, vocab = _check_shapes(draft_probs, draft_token_ids, target_probs)
    _check_values(draft_probs, draft_token_ids, target_probs, vocab)
    if batch == 0:  # an empty batch emits nothing (documented and tested)
        return jnp.zeros((0, num_drafts + 1), jnp.int32), jnp.zeros((0,), jnp.int32)
    compute = jnp.promote_types(target_probs.dtype, jnp.float32)
    target_probs = target_probs.astype(compute)
    if draft_probs is not None:
        draft_probs = draft_probs.astype(compute)
    if chosen == "pallas":
        # Two kernel launches and no XLA operation: the kernels clip the token ids and derive a
        # single key's per-row words themselves (``kernels_pallas/spec_accept.py``).
        words = rng.key_words(key)
        if words.ndim != 1:
            words = rng.row_keys(key, batch)  # B keys: their own words (one a row, checked)
        return spec_accept_kernels.chain_speculative_sample(
            draft_probs,
            draft_token_ids.astype(jnp.int32),
            target_probs,
            words,
            chunk_size=DEFAULT_CHUNK_SIZE,
            stream=SPECULATIVE_STREAM,
            interpret=interpret_mode(),
        )
    tokens = jnp.clip(draft_token_ids.astype(jnp.int32), 0, vocab - 1)
    accept, chunk, token = speculative_uniforms(key, batch, num_drafts)
    return reference.chain_speculative_sampling_from_uniforms(
        draft_probs,
        tokens,
        target_probs,
        accept.astype(compute),
        chunk.astype(compute),
        token.astype(compute),
        DEFAULT_CHUNK_SIZE,
    )


def chain_greedy_verify(
    draft_token_ids: jax.Array, target_logits: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Greedy verification (temperature 0): accept drafts while each equals the target's arg
    max (lowest index on ties, as ``sampling.sample_from_logits`` at temperature 0), then emit
    the target's arg max at the first mismatch, or at position ``n`` when all match.

    Invalid input under ``jit`` (not checked there): a NaN logit is masked (as in the greedy
    sampler); a position whose logits are all masked has arg max 0; a draft id outside
    ``[0, V)`` never equals the arg max, so the chain stops there. Emitted tokens are the
    target's arg maxes, always inside ``[0, V)``.

    Args:
      draft_token_ids: int ``[B, n]`` inside ``[0, V)``.
      target_logits: ``[B, n + 1, V]``; ``-inf`` masks a token.

    Returns:
      ``(output_token_ids int32[B, n + 1], num_accepted int32[B])``, ``-1`` past the emitted.

    Raises:
      ValueError: bad shapes; concrete token ids outside the vocabulary, logits with NaN or
        ``+inf``, a position whose logits are all ``-inf``.
      TypeError: an input that is not an array-like.

    Example:
      >>> logits = jnp.log(jnp.array([[[0.1, 0.9], [0.8, 0.2], [0.5, 0.5]]]))
      >>> out, accepted = chain_greedy_verify(jnp.array([[1, 1]]), logits)
      >>> out.tolist(), accepted.tolist()  # draft 1 is not the arg max 0: emit 0 there
      ([[1, 0, -1]], [1])
    """
    draft_token_ids = validation.as_array("draft_token_ids", draft_token_ids)
    target_logits = validation.as_array("target_logits", target_logits)
    _, _, vocab = _check_shapes(None, draft_token_ids, target_logits, "target_logits")
    _check_token_ids(draft_token_ids, vocab)
    if is_concrete(target_logits):
        values = np.asarray(target_logits, np.float64)
        checks = [
            (np.isnan(values).any(axis=-1), "contains NaN"),
            ((values == np.inf).any(axis=-1), "contains +inf"),
            ((values == -np.inf).all(axis=-1), "is entirely -inf (every token masked)"),
        ]
        for bad_rows, what in checks:
            if bad_rows.any():
                b, i = _first_bad(bad_rows)
                raise ValueError(f"target_logits[{b}, {i}] {what}")
    return reference.chain_greedy_verify_reference(draft_token_ids, target_logits)


# ----------------------------------------------------------------------------------------------
# Building p and q so that exactness holds by construction


def sampling_distribution(
    logits: jax.Array,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    order: str = "joint",
) -> jax.Array:
    """The distribution a sampler with these parameters draws from: ``softmax(logits / T)``,
    then the filters' kept set renormalized (``sampling.filters.filtered_distribution``, the
    samplers' own definition); temperature 0 is greedy (one-hot at the lowest-index arg max).

    Use it for both sides of a verification: ``target_probs`` from the target's logits with the
    user's parameters, and ``draft_probs`` from the draft's logits with the parameters the
    draft tokens were sampled with (``sample_draft`` does both at once for the draft).

    Invalid input under ``jit`` (not checked there) reads as the samplers read it, and never
    gives NaN: a NaN logit is a masked token; a row without a finite maximum (every logit
    ``-inf``, or a ``+inf``) is one-hot at its arg max (token 0, or its first ``+inf``): the
    token every sampler returns for it; a NaN or negative temperature is greedy, one above
    ``sampling.validation.MAX_TEMPERATURE`` is that; parameters are clamped into range
    (``sampling.validation.filter_params``).

    Args:
      logits: ``[B, V]`` or ``[B, m, V]`` (e.g. the ``n + 1`` positions of a request), an array
        or array-like; ``-inf`` masks a token. bfloat16 is upcast to float32.
      temperature: scalar or ``[B]``, ``>= 0``.
      top_k: an integer, scalar or ``[B]``, in ``[1, V]``; None disables.
      top_p: scalar or ``[B]`` in ``(0, 1]``; None disables.
      min_p: scalar or ``[B]`` in ``[0, 1]``; None disables.
      order: ``"joint"`` or ``"top_k_first"`` (``sampling/filters.py``).

    Returns:
      float32 (float64 for float64 logits) ``logits.shape``, each row summing to 1.

    Raises:
      ValueError: bad shapes or order; concrete NaN or ``+inf`` logits, an all ``-inf`` row, a
        parameter out of range; a ``top_k`` that is not of an integer dtype.
      TypeError: ``logits`` that is not an array-like.

    Example:
      >>> q = sampling_distribution(jnp.log(jnp.array([[0.5, 0.3, 0.2]])), top_k=2)
      >>> [round(x, 4) for x in q[0].tolist()]
      [0.625, 0.375, 0.0]
    """
    logits = validation.as_array("logits", logits)
    if logits.ndim < 2:
        raise ValueError(f"logits must have shape [batch, ..., vocab], got {jnp.shape(logits)}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    batch, vocab = logits.shape[0], logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    validation.check_rows("logits", rows)
    validation.check_logits_values(rows)
    temperature = validation.temperature_per_row(temperature, batch)
    params = validation.filter_params(batch, vocab, top_k, top_p, min_p)
    per_request = int(np.prod(logits.shape[1:-1], dtype=np.int64))
    compute = jnp.promote_types(logits.dtype, jnp.float32)
    rows = rows.astype(compute)

    def repeat(values):  # one value per request -> one per row (a broadcast, not a gather)
        return jnp.broadcast_to(values[:, None], (batch, per_request)).reshape(-1)

    temperature = repeat(temperature).astype(compute)
    probs = tempered_probs(rows, temperature)
    row_params = FilterParams(*(repeat(value) for value in params))
    kept = jax.vmap(lambda row, row_params: filtered_distribution(row, row_params, order))(
        probs, row_params
    )
    return kept.reshape(logits.shape)


def sample_draft(
    key,
    draft_logits: jax.Array,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    order: str = "joint",
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Draws one draft token per row and returns the distribution it was drawn from.

    ``q = sampling_distribution(draft_logits, ...)``, then a token from ``q`` itself by the
    exponential race (``sampling.sample_from_probs``): the ``q`` handed to verification is, by
    construction, the one the token came from (not the draft's distribution before its filters,
    nor one computed at another precision).

    Errors and invalid input under ``jit``: as ``sampling_distribution`` (so a row without a
    finite logit draws token 0, with ``q`` one-hot there).

    Args:
      key: one JAX key or ``B`` keys (use another key than the verification's).
      draft_logits: ``[B, V]``.
      temperature, top_k, top_p, min_p, order: as ``sampling_distribution``.
      backend: the sampler's backend (``sampling/api.py``).

    Returns:
      ``(tokens int32[B], draft_probs float32[B, V])``.

    Example:
      >>> tokens, q = sample_draft(jax.random.key(1), jnp.array([[0.0, 2.0, -jnp.inf]]), top_k=1)
      >>> tokens.tolist(), q.tolist()
      ([1], [[0.0, 1.0, 0.0]])
    """
    draft_logits = validation.as_array("draft_logits", draft_logits)
    if draft_logits.ndim != 2:
        raise ValueError(
            f"draft_logits must have shape [batch, vocab], got {jnp.shape(draft_logits)}"
        )
    draft_probs = sampling_distribution(
        draft_logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, order=order
    )
    tokens = sampling_api.sample_from_probs(key, draft_probs, backend=backend)
    return tokens, draft_probs
