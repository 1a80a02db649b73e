"""Generation with the MLA decoder, outside the engine: chunked prefill, then batched decode.

``serving.engine.Engine`` runs an ``MLAModelConfig`` target too (``python -m serving generate
--model mla-tiny``); this module runs one the same way in a plain loop, the reference the
engine's MLA path is tested against (``tests/test_engine_mla.py``), exercising every path of
``serving.mla_model.forward_paged_mla`` end to end:

- pages come from a ``paged.PagePool``: a prompt's pages when it is prefilled, one more page
  for a row when its next token starts a page, all freed at the end;
- each prompt is prefilled alone, in chunks of ``chunk_size`` tokens (``paged.prefill_chunks``;
  the form of each chunk is ``attention_form``'s choice for its length);
- then all rows decode together, one token a step (under ``"auto"`` absorbed:
  ``paged.mla_decode_attention``, with the kernel's host plan where the kernels' backend is
  chosen, ``absorbed_plan``);
- each token is drawn as the engine draws it: ``sampling.tempered.tempered_probs`` (one-hot at
  the arg max at temperature 0), then ``sampling.filtered_sample`` with the row's ``top_k`` and
  ``top_p``, with the key ``fold_in(fold_in(key(seed), row), tokens generated so far)``.

Every table is padded to one ``page_indices`` length, so the decode step compiles once and a
prefill chunk once per chunk length.

Command line (random weights from ``--seed``: the bytes are noise; the point is the path)::

    python -m serving.mla_generate --model mla-tiny --prompt "Hello" --max-tokens 16

``--speculative N`` drafts N tokens a step with the trained tiny draft of ``serving/weights/``
and verifies them with the MLA model (``serving/mla_speculative.py``).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import paged
import sampling
from kernels_pallas.platform import resolve_backend
from sampling.tempered import tempered_probs
from serving import model_files
from serving.mla_config import MLA_MODELS, MLAModelConfig
from serving.mla_model import (
    ATTENTION_FORMS,
    choose_attention_form,
    forward_paged_mla,
    init_mla_model_params,
    new_mla_caches,
)

# The trained byte-level draft (serving/train_tiny.py), the one the engine's demo speculates with.
DRAFT_WEIGHTS = pathlib.Path(model_files.__file__).parent / "weights" / "draft"

# The jitted paged forward (one compiled program a step shape), shared with the speculative loop.
forward_paged_mla_jit = jax.jit(
    forward_paged_mla,
    static_argnames=("config", "attention_form", "backend"),
    donate_argnames=("caches",),
)


@functools.partial(jax.jit, static_argnames=("backend",))
def draw_tokens(logits, key_data, num_generated, row_params: dict, *, backend: str):
    """int32[B]: a token from each row's logits ``[B, V]``, as the engine draws it.

    ``tempered_probs`` at the row's temperature (one-hot at the arg max at 0), then
    ``sampling.filtered_sample`` with its ``top_k`` and ``top_p`` (``row_params``: arrays
    ``[B]``; ``V`` and 1.0 disable them), key ``fold_in(row key, num_generated)``.
    """
    keys = jax.vmap(lambda data, count: jax.random.fold_in(jax.random.wrap_key_data(data), count))(
        key_data, num_generated
    )
    probs = tempered_probs(logits.astype(jnp.float32), row_params["temperature"])
    return sampling.filtered_sample(
        keys, probs, top_k=row_params["top_k"], top_p=row_params["top_p"], backend=backend
    )


def row_key_data(seed: int, batch: int) -> jax.Array:
    """uint32[B, 2]: row ``b``'s key, ``fold_in(key(seed), b)``."""
    base = jax.random.key(seed)
    return jnp.stack([jax.random.key_data(jax.random.fold_in(base, row)) for row in range(batch)])


def row_sampling_params(batch, vocab, temperature, top_k, top_p) -> dict:
    """The rows' sampling parameters as ``draw_tokens`` takes them (disabled filters: ``V``,
    1.0)."""
    return dict(
        temperature=jnp.full((batch,), temperature, jnp.float32),
        top_k=jnp.full((batch,), vocab if top_k is None else top_k, jnp.int32),
        top_p=jnp.full((batch,), 1.0 if top_p is None else top_p, jnp.float32),
    )


def check_generate_arguments(
    config,
    prompts,
    max_new_tokens,
    chunk_size,
    page_size,
    num_pages,
    temperature,
    top_k=None,
    top_p=None,
) -> None:
    """The checks ``generate_mla`` (and the speculative loop) make; ValueError naming the
    argument and the value. The sampling parameters follow ``serving.requests.SamplingParams``'s
    rules (under ``jit`` the samplers cannot refuse them: ``top_k = 0`` or ``top_p = 0`` would
    draw silently)."""
    if not isinstance(config, MLAModelConfig):
        raise ValueError(f"config must be an MLAModelConfig, got {config!r}")
    if not prompts:
        raise ValueError("prompts must hold at least one prompt, got none")
    for index, prompt in enumerate(prompts):
        if len(prompt) < 1:
            raise ValueError(f"prompts[{index}] is empty; a prompt needs at least one token")
        not_ids = [t for t in prompt if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
        if not_ids:  # a float would be truncated to an id by jnp.asarray(..., int32)
            raise ValueError(f"prompts[{index}] holds {not_ids[0]!r}, not an integer token id")
        bad = [t for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(
                f"prompts[{index}] holds token {bad[0]!r}, outside the vocabulary "
                f"[0, {config.vocab_size})"
            )
    for name, value in [
        ("max_new_tokens", max_new_tokens),
        ("chunk_size", chunk_size),
        ("page_size", page_size),
        ("num_pages", num_pages),
    ]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(temperature, bool) or not (
        isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")
    ):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 (or None for no top-k), got {top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1
    ):
        raise ValueError(f"top_p must be a number in (0, 1] (or None), got {top_p!r}")


def absorbed_plan(table, config: MLAModelConfig, q_len: int, attention_form: str, backend: str):
    """The Mosaic GPU MLA kernel's split-KV plan for a step of ``q_len`` new tokens a row over
    ``table``, made on the host, where that kernel may run the step: the step is absorbed and
    ``backend`` resolves to the kernels (``"pallas"``; ``"auto"`` on a GPU). Under ``jit`` the
    kernel needs one (``paged.mla_decode_attention``); elsewhere None."""
    if choose_attention_form(attention_form, config, q_len) != "absorbed":
        return None
    if resolve_backend(backend) != "pallas":
        return None
    from kernels_pallas.mla_decode_mgpu import plan_mla_decode  # Mosaic GPU: imported late

    return plan_mla_decode(table, config.attention.num_heads, q_len)


def _pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def generate_mla(
    params,
    config: MLAModelConfig,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    page_size: int = 16,
    num_pages: int = 64,
    chunk_size: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    attention_form: str = "auto",
    backend: str = "auto",
) -> list[list[int]]:
    """Continues every prompt by ``max_new_tokens`` tokens (module docstring).

    Args:
      params: ``serving.mla_model.init_mla_model_params``'s dict (float64 ones need x64 on).
      config: the model.
      prompts: token ids in ``[0, V)``, each prompt at least one token.
      max_new_tokens: tokens to generate a prompt, ``>= 1``.
      page_size, num_pages: the latent pools' pages (every layer's pool alike).
      chunk_size: prefill chunk length, ``>= 1``.
      temperature: ``>= 0``; 0 is greedy.
      top_k, top_p: the samplers' filters (None: off).
      seed: the generation's random key.
      attention_form, backend: passed to ``forward_paged_mla``; ``backend`` to the sampler too.

    Returns:
      Each prompt's generated token ids.

    Raises:
      ValueError: naming the argument, for an empty prompt list or prompt, a token outside the
        vocabulary, a count below 1, a negative or infinite temperature, a top_k below 1, a
        top_p outside (0, 1], an unknown form; and
        ``paged.PoolExhaustedError`` (a ValueError) when ``num_pages`` cannot hold every row.
    """
    check_generate_arguments(
        config, prompts, max_new_tokens, chunk_size, page_size, num_pages, temperature, top_k, top_p
    )
    if attention_form not in ATTENTION_FORMS:
        raise ValueError(f"attention_form must be one of {ATTENTION_FORMS}, got {attention_form!r}")

    batch = len(prompts)
    pool = paged.PagePool(num_pages)
    caches = new_mla_caches(config, num_pages, page_size, dtype=params["embed"].dtype)
    final_pages = sum(_pages_for(len(p) + max_new_tokens, page_size) for p in prompts)
    num_indices = paged.bucket_size(final_pages)  # one static table shape for every step
    key_data = row_key_data(seed, batch)
    row_params = row_sampling_params(batch, config.vocab_size, temperature, top_k, top_p)

    def draw(logits, rows, num_generated):
        return draw_tokens(
            logits,
            key_data[rows],
            jnp.full((len(rows),), num_generated, jnp.int32),
            {name: values[rows] for name, values in row_params.items()},
            backend=backend,
        )

    page_lists: list[list[int]] = []
    seq_lens = [0] * batch
    generated: list[list[int]] = [[] for _ in prompts]
    try:
        # Prefill: each prompt alone, chunk by chunk; its last logits give its first token.
        for row, prompt in enumerate(prompts):
            page_lists.append(pool.allocate(_pages_for(len(prompt), page_size)))
            seq_lens[row] = len(prompt)
            table = paged.host_page_table(
                [page_lists[row]], [len(prompt)], page_size, num_indices=num_indices
            )
            tokens = jnp.asarray([prompt], jnp.int32)
            for chunk in paged.prefill_chunks(table, len(prompt), chunk_size):
                logits, caches = forward_paged_mla_jit(
                    params,
                    config,
                    tokens[:, chunk.start : chunk.stop],
                    caches,
                    chunk.page_table,
                    attention_form=attention_form,
                    plan=absorbed_plan(
                        chunk.page_table, config, chunk.stop - chunk.start, attention_form, backend
                    ),
                    backend=backend,
                )
            first = draw(logits[:, -1], np.array([row]), 0)
            generated[row].append(int(first[0]))
        # Decode: every row one token a step, a page added where a token starts one.
        all_rows = np.arange(batch)
        for step in range(1, max_new_tokens):
            for row in range(batch):
                seq_lens[row] += 1
                if _pages_for(seq_lens[row], page_size) > len(page_lists[row]):
                    page_lists[row] += pool.allocate(1)
            table = paged.host_page_table(page_lists, seq_lens, page_size, num_indices=num_indices)
            last = jnp.asarray([[tokens_so_far[-1]] for tokens_so_far in generated], jnp.int32)
            logits, caches = forward_paged_mla_jit(
                params,
                config,
                last,
                caches,
                table,
                attention_form=attention_form,
                plan=absorbed_plan(table, config, 1, attention_form, backend),
                backend=backend,
            )
            for row, token in enumerate(np.asarray(draw(logits[:, 0], all_rows, step))):
                generated[row].append(int(token))
    finally:
        for pages in page_lists:
            pool.free(pages)
    return generated


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serving.mla_generate",
        description="Continue byte prompts with an MLA decoder of random weights (chunked "
        "prefill, batched decode over the latent cache); generated bytes on stdout, a summary "
        "on stderr.",
    )
    parser.add_argument("--model", default="mla-tiny", choices=sorted(MLA_MODELS))
    parser.add_argument("--prompt", action="append", required=True, metavar="TEXT")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0, help="weights' and sampling's seed")
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=64)
    parser.add_argument("--attention-form", default="auto", choices=ATTENTION_FORMS)
    parser.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="N",
        help="draft N tokens a step with the trained tiny draft of serving/weights/ and verify "
        "them with the MLA model (serving/mla_speculative.py); 0: plain decoding",
    )
    parser.add_argument("--backend", default="auto", choices=("auto", "reference", "pallas"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; returns 0, or 2 for a value the library refused (named on stderr)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.speculative and args.attention_form != "auto":
        # The speculative loop chooses each step's form itself (absorbed verification).
        parser.error("--attention-form applies to plain decoding only, not with --speculative")
    config = MLA_MODELS[args.model]
    prompts = [list(text.encode("utf-8")) for text in args.prompt]
    try:
        params = init_mla_model_params(config, jax.random.key(args.seed))
        start = time.perf_counter()
        common = dict(
            max_new_tokens=args.max_tokens,
            page_size=args.page_size,
            num_pages=args.num_pages,
            chunk_size=args.chunk_size,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            backend=args.backend,
        )
        acceptance = None
        if args.speculative:
            from serving.mla_speculative import speculative_generate_mla  # imports this module

            draft_config, draft_params = model_files.load_model(DRAFT_WEIGHTS)
            outputs, acceptance = speculative_generate_mla(
                params,
                config,
                draft_params,
                draft_config,
                prompts,
                num_speculative=args.speculative,
                **common,
            )
        else:
            outputs = generate_mla(
                params, config, prompts, attention_form=args.attention_form, **common
            )
        elapsed = time.perf_counter() - start
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for index, tokens in enumerate(outputs, start=1):
        print(f"[{index}] {bytes(tokens).decode('utf-8', errors='replace')!r}")
    total = sum(len(tokens) for tokens in outputs)
    print(
        f"{args.model}: {len(outputs)} prompt(s), {total} tokens in {elapsed:.2f} s "
        "(compilation included; random weights)",
        file=sys.stderr,
    )
    if acceptance is not None:
        drafted, accepted = acceptance
        print(f"drafts accepted: {accepted} of {drafted}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
