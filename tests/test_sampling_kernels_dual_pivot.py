"""The dual-pivot rejection kernel's rounds against the reference at 3000 columns: the same
tokens and rounds for the same keys and uniforms, up to the measured rounding flips
(``FILTERED_MISMATCH_BOUND``, explained in ``tests/test_sampling_kernels.py``, whose helpers
these tests use and which holds the fallback's and the tiny vocabulary's cases).

A module of its own only for the CPU's compile choice (``CPU_PROGRAMS_OPTIMIZED``,
``tests/conftest.py``): 96 rows of up to 32 rounds over 3000 columns, interpreted, run long
enough that XLA's optimizations pay for themselves, while the rest of
``test_sampling_kernels.py`` is compile-bound and runs faster without them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sampling
from tests.test_sampling_kernels import (
    DUAL_PIVOT_ROUNDS_CASES,
    FILTERED_MISMATCH_BOUND,
    _filter_rows,
    _mismatch,
    check_dual_pivot_picks_the_references_tokens,
)

CPU_PROGRAMS_OPTIMIZED = True


@pytest.mark.parametrize(("vocab", "name", "max_rounds"), DUAL_PIVOT_ROUNDS_CASES)
def test_dual_pivot_kernel_picks_the_references_tokens(vocab, name, max_rounds):
    """Same keys, same uniforms: the same tokens and rounds, up to the measured rounding flips,
    with up to 32 rounds (every filter of ``FILTER_CASES``)."""
    check_dual_pivot_picks_the_references_tokens(vocab, name, max_rounds)


def test_min_p_alone_takes_one_round_in_the_kernel():
    """The kernel starts from min-p's kept set as the reference does, and with min-p the only
    filter it skips the pivot pass: every row, the all-zero-but-one row and ties included,
    decides in exactly one round and draws a kept token. (96 rows at vocab 3000: the shape of
    the cases of ``test_dual_pivot_kernel_picks_the_references_tokens`` above, whose compiled
    kernel it shares.)"""
    batch, vocab = 96, 3000
    probs = _filter_rows(11, batch, vocab)
    keys = jax.random.split(jax.random.key(5), batch)
    min_p = jnp.linspace(0.0, 1.0, batch)  # 0 (no filter) to 1 (only the maximum's ties)
    ours, rounds = sampling.filtered_sample(
        keys, probs, min_p=min_p, return_rounds=True, backend="pallas"
    )
    theirs = sampling.filtered_sample(keys, probs, min_p=min_p, backend="reference")
    np.testing.assert_array_equal(np.asarray(rounds), 1)
    assert _mismatch(ours, theirs) <= FILTERED_MISMATCH_BOUND
    chosen = np.asarray(probs)[np.arange(batch), np.asarray(ours)]
    largest = np.asarray(probs).max(axis=1)
    assert (chosen >= np.asarray(min_p) * largest).all() and (chosen > 0).all()
