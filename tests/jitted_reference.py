"""The reference decode attention through ``jax.jit``, for tests that call it once an example.

Called eagerly, ``paged.decode_attention(..., backend="reference")`` compiles its ``lax.map``
over requests anew on every call (the map's body closes over the gathered pages): about three
XLA compilations, 0.1 to 0.3 s of CPU, each call. A hypothesis test calls it 25 times a case;
through ``jax.jit`` it compiles once per shape. ``reference_decode`` first runs, eagerly, the
concrete checks an eager call runs (``paged.decode.validate_decode_inputs``: shapes, dtypes,
page-table invariants, requests shorter than ``q_len``), so a test loses none of them.
"""

from __future__ import annotations

import functools

import jax

import paged


@functools.partial(jax.jit, static_argnames=("sm_scale", "logits_soft_cap"))
def _jitted_reference_decode(q, cache, page_table, *, sm_scale, logits_soft_cap):
    return paged.decode_attention(
        q,
        cache,
        page_table,
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        return_lse=True,
        backend="reference",
    )


def reference_decode(q, cache, page_table, *, sm_scale=None, logits_soft_cap=None):
    """``paged.decode_attention(q, cache, page_table, ..., return_lse=True,
    backend="reference")``, compiled once per shape: returns ``(o, lse)``."""
    paged.decode.validate_decode_inputs(q, cache, page_table, logits_soft_cap)
    return _jitted_reference_decode(
        q, cache, page_table, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap
    )
