"""Exact enumeration of chain speculative sampling's output distribution (float64).

One verification step is a function of its uniforms: an accept uniform per draft, and two draw
uniforms (chunk, token) at the stopping position. Each decision is a step function of its
uniform, so the output distribution is a finite sum, computed here without sampling:

- the accept test of a draft accepts exactly the uniforms below a breakpoint ``b`` (the test is
  monotone in ``u``); ``b`` is found by bisection over the float64 bit patterns *on the
  reference's own* ``accepts``, to the exact float, and the reference's ``verify_step`` is asked
  what follows on each side;
- the draw's two levels are walked interval by interval: chunk ``c`` for the first uniform in
  ``[F_{c-1}, F_c)`` of the chunk masses' normalized running sums (the floats the reference
  computes), then token ``j`` inside the chunk likewise; the reference's ``two_level_draw`` is
  asked at each interval's start and must name that token.

Two statements, each within 1e-12 (``proofs/chain_speculative.md``):

- fixed per-position distributions: position ``i``, given that it is reached, emits ``p_i``
  (Theorem 2); the acceptance rate of position ``i`` is ``sum min(p_i, q_i)`` and the expected
  number of emitted tokens ``sum_i prod_{j<i} alpha_j``, which is ``(1 - alpha^(n+1)) /
  (1 - alpha)`` when the positions share one pair (Theorem 4);
- distributions that depend on the tokens so far: the emitted tokens, completed by sampling the
  target autoregressively, have the target's autoregressive probability, for every prefix of
  every length (Theorem 3). This one runs the whole request, ``chain_row_from_uniforms``, at a
  point of every cell of the uniforms and checks the tokens it returns, so the glue (stopping,
  the bonus, the ``-1`` padding) is enumerated too.

Pairs ``(p, q)`` are drawn by hypothesis over 1 to 10 tokens: independent (with zeros, ties,
near one-hot rows, 1e-30 entries), ``q`` with support outside ``p``'s, ``p = q`` (the residual
without mass), disjoint supports, nearly equal, and a deterministic drafter (``q`` one-hot); the
draw's chunk is 1, 2, 4 tokens or the default (one chunk), so both levels are enumerated.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative import reference
from tests.conftest import enable_x64
from tests.strategies import probability_vectors, simplex_points

TOLERANCE = 1e-12
CHUNK_SIZES = (1, 2, 4, reference.DEFAULT_CHUNK_SIZE)
# The prefix-dependent walk visits every prefix of the drafts: V ** n of them. These vocabulary
# bounds keep that under a few hundred (4**4, 6**3, 10**2) while n still runs from 1 to 4.
MAX_VOCAB_FOR_DRAFTS = {1: 10, 2: 10, 3: 6, 4: 4}
_ONE = np.float64(1.0).view(np.int64)


# ----------------------------------------------------------------------------------------------
# Distribution pairs


def _normalized(vector) -> np.ndarray:
    vector = np.asarray(vector, np.float64)
    return vector / vector.sum()


PAIR_KINDS = ("independent", "equal", "q_outside_p", "disjoint", "near", "deterministic")


@st.composite
def distribution_pairs(draw, vocab: int, kind: str | None = None):
    """``(p, q)``, float64 ``[V]`` each, exact distributions (divided by their float64 sum);
    ``q`` is None for a deterministic drafter (the walk makes it one-hot at its drafted token)."""
    kind = kind or draw(st.sampled_from(PAIR_KINDS))
    p = _normalized(draw(probability_vectors(vocab)))
    if kind == "independent":
        return p, _normalized(draw(probability_vectors(vocab)))
    if kind == "equal":
        return p, p.copy()
    if kind == "q_outside_p":  # p has zeros where q (all positive) does not
        zeros = draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab))
        # Keep one token p actually has: all zeros would leave nothing to normalize.
        keep = draw(st.sampled_from(np.flatnonzero(p > 0).tolist()))
        zeros[keep] = False
        p = _normalized(np.where(zeros, 0.0, p))
        return p, _normalized(draw(simplex_points(vocab)))
    if kind == "disjoint" and vocab >= 2:
        split = draw(st.integers(1, vocab - 1))
        order = np.asarray(draw(st.permutations(range(vocab))))
        target_support = np.zeros(vocab, bool)
        target_support[order[:split]] = True
        weights = draw(simplex_points(vocab))
        return (
            _normalized(np.where(target_support, weights, 0.0)),
            _normalized(np.where(target_support, 0.0, weights)),
        )
    if kind == "near":
        scale = draw(st.sampled_from([1e-15, 1e-9, 1e-3]))
        noise = draw(simplex_points(vocab))
        return p, _normalized(p + scale * noise)
    if kind == "deterministic":
        return p, None
    return p, p.copy()  # "disjoint" with one token: the only pair there is


def _drafted_tokens(q: np.ndarray | None, deterministic_token: int) -> list[tuple[int, float]]:
    """``(token, q(token))`` for every token the drafter can propose."""
    if q is None:
        return [(deterministic_token, 1.0)]
    return [(int(t), float(q[t])) for t in np.flatnonzero(q > 0)]


def _draft_row(q: np.ndarray | None, drafted: int, vocab: int) -> np.ndarray:
    return np.eye(vocab)[drafted] if q is None else q


# ----------------------------------------------------------------------------------------------
# Walking the reference's own functions


@functools.cache
def _jitted():
    return dict(
        accepts=jax.jit(reference.accepts),
        verify_step=jax.jit(jax.vmap(reference.verify_step, in_axes=(None, 0, 0, 0))),
        residual_weights=jax.jit(reference.residual_weights),
        chunk_masses=jax.jit(reference.chunk_masses, static_argnums=1),
        chunk_weights=jax.jit(reference.chunk_weights, static_argnums=2),
        two_level_draw=jax.jit(
            jax.vmap(reference.two_level_draw, (None, 0, 0, None)), static_argnums=3
        ),
        row=jax.jit(
            jax.vmap(reference.chain_row_from_uniforms, (0, 0, 0, 0, 0, 0, None)), static_argnums=6
        ),
        deterministic_row=jax.jit(
            jax.vmap(
                lambda t, p, a, c, w, size: reference.chain_row_from_uniforms(
                    None, t, p, a, c, w, size
                ),
                (0, 0, 0, 0, 0, None),
            ),
            static_argnums=5,
        ),
    )


def _bucket(count: int) -> int:
    """Arrays handed to the jitted reference are padded to a power of two (at least 64), so
    hypothesis's examples reuse a few compilations instead of one per length."""
    return max(64, 1 << (max(count, 1) - 1).bit_length())


def _padded(values: np.ndarray, size: int, fill: float) -> np.ndarray:
    out = np.full(size, fill, np.float64)
    out[: values.size] = values
    return out


def first_true(predicate, approx: np.ndarray) -> np.ndarray:
    """For each entry, the first float64 ``u`` in ``[0, 1]`` where ``predicate`` (monotone in
    ``u``: false, then true) holds, or 1.0 where it never does.

    Found by bisection over the bit patterns of non-negative float64s (ordered like the floats),
    starting from a bracket of 64 floats either side of ``approx`` (widened to ``[0, 1]`` where
    that does not bracket): the exact breakpoint of the code ``predicate`` runs, however its
    float operations round.

    Args:
      predicate: float64 ``[k]`` -> bool ``[k]``.
      approx: float64 ``[k]``, a guess of the breakpoints.
    """
    approx = np.clip(np.asarray(approx, np.float64), 0.0, 1.0)
    zero, one = np.zeros_like(approx), np.ones_like(approx)
    at_zero, at_one = predicate(zero), predicate(one)
    bits = approx.view(np.int64)
    low = np.maximum(bits - 64, 0)
    high = np.minimum(bits + 64, _ONE)
    low = np.where(predicate(low.view(np.float64)), 0, low)
    high = np.where(predicate(high.view(np.float64)), high, _ONE)
    while np.any(high - low > 1):
        middle = low + (high - low) // 2
        holds = predicate(middle.view(np.float64))
        low = np.where(holds, low, middle)
        high = np.where(holds, middle, high)
    return np.where(at_zero, 0.0, np.where(at_one, high.view(np.float64), 1.0))


def accept_breakpoints(target_probs: np.ndarray, draft_probs: np.ndarray) -> np.ndarray:
    """float64 like the inputs: for each pair, the length ``b`` of the set of uniforms in
    ``[0, 1)`` that ``reference.accepts`` accepts, which is ``[0, b)`` (the test is monotone).
    The guess ``min(1, p / q)`` only seeds the bracket; ``b`` is the reference's."""
    accepts = _jitted()["accepts"]
    count = target_probs.size
    bucket = _bucket(count)
    p = jnp.asarray(_padded(target_probs.ravel(), bucket, 1.0))
    q = jnp.asarray(_padded(draft_probs.ravel(), bucket, 1.0))

    def rejects(uniforms):
        uniforms = jnp.asarray(_padded(uniforms, bucket, 0.5))
        return ~np.asarray(accepts(p, q, uniforms))[:count]

    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.nan_to_num(target_probs.ravel() / draft_probs.ravel(), nan=0.0, posinf=1.0)
    return first_true(rejects, guess).reshape(target_probs.shape)


def _check_transitions(target_probs, draft_probs, breakpoints) -> None:
    """``verify_step`` from a reached state: a uniform below the breakpoint accepts (one more
    draft, not stopped), one above stops the chain."""
    step = _jitted()["verify_step"]
    start = reference.initial_state()
    inside = breakpoints > 0
    if inside.any():
        after = step(
            start,
            jnp.asarray(target_probs[inside]),
            jnp.asarray(draft_probs[inside]),
            jnp.asarray(breakpoints[inside] / 2),
        )
        assert np.all(np.asarray(after.num_accepted) == 1) and not np.any(after.stopped)
    outside = breakpoints < 1
    if outside.any():
        after = step(
            start,
            jnp.asarray(target_probs[outside]),
            jnp.asarray(draft_probs[outside]),
            jnp.asarray((breakpoints[outside] + 1) / 2),
        )
        assert np.all(np.asarray(after.num_accepted) == 0) and np.all(after.stopped)


def _approximate_boundaries(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, guesses)``: the positive-weight indices after the first, and roughly where
    the uniform starts choosing each (its normalized running sum before it)."""
    weights = np.asarray(weights, np.float64)
    positive = np.flatnonzero(weights > 0)
    running = np.maximum.accumulate(np.cumsum(weights)) / np.sum(weights)
    return positive[1:], running[positive[1:] - 1]


def draw_cells(weights, chunk_size: int):
    """The cells of the reference's two-level draw: ``(token, chunk_point, token_point,
    probability)``. Every breakpoint is the exact one of ``two_level_draw`` itself: for the chunk
    (the token's chunk is monotone in the first uniform), then inside each chunk (the token is
    monotone in the second); each cell's start corner draws the cell's token (checked here).

    The point returned for each cell is its centre, not that corner: callers evaluate it in other
    programs (``chain_row_from_uniforms`` under ``vmap``), where XLA may sum the same weights in
    another order and put a breakpoint one ulp away, which moves a corner into the neighbouring
    cell (seen: uniform weights of 1/6 in chunks of 4 gave token 0 for token 4's corner) but not a
    centre. The probabilities stay those of the exact breakpoints."""
    functions = _jitted()
    weights = jnp.asarray(weights)
    vocab = weights.shape[0]
    chunk = min(chunk_size, vocab)
    masses = np.asarray(functions["chunk_masses"](weights, chunk_size))
    if not masses.sum() > 0:
        return []

    def draw(chunk_uniforms, token_uniforms):
        size = _bucket(len(chunk_uniforms))
        tokens = functions["two_level_draw"](
            weights,
            jnp.asarray(_padded(np.asarray(chunk_uniforms), size, 0.5)),
            jnp.asarray(_padded(np.asarray(token_uniforms), size, 0.5)),
            chunk_size,
        )
        return np.asarray(tokens)[: len(chunk_uniforms)]

    chunks, guesses = _approximate_boundaries(masses)
    starts = first_true(lambda u: draw(u, np.full(len(u), 0.5)) // chunk >= chunks, guesses)
    chunk_starts = np.concatenate([[0.0], starts])
    chunk_ends = np.concatenate([starts, [1.0]])
    positive_chunks = np.flatnonzero(masses > 0)
    # Inside every chunk at once: (chunk start, token boundary) pairs.
    owners, boundaries, guesses = [], [], []
    for index, chosen in enumerate(positive_chunks):
        inside = np.asarray(functions["chunk_weights"](weights, int(chosen), chunk_size))
        tokens, token_guesses = _approximate_boundaries(inside)
        owners += [index] * len(tokens)
        boundaries += (chosen * chunk + tokens).tolist()
        guesses += token_guesses.tolist()
    owners = np.asarray(owners, np.int64)
    token_starts = first_true(
        lambda u: draw(chunk_starts[owners], u) >= np.asarray(boundaries), np.asarray(guesses)
    )
    cells = []
    for index in range(len(positive_chunks)):
        mine = owners == index
        first = draw(chunk_starts[index : index + 1], [0.0])[0]
        starts_here = np.concatenate([[0.0], token_starts[mine]])
        ends_here = np.concatenate([token_starts[mine], [1.0]])
        tokens_here = [first, *np.asarray(boundaries)[mine].tolist()]
        chunk_length = chunk_ends[index] - chunk_starts[index]
        for token, start, end in zip(tokens_here, starts_here, ends_here, strict=True):
            if end > start and chunk_length > 0:
                corner = (chunk_starts[index], start)
                centre = (chunk_starts[index] + chunk_length / 2, (start + end) / 2)
                cells.append((int(token), corner, centre, chunk_length * (end - start)))
    for point in (1, 2):  # both the corner and the centre draw the cell's token here
        drawn = draw([c[point][0] for c in cells], [c[point][1] for c in cells])
        assert drawn.tolist() == [c[0] for c in cells]
    return [(token, *centre, share) for token, _, centre, share in cells]


def draw_distribution(weights: np.ndarray, chunk_size: int) -> np.ndarray:
    """float64 ``[V]``: the exact distribution of ``two_level_draw(weights, u1, u2)``."""
    out = np.zeros(np.shape(weights)[0])
    for token, _, _, probability in draw_cells(weights, chunk_size):
        out[token] += probability
    return out


def position_outcome(p: np.ndarray, q: np.ndarray | None, drafted: int, chunk_size: int):
    """One reached position through the reference's functions: ``(emitted[V], alpha)``, the
    exact distribution of the token the position emits and its probability of acceptance."""
    vocab = p.shape[0]
    drafts = _drafted_tokens(q, drafted)
    tokens = np.array([t for t, _ in drafts])
    weights = np.array([w for _, w in drafts])
    draft_row = _draft_row(q, drafted, vocab)
    breakpoints = accept_breakpoints(p[tokens], draft_row[tokens])
    _check_transitions(p[tokens], draft_row[tokens], breakpoints)
    emitted = np.zeros(vocab)
    np.add.at(emitted, tokens, weights * breakpoints)
    alpha = float(np.sum(weights * breakpoints))
    rejected = float(np.sum(weights * (1 - breakpoints)))
    if rejected > 0:
        residual = np.asarray(_jitted()["residual_weights"](jnp.asarray(p), jnp.asarray(draft_row)))
        emitted += rejected * draw_distribution(residual, chunk_size)
    return emitted, alpha


# ----------------------------------------------------------------------------------------------
# Fixed per-position distributions


@st.composite
def fixed_chains(draw, same_pair: bool = False):
    num_drafts = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 10))
    kind = draw(st.sampled_from(PAIR_KINDS))
    if same_pair:
        pairs = [draw(distribution_pairs(vocab, kind))] * num_drafts
    else:
        pairs = [draw(distribution_pairs(vocab)) for _ in range(num_drafts)]
    drafted = [draw(st.integers(0, vocab - 1)) for _ in range(num_drafts)]
    if same_pair:  # a deterministic drafter's q is its drafted token: the same one everywhere
        drafted = drafted[:1] * num_drafts
    bonus = _normalized(draw(probability_vectors(vocab)))
    return pairs, drafted, bonus, draw(st.sampled_from(CHUNK_SIZES))


@settings(max_examples=40)
@given(fixed_chains())
def test_each_reached_position_emits_its_target_distribution(chain):
    pairs, drafted, bonus, chunk_size = chain
    with enable_x64():
        for (p, q), token in zip(pairs, drafted, strict=True):
            emitted, alpha = position_outcome(p, q, token, chunk_size)
            np.testing.assert_allclose(emitted, p, rtol=0, atol=TOLERANCE)
            q_row = _draft_row(q, token, p.shape[0])
            assert abs(alpha - np.minimum(p, q_row).sum()) < TOLERANCE
        # the bonus position: the residual against no draft, p_n itself
        bonus_weights = _jitted()["residual_weights"](jnp.asarray(bonus), jnp.zeros_like(bonus))
        emitted = draw_distribution(np.asarray(bonus_weights), chunk_size)
        np.testing.assert_allclose(emitted, bonus, rtol=0, atol=TOLERANCE)


@settings(max_examples=25)
@given(fixed_chains(same_pair=True))
def test_expected_emitted_tokens_follow_the_formula(chain):
    """Positions sharing one pair accept at ``alpha = sum min(p, q)`` each (independently: each
    test has its own uniform), so position ``i`` is reached with ``alpha^i`` and the expected
    number of emitted tokens is ``sum_{i<=n} alpha^i``: ``(1 - alpha^(n+1)) / (1 - alpha)``, or
    ``n + 1`` at ``alpha = 1``. The sum is compared, being the same number without the
    cancellation the closed form suffers near ``alpha = 1``."""
    pairs, drafted, _, chunk_size = chain
    num_drafts = len(pairs)
    with enable_x64():
        reached, expected = 1.0, 1.0
        for (p, q), token in zip(pairs, drafted, strict=True):
            _, alpha = position_outcome(p, q, token, chunk_size)
            reached *= alpha
            expected += reached
    p, q = pairs[0]
    alpha = np.minimum(p, _draft_row(q, drafted[0], p.shape[0])).sum()
    formula = sum(alpha**i for i in range(num_drafts + 1))
    assert abs(expected - formula) < TOLERANCE
    if alpha < 1 - 1e-3:  # where the closed form is well conditioned
        closed = (1 - alpha ** (num_drafts + 1)) / (1 - alpha)
        assert abs(expected - closed) < TOLERANCE


def test_a_draft_equal_to_the_target_is_never_rejected():
    """p = q: every uniform below 1 accepts (the residual, which has no mass, is never drawn),
    in float32 as in float64, for probabilities from 1e-30 to 1."""
    values = np.array([1e-30, 1e-7, 0.1, 1 / 3, 0.5, 0.7, 1.0])
    for dtype in (np.float32, np.float64):
        largest_below_one = np.nextafter(dtype(1), dtype(0))
        with enable_x64():
            ok = reference.accepts(values.astype(dtype), values.astype(dtype), largest_below_one)
        assert bool(np.all(np.asarray(ok))), dtype


def test_a_residual_without_mass_draws_the_target_itself():
    """Theorem 1's case: rows that are distributions only up to rounding, ``p <= q`` with
    ``sum(p) < 1 = sum(q)``. A rejection still happens (``p(t) < q(t)``); drawing from ``p``
    makes the output exactly ``p / sum(p)``. The tempting alternative, drawing from ``q``, is
    off by an L1 distance of 0.03 here."""
    p = np.array([0.5, 0.1, 0.2, 0.0])  # sums to 0.8
    q = np.array([0.7, 0.1, 0.2, 0.0])
    with enable_x64():
        emitted, _ = position_outcome(p, q, 0, reference.DEFAULT_CHUNK_SIZE)
        np.testing.assert_allclose(emitted, p / p.sum(), rtol=0, atol=TOLERANCE)
        rejected = 1 - np.minimum(p, q).sum()
        from_q = np.minimum(p, q) + rejected * draw_distribution(q, reference.DEFAULT_CHUNK_SIZE)
        assert np.abs(from_q - p / p.sum()).sum() > 0.02


@settings(max_examples=25)
@given(fixed_chains(), st.floats(0.9, 1.1))
def test_a_target_row_summing_to_s_biases_the_output_by_at_most_its_distance_from_one(chain, s):
    """Theorem 6 (what ``row_sum_tolerance`` accepts): with ``sum(q) = 1`` and ``sum(p) = S``,
    the emitted token is within total variation ``|1 - S|`` of ``p / S``."""
    pairs, drafted, _, chunk_size = chain
    (p, q), token = pairs[0], drafted[0]
    with enable_x64():
        emitted, _ = position_outcome(s * p, q, token, chunk_size)
    distance = 0.5 * np.abs(emitted - p).sum()
    assert distance <= abs(1 - s) + TOLERANCE, (distance, s)


# ----------------------------------------------------------------------------------------------
# Distributions that depend on the tokens so far


@st.composite
def prefix_dependent_chains(draw):
    """A tree: ``p(. | prefix)`` and ``q(. | prefix)`` pick one of three drawn pairs by a hash
    of the prefix's tokens and length (a drawn multiplier), so neighbouring prefixes differ."""
    num_drafts = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, MAX_VOCAB_FOR_DRAFTS[num_drafts]))
    deterministic = draw(st.booleans()) and draw(st.booleans())  # a quarter of the examples
    pairs = []
    for _ in range(3):
        p, q = draw(distribution_pairs(vocab, "deterministic" if deterministic else None))
        if not deterministic and q is None:
            q = p.copy()
        pairs.append((p, q, draw(st.integers(0, vocab - 1))))
    multiplier = draw(st.integers(1, 7))
    return num_drafts, vocab, pairs, multiplier, deterministic, draw(st.sampled_from(CHUNK_SIZES))


def _pair_of(prefix: tuple[int, ...], pairs, multiplier: int):
    index = (len(prefix) + multiplier * sum((i + 1) * (t + 1) for i, t in enumerate(prefix))) % 3
    return pairs[index]


def enumerate_prefix_dependent(chain) -> dict[tuple[int, ...], float]:
    """The exact distribution of the emitted tokens (a tuple of length ``num_accepted + 1``),
    computed by running ``chain_row_from_uniforms`` at a point of every cell of the uniforms."""
    num_drafts, vocab, pairs, multiplier, deterministic, chunk_size = chain
    functions = _jitted()
    leaves = []  # (inputs of the row, expected emitted tokens, probability)

    def filler(prefix):
        """Rows and drafts for positions past the stop: drafts that *would* be accepted, so a
        chain that did not stop at a rejection would emit another sequence."""
        p, q, drafted = _pair_of(prefix, pairs, multiplier)
        token = drafted if q is None else int(np.argmax(np.minimum(p, q) + 1e-300 * (q > 0)))
        return p, _draft_row(q, drafted, vocab), token

    def rows_for(accepted: tuple[int, ...], stop_draft: int | None):
        target = np.zeros((num_drafts + 1, vocab))
        draft = np.zeros((num_drafts, vocab))
        tokens = np.zeros(num_drafts, np.int64)
        accept_uniforms = np.full(num_drafts, 1e-300)  # accepts any draft with p > 0
        for i in range(num_drafts + 1):
            prefix = accepted[:i] if i <= len(accepted) else accepted
            p, q, drafted = _pair_of(prefix, pairs, multiplier)
            target[i] = p
            if i < num_drafts:
                draft[i] = _draft_row(q, drafted, vocab)
                if i < len(accepted):
                    tokens[i] = accepted[i]
                elif i == len(accepted) and stop_draft is not None:
                    tokens[i] = stop_draft
                else:
                    target[i], draft[i], tokens[i] = filler(accepted + (-1,) * (i - len(accepted)))
        return target, draft, tokens, accept_uniforms

    def walk(accepted: tuple[int, ...], probability: float):
        stop = len(accepted)
        p, q, drafted = _pair_of(accepted, pairs, multiplier)
        if stop == num_drafts:  # the bonus draw
            target, draft, tokens, accept_uniforms = rows_for(accepted, None)
            for i, token in enumerate(accepted):
                accept_uniforms[i] = leaf_uniform[(accepted[:i], token)]
            for token, chunk_point, token_point, share in draw_cells(p, chunk_size):
                leaves.append(
                    (
                        target,
                        draft,
                        tokens,
                        accept_uniforms,
                        stop,
                        chunk_point,
                        token_point,
                        (*accepted, token),
                        probability * share,
                    )
                )
            return
        q_row = _draft_row(q, drafted, vocab)
        drafts = _drafted_tokens(q, drafted)
        tokens_here = np.array([t for t, _ in drafts])
        breakpoints = accept_breakpoints(p[tokens_here], q_row[tokens_here])
        residual = np.asarray(functions["residual_weights"](jnp.asarray(p), jnp.asarray(q_row)))
        cells = None
        for (token, weight), breakpoint in zip(drafts, breakpoints, strict=True):
            if breakpoint > 0:
                leaf_uniform[(accepted, token)] = breakpoint / 2
                walk((*accepted, token), probability * weight * breakpoint)
            if breakpoint < 1:
                cells = cells if cells is not None else draw_cells(residual, chunk_size)
                target, draft, tokens, accept_uniforms = rows_for(accepted, token)
                for i, earlier in enumerate(accepted):
                    accept_uniforms[i] = leaf_uniform[(accepted[:i], earlier)]
                accept_uniforms[stop] = (breakpoint + 1) / 2
                for drawn, chunk_point, token_point, share in cells:
                    leaves.append(
                        (
                            target,
                            draft,
                            tokens,
                            accept_uniforms,
                            stop,
                            chunk_point,
                            token_point,
                            (*accepted, drawn),
                            probability * weight * (1 - breakpoint) * share,
                        )
                    )

    leaf_uniform: dict = {}
    walk((), 1.0)
    count = len(leaves)
    size = _bucket(count)

    def stacked(index, dtype=np.float64):
        values = np.stack([leaf[index] for leaf in leaves])
        return np.concatenate([values, np.repeat(values[:1], size - count, axis=0)]).astype(dtype)

    stops = np.array([leaf[4] for leaf in leaves])
    chunk_uniforms = np.full((size, num_drafts + 1), 0.5)
    token_uniforms = np.full((size, num_drafts + 1), 0.5)
    chunk_uniforms[np.arange(count), stops] = [leaf[5] for leaf in leaves]
    token_uniforms[np.arange(count), stops] = [leaf[6] for leaf in leaves]
    arguments = (
        jnp.asarray(stacked(2, np.int32)),
        jnp.asarray(stacked(0)),
        jnp.asarray(stacked(3)),
        jnp.asarray(chunk_uniforms),
        jnp.asarray(token_uniforms),
    )
    if deterministic:
        out, accepted = functions["deterministic_row"](*arguments, chunk_size)
    else:
        out, accepted = functions["row"](jnp.asarray(stacked(1)), *arguments, chunk_size)
    out, accepted = np.asarray(out)[:count], np.asarray(accepted)[:count]
    distribution: dict[tuple[int, ...], float] = {}
    for row, leaf, num_accepted in zip(out, leaves, accepted, strict=True):
        emitted = leaf[7]
        assert num_accepted == len(emitted) - 1
        assert row.tolist() == list(emitted) + [-1] * (num_drafts + 1 - len(emitted))
        distribution[emitted] = distribution.get(emitted, 0.0) + leaf[8]
    return distribution


@settings(max_examples=30)
@given(prefix_dependent_chains())
def test_every_emitted_prefix_has_the_targets_autoregressive_probability(chain):
    num_drafts, vocab, pairs, multiplier, _, _ = chain
    with enable_x64():
        emitted = enumerate_prefix_dependent(chain)
    assert abs(sum(emitted.values()) - 1) < TOLERANCE

    @functools.cache
    def target(prefix: tuple[int, ...], start: int = 0) -> float:
        """The target's autoregressive probability of ``prefix[start:]`` after
        ``prefix[:start]``."""
        if len(prefix) == start:
            return 1.0
        p, _, _ = _pair_of(prefix[:-1], pairs, multiplier)
        return target(prefix[:-1], start) * p[prefix[-1]]

    # Z: the emitted tokens, completed by sampling the target after them. Z starts with y when
    # the emitted sequence is longer than y and starts with y, or is a prefix e of y and the
    # continuation draws the rest of y (probability target(y, len(e))).
    longer: dict[tuple[int, ...], float] = {}
    for sequence, probability in emitted.items():
        for length in range(1, len(sequence)):
            longer[sequence[:length]] = longer.get(sequence[:length], 0.0) + probability
    for length in range(1, num_drafts + 2):
        for prefix in itertools.product(range(vocab), repeat=length):
            completed = longer.get(prefix, 0.0)
            for cut in range(1, length + 1):
                if prefix[:cut] in emitted:
                    completed += emitted[prefix[:cut]] * target(prefix, cut)
            assert abs(completed - target(prefix)) < TOLERANCE, (prefix, completed)
