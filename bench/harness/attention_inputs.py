"""Inputs for decode-attention benchmarks: the standard grid and cold-L2 paged KV pools.

Every attention suite (the peers and our own kernel) times the same inputs, built here:

- a query per rotating set, ``[num_sets, B, H, D]`` (small);
- ONE large K pool and ONE large V pool holding ``num_sets`` disjoint sets of pages, each set's
  pages a random permutation scattered over the pool, so that a timed loop rotates small page
  tables over one pool instead of slicing large inputs (``bench.harness`` says why);
- each set's pages twice: as a CSR page table (``page_indptr``, ``page_indices``,
  ``last_page_len``, our form) and as a dense ``block_tables [B, pages_per_seq]`` (the form of
  JAX's Pallas ``paged_attention`` and of gather-based peers).

The pool is random normal bfloat16 (never zeros), generated on the device with ``jax.random``
so that gigabytes take milliseconds. Queries and keys are standard normal: with
``sm_scale = 1/sqrt(D)`` the logits have a standard deviation of about 1, so the softmax is
neither one-hot nor uniform. The same logical pages are stored in each requested layout:

- ``"HND"``: ``[num_pages, KVH, page_size, D]`` (decodelab's kernel);
- ``"NHD"``: ``[num_pages, page_size, KVH, D]``;
- ``"head_major"``: ``[KVH, num_pages, page_size, D]`` (JAX's Pallas ``paged_attention``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from bench.harness import num_rotating_sets

LAYOUTS = ("HND", "NHD", "head_major")

# (batch, context) of docs/benchmarking.md's standard grid.
ATTENTION_GRID = (
    (1, 4096),
    (1, 32768),
    (4, 1024),
    (4, 4096),
    (4, 16384),
    (4, 32768),
    (32, 4096),
    (64, 2048),
    (128, 1024),
    (256, 512),
)
QUICK_GRID = ((1, 4096), (4, 16384), (32, 4096))
# Tiny cases for dry runs on a CPU; 40 tokens leave a partly filled last page.
DRY_RUN_GRID = ((1, 64), (2, 40))

STANDARD_SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
DRY_RUN_SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16)


def kv_bytes_per_set(
    batch: int, context: int, *, num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16, **_
) -> int:
    """Bytes of K and V of one set's real tokens: ``2 * B * context * KVH * D * itemsize``.

    Extra keyword arguments (``num_q_heads``, ``page_size``) are accepted and ignored, so a
    shape dict such as ``STANDARD_SHAPE`` can be passed whole.

    Example:
      >>> kv_bytes_per_set(1, 4096, **STANDARD_SHAPE) / 2**20  # MiB
      16.0
    """
    return 2 * batch * context * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def case_name(batch: int, context: int) -> str:
    """The report's name of an attention case, e.g. ``"B=4 ctx=4096"``."""
    return f"B={batch} ctx={context}"


@dataclasses.dataclass
class AttentionSetup:
    """Benchmark inputs of one (batch, context) case; every request has ``context`` tokens.

    Attributes:
      batch, context, num_q_heads, num_kv_heads, head_dim, page_size: the case's shape.
      num_sets: rotating input sets.
      pages_per_sequence: ``ceil(context / page_size)``.
      queries: ``[num_sets, B, H, D]``, the pool's dtype.
      pools: layout name -> ``(k_pages, v_pages)``, each holding ``num_sets * B *
        pages_per_sequence`` pages.
      page_indptr: int32 ``[num_sets, B + 1]``.
      page_indices: int32 ``[num_sets, B * pages_per_sequence]``.
      last_page_len: int32 ``[num_sets, B]``.
      block_tables: int32 ``[num_sets, B, pages_per_sequence]``, the same pages as
        ``page_indices``.
      seq_lens: int32 ``[B]``, all ``context``.
      kv_bytes_per_set: bytes of K and V of the real tokens of one set, the ``bytes`` of a
        report row.
    """

    batch: int
    context: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_sets: int
    pages_per_sequence: int
    queries: jax.Array
    pools: dict[str, tuple[jax.Array, jax.Array]]
    page_indptr: jax.Array
    page_indices: jax.Array
    last_page_len: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    kv_bytes_per_set: int

    @property
    def case(self) -> str:
        return case_name(self.batch, self.context)

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def pool(self, layout: str) -> tuple[jax.Array, jax.Array]:
        """``(k_pages, v_pages)`` in ``layout``.

        Raises:
          KeyError: if the setup was not built with that layout.
        """
        if layout not in self.pools:
            raise KeyError(f"layout {layout!r} not built; this setup has {sorted(self.pools)}")
        return self.pools[layout]

    def delete(self) -> None:
        """Frees the device memory of every array now, before the next case allocates."""
        arrays = [self.queries, self.page_indptr, self.page_indices, self.last_page_len]
        arrays += [self.block_tables, self.seq_lens]
        for k_pages, v_pages in self.pools.values():
            arrays += [k_pages, v_pages]
        for array in {id(array): array for array in arrays}.values():
            if not array.is_deleted():
                array.delete()
        self.pools = {}


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _random_normal(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    return jax.random.normal(key, shape, dtype)


def _to_layout(pages_hnd: jax.Array, layout: str) -> jax.Array:
    """``[num_pages, KVH, page_size, D]`` pages in ``layout`` (a copy unless HND)."""
    if layout == "HND":
        return pages_hnd
    if layout == "NHD":
        return jnp.swapaxes(pages_hnd, 1, 2)
    return jnp.swapaxes(pages_hnd, 0, 1)  # head_major


def make_attention_setup(
    batch: int,
    context: int,
    *,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    dtype=jnp.bfloat16,
    layouts: str | tuple[str, ...] = ("HND",),
    seed: int = 0,
    num_sets: int | None = None,
) -> AttentionSetup:
    """Builds the rotating inputs of one decode-attention case on the default device.

    Args:
      batch: requests ``B``; each has ``context`` tokens.
      context: tokens per request (need not be a multiple of ``page_size``).
      num_q_heads, num_kv_heads, head_dim, page_size: the attention shape.
      dtype: of queries and pages (bfloat16 in the standard grid).
      layouts: one layout or several of ``"HND"``, ``"NHD"``, ``"head_major"``; each gets its
        own pool holding the same logical pages.
      seed: for the queries, the pages and the page permutation.
      num_sets: rotating sets; None picks ``num_rotating_sets(kv_bytes_per_set)`` (cold L2).

    Returns:
      ``AttentionSetup``; call ``delete()`` when done with it.

    Raises:
      ValueError: for an unknown layout, non-positive sizes, or heads that do not divide.

    Example:
      >>> setup = make_attention_setup(2, 40, num_q_heads=4, num_kv_heads=2, head_dim=8,
      ...                              layouts=("HND", "head_major"), num_sets=3)
      >>> setup.queries.shape, setup.pool("head_major")[0].shape, setup.block_tables.shape
      ((3, 2, 4, 8), (2, 18, 16, 8), (3, 2, 3))
      >>> setup.last_page_len[0].tolist(), setup.page_indptr[0].tolist()
      ([8, 8], [0, 3, 6])
    """
    layouts = (layouts,) if isinstance(layouts, str) else tuple(layouts)
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown or not layouts:
        raise ValueError(f"layouts must be a non-empty subset of {LAYOUTS}, got {layouts}")
    if min(batch, context, num_q_heads, num_kv_heads, head_dim, page_size) <= 0:
        raise ValueError(
            f"sizes must be positive, got batch={batch} context={context} "
            f"num_q_heads={num_q_heads} num_kv_heads={num_kv_heads} head_dim={head_dim} "
            f"page_size={page_size}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of {num_kv_heads=}")

    kv_bytes = kv_bytes_per_set(
        batch, context, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    if num_sets is None:
        num_sets = num_rotating_sets(kv_bytes)
    pages_per_sequence = -(-context // page_size)
    pages_per_set = batch * pages_per_sequence
    num_pages = num_sets * pages_per_set

    query_key, k_key, v_key, permutation_key = jax.random.split(jax.random.key(seed), 4)
    queries = _random_normal(query_key, (num_sets, batch, num_q_heads, head_dim), dtype)
    pools = {}
    pool_shape = (num_pages, num_kv_heads, page_size, head_dim)
    k_hnd = _random_normal(k_key, pool_shape, dtype)
    v_hnd = _random_normal(v_key, pool_shape, dtype)
    for layout in layouts:
        pools[layout] = (_to_layout(k_hnd, layout), _to_layout(v_hnd, layout))
    if "HND" not in layouts:
        k_hnd.delete()
        v_hnd.delete()

    # Disjoint sets: one permutation of all pages, cut into num_sets pieces.
    permutation = jax.random.permutation(permutation_key, num_pages).astype(jnp.int32)
    block_tables = permutation.reshape(num_sets, batch, pages_per_sequence)
    page_indices = block_tables.reshape(num_sets, pages_per_set)
    page_indptr = jnp.broadcast_to(
        jnp.arange(batch + 1, dtype=jnp.int32) * pages_per_sequence, (num_sets, batch + 1)
    )
    last_len = context - (pages_per_sequence - 1) * page_size
    last_page_len = jnp.full((num_sets, batch), last_len, jnp.int32)
    seq_lens = jnp.full((batch,), context, jnp.int32)

    return AttentionSetup(
        batch=batch,
        context=context,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        num_sets=num_sets,
        pages_per_sequence=pages_per_sequence,
        queries=queries,
        pools=pools,
        page_indptr=jnp.array(page_indptr),
        page_indices=page_indices,
        last_page_len=last_page_len,
        block_tables=block_tables,
        seq_lens=seq_lens,
        kv_bytes_per_set=kv_bytes,
    )
