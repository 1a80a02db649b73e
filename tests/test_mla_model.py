"""The MLA decoder: its paged forward equals its dense forward, generation over the latent cache
(plain and speculative, with a Llama-style draft) equals greedy decoding of the dense model, the
un-absorbed prefill attention equals the absorbed reference, the cache's size a token, and
refusals by name.

Oracle: ``forward_dense_mla`` (un-absorbed, every key and value per head) in float64 over each
request's whole sequence. The paged path runs in float64 too (x64 on, float64 parameters and
pools), through both attention forms, so the two agree to rounding: ``TOLERANCE`` relative L2
(measured: about 1e-15). A wrong mask, position, scale or page lookup moves logits by far more.
The two forwards share the layer stack (projections, latent norm, RoPE, scale), so the dense
forward is itself checked against ``numpy_mla_logits``, the model written out in NumPy.
The ``gpu``-marked test compares the Mosaic GPU kernel's run of ``MLA_TINY`` with the reference.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from paged.mla_prefill import mla_prefill_attention_unabsorbed
from serving import mla_generate, mla_speculative
from serving import model as model_lib
from serving.config import TINY_DRAFT, ModelConfig
from serving.mla_config import (
    MLA_TEST,
    MLA_TINY,
    MLAConfig,
    MLAModelConfig,
    cache_bytes_per_token,
    deepseek_v2_lite_like,
)
from serving.mla_model import (
    choose_attention_form,
    forward_dense_mla,
    forward_paged_mla,
    init_mla_model_params,
    mla_model_param_shapes,
    new_mla_caches,
)
from serving.mla_speculative import speculative_generate_mla

# Programs that run long (whole-model runs over many tokens): compiled with XLA's CPU optimizations
# (tests/conftest.py).
CPU_PROGRAMS_OPTIMIZED = True

TOLERANCE = 1e-12
CONFIG = MLA_TEST
PAGE_SIZE = 4
NUM_POOL_PAGES = 32
NUM_INDICES = 16  # every table padded to this: one compiled program per step length and form

_forward_paged = mla_generate.forward_paged_mla_jit  # one jit cache for every test
_forward_dense = jax.jit(forward_dense_mla, static_argnames=("config", "backend"))


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.all(np.isfinite(actual)), "non-finite output"
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def params64(seed: int = 0):
    params = init_mla_model_params(CONFIG, jax.random.key(seed))
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)


DENSE_LENGTH = 24  # the oracle's one input length: sequences are padded to it


def dense_logits(params, sequence) -> np.ndarray:
    """float64 ``[T, V]``: the oracle's logits of one request's whole sequence. Run padded to
    ``DENSE_LENGTH`` tokens (one compiled program for every length); causality keeps the
    padding out of the first ``T`` positions."""
    assert len(sequence) <= DENSE_LENGTH
    tokens = jnp.asarray([list(sequence) + [0] * (DENSE_LENGTH - len(sequence))], jnp.int32)
    logits = _forward_dense(params, CONFIG, tokens, backend="reference")
    return np.asarray(logits)[0, : len(sequence)]


def scattered_page_lists(lengths, seed):
    """Each request's pages for ``lengths`` tokens, drawn without order from the pool."""
    free = np.random.default_rng(seed).permutation(NUM_POOL_PAGES).tolist()
    lists = []
    for length in lengths:
        count = -(-length // PAGE_SIZE)
        lists.append(free[:count])
        free = free[count:]
    return lists


def table_for(page_lists, seq_lens):
    return paged.host_page_table(page_lists, seq_lens, PAGE_SIZE, num_indices=NUM_INDICES)


@pytest.mark.parametrize("form", ["absorbed", "unabsorbed"])
def test_whole_prompt_at_once_equals_dense(float64, form):
    """Two prompts of 7 tokens in one step (pages scattered, 7 not a page multiple)."""
    params = params64()
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, CONFIG.vocab_size, (2, 7))
    page_lists = scattered_page_lists([7, 7], seed=1)
    caches = new_mla_caches(CONFIG, NUM_POOL_PAGES, PAGE_SIZE, dtype=jnp.float64)
    logits, caches = _forward_paged(
        params,
        CONFIG,
        jnp.asarray(prompts, jnp.int32),
        caches,
        table_for(page_lists, [7, 7]),
        attention_form=form,
        backend="reference",
    )
    for row in range(2):
        expected = dense_logits(params, prompts[row].tolist())
        assert relative_error(logits[row], expected) < TOLERANCE


# "auto" is absorbed for these chunks; auto rather than "absorbed" shares the compiled
# programs with the generation tests below.
@pytest.mark.parametrize("prefill_form", ["auto", "unabsorbed"])
def test_chunked_prefill_then_ragged_decode_equals_dense(float64, prefill_form):
    """Prompts of 1, 5 and 11 tokens prefilled alone in chunks of 3 (chunk edges at 3, 6, 9:
    never a page edge of 4) through ``prefill_form``; then the ragged batch steps together over
    scattered pages (``"auto"``: absorbed): two decode steps, one verification-shaped step of 3
    new tokens, one more decode step. Every position's logits equal the dense forward's."""
    assert choose_attention_form("auto", CONFIG, 3) == "absorbed"
    params = params64(1)
    rng = np.random.default_rng(2)
    prompt_lengths, step_lengths = [1, 5, 11], [1, 1, 3, 1]
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in prompt_lengths]
    fed = [rng.integers(0, CONFIG.vocab_size, sum(step_lengths)).tolist() for _ in prompts]
    final_lengths = [n + sum(step_lengths) for n in prompt_lengths]
    page_lists = scattered_page_lists(final_lengths, seed=3)
    caches = new_mla_caches(CONFIG, NUM_POOL_PAGES, PAGE_SIZE, dtype=jnp.float64)
    kept = [[] for _ in prompts]
    for row, prompt in enumerate(prompts):
        table = table_for([page_lists[row]], [len(prompt)])
        tokens = jnp.asarray([prompt], jnp.int32)
        for chunk in paged.prefill_chunks(table, len(prompt), 3):
            logits, caches = _forward_paged(
                params,
                CONFIG,
                tokens[:, chunk.start : chunk.stop],
                caches,
                chunk.page_table,
                attention_form=prefill_form,
                backend="reference",
            )
            kept[row].append(np.asarray(logits[0]))
    seq_lens, done = list(prompt_lengths), 0
    for length in step_lengths:
        seq_lens = [n + length for n in seq_lens]
        tokens = jnp.asarray([row[done : done + length] for row in fed], jnp.int32)
        logits, caches = _forward_paged(
            params, CONFIG, tokens, caches, table_for(page_lists, seq_lens), backend="reference"
        )
        for row in range(len(prompts)):
            kept[row].append(np.asarray(logits[row]))
        done += length
    for row, prompt in enumerate(prompts):
        expected = dense_logits(params, prompt + fed[row])
        actual = np.concatenate(kept[row])
        assert actual.shape == expected.shape
        assert relative_error(actual, expected) < TOLERANCE


def test_attention_form_auto_follows_the_flop_break_even():
    """At DeepSeek's sizes, un-absorbed from 171 new tokens (2R(N+V) / (2(2R+P) - 2(N+P+V)) =
    262144 / 1536 = 170.7); absorbed for every decode and verification step."""
    assert choose_attention_form("auto", MLA_TINY, 170) == "absorbed"
    assert choose_attention_form("auto", MLA_TINY, 171) == "unabsorbed"
    assert choose_attention_form("unabsorbed", MLA_TINY, 1) == "unabsorbed"
    # MLA_TEST: 2 * 32 * 28 / (2 * 72 - 2 * 36) = 24.9.
    assert choose_attention_form("auto", MLA_TEST, 24) == "absorbed"
    assert choose_attention_form("auto", MLA_TEST, 25) == "unabsorbed"


def greedy_dense(params, prompt, num_tokens):
    """Greedy continuation by re-running the dense forward over the whole sequence each time
    (arg max of the float32 logits, the lowest index on a tie: the sampler's convention)."""
    sequence = list(prompt)
    for _ in range(num_tokens):
        logits = dense_logits(params, sequence)[-1].astype(np.float32)
        sequence.append(int(np.argmax(logits)))
    return sequence[len(prompt) :]


PROMPTS = [[7, 100, 3, 250, 18, 64, 5], [42], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def test_greedy_generation_equals_greedy_dense(float64):
    """Chunked prefill (chunks of 3, pages of 4), batched decode over pages the pool hands out
    as rows grow, temperature 0: the tokens of greedy decoding with the dense forward."""
    params = params64(2)
    generated = mla_generate.generate_mla(
        params,
        CONFIG,
        PROMPTS,
        max_new_tokens=6,
        page_size=PAGE_SIZE,
        num_pages=NUM_POOL_PAGES,
        chunk_size=3,
        backend="reference",
    )
    assert generated == [greedy_dense(params, prompt, 6) for prompt in PROMPTS]


def test_sampling_with_top_k_1_is_greedy_and_a_seed_repeats(float64):
    """Through the sampler's filters: ``top_k = 1`` at temperature 1 keeps the arg max only; at
    temperature 1 unfiltered, one seed gives one output, twice."""
    params = params64(2)
    common = dict(
        max_new_tokens=4,
        page_size=PAGE_SIZE,
        num_pages=NUM_POOL_PAGES,
        chunk_size=3,
        backend="reference",
    )
    top_1 = mla_generate.generate_mla(
        params, CONFIG, PROMPTS, temperature=1.0, top_k=1, seed=5, **common
    )
    assert top_1 == [greedy_dense(params, prompt, 4) for prompt in PROMPTS]
    first, second = (
        mla_generate.generate_mla(params, CONFIG, PROMPTS, temperature=1.0, seed=9, **common)
        for _ in range(2)
    )
    assert first == second
    assert first != top_1  # 12 draws from near-flat distributions over 256 bytes
    assert all(0 <= token < CONFIG.vocab_size for row in first for token in row)


# The draft of the speculative tests: a small random Llama-style model whose LM head is zero, so
# at temperature 0 it always proposes token 0 (the lowest-index arg max of equal logits).
DRAFT = ModelConfig(
    vocab_size=256,
    hidden=32,
    num_layers=1,
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate=32,
)


@pytest.mark.parametrize("num_speculative", [1, 3])
def test_speculative_greedy_generation_equals_greedy_dense(float64, num_speculative):
    """Drafts of n tokens verified by the MLA target in one (n + 1)-token step (absorbed), over
    latent and KV pools sharing the pages: at temperature 0 the tokens are greedy decoding's.
    The target's LM head column 0 is scaled up so that token 0, the draft's every proposal, is
    its choice at some positions and not others: some drafts are accepted, some rejected, and
    rows advance by different counts. At n = 1 some steps accept their draft and emit the
    target's bonus token where the next token depends on the context (at n = 3 all three are
    accepted only inside runs of zeros, which do not show a miscounted position)."""
    params = params64(2)
    params["lm_head"] = params["lm_head"].at[:, 0].multiply(3.0)
    draft_params = model_lib.init_params(DRAFT, jax.random.key(3))
    draft_params["lm_head"] = jnp.zeros_like(draft_params["lm_head"])
    generated, (drafted, accepted) = speculative_generate_mla(
        params,
        CONFIG,
        draft_params,
        DRAFT,
        PROMPTS,
        num_speculative=num_speculative,
        max_new_tokens=8,
        page_size=PAGE_SIZE,
        num_pages=NUM_POOL_PAGES,
        chunk_size=3,
        backend="reference",
    )
    assert generated == [greedy_dense(params, prompt, 8) for prompt in PROMPTS]
    assert 0 < accepted < drafted


def cached_tokens(cache, pages, length) -> list[np.ndarray]:
    """The pool's entries of the first ``length`` tokens on ``pages`` (in order), per array:
    ``[latent, rope key]`` of a ``LatentCache``, ``[key, value]`` of an NHD ``KVCache``."""
    if isinstance(cache, paged.LatentCache):
        pools = [cache.latent_pages, cache.rope_key_pages]
    else:
        pools = [cache.k_pages, cache.v_pages]
    return [
        np.asarray(pool)[pages].reshape(len(pages) * PAGE_SIZE, *pool.shape[2:])[:length]
        for pool in pools
    ]


def test_a_speculative_step_leaves_both_caches_as_a_prefill_of_the_verified_tokens(float64):
    """One ``speculative_step`` (n = 3) after a 7-token prompt: the target's latent cache and the
    draft's KV cache then hold, at positions 7 to 10, the last token and the 3 drafts (the
    draft proposes token 0 always), as a one-shot prefill of those 11 tokens writes them. The
    generation tests cannot see the draft's cache (that draft's proposals ignore it): a last
    draft pass that does not write ``d_n``, or a draft table one token short, fails here.
    Target float64 (to rounding); the draft float32, the incremental and one-shot passes
    rounding differently (measured 1e-7 relative; ``1e-6``)."""
    n, prompt, last = 3, PROMPTS[0], 42
    params = params64(2)
    draft_params = model_lib.init_params(DRAFT, jax.random.key(3))
    draft_params["lm_head"] = jnp.zeros_like(draft_params["lm_head"])
    pages = scattered_page_lists([16], seed=8)[0]  # room for the 11 tokens and more

    def table(length):
        return table_for([pages], [length])

    def fresh_caches():
        target = new_mla_caches(CONFIG, NUM_POOL_PAGES, PAGE_SIZE, dtype=jnp.float64)
        return target, model_lib.new_caches(DRAFT, NUM_POOL_PAGES, PAGE_SIZE, layout="NHD")

    def prefill(tokens, target, draft):
        tokens = jnp.asarray([tokens], jnp.int32)
        _, target = _forward_paged(
            params, CONFIG, tokens, target, table(tokens.shape[1]), backend="reference"
        )
        _, draft = mla_speculative._forward_draft(
            draft_params, DRAFT, tokens, draft, table(tokens.shape[1]), backend="reference"
        )
        return target, draft

    target, draft = prefill(prompt, *fresh_caches())
    token_ids, num_accepted, target, draft = mla_speculative.speculative_step(
        params,
        draft_params,
        target,
        draft,
        jnp.asarray([last], jnp.int32),
        mla_generate.row_key_data(0, 1),
        jnp.asarray([1], jnp.int32),
        mla_generate.row_sampling_params(1, CONFIG.vocab_size, 0.0, None, None),
        table(len(prompt) + n + 1),
        tuple(table(len(prompt) + j + 1) for j in range(n + 1)),
        target_config=CONFIG,
        draft_config=DRAFT,
        num_speculative=n,
        backend="reference",
    )
    verified = [*prompt, last, *[0] * n]
    expected_target, expected_draft = prefill(verified, *fresh_caches())
    for actual_caches, expected_caches, tolerance in [
        (target, expected_target, TOLERANCE),
        (draft, expected_draft, 1e-6),
    ]:
        for actual, expected in zip(actual_caches, expected_caches, strict=True):
            for got, want in zip(
                cached_tokens(actual, pages, len(verified)),
                cached_tokens(expected, pages, len(verified)),
                strict=True,
            ):
                assert relative_error(got, want) < tolerance
    # The step's tokens: greedy over the verified sequence (accepted drafts, then the target's).
    count = int(num_accepted[0])
    emitted = np.asarray(token_ids)[0, : count + 1].tolist()
    assert emitted == greedy_dense(params, [*prompt, last], count + 1)


def test_the_mla_tiny_model_runs_from_the_command_line(capsys):
    """DeepSeek-V2-Lite's attention sizes (16 heads, R 512, P 64, N 128, V 128; 2 layers,
    bfloat16, random weights) through a 3-token prompt and its first token: one compiled step
    (a second would double this test's time; decode runs at these sizes from the command line,
    at test sizes above)."""
    assert mla_generate.main(["--model", "mla-tiny", "--prompt", "Hi!", "--max-tokens", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("[1] ") and "mla-tiny: 1 prompt(s), 1 tokens" in err


def test_the_command_line_speculates_with_the_trained_draft(capsys, monkeypatch):
    """``--speculative N`` hands the trained tiny draft and N to the speculative loop (the loop
    itself is tested above; here only the wiring, without compiling anything)."""
    seen = {}

    def fake_loop(params, config, draft_params, draft_config, prompts, **options):
        seen.update(draft=draft_config, prompts=prompts, **options)
        return [[104, 105]], (4, 1)

    monkeypatch.setattr(mla_speculative, "speculative_generate_mla", fake_loop)
    argv = ["--model", "mla-test", "--prompt", "ab", "--max-tokens", "2", "--speculative", "2"]
    assert mla_generate.main(argv) == 0
    out, err = capsys.readouterr()
    assert seen["draft"] == TINY_DRAFT and seen["num_speculative"] == 2
    assert seen["prompts"] == [[97, 98]] and seen["max_new_tokens"] == 2
    assert out == "[1] 'hi'\n" and "drafts accepted: 1 of 4" in err


# ----------------------------------------------------------------------------------------------
# The dense forward against an independent NumPy model


def numpy_mla_logits(params, tokens) -> np.ndarray:
    """float64 ``[T, V]``: ``CONFIG``'s model written out in NumPy from the textbook MLA, one
    request at positions ``0 .. T - 1``: pre-norm layers; per head the key
    ``concat(rmsnorm(latent) @ w_uk[h], rope(k_rope))`` and value ``rmsnorm(latent) @ w_uv[h]``;
    the query ``concat(q_nope, rope(q_rope))``; logits scaled by ``1 / sqrt(N + P)``; RoPE on
    pairs ``(2i, 2i + 1)`` of the ``P`` rotary values only.

    Shares no code with ``serving.mla_model`` (the paged-vs-dense tests above share its layer
    stack, so they cannot see a mistake in it). Only ``inverse_frequencies`` comes from the
    library, and the angle is its float32 product as ``paged.rope.rope_angles`` defines it, so
    the two agree to float64 rounding."""
    sizes = CONFIG.attention
    rank, nope, rope_dim = sizes.kv_lora_rank, sizes.qk_nope_head_dim, sizes.qk_rope_head_dim
    eps = sizes.norm_eps
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    length = len(tokens)
    inv_freq = paged.rope.inverse_frequencies(rope_dim, sizes.rope)
    angles = (np.arange(length, dtype=np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)

    def norm(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    def rope(x):  # [T, ..., P]
        cos = np.cos(angles).reshape(length, *([1] * (x.ndim - 2)), rope_dim // 2)
        sin = np.sin(angles).reshape(cos.shape)
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = odd * cos + even * sin
        return out

    causal = np.tril(np.ones((length, length), bool))
    x = p["embed"][np.asarray(tokens)]
    residual = np.zeros_like(x)
    for layer in p["layers"]:
        residual = residual + x
        normed = norm(residual, layer["attn_norm"])
        q = np.einsum("td,dhe->the", normed, layer["w_q"])  # [T, H, N + P]
        compressed = normed @ layer["w_dkv"]  # [T, R + P]
        latent = norm(compressed[:, :rank], layer["latent_norm"])
        k_rope = rope(compressed[:, rank:])  # [T, P], shared by every head
        attention = np.zeros_like(x)
        for head in range(sizes.num_heads):
            query = np.concatenate([q[:, head, :nope], rope(q[:, head, nope:])], axis=-1)
            key = np.concatenate([latent @ layer["w_uk"][head], k_rope], axis=-1)
            value = latent @ layer["w_uv"][head]
            scores = np.where(causal, query @ key.T / np.sqrt(nope + rope_dim), -np.inf)
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            attention += (weights @ value) @ layer["w_o"][head]
        residual = residual + attention
        normed = norm(residual, layer["mlp_norm"])
        gate = normed @ layer["w_gate"]
        x = (gate / (1 + np.exp(-gate)) * (normed @ layer["w_up"])) @ layer["w_down"]
    return norm(residual + x, p["final_norm"]) @ p["lm_head"]


def test_dense_forward_equals_a_numpy_mla_model(float64):
    """``forward_dense_mla`` equals ``numpy_mla_logits`` to float64 rounding, over 11 tokens
    (positions up to 10: a RoPE on the wrong values, a missing rotation, a wrong scale or a
    missing latent norm moves the logits by far more than ``TOLERANCE``)."""
    params = params64(seed=3)
    tokens = np.random.default_rng(5).integers(0, CONFIG.vocab_size, 11).tolist()
    expected = numpy_mla_logits(params, tokens)
    assert relative_error(dense_logits(params, tokens), expected) < TOLERANCE


# ----------------------------------------------------------------------------------------------
# Cache size a token


def test_latent_cache_holds_r_plus_p_values_a_token_a_layer():
    """DeepSeek-V2-Lite (27 layers, bfloat16): 512 + 64 = 576 values a token a layer, 1152
    bytes, 31104 for the model; its keys and values expanded per head hold 16 x (128 + 64)
    keys and 16 x 128 values = 5120 values, 10240 bytes a layer, 276480 for the model (8.9x)."""
    v2_lite = deepseek_v2_lite_like(num_layers=27)
    assert cache_bytes_per_token(v2_lite, "latent") == 27 * 576 * 2 == 31104
    assert cache_bytes_per_token(v2_lite, "expanded") == 27 * (2 * 16 * 128 + 16 * 64) * 2
    assert cache_bytes_per_token(v2_lite, "expanded") == 276480
    caches = new_mla_caches(MLA_TINY, num_pages=2, page_size=16)
    assert [c.latent_pages.shape[2] + c.rope_key_pages.shape[2] for c in caches] == [576, 576]
    assert sum(c.bytes_per_token for c in caches) == cache_bytes_per_token(MLA_TINY, "latent")
    assert cache_bytes_per_token(MLA_TINY, "latent") == 2 * 1152
    assert cache_bytes_per_token(MLA_TINY, "expanded") == 2 * 10240


@pytest.mark.parametrize(
    "config, layout, message",
    [
        (MLA_TINY, "gqa", "layout must be one of ('latent', 'expanded'), got 'gqa'"),
        ("mla-tiny", "latent", "config must be an MLAConfig or MLAModelConfig, got 'mla-tiny'"),
    ],
)
def test_cache_bytes_per_token_refuses(config, layout, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cache_bytes_per_token(config, layout)


# ----------------------------------------------------------------------------------------------
# Refusals


@pytest.fixture(scope="module")
def small_setup():
    params = init_mla_model_params(CONFIG, jax.random.key(0))
    caches = new_mla_caches(CONFIG, 4, PAGE_SIZE)
    return params, caches, paged.PageTable.from_seq_lens([2], page_size=PAGE_SIZE)


def _forward_with(small_setup, *, tokens=None, caches=None, table=None, form="auto"):
    params, default_caches, default_table = small_setup
    return forward_paged_mla(
        params,
        CONFIG,
        jnp.asarray([[3, 4]], jnp.int32) if tokens is None else tokens,
        default_caches if caches is None else caches,
        default_table if table is None else table,
        attention_form=form,
        backend="reference",
    )


@pytest.mark.parametrize(
    "tokens, message",
    [
        (jnp.asarray([[3.0, 4.0]]), "tokens must be integer token ids, got dtype float32"),
        (jnp.asarray([[3, 256]]), "tokens[0, 1]=256 is outside the vocabulary [0, 256)"),
        (jnp.asarray([[-1, 4]]), "tokens[0, 0]=-1 is outside the vocabulary [0, 256)"),
        (jnp.asarray([3, 4]), "tokens must have shape [batch, length], got (2,)"),
        (jnp.asarray([[3, 4], [5, 6]]), "tokens has 2 requests but page_table describes 1"),
    ],
)
def test_bad_tokens_are_refused(small_setup, tokens, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _forward_with(small_setup, tokens=tokens)
    if tokens.ndim == 2 and tokens.shape[0] == 1 and jnp.issubdtype(tokens.dtype, jnp.integer):
        with pytest.raises(ValueError, match=re.escape(message)):
            forward_dense_mla(small_setup[0], CONFIG, tokens)


def test_bad_caches_and_tables_are_refused(small_setup):
    caches = small_setup[1]
    cases = [
        (
            dict(caches=caches[:1]),
            "caches must be a list of config.num_layers=2 LatentCache, got 1",
        ),
        (
            dict(caches=[caches[0], paged.new_latent_cache(4, PAGE_SIZE, 16, 8, jnp.float32)]),
            "caches[1] has (kv_lora_rank, qk_rope_head_dim, dtype)=(16, 8, dtype('float32')), "
            "the config and parameters need (32, 8, dtype('float32'))",
        ),
        (
            dict(caches=new_mla_caches(CONFIG, 4, PAGE_SIZE, dtype=jnp.bfloat16)),
            "caches[0] has (kv_lora_rank, qk_rope_head_dim, dtype)=(32, 8, dtype(bfloat16)), "
            "the config and parameters need (32, 8, dtype('float32'))",
        ),
        (
            dict(caches=[caches[0], new_mla_caches(CONFIG, 5, PAGE_SIZE)[0]]),
            "caches[1] has pages of shape (5, 4, 32) but caches[0] has (4, 4, 32)",
        ),
        (
            dict(table=paged.PageTable.from_seq_lens([2], page_size=8)),
            "page_table.page_size=8 differs from the caches' page_size=4",
        ),
        (
            dict(table=paged.PageTable.from_seq_lens([1], page_size=PAGE_SIZE)),
            "page_table's request 0 has 1 tokens, fewer than the L=2 new ones",
        ),
        (
            dict(form="naive"),
            "attention_form must be one of ('auto', 'absorbed', 'unabsorbed'), got 'naive'",
        ),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            _forward_with(small_setup, **arguments)


def test_the_test_model_has_no_square_weight():
    """Every weight of ``MLA_TEST`` has axes of distinct widths, so ``validate_mla_model_params``
    refuses any of them stored transposed (with hidden = N + P, ``w_q`` would pass)."""
    shapes = jax.tree.leaves(
        mla_model_param_shapes(MLA_TEST), is_leaf=lambda leaf: isinstance(leaf, tuple)
    )
    assert all(len(set(shape)) == len(shape) for shape in shapes)


def test_bad_configs_and_parameters_are_refused(small_setup):
    params = small_setup[0]
    with pytest.raises(ValueError, match=re.escape("vocab_size must be an int >= 1, got 0")):
        MLAModelConfig(attention=MLA_TEST.attention, vocab_size=0)
    with pytest.raises(ValueError, match=re.escape("attention must be an MLAConfig, got 16")):
        MLAModelConfig(attention=16)
    other = MLAModelConfig(
        attention=MLAConfig(hidden=28, num_layers=2, num_heads=2, kv_lora_rank=32), vocab_size=256
    )
    with pytest.raises(ValueError, match=re.escape("params 'layers.0.w_q' has shape (28, 4, 24)")):
        forward_dense_mla(params, other, jnp.asarray([[1]], jnp.int32))
    with pytest.raises(ValueError, match=re.escape("config must be an MLAModelConfig, got")):
        forward_dense_mla(params, MLA_TEST.attention, jnp.asarray([[1]], jnp.int32))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(prompts=[[1], []]), "prompts[1] is empty; a prompt needs at least one token"),
        (dict(prompts=[[1, 300]]), "prompts[0] holds token 300, outside the vocabulary [0, 256)"),
        (dict(prompts=[[1, 2.5]]), "prompts[0] holds 2.5, not an integer token id"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
        (dict(temperature=-1.0), "temperature must be a finite number >= 0, got -1.0"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
        (dict(top_k=0), "top_k must be an int >= 1 (or None for no top-k), got 0"),
        (dict(top_p=0.0), "top_p must be a number in (0, 1] (or None), got 0.0"),
        (dict(top_p=1.5), "top_p must be a number in (0, 1] (or None), got 1.5"),
        (dict(num_pages=1), "cannot allocate 3 pages: only 1 of 1 are free"),
    ],
)
def test_generate_refuses_bad_arguments(small_setup, change, message):
    arguments = dict(prompts=[[1, 2, 3, 4, 5, 6, 7, 8, 9]], max_new_tokens=2, page_size=PAGE_SIZE)
    arguments |= change
    with pytest.raises(ValueError, match=re.escape(message)):
        mla_generate.generate_mla(small_setup[0], CONFIG, **arguments)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_speculative=0), "num_speculative must be an int >= 1, got 0"),
        (dict(num_speculative=True), "num_speculative must be an int >= 1, got True"),
        (dict(draft_config=CONFIG), "draft_config must be a serving.config.ModelConfig, got"),
        (
            dict(draft_config=dataclasses.replace(DRAFT, vocab_size=128)),
            "the draft's vocab_size=128 differs from the target's 256",
        ),
        (dict(top_p=0.0), "top_p must be a number in (0, 1] (or None), got 0.0"),
    ],
)
def test_speculative_generate_refuses_bad_arguments(small_setup, change, message):
    arguments = dict(
        draft_params=None,
        draft_config=DRAFT,
        prompts=[[1, 2, 3]],
        num_speculative=2,
        max_new_tokens=2,
        page_size=PAGE_SIZE,
    )
    arguments |= change
    with pytest.raises(ValueError, match=re.escape(message)):
        speculative_generate_mla(small_setup[0], CONFIG, **arguments)


def test_the_kernel_plan_is_made_only_where_the_kernel_may_run_the_step():
    """Under jit the Mosaic GPU kernel needs a host-made plan: the loops make one for absorbed
    steps on the kernels' backend, and none for the reference or an un-absorbed chunk."""
    table = paged.host_page_table([[3, 1], [2]], [20, 5], 16, num_indices=16)
    plan = mla_generate.absorbed_plan(table, MLA_TINY, 1, "auto", "pallas")
    assert isinstance(plan, paged.DecodePlan)
    assert mla_generate.absorbed_plan(table, MLA_TINY, 1, "auto", "reference") is None
    assert mla_generate.absorbed_plan(table, MLA_TINY, 171, "auto", "pallas") is None
    assert mla_generate.absorbed_plan(table, MLA_TINY, 1, "unabsorbed", "pallas") is None


@pytest.mark.gpu
def test_the_mla_kernel_runs_the_model_as_the_reference_does():
    """On the H200: ``MLA_TINY`` (bfloat16, the Mosaic GPU kernel's sizes) through a 5-token
    prefill chunk and two decode steps of a ragged batch, absorbed attention on the kernel
    (compiled, with host plans) against the same steps on the reference: logits within
    bfloat16's tolerance (1e-2 relative, testing.md)."""
    params = init_mla_model_params(MLA_TINY, jax.random.key(4))
    rng = np.random.default_rng(5)
    prompts = rng.integers(0, MLA_TINY.vocab_size, (2, 5))
    fed = rng.integers(0, MLA_TINY.vocab_size, (2, 2))
    page_lists, page_size = [[7, 2], [4, 9]], 16
    logits = {}
    for backend in ("reference", "pallas"):
        caches = new_mla_caches(MLA_TINY, 16, page_size)
        steps = [(prompts, [5, 5]), (fed[:, :1], [6, 6]), (fed[:, 1:], [7, 7])]
        kept = []
        for tokens, lengths in steps:
            table = paged.host_page_table(page_lists, lengths, page_size, num_indices=16)
            plan = mla_generate.absorbed_plan(table, MLA_TINY, tokens.shape[1], "auto", backend)
            step_logits, caches = _forward_paged(
                params,
                MLA_TINY,
                jnp.asarray(tokens, jnp.int32),
                caches,
                table,
                attention_form="auto",
                plan=plan,
                backend=backend,
            )
            kept.append(np.asarray(step_logits, np.float32))
        logits[backend] = np.concatenate(kept, axis=1)
    assert relative_error(logits["pallas"], logits["reference"]) < 1e-2


# ----------------------------------------------------------------------------------------------
# The un-absorbed prefill attention on its own


def test_unabsorbed_prefill_attention_equals_the_absorbed_reference(float64):
    """Ragged requests (3, 6 and 9 tokens) over scattered pages, the last 3 of each new: the
    un-absorbed form equals ``paged.mla_decode_absorbed_reference`` to rounding."""
    heads, rank, nope, rope, value = 2, 8, 4, 2, 3
    rng = np.random.default_rng(6)
    lengths = [3, 6, 9]
    page_lists = scattered_page_lists(lengths, seed=7)
    table = table_for(page_lists, lengths)
    cache = paged.LatentCache(
        jnp.asarray(rng.normal(size=(NUM_POOL_PAGES, PAGE_SIZE, rank))),
        jnp.asarray(rng.normal(size=(NUM_POOL_PAGES, PAGE_SIZE, rope))),
    )
    q_nope = jnp.asarray(rng.normal(size=(3, 3, heads, nope)))
    q_rope = jnp.asarray(rng.normal(size=(3, 3, heads, rope)))
    w_uk = jnp.asarray(rng.normal(size=(heads, rank, nope)))
    w_uv = jnp.asarray(rng.normal(size=(heads, rank, value)))
    out = mla_prefill_attention_unabsorbed(q_nope, q_rope, cache, table, w_uk, w_uv)
    expected, _ = paged.mla_decode_absorbed_reference(q_nope, q_rope, cache, table, w_uk, w_uv)
    assert out.dtype == jnp.float64
    assert relative_error(out, expected) < TOLERANCE
    with pytest.raises(ValueError, match=re.escape("q_nope must have shape [B, L, H, N], got")):
        mla_prefill_attention_unabsorbed(q_nope[:, 0], q_rope[:, 0], cache, table, w_uk, w_uv)
    with pytest.raises(ValueError, match="q_nope has qk_nope_head_dim 4 but w_uk has 5"):
        mla_prefill_attention_unabsorbed(
            q_nope, q_rope, cache, table, jnp.zeros((heads, rank, 5)), w_uv
        )


def test_attention_form_with_speculative_is_a_usage_error(capsys):
    from serving.mla_generate import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--prompt", "a", "--speculative", "2", "--attention-form", "absorbed"])
    assert exit_info.value.code == 2
    assert "--attention-form applies to plain decoding only" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_unabsorbed_is_cheaper_refuses_a_bad_size(bad):
    from paged.mla_prefill import unabsorbed_is_cheaper

    with pytest.raises(ValueError, match=rf"q_len must be an int >= 1, got {bad!r}"):
        unabsorbed_is_cheaper(bad, 512, 128, 64, 128)
