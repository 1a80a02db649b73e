"""The fused paged decode kernel on lengths and page placements that hypothesis draws, all in
one page-table bucket, against the float64 reference (``tests/test_paged_decode_kernel.py``'s
helpers and bounds).

A module of its own only for the CPU's compile choice (``CPU_PROGRAMS_OPTIMIZED``,
``tests/conftest.py``): one program runs for every draw (25 in the ``ci`` profile), so running
it fast matters more than compiling it fast, while the rest of ``test_paged_decode_kernel.py``
is compile-bound and runs faster without XLA's optimizations.
"""

from __future__ import annotations

import jax.numpy as jnp
from hypothesis import given
from hypothesis import strategies as st

import paged
from tests.test_paged_decode_kernel import NUM_KV_HEADS, check_against_reference, make_inputs

CPU_PROGRAMS_OPTIMIZED = True

LEN_BUCKET = st.lists(st.integers(0, 160), min_size=4, max_size=4)


@given(lens=LEN_BUCKET, seed=st.integers(0, 2**31 - 1), fixed=st.sampled_from([None, 1, 2, 5]))
def test_random_lengths_inside_one_bucket(lens, seed, fixed):
    """Hypothesis draws lengths and page placements; shapes stay in one bucket (no recompiles)."""
    q, cache, table = make_inputs(seed, lens, "HND", 4, 64, jnp.float32, num_pool_pages=48)
    table = table.padded(64)  # one static size for every draw
    plan = paged.plan_decode(
        table, q.shape[1], NUM_KV_HEADS, 64, fixed_split_pages=fixed, num_work_items=256
    )
    check_against_reference(q, cache, table, lens, plan=plan)
