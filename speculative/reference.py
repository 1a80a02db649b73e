"""Reference chain speculative sampling with explicit randomness: plain JAX, checked line by line.

One verification step of one request. A drafter proposed ``n`` tokens ``t_0 .. t_{n-1}``, draft
``i`` sampled from ``q_i``; the target model scored every prefix, giving ``p_0 .. p_n`` (``p_i``
the target's distribution for position ``i`` given the prompt and ``t_0 .. t_{i-1}``). Then:

1. drafts are tested in order; draft ``i`` is accepted when ``u_i * q_i(t_i) < p_i(t_i)``, with
   ``u_i`` uniform on (0, 1): probability ``min(1, p_i(t_i) / q_i(t_i))`` (``accepts``);
2. at the first rejection, position ``s``, a token is drawn from the residual
   ``normalize(max(p_s - q_s, 0))`` (``residual_weights``), and the step ends;
3. if every draft is accepted (``s = n``), a bonus token is drawn from ``p_n``. This is the same
   draw as step 2 with an empty draft (``q_n = 0``, whose residual is ``p_n`` itself), so one
   function serves both.

The step emits ``t_0 .. t_{s-1}`` and the drawn token: ``s + 1`` tokens, distributed exactly as
``s + 1`` tokens of autoregressive sampling from the target (``proofs/chain_speculative.md``).

**A residual with no mass.** ``max(p - q, 0)`` is zero everywhere only where ``p <= q``
everywhere; for two distributions that means ``p = q``, and then no draft is ever rejected
(``u * q(t) < q(t)`` for every ``u < 1``, in float32 too where ``q(t)`` is a normal float;
a subnormal ``q(t)``, below ``1.2e-38``, can round the product up to it). Rows that are
distributions only up to rounding can still reach it (``p(t)`` an ulp below ``q(t)``). The draw then takes ``p`` itself:
Theorem 1 of the proof shows that this choice makes the step's output exactly ``p / sum(p)``
whenever ``sum(q) = 1`` and ``p <= q``, where a "draw from the zero vector" has no meaning at all.

**The draw: two-level inverse transform.** A token is drawn from non-negative weights ``w[V]``
with two independent uniforms: the vocabulary is cut into chunks of ``chunk_size`` tokens (the
last one shorter); the first uniform picks a chunk in proportion to its mass
(``chunk_masses``), the second a token inside that chunk in proportion to its weight. Token ``x``
of chunk ``c`` comes out with probability ``(M_c / M) (w_x / M_c) = w_x / M``. Why two levels
rather than one: a float32 uniform has 23 random bits, so one inverse transform over 128K tokens
cannot resolve probabilities below about ``1.2e-7`` of the row (``proofs/sampling.md``, §4); two
levels resolve each level separately. And the chunk level lets a kernel split a row across
programs that need to exchange only one mass and one candidate token each
(``kernels_pallas/spec_accept.py``). ``chunk_size`` is part of the draw's definition: the kernel
and this reference must use the same one to pick the same tokens.

Each piece is a function of its uniforms, exposed for the exact enumeration of
``tests/test_speculative_exact.py``: ``accepts`` and the state transition ``verify_step``,
``residual_weights``, ``chunk_masses`` / ``chunk_weights`` / ``two_level_draw``, and the row
``chain_row_from_uniforms`` built from them. Computation follows the input dtype (float64 in
the exact tests).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sampling.reference import inverse_transform

# Tokens per chunk of the two-level draw. Part of the definition of the draw (module docstring):
# changing it changes sampled tokens. 16 chunks at vocab 128256.
DEFAULT_CHUNK_SIZE = 8192


# ----------------------------------------------------------------------------------------------
# Accept tests


def accepts(target_prob, draft_prob, uniform) -> jax.Array:
    """bool: is a draft accepted? ``uniform * q(t) < p(t)``.

    For ``uniform`` uniform on (0, 1) and ``q(t) > 0`` this holds with probability
    ``min(1, p(t) / q(t))``, computed without a division (no overflow, no 0 / 0). The set of
    uniforms that accept is an interval ``(0, b)``: the product is monotone in ``uniform``,
    rounding included, which is what lets the exact test find ``b`` by bisection. A NaN
    probability never accepts.

    Args:
      target_prob: ``p(t)``, any shape.
      draft_prob: ``q(t)``, broadcastable.
      uniform: in (0, 1), broadcastable.
    """
    return uniform * draft_prob < target_prob


class ChainState(NamedTuple):
    """Where one request's verification stands.

    Attributes:
      num_accepted: int32, drafts accepted so far.
      stopped: bool, a draft was rejected; no later draft is tested.
    """

    num_accepted: jax.Array
    stopped: jax.Array


def initial_state() -> ChainState:
    """Nothing tested yet."""
    return ChainState(num_accepted=jnp.zeros((), jnp.int32), stopped=jnp.zeros((), bool))


def verify_step(state: ChainState, target_prob, draft_prob, uniform) -> ChainState:
    """The transition of one draft's test: accepted drafts count, the first rejection stops the
    chain, and a stopped chain is left unchanged.

    Args:
      state: before the test.
      target_prob, draft_prob: ``p_i(t_i)`` and ``q_i(t_i)`` of the draft under test.
      uniform: its uniform in (0, 1).
    """
    passed = ~state.stopped & accepts(target_prob, draft_prob, uniform)
    return ChainState(
        num_accepted=state.num_accepted + passed.astype(jnp.int32),
        stopped=state.stopped | ~passed,
    )


# ----------------------------------------------------------------------------------------------
# The draw at the stopping position


def residual_weights(target_row: jax.Array, draft_row: jax.Array) -> jax.Array:
    """``[V]``: the weights of the token drawn where the chain stops.

    ``max(p - q, 0)`` (unnormalized: the draw normalizes); where that has no positive mass, ``p``
    itself (module docstring, and Theorem 1 of the proof). With ``q = 0`` (no draft: the bonus
    position) this is ``p``. Negative and NaN entries (bad input only ``jit`` lets through)
    weigh 0.

    Args:
      target_row: ``p``, ``[V]``.
      draft_row: ``q``, ``[V]``.
    """
    difference = target_row - draft_row
    residual = jnp.where(difference > 0, difference, 0)
    target = jnp.where(target_row > 0, target_row, 0)
    return jnp.where(jnp.sum(residual) > 0, residual, target)


def _chunking(vocab: int, chunk_size: int) -> tuple[int, int]:
    """``(chunk, num_chunks)``: a row no longer than ``chunk_size`` is one chunk of its own
    length (no padding)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunk = min(chunk_size, vocab)
    return chunk, -(-vocab // chunk)


def _chunked(weights: jax.Array, chunk_size: int) -> jax.Array:
    """``[C, chunk]``: ``weights[V]`` cut into chunks, the last padded with zeros."""
    vocab = weights.shape[-1]
    chunk, num_chunks = _chunking(vocab, chunk_size)
    padded = jnp.pad(weights, (0, chunk * num_chunks - vocab))
    return padded.reshape(num_chunks, chunk)


def chunk_masses(weights: jax.Array, chunk_size: int = DEFAULT_CHUNK_SIZE) -> jax.Array:
    """``[C]``: the mass of each chunk of ``weights[V]``, ``C = ceil(V / chunk_size)``."""
    return jnp.sum(_chunked(weights, chunk_size), axis=-1)


def chunk_weights(weights: jax.Array, chunk, chunk_size: int = DEFAULT_CHUNK_SIZE) -> jax.Array:
    """``[chunk]``: the weights of chunk ``chunk`` (past the row's end: zeros)."""
    return _chunked(weights, chunk_size)[chunk]


def two_level_draw(
    weights: jax.Array, chunk_uniform, token_uniform, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> jax.Array:
    """int32: a token drawn from ``weights[V]`` by the two-level inverse transform.

    The chunk is ``inverse_transform(chunk_masses, chunk_uniform)``, the token inside it
    ``inverse_transform(chunk_weights, token_uniform)`` (``sampling.reference``: running
    maximum of the running sums, never a token of zero weight while the row has mass). A row
    with no positive weight (bad input under ``jit``) gives token 0.

    Example:
      >>> w = jnp.array([1.0, 0.0, 3.0, 4.0])
      >>> # chunks [1, 0] and [3, 4]; 0.5 of the mass 8 falls in chunk 1; 0.5 of its 7 on token 3
      >>> int(two_level_draw(w, 0.5, 0.5, chunk_size=2))
      3
    """
    vocab = weights.shape[-1]
    chunk, _ = _chunking(vocab, chunk_size)
    chosen = inverse_transform(chunk_masses(weights, chunk_size), chunk_uniform)
    within = inverse_transform(chunk_weights(weights, chosen, chunk_size), token_uniform)
    return jnp.minimum(chosen * chunk + within, vocab - 1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# One request, and a batch


def chain_row_from_uniforms(
    draft_probs: jax.Array | None,
    draft_token_ids: jax.Array,
    target_probs: jax.Array,
    accept_uniforms: jax.Array,
    chunk_uniforms: jax.Array,
    token_uniforms: jax.Array,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """One request's verification step with explicit uniforms.

    Reads only what the step needs: ``p_i(t_i)`` and ``q_i(t_i)`` for the tests, then the two
    rows at the stopping position.

    Args:
      draft_probs: ``q``, ``[n, V]``, or None for a deterministic drafter (``q_i`` one-hot at
        ``t_i``).
      draft_token_ids: ``t``, int ``[n]``, inside ``[0, V)``.
      target_probs: ``p``, ``[n + 1, V]``.
      accept_uniforms: ``[n]`` in (0, 1), one per draft's test.
      chunk_uniforms, token_uniforms: ``[n + 1]`` in (0, 1): the two uniforms of the draw at
        each position that can be the stopping one (the last for the bonus token).
      chunk_size: the chunk of the two-level draw.

    Returns:
      ``(tokens int32[n + 1], num_accepted int32)``: ``t_0 .. t_{s-1}``, the drawn token at
      ``s = num_accepted``, then ``-1``.
    """
    num_drafts = draft_token_ids.shape[-1]
    vocab = target_probs.shape[-1]
    tokens = draft_token_ids.astype(jnp.int32)
    state = initial_state()
    for i in range(num_drafts):
        draft_prob = 1.0 if draft_probs is None else draft_probs[i, tokens[i]]
        state = verify_step(state, target_probs[i, tokens[i]], draft_prob, accept_uniforms[i])
    stop = state.num_accepted
    # The draft row at the stopping position; at the bonus position (stop == n) there is none.
    has_draft = stop < num_drafts
    last = jnp.maximum(num_drafts - 1, 0)
    stop_draft = jnp.minimum(stop, last)
    if draft_probs is None:
        draft_token = tokens[stop_draft] if num_drafts else 0
        draft_row = jax.nn.one_hot(draft_token, vocab, dtype=target_probs.dtype)
    else:
        draft_row = draft_probs[stop_draft] if num_drafts else jnp.zeros_like(target_probs[0])
    draft_row = jnp.where(has_draft, draft_row, 0)
    weights = residual_weights(target_probs[stop], draft_row)
    drawn = two_level_draw(weights, chunk_uniforms[stop], token_uniforms[stop], chunk_size)
    positions = jnp.arange(num_drafts + 1)
    padded_drafts = jnp.concatenate([tokens, jnp.full((1,), -1, jnp.int32)])
    out = jnp.where(positions < stop, padded_drafts, -1)
    out = jnp.where(positions == stop, drawn, out)
    return out.astype(jnp.int32), stop.astype(jnp.int32)


def chain_speculative_sampling_from_uniforms(
    draft_probs: jax.Array | None,
    draft_token_ids: jax.Array,
    target_probs: jax.Array,
    accept_uniforms: jax.Array,
    chunk_uniforms: jax.Array,
    token_uniforms: jax.Array,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """Chain speculative sampling of a batch with explicit uniforms (no input checks).

    Args:
      draft_probs: ``[B, n, V]`` or None (deterministic drafter).
      draft_token_ids: int ``[B, n]``.
      target_probs: ``[B, n + 1, V]``.
      accept_uniforms: ``[B, n]``.
      chunk_uniforms, token_uniforms: ``[B, n + 1]``.
      chunk_size: the chunk of the two-level draw.

    Returns:
      ``(output_token_ids int32[B, n + 1], num_accepted int32[B])``.

    Example:
      >>> p = jnp.array([[[0.5, 0.5], [0.9, 0.1]]])   # B=1, n=1, V=2
      >>> q = jnp.array([[[0.2, 0.8]]])
      >>> t = jnp.array([[1]])                        # accepted iff u * 0.8 < 0.5
      >>> half = jnp.array([[0.5, 0.5]])
      >>> out, accepted = chain_speculative_sampling_from_uniforms(
      ...     q, t, p, jnp.array([[0.9]]), half, half)
      >>> out.tolist(), accepted.tolist()  # rejected: residual [0.3, 0] gives token 0
      ([[0, -1]], [0])
    """
    if draft_probs is None:
        return jax.vmap(
            lambda t, p, a, c, w: chain_row_from_uniforms(None, t, p, a, c, w, chunk_size)
        )(draft_token_ids, target_probs, accept_uniforms, chunk_uniforms, token_uniforms)
    return jax.vmap(lambda q, t, p, a, c, w: chain_row_from_uniforms(q, t, p, a, c, w, chunk_size))(
        draft_probs, draft_token_ids, target_probs, accept_uniforms, chunk_uniforms, token_uniforms
    )


def chain_greedy_verify_reference(
    draft_token_ids: jax.Array, target_logits: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Greedy verification (temperature 0): accept while a draft equals the target's arg max
    (lowest index on ties), then emit the arg max at the first mismatch (or the bonus position).

    Args:
      draft_token_ids: int ``[B, n]``.
      target_logits: ``[B, n + 1, V]``.

    Returns:
      ``(output_token_ids int32[B, n + 1], num_accepted int32[B])``, ``-1`` past the emitted.
    """
    num_drafts = draft_token_ids.shape[-1]
    # A NaN logit (bad input only jit lets through) is masked, as in the greedy sampler.
    logits = jnp.where(jnp.isnan(target_logits), -jnp.inf, target_logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, n + 1]
    matches = draft_token_ids.astype(jnp.int32) == greedy[:, :num_drafts]
    num_accepted = jnp.sum(jnp.cumprod(matches, axis=-1), axis=-1).astype(jnp.int32)
    emitted = jnp.arange(num_drafts + 1)[None, :] <= num_accepted[:, None]
    return jnp.where(emitted, greedy, -1).astype(jnp.int32), num_accepted
