"""Kernels run as 32-bit programs, whatever the caller's ``jax_enable_x64``.

Researchers run float64 references with x64 enabled (``jax.enable_x64(True)``), and every public
function must keep working then. Pallas kernels are written for 32-bit defaults: their index
arithmetic mixes int32 refs and program ids with Python ints (``pl.cdiv(n, pages_per_step)``,
``ref.at[pl.ds(row, rows), :]``), which x64 mode turns into int64, and ``lax`` operations do
not promote: tracing fails with an int32/int64 ``TypeError``, and so does the interpret mode's
lowering of a store (JAX 0.11.2), which happens when the *caller's* program is lowered, outside
any context the wrapper could set.

``runs_in_32_bits`` therefore, with x64 on only, traces and lowers the kernel's jitted wrapper
with x64 off (``jax.export``) and embeds the lowered program in the caller's (``Exported.call``
works eagerly and inside ``jit``). 64-bit integer operands are cast to int32 first; 64-bit
floats are refused (the kernels compute in float32). With x64 off nothing changes: the wrapper
is called as it is, and the compiled kernel is the same.

The other way, taken by the sampling, speculative and norm kernels (``gumbel.py``,
``dual_pivot.py``, ``filter_masks.py``, ``spec_accept.py``, ``norm.py``, with the helpers of
``row_select.py``): the kernel names ``jnp.int32`` in every integer sum, count and store index,
so it traces the same under x64 and needs no export. That is the cheaper rule, and the one for
a new kernel whose index arithmetic is small enough to audit; the attention kernels, whose
index arithmetic runs through Pallas helpers (``pl.ds``, ``pl.cdiv``, block specs), use this
module instead. Either way the public function's x64 test (``tests/test_bad_input_*.py``, ``-k
x64``) is what shows it works.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Triton IR is not a stable export format, which is why jax.export refuses it by default; the
# program exported here is called at once, in this process, never stored.
_EXPORT_CHECKS = (jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),)


def _is_array(value) -> bool:
    return isinstance(value, (jax.Array, np.ndarray))


def _as_32_bits(name: str, array):
    dtype = jnp.dtype(array.dtype)
    if dtype.itemsize <= 4:
        return array
    if jnp.issubdtype(dtype, jnp.integer):
        return array.astype(jnp.int32)
    raise TypeError(f"{name} has dtype {dtype}; the Pallas kernels compute in 32 bits")


@functools.lru_cache(maxsize=256)
def _exported(jitted, static_items, keyword_names, positional_avals, keyword_avals):
    """``jitted`` with its static arguments bound, traced and lowered with x64 off (cached)."""

    def run(positional, keyword):
        arrays = dict(zip(keyword_names, keyword, strict=True))
        return jitted(*positional, **arrays, **dict(static_items))

    def structs(avals):
        return tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals)

    with jax.enable_x64(False):
        return jax.export.export(jax.jit(run), disabled_checks=_EXPORT_CHECKS)(
            structs(positional_avals), structs(keyword_avals)
        )


def _avals(arrays):
    return tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in arrays)


def runs_in_32_bits(jitted):
    """Decorates a kernel's jitted wrapper so that it also runs with x64 on (module docstring).

    Keyword arguments that are arrays are operands; every other keyword argument is static
    (hashable). Positional arguments are operands.

    Example:
      >>> double = runs_in_32_bits(jax.jit(lambda x, *, scale: x * scale, static_argnames="scale"))
      >>> with jax.enable_x64(True):
      ...     double(jnp.arange(3), scale=2).dtype
      dtype('int32')
    """

    @functools.wraps(jitted)
    def call(*args, **kwargs):
        if not jax.config.read("jax_enable_x64"):
            return jitted(*args, **kwargs)
        array_names = tuple(name for name, value in kwargs.items() if _is_array(value))
        static_items = tuple(
            sorted((name, value) for name, value in kwargs.items() if name not in array_names)
        )
        positional = tuple(_as_32_bits(f"argument {i}", a) for i, a in enumerate(args))
        keyword = tuple(_as_32_bits(name, kwargs[name]) for name in array_names)
        exported = _exported(jitted, static_items, array_names, _avals(positional), _avals(keyword))
        return exported.call(positional, keyword)

    # Ahead-of-time use (tests read the lowered kernel) goes to the jitted wrapper itself.
    call.trace, call.lower = jitted.trace, jitted.lower
    return call
