"""The engine's jitted programs: one decode (or verification) step, several plain decode steps,
one prefill chunk.

One decode step, one program
----------------------------
On the GPU host a jitted call costs about 35 us to dispatch, more than a layer's kernels at
small batch, so a step is never a chain of small calls. The decode program holds every layer of
the ``n + 1`` draft passes, the target's verification of ``n + 1`` positions, the sampling and
the acceptance test. Its shapes are static: ``B = parallel`` rows always (idle slots are phantom
rows on the scheduler's padding page), ``page_indices`` padded to ``paged.bucket_size``, so it
compiles once per bucket (and per split-KV plan variant on the Pallas path, ``paged.plan``;
and once more for a step with cascade levels, whose shapes the bucket fixes too:
``serving/cascade_step.py``), never per sequence length or group layout. Prefill chunks have power-of-two lengths (the scheduler's rule), one
program per length and table bucket. The step's host arrays (tokens, keys, sampling parameters,
page tables, plans) travel as one int32 buffer (``serving/host_inputs.py``): one
host-to-device copy a step, not one an array.

Several decode steps, one program
---------------------------------
Where the host measured more time planning and dispatching a step than the device took to run
it (issue 18), ``decode_steps`` runs ``K`` plain decode steps in one program: a ``lax.scan``
whose body is ``decode_step``, step ``k`` fed the tokens step ``k - 1`` sampled, reading its
own table and plan (the host plans all ``K``: ``stack_steps``), its keys folded with
``num_generated + k``. ``K`` is a static shape (the stacked tables' leading axis), so each
``K`` compiles once per bucket; the engine uses powers of two.

Sparse decode (``serving/sparse_step.py``)
------------------------------------------
With ``Engine(sparse=...)`` the decode programs take a static ``sparse``
(``serving.sparse_step.SparseDecode``: mode and budget, so each compiles its own program) and
their target attends through its selection; prefill chunks attend densely. With ``"quest"`` the
target's state is a ``BoundedCaches`` (its pools and their key bounds) where it is otherwise the
list of pools; every program takes and returns it in that place and keeps the bounds current.
``DecodeInputs`` carries nothing for it: the selection is computed in the program.

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
from serving.mla_config import MLAModelConfig
from serving.mla_expanded import ExpandedMLAConfig, forward_paged_mla_expanded
from serving.mla_model import forward_paged_mla
from serving.sparse_step import BoundedCaches, SparseDecode


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
      plan, draft_plans: split-KV plans for the Pallas attention (None on the reference, and
        ``plan`` None on a cascaded step).
      cascade: the target's ``paged.CascadeLevels`` over ``page_table`` (requests sharing
        leading pages attend to them as one group: ``serving/cascade_step.py``), or None for
        plain decode. Its shapes are fixed by ``B`` and the table's bucket, so a bucket compiles
        one plain and at most one cascade program. The draft passes always decode plainly.
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
    cascade: paged.CascadeLevels | None = None


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


def _feed_previous_tokens(
    inputs: DecodeInputs, previous_token_ids: jax.Array | None
) -> DecodeInputs:
    """``inputs`` whose rows with a negative ``token_ids`` (the scheduler's ``UNRESOLVED_TOKEN``)
    feed the token their slot sampled in the previous step, ``previous_token_ids[:, 0]``
    (int32[B, 1], still on the device); ``inputs`` unchanged when it is None."""
    if previous_token_ids is None:
        return inputs
    fed = jnp.where(inputs.token_ids < 0, previous_token_ids[:, 0], inputs.token_ids)
    return inputs._replace(token_ids=fed)


def _plain_decode_result(token_ids: jax.Array) -> DecodeResult:
    """The result of plain (not speculative) decoding that emitted ``token_ids`` int32[B, K]:
    no draft accepted (``num_accepted`` int32[B] zeros), no drafts (``draft_token_ids``
    int32[B, 0])."""
    batch = token_ids.shape[0]
    return DecodeResult(token_ids, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, 0), jnp.int32))


def _target_forward(params, config: ModelConfig, tokens, target_caches, page_table, **options):
    """``model.forward_paged`` of the target on its state: a list of caches, or a
    ``BoundedCaches`` (``serving/sparse_step.py``), whose key bounds are then kept current.
    An MLA target (``config`` an ``MLAModelConfig``, static: chosen when traced) runs
    ``serving.mla_model.forward_paged_mla`` over its ``paged.LatentCache`` list (its form,
    absorbed or not, by the step's ``L``; no cascade, no sparse decode: the engine refuses
    them); an ``ExpandedMLAConfig`` (``serving/mla_expanded.py``) runs
    ``forward_paged_mla_expanded`` over its ``KVCache`` list, alike. Returns ``(logits,
    target_caches)``, the state of the type given."""
    if isinstance(config, MLAModelConfig | ExpandedMLAConfig):
        if options.pop("cascade", None) is not None or options.pop("sparse", None) is not None:
            raise ValueError("an MLA target decodes plainly: no cascade levels, no sparse decode")
        forward = (
            forward_paged_mla if isinstance(config, MLAModelConfig) else forward_paged_mla_expanded
        )
        return forward(params, config, tokens, target_caches, page_table, **options)
    if not isinstance(target_caches, BoundedCaches):
        return model_lib.forward_paged(params, config, tokens, target_caches, page_table, **options)
    logits, caches, bounds = model_lib.forward_paged(
        params,
        config,
        tokens,
        target_caches.caches,
        page_table,
        key_bounds=target_caches.key_bounds,
        **options,
    )
    return logits, BoundedCaches(caches, bounds)


def decode_step(
    target_params,
    draft_params,
    target_caches,
    draft_caches,
    inputs: DecodeInputs,
    previous_token_ids: jax.Array | None = None,
    *,
    target_config: ModelConfig | MLAModelConfig,
    draft_config: ModelConfig | None,
    num_speculative: int,
    backend: str,
    sparse: SparseDecode | None = None,
) -> tuple[DecodeResult, list[paged.KVCache], list[paged.KVCache] | None]:
    """One decode (or verification) step of ``B`` rows: draft passes, target, sampling, acceptance.

    Args:
      target_params, draft_params: parameter pytrees (``draft_params`` None without a draft).
      target_caches, draft_caches: per-layer ``paged.KVCache`` lists (donated under ``jit``);
        ``target_caches`` may be a ``serving.sparse_step.BoundedCaches``, whose key bounds
        the step keeps current.
      inputs: the ``DecodeInputs``.
      previous_token_ids: int32[B, 1], the previous step's ``DecodeResult.token_ids``, still on
        the device (overlapped steps): a row whose ``inputs.token_ids`` is negative (the
        scheduler's ``UNRESOLVED_TOKEN``) feeds the token its slot sampled there. None: every
        row's token comes from ``inputs``.
      target_config, draft_config: the models (static); the target may be an
        ``MLAModelConfig`` (its caches then ``paged.LatentCache``s, ``inputs.plan`` the MLA
        kernel's, and its forward ``serving.mla_model.forward_paged_mla``), the draft not.
      num_speculative: ``n`` (static); 0 is plain decoding.
      backend: for every op (static).
      sparse: a ``serving.sparse_step.SparseDecode`` (static): the target attends over its
        selection of each request's pages (``"quest"`` needs a ``BoundedCaches``); plain
        decoding only. None: dense decode.

    Returns:
      ``(DecodeResult, target_caches, draft_caches)``, ``target_caches`` of the type given.

    Raises:
      ValueError: ``sparse`` with ``num_speculative > 0`` (a verification step feeds ``n + 1``
        tokens a row; sparse decode attends one).
    """
    n = num_speculative
    if sparse is not None and n:
        raise ValueError(
            f"sparse decode attends one new token a request; num_speculative={n} verifies "
            f"{n + 1} a row"
        )
    inputs = _feed_previous_tokens(inputs, previous_token_ids)
    keys = step_keys(inputs.key_data, inputs.num_generated)
    row_params = dict(
        temperature=inputs.temperature, top_k=inputs.top_k, top_p=inputs.top_p, min_p=inputs.min_p
    )
    if n == 0:
        logits, target_caches = _target_forward(
            target_params,
            target_config,
            inputs.token_ids[:, None],
            target_caches,
            inputs.page_table,
            plan=inputs.plan,
            backend=backend,
            cascade=inputs.cascade,
            sparse=sparse,
        )
        tokens = sampling.filtered_sample(
            keys,
            speculative.tempered_probs(logits[:, 0].astype(jnp.float32), inputs.temperature),
            top_k=inputs.top_k,
            top_p=inputs.top_p,
            min_p=inputs.min_p,
            backend=backend,
        )
        return _plain_decode_result(tokens[:, None]), target_caches, draft_caches

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
    target_logits, target_caches = _target_forward(
        target_params,
        target_config,
        verified,
        target_caches,
        inputs.page_table,
        plan=inputs.plan,
        backend=backend,
        cascade=inputs.cascade,
    )
    target_probs = speculative.sampling_distribution(target_logits, **row_params)  # [B, n+1, V]
    token_ids, num_accepted = speculative.chain_speculative_sampling(
        keys, jnp.stack(draft_probs, axis=1), draft_token_ids, target_probs, backend=backend
    )
    return DecodeResult(token_ids, num_accepted, draft_token_ids), target_caches, draft_caches


def decode_steps(
    target_params,
    draft_params,
    target_caches,
    draft_caches,
    inputs: DecodeInputs,
    previous_token_ids: jax.Array | None = None,
    *,
    target_config: ModelConfig | MLAModelConfig,
    draft_config: ModelConfig | None,
    backend: str,
    sparse: SparseDecode | None = None,
) -> tuple[DecodeResult, jax.Array, list[paged.KVCache], list[paged.KVCache] | None]:
    """``K`` plain decode steps in one program: a ``lax.scan`` whose body is ``decode_step``.

    Step ``k`` is the single step the engine would have run ``k`` steps later: it feeds the
    tokens step ``k - 1`` sampled (step 0 those of ``inputs``, or of ``previous_token_ids``
    where ``inputs.token_ids`` is negative), reads and writes through step ``k``'s table and
    plan, and samples with each row's key folded with ``num_generated + k``. So the tokens,
    keys and cache writes are those of ``K`` single steps; only the host is not in between.

    Args:
      target_params, draft_params, target_caches, draft_caches: as ``decode_step`` (plain
        decoding: the draft's are passed through untouched; a ``BoundedCaches`` target state
        is in the scan's carry, its bounds kept step by step).
      inputs: ``DecodeInputs`` whose ``page_table``, ``plan`` and ``cascade`` leaves have a
        leading ``[K]`` axis (step ``k``'s table and plan: ``stack_steps``; its cascade levels:
        ``serving.cascade_step.stack_levels``); the rest as for one step, step 0's.
      previous_token_ids: int32[B, 1] or None, as ``decode_step``.
      target_config, draft_config, backend, sparse: static, as ``decode_step``.

    Returns:
      ``(DecodeResult, last_token_ids, target_caches, draft_caches)``: ``token_ids`` int32[B,
      K] (step ``k``'s tokens in column ``k``), ``num_accepted`` zeros, ``draft_token_ids``
      int32[B, 0]; ``last_token_ids`` int32[B, 1], column ``K - 1`` (what the next step's
      unresolved rows feed).
    """
    if inputs.draft_page_tables:
        raise ValueError("decode_steps runs plain decoding: draft_page_tables must be empty")
    if inputs.page_table.last_page_len.ndim != 2:
        raise ValueError(
            "decode_steps needs a table stacked over the steps (programs.stack_steps), got "
            f"last_page_len of shape {inputs.page_table.last_page_len.shape}"
        )
    inputs = _feed_previous_tokens(inputs, previous_token_ids)

    def one_step(carry, per_step):
        token_ids, caches = carry
        step, page_table, plan, cascade = per_step
        step_inputs = inputs._replace(
            token_ids=token_ids,
            num_generated=inputs.num_generated + step,
            page_table=page_table,
            plan=plan,
            cascade=cascade,
        )
        result, caches, _ = decode_step(
            target_params,
            draft_params,
            caches,
            None,
            step_inputs,
            target_config=target_config,
            draft_config=draft_config,
            num_speculative=0,
            backend=backend,
            sparse=sparse,
        )
        tokens = result.token_ids[:, 0]
        return (tokens, caches), tokens

    steps = jnp.arange(num_steps(inputs), dtype=jnp.int32)
    (last, target_caches), tokens = jax.lax.scan(
        one_step,
        (inputs.token_ids, target_caches),
        (steps, inputs.page_table, inputs.plan, inputs.cascade),
    )
    return _plain_decode_result(tokens.T), last[:, None], target_caches, draft_caches


def stack_steps(tables: list[paged.PageTable], plans: list[paged.DecodePlan | None]):
    """Host side: ``K`` steps' tables and plans as one table and one plan whose leaves have a
    leading ``[K]`` axis (``decode_steps``'s ``inputs``).

    The tables must share their padded size (the scheduler's ``step_page_tables`` do); the
    plans (None on the reference path) their static fields (``write_final``,
    ``long_chunks``): their work arrays are padded to the longest (items of request -1 with
    empty ranges, as ``paged.plan_decode`` pads). A plan is made for its own step's lengths
    (``paged.plan_decode_tables``), so the kernel splits every step as a single step would.

    Raises:
      ValueError: tables of different padded sizes or page sizes, or plans of different
        static fields.
    """
    if len({table.page_indices.shape for table in tables}) != 1:
        raise ValueError(
            f"the steps' tables must share one padded size, got "
            f"{[table.page_indices.shape for table in tables]}"
        )
    if len({table.page_size for table in tables}) != 1:
        raise ValueError("the steps' tables must share one page size")
    table = paged.PageTable(
        *(np.stack([getattr(t, f) for t in tables]) for f in _TABLE_FIELDS),
        page_size=tables[0].page_size,
    )
    if plans[0] is None:
        if any(plan is not None for plan in plans):
            raise ValueError("plans must be all None or all DecodePlans")
        return table, None
    variants = {(plan.write_final, plan.long_chunks) for plan in plans}
    if len(variants) != 1:
        raise ValueError(f"the steps' plans differ in their static fields: {sorted(variants)}")
    width = max(plan.work_request.shape[0] for plan in plans)

    def padded(plan, field, fill):
        values = np.asarray(getattr(plan, field))
        return np.pad(values, (0, width - values.shape[0]), constant_values=fill)

    stacked = {
        field: np.stack(
            [padded(plan, field, -1 if field == "work_request" else 0) for plan in plans]
        )
        for field in _PLAN_WORK_FIELDS
    }
    for field in ("merge_indptr", "chunk_pages", "num_work_items"):
        stacked[field] = np.stack([np.asarray(getattr(plan, field)) for plan in plans])
    plan = paged.DecodePlan(
        **stacked, write_final=plans[0].write_final, long_chunks=plans[0].long_chunks
    )
    return table, plan


def num_steps(inputs: DecodeInputs) -> int:
    """The decode steps ``inputs`` are for: ``K`` when their table is stacked
    (``decode_steps``), else 1 (``decode_step``)."""
    lengths = inputs.page_table.last_page_len
    return 1 if lengths.ndim == 1 else lengths.shape[0]


def first_step(inputs: DecodeInputs) -> DecodeInputs:
    """The single step's inputs of step 0 of ``decode_steps``'s ``inputs`` (its table and
    plan, unstacked): what the scan's body runs first."""
    first = lambda tree: jax.tree.map(lambda leaf: leaf[0], tree)
    return inputs._replace(
        page_table=first(inputs.page_table),
        plan=first(inputs.plan),
        cascade=first(inputs.cascade),
    )


_TABLE_FIELDS = ("page_indptr", "page_indices", "last_page_len")
_PLAN_WORK_FIELDS = ("work_request", "work_page_start", "work_page_end", "work_last_page_len")


def prefill_step(
    target_params,
    draft_params,
    target_caches,
    draft_caches,
    token_ids: jax.Array,
    page_table: paged.PageTable,
    target_plan: paged.DecodePlan | None = None,
    *,
    target_config: ModelConfig | MLAModelConfig,
    draft_config: ModelConfig | None,
    backend: str,
):
    """Writes one prompt chunk's keys and values into both caches (its logits are not needed:
    the scheduler prefills up to, not including, a prompt's last token).

    Args:
      token_ids: int32[1, L], the chunk.
      page_table: one row covering the chunk's end.
      target_plan: an MLA target's plan for the MLA kernel (``plan_mla_decode`` of
        ``page_table`` with ``q_len = L``) where that kernel runs the chunk; None otherwise
        (always for a Llama-style target, whose chunks need no plan).
      target_caches: a list of caches (``paged.LatentCache`` for an MLA target), or a
        ``serving.sparse_step.BoundedCaches`` (whose key bounds the chunk's keys widen); a
        chunk attends densely whatever the engine's sparse mode.

    Returns:
      ``(target_caches, draft_caches)``, ``target_caches`` of the type given.
    """
    options = dict(backend=backend)
    if target_plan is not None:
        options["plan"] = target_plan
    _, target_caches = _target_forward(
        target_params, target_config, token_ids, target_caches, page_table, **options
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


def packed_decode_steps(
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
    """``decode_steps`` on inputs packed by ``serving.host_inputs.pack`` (one host copy)."""
    inputs = host_inputs.unpack(packed_inputs, packing)
    return decode_steps(
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
    static_argnames=(*_STATIC, "num_speculative", "packing", "sparse"),
    donate_argnames=("target_caches", "draft_caches"),
)
# One compilation per number of steps K (it is in the packing's shapes) and table bucket.
decode_steps_jit = jax.jit(
    packed_decode_steps,
    static_argnames=(*_STATIC, "packing", "sparse"),
    donate_argnames=("target_caches", "draft_caches"),
)
prefill_step_jit = jax.jit(
    prefill_step, static_argnames=_STATIC, donate_argnames=("target_caches", "draft_caches")
)


def abstract(tree):
    """The same pytree with every array replaced by its shape and dtype (for tracing later,
    after the arrays themselves were donated)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
