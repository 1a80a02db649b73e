"""One host-to-device transfer a step: a step's small host arrays packed into one buffer.

Why: a jitted call copies each NumPy argument to the device separately, and on the GPU host
each small copy costs tens of microseconds of host time. An engine step passes about twenty of
them (tokens, keys, sampling parameters, the page table, the split-KV plan), so the GPU run of
2026-12-01 measured about 1 ms a step just dispatching the call at batch 1
(``docs/benchmark_results/2026-11-30-gpu-checks.md``, fourth session), more than the device
step's attention, sampling and norms together. Packing them into one int32 buffer makes it one
copy; the jitted step unpacks it with static slices and bitcasts, which cost nothing on the
device.

Every leaf starts at a multiple of ``LEAF_ALIGN_WORDS`` (256 bytes). Why: XLA hands a kernel a
contiguous slice of a buffer in place (a sub-buffer, no copy), and a Mosaic GPU kernel refuses,
at launch, an operand that does not start on 256 bytes ("Input buffer 4 is not 256-byte
aligned": the decode step's ``page_indices`` on the H200, 2026-12-02). Padding costs at most
255 bytes a leaf of the one copy.

- ``pack(tree) -> (buffer int32[N], packing)`` on the host: every leaf (a NumPy array or
  scalar of a 4-byte type, or a bool) flattened into ``buffer``; ``packing`` (hashable: pass it
  as a static argument) says where each leaf lies and what it was.
- ``unpack(buffer, packing) -> tree`` inside ``jit``: the same pytree, as device arrays of the
  same shapes and dtypes.

Leaves must be host values (NumPy arrays or scalars, Python numbers; a ``jax.Array`` is
refused, as it would be copied back to the host). 64-bit integers and floats become their 32-bit
types, as JAX makes them without x64, after a check that integers fit (signed in int32, unsigned
in uint32); Python scalars become strongly typed int32 / float32 arrays, where ``jit`` would
have made them weakly typed.

Example:
  >>> import numpy as np
  >>> buffer, packing = pack({"a": np.arange(3, dtype=np.int32), "b": np.float32(0.5)})
  >>> buffer.dtype, buffer.shape  # "b" starts at word 64 (256 bytes)
  (dtype('int32'), (65,))
  >>> tree = unpack(jax.numpy.asarray(buffer), packing)
  >>> tree["a"].tolist(), float(tree["b"])
  ([0, 1, 2], 0.5)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Each leaf's offset in the buffer, in int32 words: 64 words = 256 bytes, the alignment Mosaic GPU
# kernels require of every operand (module docstring).
LEAF_ALIGN_WORDS = 64


class Packing(NamedTuple):
    """Where each leaf of a packed pytree lies in the buffer (static, hashable).

    Attributes:
      treedef: the pytree's structure.
      leaves: per leaf, ``(offset, shape, dtype string)`` in the buffer (offset in int32
        words, a multiple of ``LEAF_ALIGN_WORDS``; the dtype as ``numpy.dtype.str``, e.g.
        ``"<f4"``).
      size: the buffer's length.
    """

    treedef: Any
    leaves: tuple[tuple[int, tuple[int, ...], str], ...]
    size: int


def _as_32_bit(leaf, where) -> np.ndarray:
    """``leaf`` as a NumPy array of a 4-byte type or bool; ``where()`` names it in errors (its
    path in the tree, made only then: this runs for every leaf of every step)."""
    if isinstance(leaf, jax.Array):  # would be copied back to the host: a caller's mistake
        raise ValueError(f"{where()} is a jax.Array; pack takes host arrays")
    array = np.asarray(leaf)
    if array.dtype == np.bool_:
        return array
    if array.dtype.kind in "iu" and array.dtype.itemsize == 8:
        narrow = np.uint32 if array.dtype.kind == "u" else np.int32
        limits = np.iinfo(narrow)
        if array.size and (array.min() < limits.min or array.max() > limits.max):
            raise ValueError(
                f"{where()} holds integers outside {np.dtype(narrow).name}: "
                f"{array.min()}..{array.max()}"
            )
        return array.astype(narrow)
    if array.dtype == np.float64:
        return array.astype(np.float32)
    if array.dtype.kind not in "iuf" or array.dtype.itemsize != 4:
        raise ValueError(
            f"{where()} must be a 4-byte int or float array (or bool), got {array.dtype}"
        )
    return array


# Leaves taken as they are: NumPy arrays of these types (every leaf of an engine step). Checked
# by one set lookup, not _as_32_bit's dtype tests: those cost about 3 us a leaf on a CPU, and a
# cascading step packs eighteen leaves.
_AS_THEY_ARE = frozenset(np.dtype(t) for t in (np.int32, np.uint32, np.float32))


def pack(tree) -> tuple[np.ndarray, Packing]:
    """Host side: every leaf of ``tree`` in one int32 buffer, and where (module docstring).

    Raises:
      ValueError: a leaf that is not a bool or a 4-byte int/float array (64-bit ones are
        narrowed, if their values fit), naming its path in the tree.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts, entries, offset = [], [], 0
    for index, leaf in enumerate(leaves):
        if type(leaf) is np.ndarray and leaf.dtype in _AS_THEY_ARE:
            array = words = leaf
        else:
            array = _as_32_bit(leaf, lambda index=index: _path_of(tree, index))
            words = array.astype(np.int32) if array.dtype == np.bool_ else array
        aligned = -(-offset // LEAF_ALIGN_WORDS) * LEAF_ALIGN_WORDS
        if aligned > offset:  # zeros up to the next 256-byte boundary
            parts.append(np.zeros((aligned - offset,), np.int32))
            offset = aligned
        parts.append(words.reshape(-1).view(np.int32))
        # dtype.str ("<f4"), not dtype.name ("float32"): NumPy computes a name in Python, and
        # for the twenty-odd leaves of an engine step that was 40% of this function's time.
        entries.append((offset, array.shape, array.dtype.str))
        offset += words.size
    buffer = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    return buffer, Packing(treedef, tuple(entries), offset)


def _path_of(tree, index: int) -> str:
    """The path of leaf ``index`` of ``tree`` (``jax.tree_util.keystr``), for an error."""
    return jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][index][0])


def unpack(buffer: jax.Array, packing: Packing):
    """Inside ``jit``: the pytree ``pack`` packed, from its int32 ``buffer``."""
    if buffer.shape != (packing.size,):
        raise ValueError(f"buffer must be int32[{packing.size}], got {buffer.shape}")
    leaves = []
    for offset, shape, dtype_str in packing.leaves:
        words = buffer[offset : offset + int(np.prod(shape, dtype=np.int64))]
        dtype = np.dtype(dtype_str)
        if dtype == np.bool_:
            leaf = words != 0
        elif dtype == np.int32:
            leaf = words
        else:
            leaf = lax.bitcast_convert_type(words, jnp.dtype(dtype))
        leaves.append(leaf.reshape(shape))
    return jax.tree_util.tree_unflatten(packing.treedef, leaves)
