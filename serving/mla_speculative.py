"""Speculative decoding of the MLA decoder with a Llama-style draft, outside the engine.

The target is an ``MLAModelConfig`` model over latent caches (``serving.mla_model``); the draft
a ``serving.config.ModelConfig`` model over ``paged.KVCache`` pools (the trained tiny draft of
``serving/weights/`` shares the byte vocabulary). Both sets of pools are indexed by one page
table a row, from one ``paged.PagePool``. A step follows ``serving.programs.decode_step``:

1. Draft pass ``j = 0 .. n``: the draft runs one token a row (the row's last token, then its
   drafts), its table covering ``cached + j + 1`` tokens; pass ``j < n`` draws draft
   ``d_{j+1}`` with ``speculative.sample_draft`` (key ``fold_in(step key, j + 1)``) and keeps the
   ``q`` it drew from; pass ``n`` only writes ``d_n``'s keys and values.
2. The target verifies ``L = n + 1`` tokens (the last token and the drafts) in one
   ``forward_paged_mla`` call: the verification shape, absorbed (``paged.mla_decode_attention``
   with ``q_len = n + 1``).
3. ``speculative.chain_speculative_sampling`` accepts ``a`` drafts and emits ``a + 1`` tokens,
   distributed as the target's sampler (at temperature 0: exactly greedy decoding's tokens).

``cached`` (the tokens whose keys are in both caches) then grows by ``a + 1``: the last token
and the accepted drafts. Entries written past it (rejected drafts) are overwritten by later
steps; no page is returned early. Prompts are prefilled into both models chunk by chunk, and
the first token is drawn from the target's last prompt logits, as the engine does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import paged
import speculative
from serving import model as model_lib
from serving.config import ModelConfig
from serving.mla_config import MLAModelConfig
from serving.mla_generate import (
    absorbed_plan,
    check_generate_arguments,
    draw_tokens,
    forward_paged_mla_jit,
    row_key_data,
    row_sampling_params,
)
from serving.mla_model import forward_paged_mla, new_mla_caches

_forward_draft = jax.jit(
    model_lib.forward_paged, static_argnames=("config", "backend"), donate_argnames=("caches",)
)


@functools.partial(
    jax.jit,
    static_argnames=("target_config", "draft_config", "num_speculative", "backend"),
    donate_argnames=("target_caches", "draft_caches"),
)
def speculative_step(
    target_params,
    draft_params,
    target_caches,
    draft_caches,
    last_token_ids,
    key_data,
    num_generated,
    row_params: dict,
    target_table: paged.PageTable,
    draft_tables: tuple[paged.PageTable, ...],
    target_plan: paged.DecodePlan | None = None,
    *,
    target_config: MLAModelConfig,
    draft_config: ModelConfig,
    num_speculative: int,
    backend: str,
):
    """One step of ``B`` rows (module docstring), one program.

    Args:
      target_params, draft_params: the two models' parameters.
      target_caches: the target's ``LatentCache`` list; draft_caches: the draft's ``KVCache``
        list (both donated).
      last_token_ids: int32[B], each row's last emitted token (not yet in either cache).
      key_data: uint32[B, 2], each row's key; num_generated: int32[B], its tokens so far (the
        step key is ``fold_in(row key, num_generated)``).
      row_params: ``temperature``, ``top_k``, ``top_p`` arrays ``[B]`` (filters off: ``V``,
        1.0).
      target_table: rows covering ``cached + n + 1`` tokens.
      draft_tables: ``n + 1`` tables, table ``j`` covering ``cached + j + 1`` tokens.
      target_plan: the MLA kernel's plan of ``target_table`` (``absorbed_plan``), or None.
      target_config, draft_config, num_speculative, backend: static.

    Returns:
      ``(token_ids int32[B, n + 1], num_accepted int32[B], target_caches, draft_caches)``: row
      ``b`` emitted ``token_ids[b, :num_accepted[b] + 1]``.
    """
    n = num_speculative
    keys = jax.vmap(lambda data, count: jax.random.fold_in(jax.random.wrap_key_data(data), count))(
        key_data, num_generated
    )
    fed, drafts, draft_probs = last_token_ids, [], []
    for j in range(n + 1):
        draft_logits, draft_caches = model_lib.forward_paged(
            draft_params, draft_config, fed[:, None], draft_caches, draft_tables[j], backend=backend
        )
        if j == n:  # the last pass only writes d_n's keys and values
            break
        draft_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, j + 1)
        fed, q = speculative.sample_draft(
            draft_keys, draft_logits[:, 0], **row_params, backend=backend
        )
        drafts.append(fed)
        draft_probs.append(q)
    draft_token_ids = jnp.stack(drafts, axis=1)  # [B, n]
    verified = jnp.concatenate([last_token_ids[:, None], draft_token_ids], axis=1)
    target_logits, target_caches = forward_paged_mla(
        target_params,
        target_config,
        verified,
        target_caches,
        target_table,
        plan=target_plan,
        backend=backend,
    )
    target_probs = speculative.sampling_distribution(
        target_logits.astype(jnp.float32), **row_params
    )
    token_ids, num_accepted = speculative.chain_speculative_sampling(
        keys, jnp.stack(draft_probs, axis=1), draft_token_ids, target_probs, backend=backend
    )
    return token_ids, num_accepted, target_caches, draft_caches


def speculative_generate_mla(
    target_params,
    target_config: MLAModelConfig,
    draft_params,
    draft_config: ModelConfig,
    prompts: list[list[int]],
    *,
    num_speculative: int,
    max_new_tokens: int,
    page_size: int = 16,
    num_pages: int = 64,
    chunk_size: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    backend: str = "auto",
) -> tuple[list[list[int]], tuple[int, int]]:
    """Continues every prompt by ``max_new_tokens`` tokens with ``num_speculative`` drafts a step.

    Arguments as ``serving.mla_generate.generate_mla``, plus the draft and
    ``num_speculative >= 1``. Rows step together until every row has its tokens; a row's
    extra tokens are cut.

    Returns:
      ``(generated, (drafted, accepted))``: each prompt's tokens, and the drafts proposed and
      accepted over the steps (every row of every step counted).

    Raises:
      ValueError: what ``generate_mla`` refuses; a draft that is not a ``ModelConfig`` or whose
        vocabulary differs from the target's; ``num_speculative`` below 1.
    """
    check_generate_arguments(
        target_config,
        prompts,
        max_new_tokens,
        chunk_size,
        page_size,
        num_pages,
        temperature,
        top_k,
        top_p,
    )
    if not isinstance(draft_config, ModelConfig):
        raise ValueError(f"draft_config must be a serving.config.ModelConfig, got {draft_config!r}")
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"the draft's vocab_size={draft_config.vocab_size} differs from the target's "
            f"{target_config.vocab_size}"
        )
    if isinstance(num_speculative, bool) or not isinstance(num_speculative, int):
        raise ValueError(f"num_speculative must be an int >= 1, got {num_speculative!r}")
    if num_speculative < 1:
        raise ValueError(f"num_speculative must be an int >= 1, got {num_speculative!r}")
    n, batch, vocab = num_speculative, len(prompts), target_config.vocab_size
    pool = paged.PagePool(num_pages)
    target_caches = new_mla_caches(
        target_config, num_pages, page_size, dtype=target_params["embed"].dtype
    )
    draft_caches = model_lib.new_caches(draft_config, num_pages, page_size, layout="NHD")
    # A row may end a step up to n tokens past max_new_tokens, with n + 1 more written.
    longest = [len(p) + max_new_tokens + 2 * n + 1 for p in prompts]
    num_indices = paged.bucket_size(sum(-(-length // page_size) for length in longest))
    key_data = row_key_data(seed, batch)
    row_params = row_sampling_params(batch, vocab, temperature, top_k, top_p)

    def table(page_lists, lengths):
        return paged.host_page_table(page_lists, lengths, page_size, num_indices=num_indices)

    def grow(row, page_lists, length):
        missing = -(-length // page_size) - len(page_lists[row])
        if missing > 0:
            page_lists[row] += pool.allocate(missing)

    page_lists: list[list[int]] = [[] for _ in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    cached = [len(p) for p in prompts]
    drafted = accepted = 0
    try:
        for row, prompt in enumerate(prompts):
            grow(row, page_lists, len(prompt))
            prompt_table = table([page_lists[row]], [len(prompt)])
            tokens = jnp.asarray([prompt], jnp.int32)
            for chunk in paged.prefill_chunks(prompt_table, len(prompt), chunk_size):
                piece = tokens[:, chunk.start : chunk.stop]
                logits, target_caches = forward_paged_mla_jit(
                    target_params,
                    target_config,
                    piece,
                    target_caches,
                    chunk.page_table,
                    attention_form="auto",
                    plan=absorbed_plan(
                        chunk.page_table, target_config, chunk.stop - chunk.start, "auto", backend
                    ),
                    backend=backend,
                )
                _, draft_caches = _forward_draft(
                    draft_params,
                    draft_config,
                    piece,
                    draft_caches,
                    chunk.page_table,
                    backend=backend,
                )
            first = draw_tokens(
                logits[:, -1],
                key_data[row : row + 1],
                jnp.zeros((1,), jnp.int32),
                {name: values[row : row + 1] for name, values in row_params.items()},
                backend=backend,
            )
            generated[row].append(int(first[0]))
        while min(len(tokens) for tokens in generated) < max_new_tokens:
            for row in range(batch):
                grow(row, page_lists, cached[row] + n + 1)
            target_table = table(page_lists, [length + n + 1 for length in cached])
            draft_tables = tuple(
                table(page_lists, [length + j + 1 for length in cached]) for j in range(n + 1)
            )
            token_ids, num_accepted, target_caches, draft_caches = speculative_step(
                target_params,
                draft_params,
                target_caches,
                draft_caches,
                jnp.asarray([tokens[-1] for tokens in generated], jnp.int32),
                key_data,
                jnp.asarray([len(tokens) for tokens in generated], jnp.int32),
                row_params,
                target_table,
                draft_tables,
                absorbed_plan(target_table, target_config, n + 1, "auto", backend),
                target_config=target_config,
                draft_config=draft_config,
                num_speculative=n,
                backend=backend,
            )
            token_ids, num_accepted = np.asarray(token_ids), np.asarray(num_accepted)
            for row in range(batch):
                count = int(num_accepted[row])
                generated[row] += token_ids[row, : count + 1].tolist()
                cached[row] += count + 1
                drafted, accepted = drafted + n, accepted + count
    finally:
        for pages in page_lists:
            pool.free(pages)
    return [tokens[:max_new_tokens] for tokens in generated], (drafted, accepted)
