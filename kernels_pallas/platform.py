"""Which backend a public function runs (the one backend chooser), and whether a Pallas kernel
must be interpreted.

The rule (``design.md``): ``backend="auto"`` means the Pallas kernel on a GPU and the pure-JAX
reference elsewhere; ``DECODELAB_BACKEND=reference`` turns every ``"auto"`` into the reference
(the kill switch); an explicit ``backend=`` wins over the variable. Every public function asks
``choose_backend`` with its operation's name and whether its kernel can run the shapes at hand;
the answer says why, and ``record_backends`` collects the answers. The choice is made in Python
when a function is traced, so a jitted function keeps the backend it was traced with.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import NamedTuple

import jax
from jax.experimental import pallas as pl

BACKENDS = ("auto", "reference", "pallas")
KILL_SWITCH_VARIABLE = "DECODELAB_BACKEND"

# Whether backend="auto" runs an operation's kernel on a GPU: True once the kernel was compiled,
# checked against its reference and measured faster than it on the H200. The evidence:
# - decode_attention: docs/benchmark_results/2026-12-02-decode.md (the Mosaic GPU kernel where it
#   takes the shapes, the Triton one elsewhere: paged.decode.decode_kernel_for).
# - rope_append_kv: 2026-12-01-fused_ops.md (1.55x the unfused rotate-then-scatter path at batch
#   64, 32 query heads, 8 KV heads, head_dim 128).
# - rmsnorm, fused_add_rmsnorm: 2026-12-01-fused_ops.md (86-89% of the copy ceiling at 4096
#   tokens, 1.5x XLA's fusion of the reference, faster than it at 1 and 64 tokens too).
# - sample_from_logits, sample_from_probs (Gumbel-max): archive/2026-12-01-gumbel-tuning.md, from
#   sampling.api.GUMBEL_KERNEL_MIN_BATCH rows up (below it the caller declines the kernel).
# - filtered_sample (dual-pivot rejection): 13x to 31x the sort-based JAX top-p at batch 256.
# - the renorm and mask functions: not yet timed beside the reference.
# - chain_speculative_sampling: 2026-11-30-gpu-checks.md and 2026-12-01-speculative.md (the
#   target's distribution at vocab 128256, the reference's tokens on 2048 of 2048 rows, 24.8 us
#   at B=64, n=4, 3.06x the XLA reference).
AUTO_PICKS_KERNEL = {
    "decode_attention": True,
    "rope_append_kv": True,
    "rmsnorm": True,
    "fused_add_rmsnorm": True,
    "sample_from_logits": True,
    "sample_from_probs": True,
    "filtered_sample": True,
    "top_k_renorm_probs": False,
    "top_p_renorm_probs": False,
    "top_k_mask_logits": False,
    "chain_speculative_sampling": True,
}


class BackendChoice(NamedTuple):
    """What ``choose_backend`` decided: ``backend`` is ``"reference"`` or ``"pallas"``, ``reason``
    says why in words (for reports and error messages)."""

    backend: str
    reason: str


class BackendRecord(NamedTuple):
    """One decision seen by ``record_backends``: the operation, the kernel it would run (the
    name its ``pl.pallas_call`` starts with), and the ``BackendChoice``'s two fields."""

    operation: str
    kernel: str
    backend: str
    reason: str


_recorders = threading.local()


@contextlib.contextmanager
def record_backends() -> Iterator[list[BackendRecord]]:
    """Collects every ``choose_backend`` decision made inside the block, in order.

    Decisions are made when a function is traced: a call of an already compiled ``jax.jit``
    function traces nothing and records nothing. To read a jitted program's choices, trace it
    inside the block (``jax.eval_shape`` traces without compiling). Blocks nest; each collects
    every decision made inside it.

    Example:
      >>> with record_backends() as records:
      ...     _ = choose_backend("filtered_sample", "reference", kernel="dual_pivot")
      >>> records[0].operation, records[0].backend
      ('filtered_sample', 'reference')
    """
    stack = getattr(_recorders, "stack", None)
    if stack is None:
        stack = _recorders.stack = []
    records: list[BackendRecord] = []
    stack.append(records)
    try:
        yield records
    finally:
        stack.remove(records)


def on_gpu() -> bool:
    """True when JAX's default backend is a CUDA (or ROCm) GPU."""
    return jax.default_backend() == "gpu"


def interpret_mode() -> bool:
    """Pallas kernels run in interpret mode everywhere but on a GPU."""
    return not on_gpu()


def _kill_switch_on() -> bool:
    forced = os.environ.get(KILL_SWITCH_VARIABLE, "").strip()
    if forced not in ("", "reference", "auto"):
        raise ValueError(f"{KILL_SWITCH_VARIABLE} must be 'reference' or unset, got {forced!r}")
    return forced == "reference"


def _decide(operation, requested, unsupported, auto_declines) -> BackendChoice:
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if operation is not None and operation not in AUTO_PICKS_KERNEL:
        raise ValueError(f"operation must be one of {sorted(AUTO_PICKS_KERNEL)}, got {operation!r}")
    kill_switch = _kill_switch_on()  # checked on every path: a bad value fails early
    if requested == "reference":
        return BackendChoice("reference", "backend='reference' was asked for")
    if requested == "pallas":
        if unsupported:
            raise ValueError(f"backend='pallas' cannot run {operation} here: {unsupported}")
        return BackendChoice("pallas", "backend='pallas' was asked for")
    if kill_switch:
        return BackendChoice("reference", f"{KILL_SWITCH_VARIABLE}=reference (the kill switch)")
    if operation is not None and not AUTO_PICKS_KERNEL[operation]:
        return BackendChoice("reference", "auto: the kernel is not yet measured faster on a GPU")
    if not on_gpu():
        return BackendChoice("reference", "auto: no GPU (the kernel would run interpreted)")
    if unsupported:
        return BackendChoice("reference", f"auto: the kernel cannot run this: {unsupported}")
    if auto_declines:
        return BackendChoice("reference", f"auto: {auto_declines}")
    return BackendChoice("pallas", "auto: a GPU, and the kernel was measured faster there")


def choose_backend(
    operation: str,
    requested: str,
    *,
    unsupported: str | None = None,
    auto_declines: str | None = None,
    kernel: str | None = None,
) -> BackendChoice:
    """The backend of one call of a public function, and why; recorded by ``record_backends``.

    ``"reference"`` and ``"pallas"`` are obeyed (``"pallas"`` on a CPU runs the kernel
    interpreted). ``"auto"`` is the reference under the kill switch, for an operation whose
    kernel ``AUTO_PICKS_KERNEL`` does not pick, off a GPU, where the kernel cannot run the
    shapes, and where the caller declines the kernel for this call; the kernel otherwise.

    Args:
      operation: the public function's name, a key of ``AUTO_PICKS_KERNEL``.
      requested: the caller's ``backend=``: ``"auto"``, ``"reference"`` or ``"pallas"``.
      unsupported: why the kernel cannot run this call's shapes or dtypes, or None if it can.
      auto_declines: why ``"auto"`` should take the reference for this call although the kernel
        could run it (a measured crossover, e.g. a batch too small), or None.
      kernel: the kernel this call would run, for the record (default: ``operation``).

    Returns:
      ``BackendChoice(backend, reason)``.

    Raises:
      ValueError: an unknown backend, an unknown ``DECODELAB_BACKEND`` value, or ``"pallas"``
        asked for where ``unsupported`` says the kernel cannot run (naming the reason).

    Example:
      >>> choose_backend("rmsnorm", "reference")
      BackendChoice(backend='reference', reason="backend='reference' was asked for")
      >>> choose_backend("rmsnorm", "pallas", unsupported="hidden=9000 is too wide")
      Traceback (most recent call last):
      ...
      ValueError: backend='pallas' cannot run rmsnorm here: hidden=9000 is too wide
    """
    choice = _decide(operation, requested, unsupported, auto_declines)
    record = BackendRecord(operation, kernel or operation, *choice)
    for records in getattr(_recorders, "stack", ()):
        records.append(record)
    return choice


def resolve_backend(backend: str) -> str:
    """What ``backend`` means for an operation whose kernel ``"auto"`` picks and can run the
    shapes: ``choose_backend``'s rule without an operation, for callers that decide ahead of a
    call (the engine plans split-KV work only for the Pallas attention). Records nothing.

    Raises:
      ValueError: for an unknown backend or an unknown kill-switch value.

    Example:
      >>> resolve_backend("reference")
      'reference'
    """
    return _decide(None, backend, None, None).backend


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
