"""Input checks shared by every public sampler.

Shape, dtype and static-parameter checks always run. Value checks (NaN, infinities, negative
weights, rows without mass, per-row parameters out of range) run when the inputs are concrete,
outside ``jit``, and raise ``ValueError`` naming the argument and the bad value. Under ``jit``
they cannot run; the samplers then clamp per-row parameters into range (``top_k`` to ``[1, V]``,
``top_p`` to ``(0, 1]``, ``min_p`` to ``[0, 1]``) and a row without positive finite mass returns
token 0, so a token id is never out of range. Both behaviours are tested.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.platform import is_concrete


def check_rows(name: str, array: jax.Array) -> tuple[int, int]:
    """``[B, V]`` floating rows; returns ``(B, V)``."""
    if array.ndim != 2:
        raise ValueError(f"{name} must have shape [batch, vocab], got {array.shape}")
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got {array.dtype}")
    if array.shape[1] < 1:
        raise ValueError(f"{name} must have at least one token, got shape {array.shape}")
    return array.shape


def _first_bad_row(bad_rows: np.ndarray) -> int:
    return int(np.flatnonzero(bad_rows)[0])


def check_probs_values(probs: jax.Array) -> None:
    """Concrete ``probs``: finite, non-negative, some positive mass in every row."""
    if not is_concrete(probs):
        return
    values = np.asarray(probs, np.float64)
    checks = [
        (np.isnan(values).any(axis=1), "contains NaN"),
        (np.isinf(values).any(axis=1), "contains an infinity"),
        ((values < 0).any(axis=1), "contains a negative probability"),
        (~(values > 0).any(axis=1), "has no positive probability (it sums to 0)"),
        (
            (values.max(axis=1, initial=0) < np.finfo(np.float32).tiny),
            "has only subnormal probabilities (float32 arithmetic flushes them to 0)",
        ),
    ]
    for bad_rows, what in checks:
        if bad_rows.any():
            row = _first_bad_row(bad_rows)
            raise ValueError(f"probs row {row} {what}: {values[row][:8].tolist()}...")


def check_logits_values(logits: jax.Array) -> None:
    """Concrete ``logits``: no NaN, no ``+inf``, not every entry ``-inf`` (a masked row)."""
    if not is_concrete(logits):
        return
    values = np.asarray(logits, np.float64)
    checks = [
        (np.isnan(values).any(axis=1), "contains NaN"),
        ((values == np.inf).any(axis=1), "contains +inf"),
        ((values == -np.inf).all(axis=1), "is entirely -inf (every token masked)"),
    ]
    for bad_rows, what in checks:
        if bad_rows.any():
            row = _first_bad_row(bad_rows)
            raise ValueError(f"logits row {row} {what}")


def per_row(name: str, value, batch: int, dtype) -> jax.Array:
    """A scalar or ``[B]`` parameter as a ``[B]`` array of ``dtype``."""
    array = jnp.asarray(value, dtype)
    if array.ndim == 0:
        return jnp.broadcast_to(array, (batch,))
    if array.shape != (batch,):
        raise ValueError(f"{name} must be a scalar or have shape [{batch}], got {array.shape}")
    return array


def check_range(name: str, array: jax.Array, low, high, *, low_open: bool = False) -> None:
    """Concrete ``array`` inside ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    if not is_concrete(array):
        return
    values = np.asarray(array)
    below = values <= low if low_open else values < low
    bad = below | (values > high) | np.isnan(values)
    if bad.any():
        index = _first_bad_row(bad)
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name}[{index}]={values[index]} is outside {interval}")
