"""Each draft position and each step of the engine draws its own random stream.

A speculative step drafts ``n`` tokens, each with its own key, then verifies them with the step's
key. An engine that derived every draft position's key alike (one ``fold_in`` for all of them)
would draft the second token with the first one's random numbers: with a draft distribution
that does not depend on the previous token the second draft equals the first every time. The
first-two-tokens test of ``tests/test_engine.py`` let that through (its trained draft depends on
the previous token, so there the second draft is no copy of the first; the skew stayed under
that test's bound). Two kinds of test here:

- Keys: spies on ``speculative.sample_draft`` and ``speculative.chain_speculative_sampling``
  (called by the engine through the ``speculative`` module) send the keys a decode step hands
  them to the host (``jax.debug.callback``). Every draft position of every step of every
  request has its own key; the keys do not depend on the slot; and they are the module
  docstring's derivation (``serving/keys.py``, used by ``serving/programs.py``): ``fold_in(fold_in(request key, tokens
  generated), position + 1)``, verification ``fold_in(request key, tokens generated)``.
- Two drafts: draft and target models whose distributions ignore the context (every embedding
  row equal, every layer's weights zero), a 4-token vocabulary, two drafts a step. The first
  two emitted tokens must follow the target's joint distribution ``p x p`` (calibrated bound,
  ``ALPHA = 1e-6``). Under the reuse the emitted pair's distribution is off by an L1 distance
  of about 0.96 (computed exactly below), six times the bound (0.16).

Shown to fail, each planted in the engine alone (then ``serving/engine.py``, now
``serving/programs.py``): every draft position keyed ``fold_in(step key, 1)`` (the position test: positions 0 and 1 of step 0 share a key; the
derivation test; the two-draft test: L1 distance 0.98 against the bound 0.16); step keys that
ignore the generated count (the position test: step 0 and step 1 share a key; the derivation
test; the two-draft test: 0.26); draft keys folded with the slot (the slot test; the
derivation test).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sampling
import speculative
from serving.engine import Engine
from serving.keys import request_key_data
from serving.model import ModelConfig, forward_dense, param_shapes
from serving.requests import Request, SamplingParams
from tests.test_sampling_api import assert_distributed_as

VOCAB = 4
CONFIG = ModelConfig(
    vocab_size=VOCAB,
    hidden=8,
    num_layers=1,
    num_q_heads=1,
    num_kv_heads=1,
    head_dim=8,
    intermediate=8,
)
# Context-free distributions: the target's p and the draft's q at temperature 1. q differs from
# p (the draft is rejected about 20% of the time, so residual draws happen) and no token is
# rare, so the reuse moves probability onto the diagonal of every row of the pair table.
TARGET_PROBS = (0.4, 0.3, 0.2, 0.1)
DRAFT_PROBS = (0.25, 0.25, 0.25, 0.25)
PAGE_SIZE = 8


def _context_free_model(probs) -> tuple[ModelConfig, dict]:
    """A model whose next-token logits are ``log(probs)`` (up to the final norm's rounding)
    after any context: every embedding row is the same vector of ones, every layer's weights
    are zero (norms one), so attention and MLP add nothing to the residual stream, and the head
    maps that vector to the logits."""
    is_shape = lambda node: isinstance(node, tuple) and all(isinstance(n, int) for n in node)
    params = jax.tree.map(
        lambda shape: (jnp.ones if len(shape) == 1 else jnp.zeros)(shape, jnp.float32),
        param_shapes(CONFIG),
        is_leaf=is_shape,
    )
    params["embed"] = jnp.ones_like(params["embed"])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))
    params["lm_head"] = jnp.outer(jnp.full((CONFIG.hidden,), 1 / CONFIG.hidden), logits)
    return CONFIG, params


@pytest.fixture(scope="module")
def context_free_pair():
    return _context_free_model(TARGET_PROBS), _context_free_model(DRAFT_PROBS)


@functools.partial(jax.jit, static_argnames="config")
def _next_token_distribution(params, config, contexts):
    logits = forward_dense(params, config, contexts, backend="reference")[:, -1]
    return speculative.sampling_distribution(logits)


def _next_token_probs(model, contexts) -> np.ndarray:
    """float64[C, V]: the model's temperature-1 next-token distribution after each context."""
    config, params = model
    probs = _next_token_distribution(params, config, jnp.asarray(contexts, jnp.int32))
    return np.asarray(probs, np.float64)


def test_the_context_free_models_ignore_their_context(context_free_pair):
    """The premise of the two-draft test: the same next-token distribution after every
    context (within float32 rounding), the one asked for."""
    contexts = [[0, 0, 0], [1, 2, 3], [3, 3, 1], [2, 0, 1]]
    for model, probs in zip(context_free_pair, (TARGET_PROBS, DRAFT_PROBS), strict=True):
        got = _next_token_probs(model, contexts)
        np.testing.assert_allclose(got, np.broadcast_to(probs, got.shape), rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Keys: every draft position and every step its own, a function of the request alone

NUM_DRAFTS = 3
KEY_SEEDS = (11, 12, 13, 14)  # one request each, all decoding in every recorded step
KEY_STEPS = 3


@dataclasses.dataclass(frozen=True)
class StepKeys:
    """The keys one decode step handed to the samplers (``jax.random.key_data`` words).

    Attributes:
      draft: uint32[B, n, 2], row ``b``'s key for draft position ``j`` (``sample_draft``).
      verify: uint32[B, 2], row ``b``'s key for the verification (``chain_speculative_sampling``).
      generated: per request, the tokens it had generated before the step.
    """

    draft: np.ndarray
    verify: np.ndarray
    generated: dict[Hashable, int]


# Where the spies' callbacks put the keys while ``_record_keys`` runs (None otherwise). The
# compiled decode program keeps the callbacks it was traced with, so they write to whatever
# list is current when it runs: the second recording reuses the first one's program.
_KEY_SINK: list[tuple[str, np.ndarray]] | None = None


def _record_key(kind: str, key_data) -> None:
    if _KEY_SINK is not None:
        _KEY_SINK.append((kind, np.asarray(key_data)))


def _record_keys(pair, seeds, num_steps: int) -> list[StepKeys]:
    """Runs ``num_steps`` engine steps of one request per seed (one-token prompts, so no
    prefill: every slot decodes from the first step) and records the samplers' keys. Slots are
    given in submission order (the scheduler hands out the lowest free slot first).

    The spies wrap ``speculative.sample_draft`` and ``speculative.chain_speculative_sampling``
    and send each key to the host with an ordered ``jax.debug.callback`` (inside the jitted
    decode program the keys are tracers). They must be in place when the program is traced:
    no other test runs this module's model with these shapes, and a program traced without
    them fails the count below rather than passing silently."""
    global _KEY_SINK
    target, draft = pair
    engine = Engine(
        target,
        draft,
        num_pages=len(seeds) * 4 + 1,
        page_size=PAGE_SIZE,
        parallel=len(seeds),
        num_speculative=NUM_DRAFTS,
        backend="reference",
    )
    real_sample_draft = speculative.sample_draft
    real_verify = speculative.chain_speculative_sampling

    def sample_draft_spy(key, *args, **kwargs):
        jax.debug.callback(
            functools.partial(_record_key, "draft"), jax.random.key_data(key), ordered=True
        )
        return real_sample_draft(key, *args, **kwargs)

    def verify_spy(key, *args, **kwargs):
        jax.debug.callback(
            functools.partial(_record_key, "verify"), jax.random.key_data(key), ordered=True
        )
        return real_verify(key, *args, **kwargs)

    generated = {seed: 0 for seed in seeds}
    steps = []
    _KEY_SINK = []
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(speculative, "sample_draft", sample_draft_spy)
            patch.setattr(speculative, "chain_speculative_sampling", verify_spy)
            for seed in seeds:
                params = SamplingParams(temperature=1.0, max_tokens=16, seed=seed)
                engine.submit(Request(seed, [seed % VOCAB], params))
            for _ in range(num_steps):
                _KEY_SINK.clear()
                output = engine.step()
                jax.effects_barrier()  # every callback of the step has run
                assert output.stats.num_decode_rows == len(seeds), "every slot decodes every step"
                kinds = [kind for kind, _ in _KEY_SINK]
                assert kinds == ["draft"] * NUM_DRAFTS + ["verify"], (
                    "the engine must call speculative.sample_draft once a draft position, then "
                    "speculative.chain_speculative_sampling, through the module (so the spies "
                    f"see them); the step called {kinds}"
                )
                keys = [key_data for _, key_data in _KEY_SINK]
                steps.append(StepKeys(np.stack(keys[:-1], axis=1), keys[-1], dict(generated)))
                for request_id, tokens in output.new_token_ids.items():
                    generated[request_id] += len(tokens)
    finally:
        _KEY_SINK = None
    return steps


@pytest.fixture(scope="module")
def recorded_keys(context_free_pair) -> list[StepKeys]:
    return _record_keys(context_free_pair, KEY_SEEDS, KEY_STEPS)


def _first_repeat(keys: np.ndarray, labels: list[str]) -> str | None:
    """The labels of the first two equal keys among ``keys`` (uint32[K, 2]), or None."""
    seen: dict[tuple[int, int], str] = {}
    for key, label in zip(map(tuple, keys.tolist()), labels, strict=True):
        if key in seen:
            return f"{seen[key]} and {label} share key {key}"
        seen[key] = label
    return None


def test_each_draft_position_and_each_step_draws_its_own_key(recorded_keys):
    """Over the recorded steps of four requests (distinct seeds), the draft keys of every
    (step, slot, position) are pairwise distinct: positions of one step, and successive steps
    of one request, never share a stream. So are the verification keys of every (step,
    slot)."""
    draft_labels = [
        f"step {s} slot {b} position {j}"
        for s, step in enumerate(recorded_keys)
        for b in range(step.draft.shape[0])
        for j in range(NUM_DRAFTS)
    ]
    drafts = np.concatenate([step.draft.reshape(-1, 2) for step in recorded_keys])
    repeat = _first_repeat(drafts, draft_labels)
    assert repeat is None, repeat
    verify_labels = [
        f"step {s} slot {b}" for s, step in enumerate(recorded_keys) for b in range(len(KEY_SEEDS))
    ]
    verifies = np.concatenate([step.verify for step in recorded_keys])
    repeat = _first_repeat(verifies, verify_labels)
    assert repeat is None, repeat


def _rows(step: StepKeys) -> list[tuple[int, ...]]:
    """A step's keys row by row (verification key, then the draft keys in position order),
    sorted: what the step drew, whatever the slots."""
    rows = np.concatenate([step.verify, step.draft.reshape(step.draft.shape[0], -1)], axis=1)
    return sorted(map(tuple, rows.tolist()))


def test_keys_do_not_depend_on_the_slot(context_free_pair, recorded_keys):
    """The same requests submitted in the opposite order sit in the opposite slots; step by
    step, the same keys are drawn (each request's tokens, hence its generated count, are its
    own, so each request is at the same point of its stream in both runs)."""
    reversed_run = _record_keys(context_free_pair, KEY_SEEDS[::-1], KEY_STEPS)
    first, moved = recorded_keys[0].verify, reversed_run[0].verify
    assert not np.array_equal(first, moved), "the requests did not change slots: test nothing"
    for index, (forward, backward) in enumerate(zip(recorded_keys, reversed_run, strict=True)):
        assert forward.generated == backward.generated, f"step {index}: tokens differ by slot"
        assert _rows(forward) == _rows(backward), f"step {index}: keys differ by slot"


def _documented_keys(seed: int, generated: int) -> tuple[int, ...]:
    """The module docstring's derivation (``serving/keys.py``, used by ``serving/programs.py``): the verification key
    ``fold_in(key(seed), generated)`` and draft ``j``'s ``fold_in(that, j + 1)``, as one row of
    key words like ``_rows``'."""
    step_key = jax.random.fold_in(jax.random.key(seed), generated)
    keys = [step_key] + [jax.random.fold_in(step_key, j + 1) for j in range(NUM_DRAFTS)]
    return tuple(int(word) for key in keys for word in np.asarray(jax.random.key_data(key)))


def test_keys_follow_the_documented_derivation(recorded_keys):
    """Each row's keys are the documented function of its request key, the tokens it has
    generated and the draft position (and of nothing else): a change here changes every
    sampled token, a contract change to announce."""
    for index, step in enumerate(recorded_keys):
        expected = sorted(_documented_keys(seed, step.generated[seed]) for seed in KEY_SEEDS)
        assert _rows(step) == expected, f"step {index}: keys differ from the documented ones"


# ----------------------------------------------------------------------------------------------
# Two drafts a step: the emitted pair follows the target's joint distribution

NUM_PAIRS = 2048
PAIR_PARALLEL = 64


def _pair_joint_under_draft_reuse(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """float64[V, V]: the first two emitted tokens' distribution when both drafts of a step
    are one draw ``x ~ q`` (the reuse), with context-free ``p`` and ``q`` and two drafts.

    Accepted (probability ``q(x) a(x)``, ``a = min(1, p / q)``): token 1 is ``x``; the second
    draft, ``x`` again, is accepted with probability ``a(x)``, else token 2 is a residual draw
    ``r = normalize(max(p - q, 0))``. Rejected: token 1 is a residual draw and token 2 the next
    step's first token, correctly distributed as ``p``."""
    accept = np.minimum(1.0, p / q)
    residual = np.maximum(p - q, 0.0)
    residual /= residual.sum()
    joint = (q * accept)[:, None] * (
        accept[:, None] * np.eye(p.size) + (1 - accept)[:, None] * residual[None, :]
    )
    return joint + (1 - np.sum(q * accept)) * np.outer(residual, p)


def test_two_drafts_of_one_step_are_independent(context_free_pair):
    """2048 requests differing only in their seed, each a one-token prompt and two tokens
    through two-draft speculation: the emitted pairs against ``p x p`` (Bretagnolle-Huber-
    Carol, ``assert_distributed_as``: 17 categories, bound 0.16 at ``ALPHA``). Under the draft
    reuse the pairs would be off by about 0.96 (asserted on the exact distributions, so the
    test keeps its power if the probabilities are changed)."""
    target, draft = context_free_pair
    p = _next_token_probs(target, [[0]])[0]
    q = _next_token_probs(draft, [[0]])[0]
    reuse_distance = np.abs(_pair_joint_under_draft_reuse(p, q) - np.outer(p, p)).sum()
    assert reuse_distance > 0.5  # the bug this test is for must fail it with near certainty

    engine = Engine(
        target,
        draft,
        num_pages=PAIR_PARALLEL + 1,
        page_size=PAGE_SIZE,
        parallel=PAIR_PARALLEL,
        num_speculative=2,
        backend="reference",
    )
    requests = [
        Request(i, [0], SamplingParams(temperature=1.0, max_tokens=2, seed=i))
        for i in range(NUM_PAIRS)
    ]
    pairs = np.array([output.token_ids for output in engine.generate(requests)])
    assert pairs.shape == (NUM_PAIRS, 2)
    assert_distributed_as(pairs[:, 0] * VOCAB + pairs[:, 1], np.outer(p, p).ravel())
    rates = engine.acceptance.rate_at()
    assert 0.6 < rates[0] < 0.95  # 0.8 expected: both branches of the first test were taken


# ----------------------------------------------------------------------------------------------
# Keys of a block of plain decode steps (Engine(max_steps_per_program=K))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_block_of_steps_draws_the_keys_of_single_steps(context_free_pair, overlap):
    """Two requests of one-token prompts (no prefill, so blocks of four from the first step)
    with eight tokens each: two blocks. The sampler is called once a step of the scan, and
    row ``b`` of step ``k`` of a block draws with ``fold_in(request key, generated + k)``:
    over both blocks each request draws ``fold_in(its key, g)`` for ``g = 0..7``, in order,
    as eight single steps do. (A spy on ``sampling.filtered_sample``, as the key test above;
    this module's model runs no other plain decode program, so it is traced with the spy.
    Shown to fail: every step of a block keyed with the block's first count.)"""
    global _KEY_SINK
    target, _ = context_free_pair
    seeds = KEY_SEEDS[:2]
    engine = Engine(
        target,
        num_pages=5,
        page_size=PAGE_SIZE,
        parallel=len(seeds),
        backend="reference",
        overlap=overlap,
        max_steps_per_program=4,
    )
    real_sample = sampling.filtered_sample

    def sample_spy(key, *args, **kwargs):
        jax.debug.callback(
            functools.partial(_record_key, "plain"), jax.random.key_data(key), ordered=True
        )
        return real_sample(key, *args, **kwargs)

    _KEY_SINK = []
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sampling, "filtered_sample", sample_spy)
            params = lambda seed: SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
            requests = [Request(seed, [seed % VOCAB], params(seed)) for seed in seeds]
            stats = []
            outputs = engine.generate(requests, lambda out: stats.append(out.stats))
            jax.effects_barrier()
            drawn = np.stack([key_data for _, key_data in _KEY_SINK])  # [steps, B, 2]
    finally:
        _KEY_SINK = None
    assert [s.num_decode_steps for s in stats if s.num_decode_steps] == [4, 4]
    assert [len(out.token_ids) for out in outputs] == [8, 8]
    for slot, seed in enumerate(seeds):
        key = jax.random.wrap_key_data(jnp.asarray(request_key_data(seed)))
        expected = [jax.random.key_data(jax.random.fold_in(key, g)) for g in range(8)]
        np.testing.assert_array_equal(drawn[:, slot], np.stack(expected))
