"""The engine running an MLA target (``serving/mla_model.py``) through every path it has.

Greedy outputs are checked against ``serving.mla_generate.generate_mla`` (the same model and
prompts outside the engine): prompts prefilled in chunks of 4 tokens spread over steps beside
decode rows, ragged requests (different prompt lengths and ``max_tokens``) on fewer slots than
requests, the overlapped loop with single steps and the synchronous one with blocks of steps.
Speculative decoding with the trained tiny draft of ``serving/weights/`` (its LM head zeroed, so
it always proposes token 0, which the target's boosted LM head makes its greedy choice often but
not always: drafts accepted and rejected, rows advancing by different counts) gives the greedy
output exactly (chain speculative sampling with one-hot distributions). Sampling is
seed-deterministic. The refusals, the command line. The ``gpu``-marked test runs the engine on
the Mosaic GPU MLA kernel against the reference.

Float32 ``MLA_TEST`` on a CPU: the engine's and the loop's computations differ in their order
(the engine prefills up to the prompt's last token, which its first decode step feeds), so
greedy equality relies on no near-tie among the logits, which these random weights do not have.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged
from serving import model_files, programs
from serving.__main__ import MLA_MODEL_NAMES, MLA_WEIGHTS_SEED, main
from serving.config import TINY_DRAFT
from serving.engine import Engine, max_verified_tokens
from serving.mla_config import MLA_MODELS, MLA_TEST, MLA_TINY
from serving.mla_expanded import (
    ExpandedMLAConfig,
    forward_paged_mla_expanded,
    new_expanded_mla_caches,
)
from serving.mla_generate import DRAFT_WEIGHTS, generate_mla
from serving.mla_model import (
    choose_attention_form,
    forward_paged_mla,
    init_mla_model_params,
    new_mla_caches,
)
from serving.model import init_params
from serving.requests import Request, SamplingParams

PAGE_SIZE = 4
NUM_PAGES = 40
PARALLEL = 2
CHUNK = 4
# Ragged: 11 prompt tokens (10 prefilled in chunks of 4, 4, 2), 3, 1 and 7; and max_tokens.
PROMPTS = [list(range(40, 51)), [7, 8, 9], [200], [3, 1, 4, 1, 5, 9, 2]]
MAX_TOKENS = [6, 4, 7, 5]


@pytest.fixture(scope="module")
def target():
    """``(MLA_TEST, params)``: random weights, token 0's LM head column tripled (the target's
    greedy choice for some tokens, not all, so the always-0 draft is accepted at times)."""
    params = init_mla_model_params(MLA_TEST, jax.random.key(1))
    params["lm_head"] = params["lm_head"].at[:, 0].multiply(3.0)
    return MLA_TEST, params


@pytest.fixture(scope="module")
def zero_draft():
    """The trained tiny draft with a zero LM head: it always proposes token 0."""
    config, params = model_files.load_model(DRAFT_WEIGHTS)
    params = dict(params, lm_head=jnp.zeros_like(params["lm_head"]))
    return config, params


def _requests(temperature=0.0, seeds=None, **sampling):
    return [
        Request(
            index,
            prompt,
            SamplingParams(
                temperature=temperature,
                max_tokens=max_tokens,
                seed=None if seeds is None else seeds[index],
                **sampling,
            ),
        )
        for index, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))
    ]


def _engine(target, draft=None, **options):
    options = (
        dict(
            num_pages=NUM_PAGES,
            page_size=PAGE_SIZE,
            parallel=PARALLEL,
            backend="reference",
            prefill_chunk_size=CHUNK,
            max_prefill_tokens=CHUNK,
        )
        | options
    )
    return Engine(target, draft, **options)


def _tokens(outputs) -> list[list[int]]:
    return [list(out.token_ids) for out in outputs]


@pytest.fixture(scope="module")
def greedy(target):
    """The loop's greedy continuations (``generate_mla``, the longest ``max_tokens``)."""
    config, params = target
    outputs = generate_mla(
        params,
        config,
        PROMPTS,
        max_new_tokens=max(MAX_TOKENS),
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        chunk_size=CHUNK,
        backend="reference",
    )
    return [tokens[:count] for tokens, count in zip(outputs, MAX_TOKENS, strict=True)]


@pytest.fixture(scope="module")
def plain_engine_output(target):
    """The engine's greedy outputs (overlapped, single steps: the defaults) and its engine."""
    engine = _engine(target)
    return _tokens(engine.generate(_requests())), engine


def test_engine_greedy_equals_the_loop_outside_it(plain_engine_output, greedy):
    """Chunked prefill beside decode rows, admission as slots free, overlapped steps."""
    outputs, engine = plain_engine_output
    assert outputs == greedy
    assert engine.scheduler.pool.num_free == NUM_PAGES - 1  # every page back but padding
    report = engine.backend_report()
    assert report["decode: attention"] == "reference"
    assert report["prefill: attention"] == "reference"
    assert "an MLA target" in engine.cascade_report().last_reason


def test_long_prefill_chunks_run_unabsorbed_and_give_the_loops_output(target):
    """Chunks of 32 tokens are past ``MLA_TEST``'s crossover (the un-absorbed form: per-head K
    and V from the gathered latents), so the engine's other prefill form, and its ``plan=None``
    path, is compared with the loop outside it (which chunks the same prompts its own way)."""
    config, params = target
    assert choose_attention_form("auto", config, 32) == "unabsorbed"
    assert choose_attention_form("auto", config, 4) == "absorbed"
    prompts = [list(range(60, 100)), [9, 8, 7, 6, 5]]
    expected = generate_mla(
        params,
        config,
        prompts,
        max_new_tokens=3,
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        chunk_size=32,
        backend="reference",
    )
    engine = _engine(target, prefill_chunk_size=32, max_prefill_tokens=32)
    requests = [
        Request(index, prompt, SamplingParams(temperature=0.0, max_tokens=3))
        for index, prompt in enumerate(prompts)
    ]
    assert _tokens(engine.generate(requests)) == [list(tokens) for tokens in expected]


def test_blocks_of_steps_and_the_synchronous_loop_give_the_same_output(target, greedy):
    engine = _engine(target, overlap=False, max_steps_per_program=4)
    steps = []
    assert _tokens(engine.generate(_requests(), steps.append)) == greedy
    assert max(output.stats.num_decode_steps for output in steps) > 1  # a block ran


def test_speculative_verification_gives_the_greedy_output(target, zero_draft, greedy):
    """``n = 3`` drafts of the trained draft (always token 0), verified by the MLA target."""
    engine = _engine(target, zero_draft, num_speculative=3)
    assert _tokens(engine.generate(_requests())) == greedy
    accepted = engine.acceptance.accepted_at
    assert accepted.sum() > 0 and engine.acceptance.reached_at[0] > accepted[0]
    assert engine.backend_report()["decode: speculative acceptance"] == "reference"


def test_sampling_is_seed_deterministic_plainly_and_speculatively(target, zero_draft, greedy):
    """Temperature, top-k and top-p: the same seeds give the same tokens, others others; a
    greedy request in the same batch keeps its greedy tokens."""
    options = dict(top_k=50, top_p=0.9)
    for draft, num_speculative in [(None, 0), (zero_draft, 2)]:
        runs = []
        for seeds in [(11, 12, 13, 14), (11, 12, 13, 14), (21, 22, 23, 24)]:
            engine = _engine(target, draft, num_speculative=num_speculative)
            requests = _requests(temperature=1.0, seeds=seeds, **options)
            requests[1] = _requests()[1]  # greedy among sampled rows
            runs.append(_tokens(engine.generate(requests)))
        assert runs[0] == runs[1]
        assert runs[0] != runs[2]
        assert runs[0][1] == runs[2][1] == greedy[1]
        assert [len(tokens) for tokens in runs[0]] == MAX_TOKENS


def test_the_expanded_baseline_computes_the_latent_models_function(target):
    """``forward_paged_mla_expanded`` (per-head K/V pages, the probe's baseline) against
    ``forward_paged_mla`` on the same weights: a 3-token prefill of two requests, then a
    2-token step (a verification's shape) that crosses into a second, scattered page."""
    config, params = target
    expanded = ExpandedMLAConfig(config)
    tables = [
        paged.PageTable.from_page_lists(page_lists, seq_lens=lengths, page_size=PAGE_SIZE)
        for page_lists, lengths in [([[3], [6]], [3, 3]), ([[3, 1], [6, 2]], [5, 5])]
    ]
    steps = [jnp.array([[9, 8, 7], [4, 3, 2]], jnp.int32), jnp.array([[11, 5], [12, 0]], jnp.int32)]
    logits = {}
    for model, forward, caches in [
        (config, forward_paged_mla, new_mla_caches(config, 8, PAGE_SIZE)),
        (expanded, forward_paged_mla_expanded, new_expanded_mla_caches(expanded, 8, PAGE_SIZE)),
    ]:
        run = jax.jit(forward, static_argnames=("config", "backend"))
        kept = []
        for tokens, table in zip(steps, tables, strict=True):
            out, caches = run(params, model, tokens, caches, table, backend="reference")
            kept.append(np.asarray(out))
        logits[model] = np.concatenate(kept, axis=1)
    np.testing.assert_allclose(logits[expanded], logits[config], rtol=2e-4, atol=2e-4)
    assert ExpandedMLAConfig(MLA_TINY).head_dim == 256  # 192-wide keys: the next power of two
    with pytest.raises(ValueError, match="head_dim must be at least max"):
        ExpandedMLAConfig(MLA_TEST, head_dim=16)


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(cascade="on"), "cascade='on' is not supported with an MLA target"),
        (dict(sparse="quest"), "sparse='quest' is not supported with an MLA target"),
        (dict(sparse="recent"), "sparse='recent' is not supported with an MLA target"),
        (
            dict(backend="pallas"),
            "backend='pallas' cannot run the MLA target's attention on the MLA kernel: dtype "
            "float32",
        ),
        (dict(num_speculative=16), r"num_speculative must be in \[0, 15\]"),
    ],
)
def test_unsupported_combinations_are_refused_by_name(target, zero_draft, options, message):
    draft = zero_draft if options.get("num_speculative") else None
    with pytest.raises(ValueError, match=message):
        _engine(target, draft, **options)


def _shapes_only(init, config):
    """Parameters as shapes (what the engine's checks read before it allocates anything)."""
    return jax.eval_shape(lambda: init(config, jax.random.key(0)))


def test_an_mla_draft_is_refused(target):
    llama = (TINY_DRAFT, _shapes_only(init_params, TINY_DRAFT))
    with pytest.raises(ValueError, match=r"draft\[0\] is an MLAModelConfig, but an MLA draft"):
        _engine(llama, target, num_speculative=1)


def test_pallas_is_refused_where_the_mla_kernel_cannot_run_the_page_size():
    """``MLA_TINY``'s sizes are the kernel's; a page of 4 tokens is not (8 to 64)."""
    params = _shapes_only(init_mla_model_params, MLA_TINY)
    with pytest.raises(ValueError, match="page_size must be one of"):
        _engine((MLA_TINY, params), backend="pallas")


def _record_mla_plans(monkeypatch) -> list[tuple[int, int]]:
    """Spies on ``plan_mla_decode`` (the engine imports it when it plans): the ``(num_heads,
    q_len)`` of every plan made. A plan of one short request is the same for any ``q_len``
    (never split), so comparing plans alone would not catch a wrong ``q_len``."""
    import kernels_pallas.mla_decode_mgpu as mla_kernel

    calls = []
    real = mla_kernel.plan_mla_decode

    def spy(page_table, num_heads, q_len=1, **options):
        calls.append((num_heads, q_len))
        return real(page_table, num_heads, q_len, **options)

    monkeypatch.setattr(mla_kernel, "plan_mla_decode", spy)
    return calls


def test_the_pallas_backend_plans_each_step_for_the_mla_kernel(monkeypatch):
    """On ``backend="pallas"`` with sizes the kernel takes (``MLA_TINY``, 16-token pages), the
    engine's decode inputs carry the MLA kernel's plan of the step's table (``plan_mla_decode``
    with the target's heads and ``q_len = n + 1``), made on the host; nothing is run (the
    kernel runs compiled in the ``gpu``-marked test below; interpreted, the model takes
    minutes)."""
    from kernels_pallas.mla_decode_mgpu import plan_mla_decode

    calls = _record_mla_plans(monkeypatch)
    params = _shapes_only(init_mla_model_params, MLA_TINY)
    for draft, num_speculative in [
        (None, 0),
        ((TINY_DRAFT, _shapes_only(init_params, TINY_DRAFT)), 2),
    ]:
        engine = Engine(
            (MLA_TINY, params),
            draft,
            num_pages=8,
            page_size=16,
            parallel=2,
            backend="pallas",
            num_speculative=num_speculative,
        )
        assert engine._target_kernel_plans()
        engine.submit(Request("a", [1], SamplingParams(temperature=0, max_tokens=2)))
        step = engine.scheduler.plan_step(1)  # a one-token prompt decodes at once
        calls.clear()
        inputs = engine._decode_inputs(step.decode)
        assert calls == [(MLA_TINY.attention.num_heads, num_speculative + 1)]
        calls.clear()
        expected = plan_mla_decode(inputs.page_table, 16, num_speculative + 1)
        for field in ("work_request", "work_page_start", "work_page_end", "merge_indptr"):
            np.testing.assert_array_equal(getattr(inputs.plan, field), getattr(expected, field))
        assert len(inputs.draft_plans) == (num_speculative + 1 if num_speculative else 0)
        assert all(plan is not None for plan in inputs.draft_plans)  # the draft's own kernel


def test_the_pallas_backend_plans_each_absorbed_prefill_chunk(monkeypatch):
    """A prefill chunk the MLA kernel runs (absorbed: shorter than 171 tokens at these sizes)
    reaches ``prefill_step`` with its plan (``plan_mla_decode`` with ``q_len`` the chunk's
    length); the program itself is not run (a spy stands in for it)."""
    from kernels_pallas.mla_decode_mgpu import plan_mla_decode

    seen = []

    def spy(*args, **static):
        seen.append(args)
        return args[2], args[3]

    monkeypatch.setattr(programs, "prefill_step_jit", spy)
    calls = _record_mla_plans(monkeypatch)
    params = _shapes_only(init_mla_model_params, MLA_TINY)
    engine = Engine((MLA_TINY, params), num_pages=8, page_size=16, parallel=2, backend="pallas")
    engine.submit(Request("a", list(range(1, 22)), SamplingParams(temperature=0, max_tokens=2)))
    for chunk in engine.scheduler.plan_step(1).prefill:
        engine._run_prefill_chunk(chunk)
    lengths = []
    for args in seen:
        token_ids, table, plan = args[4:]
        lengths.append(token_ids.shape[1])
        expected = plan_mla_decode(table, 16, token_ids.shape[1])
        for field in ("work_request", "work_page_start", "work_page_end", "merge_indptr"):
            np.testing.assert_array_equal(getattr(plan, field), getattr(expected, field))
    assert lengths == [16, 4]  # 20 tokens to prefill: power-of-two chunks
    heads = MLA_TINY.attention.num_heads
    assert calls[: len(lengths)] == [(heads, length) for length in lengths]


def test_cascade_auto_decodes_plainly_and_the_bound_is_the_mla_kernels(target):
    engine = _engine(target, cascade="auto")
    assert engine.mla and engine.max_verified_tokens == max_verified_tokens(MLA_TEST) == 16


def test_bad_mla_params_are_refused_by_name(target):
    config, params = target
    bad = dict(params, lm_head=params["lm_head"][:, :10])
    with pytest.raises(ValueError, match="params 'lm_head' has shape"):
        _engine((config, bad))


# --- the command line ------------------------------------------------------------------------


def test_the_command_lines_mla_models_are_mla_config_s():
    assert set(MLA_MODEL_NAMES) == set(MLA_MODELS)


def test_command_line_generates_with_mla_test_and_the_draft(capsys):
    """``--model mla-test`` through the engine, speculating with the trained draft (random
    target weights of ``MLA_WEIGHTS_SEED``: the bytes are noise, and the run says so)."""
    argv = ["generate", "--model", "mla-test", "--prompt", "Hi", "--prompt", "abc"]
    argv += ["--max-tokens", "3", "--speculative", "2", "--backend", "reference", "--stats"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "--- prompt 1 ---" in out and "--- prompt 2 ---" in out
    assert f"mla-test has random weights (seed {MLA_WEIGHTS_SEED}): its bytes are noise" in err
    assert "6 tokens in" in err and "acceptance alpha" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cascade", "on"], "--cascade on is not supported with --model mla-test"),
        (["--sparse", "quest"], "--sparse quest is not supported with --model mla-test"),
        (["--speculative", "16"], "--speculative must be in [0, 15]"),
    ],
)
def test_command_line_refuses_what_an_mla_target_cannot_run(flags, message, capsys):
    assert main(["generate", "--model", "mla-test", "--prompt", "a", *flags]) == 2
    assert message in capsys.readouterr().err


# --- the kernel --------------------------------------------------------------------------------


@pytest.mark.gpu
def test_the_engine_on_the_mla_kernel_gives_the_references_output():
    """On a GPU: ``MLA_TINY``'s attention sizes in float16 (the kernel's; float16 rather than
    bfloat16 so that rounding is 8 times finer and greedy near-ties rarer), chunked prefill,
    decode and speculative verification with the trained draft, backend ``"pallas"`` (the MLA
    kernel with the engine's host plans) against ``"reference"``: the same greedy tokens, and
    the report names the kernel."""
    config = dataclasses.replace(
        MLA_TINY, attention=dataclasses.replace(MLA_TINY.attention, dtype="float16")
    )
    params = init_mla_model_params(config, jax.random.key(2))
    draft = model_files.load_model(DRAFT_WEIGHTS)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, 256, n)) for n in (37, 5, 20)]
    requests = lambda: [
        Request(i, [int(t) for t in p], SamplingParams(temperature=0, max_tokens=8))
        for i, p in enumerate(prompts)
    ]
    # Chunks of 16, and of 128: the kernel then takes a whole 37-token prompt as one absorbed
    # chunk (37 query rows a head, past the verification steps' 16; up to 170 at these sizes).
    for num_speculative, chunk in [(0, 16), (3, 16), (0, 128)]:
        outputs, reports = {}, {}
        for backend in ("reference", "pallas"):
            engine = Engine(
                (config, params),
                draft if num_speculative else None,
                num_pages=32,
                page_size=16,
                parallel=2,
                backend=backend,
                num_speculative=num_speculative,
                prefill_chunk_size=chunk,
            )
            outputs[backend] = _tokens(engine.generate(requests()))
            reports[backend] = engine.backend_report()
        assert outputs["pallas"] == outputs["reference"], (num_speculative, chunk)
        assert "mla_decode_mgpu" in reports["pallas"]["decode: attention"]
        assert "mla_decode_mgpu" in reports["pallas"]["prefill: attention"]
