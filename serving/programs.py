"""The engine's jitted programs: one decode (or verification) step, one prefill chunk.

One decode step, one program
----------------------------
On the GPU host a jitted call costs about 35 us to dispatch, more than a layer's kernels at
small batch, so a step is never a chain of small calls. The decode program holds every layer of
the ``n + 1`` draft passes, the target's verification of ``n + 1`` positions, the sampling and
the acceptance test. Its shapes are static: ``B = parallel`` rows always (idle slots are phantom
rows on the scheduler's padding page), ``page_indices`` padded to ``paged.bucket_size``, so it
compiles once per bucket (and per split-KV plan variant on the Pallas path, ``paged.plan``),
never per sequence length. Prefill chunks have power-of-two lengths (the scheduler's rule), one
program per length and table bucket. The step's host arrays (tokens, keys, sampling parameters,
page tables, plans) travel as one int32 buffer (``serving/host_inputs.py``): one
host-to-device copy a step, not one an array.

Sampling (keys: ``serving/keys.py``)
------------------------------------
- Plain decoding (``num_speculative = 0``): the target's logits at the fed token, tempered
  (``speculative.tempered_probs``: ``softmax(logits / T)``; temperature 0 is one-hot at the
  lowest-index arg max, the samplers' convention), then ``sampling.filtered_sample`` with the
  row's top-k, top-p and min-p (disabled filters: ``top_k = V``, ``top_p = 1``, ``min_p = 0``).
  Key: the step key.
- Speculative decoding (``n`` drafts): draft pass ``j < n`` draws ``d_{j+1}`` with
  ``speculative.sample_draft`` under the row's own parameters, with key ``fold_in(step key, j +
  1)``, and keeps the ``q`` it drew from; pass ``n`` only writes ``d_n``'s keys and values (the
  scheduler's cache contract). The target runs ``L = n + 1`` tokens (the last token and the
  drafts); ``p = speculative.sampling_distribution`` of its logits with the row's parameters;
  ``speculative.chain_speculative_sampling(step key, q, drafts, p)`` decides.
- Mixed batches (greedy and sampled rows together) need no select: at temperature 0,
  ``sampling_distribution`` and ``sample_draft`` give one-hot ``p`` and ``q`` at the arg max,
  and chain sampling with one-hot distributions accepts a draft exactly when it is the target's
  arg max and otherwise emits the target's arg max (the residual ``max(p - q, 0)`` is ``p``'s
  one-hot): ``chain_greedy_verify``'s semantics, row by row, with no random number mattering.
  ``tests/test_engine.py`` checks that equality on random logits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import paged
import sampling
import speculative
from serving import host_inputs
from serving import model as model_lib
from serving.config import ModelConfig
from serving.keys import step_keys


class DecodeInputs(NamedTuple):
    """A decode step's device inputs (a pytree; shapes static per table bucket).

    Attributes:
      token_ids: int32[B], each row's last token.
      key_data: uint32[B, 2], each row's request key (``jax.random.key_data``).
      num_generated: int32[B], tokens each row's request has generated (folded into its key).
      temperature, top_p, min_p: float32[B]; top_k: int32[B] (``V`` when disabled).
      page_table: the target's table, rows covering ``positions + n + 1`` tokens.
      draft_page_tables: ``n + 1`` tables, draft pass ``j``'s rows covering ``positions + j +
        1`` tokens (empty without speculation).
      plan, draft_plans: split-KV plans for the Pallas attention (None on the reference).
    """

    token_ids: jax.Array
    key_data: jax.Array
    num_generated: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    page_table: paged.PageTable
    draft_page_tables: tuple[paged.PageTable, ...]
    plan: paged.DecodePlan | None
    draft_plans: tuple[paged.DecodePlan | None, ...]


class DecodeResult(NamedTuple):
    """A decode step's outputs.

    Attributes:
      token_ids: int32[B, n + 1], row ``b`` emitted ``token_ids[b, :num_accepted[b] + 1]``
        (``-1`` after).
      num_accepted: int32[B] in ``[0, n]`` (0 without speculation).
      draft_token_ids: int32[B, n], the drafts fed to the target.
    """

    token_ids: jax.Array
    num_accepted: jax.Array
    draft_token_ids: jax.Array


def decode_step(
    target_params,
    draft_params,
    target_caches,
    draft_caches,
    inputs: DecodeInputs,
    previous_token_ids: jax.Array | None = None,
    *,
    target_config: ModelConfig,
    draft_config: ModelConfig | None,
    num_speculative: int,
    backend: str,
) -> tuple[DecodeResult, list[paged.KVCache], list[paged.KVCache] | None]:
    """One decode (or verification) step of ``B`` rows: draft passes, target, sampling, acceptance.

    Args:
      target_params, draft_params: parameter pytrees (``draft_params`` None without a draft).
      target_caches, draft_caches: per-layer ``paged.KVCache`` lists (donated under ``jit``).
      inputs: the ``DecodeInputs``.
      previous_token_ids: int32[B, 1], the previous step's ``DecodeResult.token_ids``, still on
        the device (overlapped steps): a row whose ``inputs.token_ids`` is negative (the
        scheduler's ``UNRESOLVED_TOKEN``) feeds the token its slot sampled there. None: every
        row's token comes from ``inputs``.
      target_config, draft_config: the models (static).
      num_speculative: ``n`` (static); 0 is plain decoding.
      backend: for every op (static).

    Returns:
      ``(DecodeResult, target_caches, draft_caches)``.
    """
    n = num_speculative
    if previous_token_ids is not None:
        fed = jnp.where(inputs.token_ids < 0, previous_token_ids[:, 0], inputs.token_ids)
        inputs = inputs._replace(token_ids=fed)
    keys = step_keys(inputs.key_data, inputs.num_generated)
    row_params = dict(
        temperature=inputs.temperature, top_k=inputs.top_k, top_p=inputs.top_p, min_p=inputs.min_p
    )
    if n == 0:
        logits, target_caches = model_lib.forward_paged(
            target_params,
            target_config,
            inputs.token_ids[:, None],
            target_caches,
            inputs.page_table,
            plan=inputs.plan,
            backend=backend,
        )
        tokens = sampling.filtered_sample(
            keys,
            speculative.tempered_probs(logits[:, 0].astype(jnp.float32), inputs.temperature),
            top_k=inputs.top_k,
            top_p=inputs.top_p,
            min_p=inputs.min_p,
            backend=backend,
        )
        batch = tokens.shape[0]
        result = DecodeResult(
            tokens[:, None], jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, 0), jnp.int32)
        )
        return result, target_caches, draft_caches

    fed = inputs.token_ids
    drafts, draft_probs = [], []
    for j in range(n + 1):
        draft_logits, draft_caches = model_lib.forward_paged(
            draft_params,
            draft_config,
            fed[:, None],
            draft_caches,
            inputs.draft_page_tables[j],
            plan=inputs.draft_plans[j],
            backend=backend,
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
    verified = jnp.concatenate([inputs.token_ids[:, None], draft_token_ids], axis=1)
    target_logits, target_caches = model_lib.forward_paged(
        target_params,
        target_config,
        verified,
        target_caches,
        inputs.page_table,
        plan=inputs.plan,
        backend=backend,
    )
    target_probs = speculative.sampling_distribution(target_logits, **row_params)  # [B, n+1, V]
    token_ids, num_accepted = speculative.chain_speculative_sampling(
        keys, jnp.stack(draft_probs, axis=1), draft_token_ids, target_probs, backend=backend
    )
    return DecodeResult(token_ids, num_accepted, draft_token_ids), target_caches, draft_caches


def prefill_step(
    target_params,
    draft_params,
    target_caches,
    draft_caches,
    token_ids: jax.Array,
    page_table: paged.PageTable,
    *,
    target_config: ModelConfig,
    draft_config: ModelConfig | None,
    backend: str,
):
    """Writes one prompt chunk's keys and values into both caches (its logits are not needed:
    the scheduler prefills up to, not including, a prompt's last token).

    Args:
      token_ids: int32[1, L], the chunk.
      page_table: one row covering the chunk's end.

    Returns:
      ``(target_caches, draft_caches)``.
    """
    _, target_caches = model_lib.forward_paged(
        target_params, target_config, token_ids, target_caches, page_table, backend=backend
    )
    if draft_config is not None:
        _, draft_caches = model_lib.forward_paged(
            draft_params, draft_config, token_ids, draft_caches, page_table, backend=backend
        )
    return target_caches, draft_caches


def packed_decode_step(
    target_params,
    draft_params,
    target_caches,
    draft_caches,
    packed_inputs,
    previous_token_ids=None,
    *,
    packing,
    **static,
):
    """``decode_step`` on ``DecodeInputs`` packed by ``serving.host_inputs.pack`` into one int32
    buffer: the step's host arrays reach the device in one copy, not twenty."""
    inputs = host_inputs.unpack(packed_inputs, packing)
    return decode_step(
        target_params,
        draft_params,
        target_caches,
        draft_caches,
        inputs,
        previous_token_ids,
        **static,
    )


_STATIC = ("target_config", "draft_config", "backend")
decode_step_jit = jax.jit(
    packed_decode_step,
    static_argnames=(*_STATIC, "num_speculative", "packing"),
    donate_argnames=("target_caches", "draft_caches"),
)
prefill_step_jit = jax.jit(
    prefill_step, static_argnames=_STATIC, donate_argnames=("target_caches", "draft_caches")
)


def abstract(tree):
    """The same pytree with every array replaced by its shape and dtype (for tracing later,
    after the arrays themselves were donated)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
