"""The online softmax both attention kernels run over their key blocks (Pallas, in-kernel).

One idea: attention over keys that arrive a block at a time, in float32 and base 2, with
running state per query row ``(acc [rows, D], running_max [rows], running_sum [rows])``:

- ``scaled_logits``: ``q . k`` times the logit scale, or soft-capped, in base 2 (``log2 e`` is
  folded into the scale, so the exponentials below are ``exp2``, one instruction each);
- ``update``: fold one block of logits and values into the state (the max-rescaling of
  FlashAttention; masked logits carry ``MASKED_LOGIT`` rather than ``-inf``, so that
  ``exp2(masked - running_max)`` is exactly 0 and never ``exp2(-inf - (-inf))`` = NaN);
- ``finish``: the normalized output and the natural-log LSE (``o = 0``, ``lse = -inf`` for a row
  that saw no key).

``kernels_pallas/paged_decode.py`` (a few query tokens, split-KV) and
``kernels_pallas/paged_prefill.py`` (a prompt chunk, query blocks) differ in what they read and
how they mask; the arithmetic on a block is this, once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# Masked logits get this instead of -inf so that exp2(masked - running_max) is exactly 0 and
# never exp2(-inf - (-inf)) = NaN; it is far below any real base-2 logit.
MASKED_LOGIT = -1e30


def initial_state(rows: int, head_dim: int):
    """``(acc, running_max, running_sum)`` before any key: zeros, ``-inf``, zeros."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def scaled_logits(q, k, *, logit_scale_log2, logits_soft_cap, sm_scale, precision) -> jax.Array:
    """float32 ``[rows, block]``: base-2 logits of ``q [rows, D]`` against ``k [block, D]``:
    ``(q . k) * sm_scale * log2 e``, or ``cap * tanh((q . k) * sm_scale / cap) * log2 e``."""
    logits = plgpu.dot(q, k, trans_b=True, precision=precision)
    if logits_soft_cap is None:
        return logits * logit_scale_log2
    capped = logits_soft_cap * jnp.tanh(logits * (sm_scale / logits_soft_cap))
    return capped * LOG2_E


def update(state, logits, v, visible, *, precision):
    """Folds one block into the state.

    Args:
      state: ``(acc [rows, D], running_max [rows], running_sum [rows])``, float32.
      logits: float32 ``[rows, block]`` base-2 logits, ``MASKED_LOGIT`` where masked.
      v: ``[block, D]`` values; zero those of keys no row may see (a zero weight times a NaN
        left in an unused slot is still NaN).
      visible: bool ``[rows, block]`` (or broadcastable), or None when every key is visible to
        every row. Masked keys get weight exactly 0, even in a block where a row sees no key (its
        logits and max are then all ``MASKED_LOGIT``, and ``logits - max`` is 0).
      precision: of the ``p . v`` dot.
    """
    acc, running_max, running_sum = state
    new_max = jnp.maximum(running_max, jnp.max(logits, axis=1))
    correction = jnp.exp2(running_max - new_max)
    probs = jnp.exp2(logits - new_max[:, None])
    if visible is not None:
        probs = jnp.where(visible, probs, 0.0)
    running_sum = running_sum * correction + jnp.sum(probs, axis=1)
    acc = acc * correction[:, None] + plgpu.dot(probs.astype(v.dtype), v, precision=precision)
    return acc, new_max, running_sum


def finish(state):
    """``(out float32 [rows, D], lse float32 [rows])``: normalized output and natural-log LSE;
    a row with no visible key gets ``out = 0``, ``lse = -inf``."""
    acc, running_max, running_sum = state
    nonempty = running_sum > 0
    out = acc / jnp.where(nonempty, running_sum, 1.0)[:, None]
    lse = jnp.where(nonempty, (running_max + jnp.log2(running_sum)) * LN_2, -jnp.inf)
    return out, lse
