"""Input checks shared by every public sampler.

Shape, dtype and static-parameter checks always run. Value checks (NaN, infinities, negative
weights, rows without mass, per-row parameters out of range) run when the inputs are concrete,
outside ``jit``, and raise ``ValueError`` naming the argument and the bad value. Under ``jit``
they cannot run; the samplers then clamp per-row parameters into range (``top_k`` to ``[1, V]``,
``top_p`` to ``(0, 1]``, ``min_p`` to ``[0, 1]``, the temperature to ``[0, MAX_TEMPERATURE]``),
read NaN and negative probabilities as weight 0 (``as_weights``, as the kernels do), and a row
without positive finite mass still returns a token inside ``[0, V)``. Each public function's
docstring says what it does with such input; both behaviours are tested
(``tests/test_bad_input_sampling.py``).

Inputs may be array-likes (``as_array``); ``top_k`` has one rule everywhere (``top_k_per_row``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.platform import is_concrete
from sampling.filters import FilterParams


def as_array(name: str, value) -> jax.Array:
    """``value`` as a JAX array: arrays pass through, array-likes (lists, tuples, NumPy arrays,
    scalars) are converted with ``jnp.asarray``; anything else raises ``TypeError`` naming
    ``name``."""
    if isinstance(value, jax.Array):
        return value
    try:
        return jnp.asarray(value)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{name} must be an array or array-like (list, NumPy array), got "
            f"{type(value).__name__}: {error}"
        ) from None


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


def as_weights(probs: jax.Array) -> jax.Array:
    """``probs`` with NaN and negative entries (bad input only ``jit`` lets through) set to 0:
    the weights every kernel reads (``kernels_pallas/row_select.as_weights``), so that the
    reference backend reads the same row."""
    return jnp.where(probs > 0, probs, 0)


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


# The temperature is clamped to 2**126 (after the concrete check against the largest float32):
# the race scales logits by 1 / T, and this is the largest T whose reciprocal is a normal
# float32. Above it 1 / T is subnormal, which a GPU or XLA's CPU flushes to 0, and a masked
# logit would become -inf * 0 = NaN. At 2**126 every finite logit below about 1e30 scales to
# (nearly) 0 already: the uniform distribution over the unmasked tokens, as at any larger T.
MAX_TEMPERATURE = 2.0**126


def temperature_per_row(temperature, batch: int) -> jax.Array:
    """float32 ``[B]`` from a scalar or ``[B]`` temperature: checked against
    ``[0, float32 max]`` when concrete; then, for ``jit``, NaN and negative values become 0
    (greedy) and values above ``MAX_TEMPERATURE`` (``+inf`` included) become it.

    Raises:
      ValueError: a shape other than ``[]`` or ``[B]``; a concrete NaN, negative or infinite
        temperature.
    """
    temperature = per_row("temperature", temperature, batch, jnp.float32)
    check_range("temperature", temperature, 0.0, float(jnp.finfo(jnp.float32).max))
    return jnp.clip(jnp.nan_to_num(temperature, nan=0.0), 0.0, MAX_TEMPERATURE)


def top_k_per_row(top_k, batch: int, vocab: int) -> jax.Array:
    """int32 ``[B]`` from an integer ``top_k`` (scalar or ``[B]``): checked against ``[1, V]``
    when concrete, clamped into it (for ``jit``).

    Raises:
      ValueError: a ``top_k`` that is not of an integer dtype (``2.7``, ``2.0``, ``True``), a
        shape other than ``[]`` or ``[B]``, or a concrete value outside ``[1, V]``.
    """
    if not jnp.issubdtype(as_array("top_k", top_k).dtype, jnp.integer):
        raise ValueError(f"top_k must be an integer (or integers), got {top_k!r}")
    k = per_row("top_k", top_k, batch, jnp.int32)
    check_range("top_k", k, 1, vocab)
    return jnp.clip(k, 1, vocab)


def filter_params(batch: int, vocab: int, top_k, top_p, min_p) -> FilterParams:
    """Per-row filter parameters (None disables a filter), checked when concrete and clamped
    into range for ``jit``: ``top_k`` to ``[1, V]``, ``top_p`` to ``(0, 1]`` (NaN: 1, off),
    ``min_p`` to ``[0, 1]`` (NaN: 0, off).

    Raises:
      ValueError: as ``top_k_per_row``; a ``top_p`` outside ``(0, 1]`` or ``min_p`` outside
        ``[0, 1]`` (concrete), a shape other than ``[]`` or ``[B]``.
    """
    k = top_k_per_row(vocab if top_k is None else top_k, batch, vocab)
    p = per_row("top_p", 1.0 if top_p is None else top_p, batch, jnp.float32)
    m = per_row("min_p", 0.0 if min_p is None else min_p, batch, jnp.float32)
    check_range("top_p", p, 0.0, 1.0, low_open=True)
    check_range("min_p", m, 0.0, 1.0)
    return FilterParams(
        top_k=k,
        top_p=jnp.clip(jnp.nan_to_num(p, nan=1.0), jnp.finfo(jnp.float32).tiny, 1.0),
        min_p=jnp.clip(jnp.nan_to_num(m, nan=0.0), 0.0, 1.0),
    )
