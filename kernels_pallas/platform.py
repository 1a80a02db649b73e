"""Which backend a public function runs, and whether a Pallas kernel must be interpreted.

The rule (``design.md``): ``backend="auto"`` means the Pallas kernel on a GPU and the pure-JAX
reference elsewhere; ``DECODELAB_BACKEND=reference`` turns every ``"auto"`` into the reference
(the kill switch); an explicit ``backend=`` wins over the variable. The choice is made in Python
when a function is traced, so a jitted function keeps the backend it was traced with.
"""

from __future__ import annotations

import os

import jax
from jax.experimental import pallas as pl

BACKENDS = ("auto", "reference", "pallas")
KILL_SWITCH_VARIABLE = "DECODELAB_BACKEND"


def on_gpu() -> bool:
    """True when JAX's default backend is a CUDA (or ROCm) GPU."""
    return jax.default_backend() == "gpu"


def interpret_mode() -> bool:
    """Pallas kernels run in interpret mode everywhere but on a GPU."""
    return not on_gpu()


def resolve_backend(backend: str, *, pallas_available: bool = True) -> str:
    """Turn a user's ``backend=`` argument into ``"reference"`` or ``"pallas"``.

    Args:
      backend: ``"auto"``, ``"reference"`` or ``"pallas"``.
      pallas_available: whether a kernel exists for this operation (``False`` makes ``"pallas"``
        an error and ``"auto"`` the reference).

    Raises:
      ValueError: for an unknown backend, an unknown kill-switch value, or ``"pallas"`` where no
        kernel exists.

    Example:
      >>> resolve_backend("reference")
      'reference'
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "pallas":
        if not pallas_available:
            raise ValueError("backend='pallas' is not available for this operation yet")
        return "pallas"
    if backend == "reference":
        return "reference"
    forced = os.environ.get(KILL_SWITCH_VARIABLE, "").strip()
    if forced not in ("", "reference", "auto"):
        raise ValueError(f"{KILL_SWITCH_VARIABLE} must be 'reference' or unset, got {forced!r}")
    if forced == "reference" or not pallas_available or not on_gpu():
        return "reference"
    return "pallas"


def is_concrete(*arrays) -> bool:
    """True when none of ``arrays`` is a tracer, so value checks may read them."""
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def whole_array(shape):
    """A ``BlockSpec`` that hands every program of any grid the whole array of ``shape``.

    The kernels here index their operands themselves (pages through a table, rows by program
    id, masked blocks of a row), so each sees whole arrays rather than grid-sliced blocks.
    """
    shape = tuple(shape)
    return pl.BlockSpec(shape, lambda *grid_indices: (0,) * len(shape))
