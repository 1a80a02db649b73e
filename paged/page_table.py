"""The CSR page table: which pages of the KV pool hold each request's tokens.

FlashInfer's form (``design.md``), three int32 arrays for a batch of ``B`` requests:

- ``page_indptr[B + 1]``: prefix sums of each request's page count; request ``b`` owns
  ``page_indices[page_indptr[b]:page_indptr[b + 1]]``.
- ``page_indices[nnz]``: every request's pages, concatenated in token order. Padded to a bucketed
  static size for ``jit``; entries past ``page_indptr[-1]`` hold 0 and are ignored.
- ``last_page_len[B]``: tokens in each request's last page, in ``[1, page_size]``; 0 for an empty
  request (no pages, sequence length 0).

Token ``t`` of request ``b`` lives in page ``page_indices[page_indptr[b] + t // page_size]`` at
slot ``t % page_size``. Sequence length is ``page_size * (num_pages - 1) + last_page_len``.

One type serves the device and the host: a ``PageTable``'s arrays are JAX arrays, or NumPy
arrays where a host builds tables every step (the serving scheduler, ``host_page_table``) and a
jitted call transfers them with its other inputs; nothing re-wraps them on the way.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.platform import is_concrete


def bucket_size(n: int, minimum: int = 16) -> int:
    """The static size an array of ``n`` entries is padded to: the next power of two >= n.

    Powers of two keep the number of distinct compiled shapes logarithmic in the largest size,
    and waste at most half of a padded array.

    Example:
      >>> bucket_size(5), bucket_size(17), bucket_size(64)
      (16, 32, 64)
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    size = max(minimum, 1)
    while size < n:
        size *= 2
    return size


def _check_page_size(page_size) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)):
        raise TypeError(f"page_size must be an int, got {page_size!r}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")


@dataclasses.dataclass(frozen=True)
class PageTable:
    """A batch's CSR page table (a pytree; ``page_size`` is static).

    The three arrays are JAX arrays or, for a table built on the host each step, NumPy arrays
    (``host_page_table``; ``num_pages`` and ``seq_lens`` then answer in NumPy too).

    Attributes:
      page_indptr: int32[B + 1], non-decreasing, starting at 0.
      page_indices: int32[nnz_padded], ``nnz_padded >= page_indptr[-1]``.
      last_page_len: int32[B].
      page_size: tokens per page (static).

    Example:
      >>> table = PageTable.from_page_lists([[3, 0], [2]], seq_lens=[20, 5], page_size=16)
      >>> table.page_indptr.tolist(), table.last_page_len.tolist(), table.seq_lens().tolist()
      ([0, 2, 3], [4, 5], [20, 5])
    """

    page_indptr: jax.Array | np.ndarray
    page_indices: jax.Array | np.ndarray
    last_page_len: jax.Array | np.ndarray
    page_size: int

    @property
    def batch_size(self) -> int:
        return self.last_page_len.shape[0]

    @property
    def on_host(self) -> bool:
        """Whether the arrays are NumPy arrays (a host table) rather than JAX arrays."""
        return isinstance(self.page_indptr, np.ndarray)

    def num_pages(self) -> jax.Array | np.ndarray:
        """int32[B]: pages owned by each request."""
        return self.page_indptr[1:] - self.page_indptr[:-1]

    def seq_lens(self) -> jax.Array | np.ndarray:
        """int32[B]: tokens of each request (0 for an empty request, and for one whose
        ``page_indptr`` decreases: unchecked here, ``validate_page_table`` refuses it)."""
        xp = np if self.on_host else jnp  # a host table stays off the device
        num_pages = self.num_pages()
        return xp.where(
            num_pages > 0, self.page_size * (num_pages - 1) + self.last_page_len, 0
        ).astype(np.int32)

    @staticmethod
    def from_page_lists(
        page_lists: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        page_size: int,
        *,
        num_indices: int | None = None,
    ) -> PageTable:
        """Builds a table from each request's pages and token count.

        Args:
          page_lists: for each request, its pages in token order.
          seq_lens: for each request, its number of tokens; needs exactly
            ``ceil(seq_len / page_size)`` pages.
          page_size: tokens per page.
          num_indices: static length to pad ``page_indices`` to (default: ``bucket_size(nnz)``).

        Raises:
          TypeError: if ``page_size`` is not an int.
          ValueError: if ``page_size < 1``, a request's page count does not match its length, or
            ``num_indices`` is smaller than the number of pages.
        """
        _check_page_size(page_size)
        if len(page_lists) != len(seq_lens):
            raise ValueError(
                f"page_lists has {len(page_lists)} requests but seq_lens has {len(seq_lens)}"
            )
        indptr, last = [0], []
        for b, (pages, length) in enumerate(zip(page_lists, seq_lens, strict=True)):
            if length < 0:
                raise ValueError(f"seq_lens[{b}] must be >= 0, got {length}")
            needed = -(-length // page_size)
            if len(pages) != needed:
                raise ValueError(
                    f"request {b} has seq_len {length}, which needs {needed} pages of "
                    f"{page_size}, but page_lists[{b}] has {len(pages)}"
                )
            indptr.append(indptr[-1] + needed)
            last.append(length - page_size * (needed - 1) if needed else 0)
        nnz = indptr[-1]
        size = bucket_size(nnz) if num_indices is None else num_indices
        if size < nnz:
            raise ValueError(f"num_indices={size} is smaller than the {nnz} pages in the table")
        flat = np.zeros(size, np.int32)
        flat[:nnz] = [p for pages in page_lists for p in pages]
        return PageTable(
            page_indptr=jnp.asarray(indptr, jnp.int32),
            page_indices=jnp.asarray(flat),
            last_page_len=jnp.asarray(last, jnp.int32),
            page_size=page_size,
        )

    @staticmethod
    def from_seq_lens(
        seq_lens: Sequence[int],
        page_size: int,
        *,
        pages: Sequence[int] | None = None,
        num_indices: int | None = None,
    ) -> PageTable:
        """Builds a table for the given lengths, taking pages in order from ``pages``.

        Args:
          seq_lens: tokens of each request.
          page_size: tokens per page.
          pages: the pages to hand out, in order (default ``0, 1, 2, ...``); pass a shuffled
            list, or pages from ``PagePool.allocate``, to scatter requests over a pool.
          num_indices: static length to pad ``page_indices`` to.

        Raises:
          TypeError: if ``page_size`` is not an int.
          ValueError: if ``page_size < 1``, a length is negative, ``pages`` is too short, or
            ``num_indices`` is smaller than the number of pages.

        Example:
          >>> PageTable.from_seq_lens([1, 17], page_size=16).page_indices[:3].tolist()
          [0, 1, 2]
        """
        _check_page_size(page_size)
        counts = [-(-int(n) // page_size) for n in seq_lens]
        total = sum(counts)
        pages = list(range(total)) if pages is None else list(pages)
        if len(pages) < total:
            raise ValueError(f"pages has {len(pages)} entries but the lengths need {total}")
        page_lists, start = [], 0
        for count in counts:
            page_lists.append(pages[start : start + count])
            start += count
        return PageTable.from_page_lists(
            page_lists, [int(n) for n in seq_lens], page_size, num_indices=num_indices
        )

    def padded(self, num_indices: int) -> PageTable:
        """The same table with ``page_indices`` padded (with zeros) to ``num_indices`` entries."""
        current = self.page_indices.shape[0]
        if num_indices < current:
            raise ValueError(f"num_indices={num_indices} is smaller than the current {current}")
        indices = jnp.pad(self.page_indices, (0, num_indices - current))
        return dataclasses.replace(self, page_indices=indices)

    def page_lists(self) -> list[list[int]]:
        """Host-side: each request's pages (reads the arrays; not for use under ``jit``)."""
        indptr = np.asarray(self.page_indptr)
        indices = np.asarray(self.page_indices)
        return [indices[indptr[b] : indptr[b + 1]].tolist() for b in range(self.batch_size)]


jax.tree_util.register_dataclass(
    PageTable,
    data_fields=["page_indptr", "page_indices", "last_page_len"],
    meta_fields=["page_size"],
)


def host_page_table(
    page_lists: Sequence[Sequence[int]],
    seq_lens: Sequence[int] | np.ndarray,
    page_size: int,
    *,
    num_indices: int | None = None,
) -> PageTable:
    """A ``PageTable`` of NumPy arrays: rows of ``seq_lens`` tokens, each reading the first
    pages of its list (a host's per-step table; a jitted call transfers it with its inputs).

    Unlike ``PageTable.from_page_lists`` a list may hold more pages than its row needs (a
    request's pages beyond the tokens this table covers); the extra ones are left out.

    Args:
      page_lists: per row, at least ``ceil(seq_lens[b] / page_size)`` pages.
      seq_lens: int[B] tokens per row, each ``>= 0``.
      page_size: tokens per page, ``>= 1``.
      num_indices: static length of ``page_indices`` (default ``bucket_size(nnz)``).

    Raises:
      ValueError: a bad ``page_size``, a negative length, a row with too few pages, or
        ``num_indices`` below the pages the rows need.

    Example:
      >>> table = host_page_table([[3, 1, 7], [2]], [5, 4], page_size=4)
      >>> table.on_host, table.page_lists(), table.seq_lens().tolist()
      (True, [[3, 1], [2]], [5, 4])
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    seq_lens = np.asarray(seq_lens, np.int32)
    if len(page_lists) != len(seq_lens):
        raise ValueError(f"page_lists has {len(page_lists)} rows but seq_lens has {len(seq_lens)}")
    if np.any(seq_lens < 0):
        b = int(np.argmax(seq_lens < 0))
        raise ValueError(f"seq_lens[{b}] must be >= 0, got {seq_lens[b]}")
    counts = -(-seq_lens // page_size)
    for b, (pages, count) in enumerate(zip(page_lists, counts.tolist(), strict=True)):
        if len(pages) < count:
            raise ValueError(
                f"row {b} has seq_len {seq_lens[b]}, which needs {count} pages of {page_size}, "
                f"but page_lists[{b}] has {len(pages)}"
            )
    indptr = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=indptr[1:])
    nnz = int(indptr[-1])
    size = bucket_size(nnz) if num_indices is None else num_indices
    if size < nnz:
        raise ValueError(f"num_indices={size} is smaller than the {nnz} pages in the table")
    indices = np.zeros(size, np.int32)
    indices[:nnz] = list(
        itertools.chain.from_iterable(
            pages[:count] for pages, count in zip(page_lists, counts.tolist(), strict=True)
        )
    )
    last = np.where(counts > 0, seq_lens - page_size * (counts - 1), 0).astype(np.int32)
    return PageTable(indptr, indices, last, page_size)


def check_holds_new_tokens(
    table: PageTable, num_new_tokens: int, what: str, *, allow_empty: bool = False
) -> None:
    """Raises ``ValueError`` if a concrete ``table`` has a request with fewer than
    ``num_new_tokens`` tokens: a table handed to a forward pass or a prefill must already
    include the new tokens (``what`` names them in the message). With ``allow_empty``, a request
    of no tokens passes (an idle row of a decode batch). Traced tables are not checked.

    Example:
      >>> check_holds_new_tokens(PageTable.from_seq_lens([3], page_size=4), 2, "L=2 new tokens")
    """
    if not is_concrete(table.page_indptr, table.last_page_len):
        return
    lengths = np.asarray(table.seq_lens())
    short = lengths < num_new_tokens
    if allow_empty:
        short &= lengths > 0
    if np.any(short):
        b = int(np.argmax(short))
        raise ValueError(
            f"page_table's request {b} has {lengths[b]} tokens, fewer than the {what}: the "
            "table must already include the new tokens"
        )


def check_csr_offsets(
    indptr: np.ndarray, owner: str, offsets_name: str, entries_name: str, num_entries: int
) -> np.ndarray:
    """Checks concrete CSR offsets (the rows of ``entries_name`` are ``[indptr[r],
    indptr[r + 1])``): they start at 0, never decrease, and end inside the entries. Errors name
    ``owner.offsets_name`` and the bad entries. Returns each row's length (``np.diff``)."""
    full = f"{owner}.{offsets_name}"
    if indptr[0] != 0:
        raise ValueError(f"{full} must start at 0, got {indptr[0]}")
    # Array methods, not np.diff and np.any: the same values without their Python wrappers
    # (the engine validates a table a step; a few microseconds each on a CPU).
    steps = indptr[1:] - indptr[:-1]
    if (steps < 0).any():
        r = int(np.argmax(steps < 0))
        raise ValueError(
            f"{full} must be non-decreasing, but {offsets_name}[{r}]={indptr[r]} > "
            f"{offsets_name}[{r + 1}]={indptr[r + 1]}"
        )
    if indptr[-1] > num_entries:
        raise ValueError(f"{full}[-1]={indptr[-1]} exceeds len({entries_name})={num_entries}")
    return steps


def validate_page_table(
    table: PageTable, num_pool_pages: int | None, *, batch_size: int | None = None
) -> None:
    """Checks a page table's shapes and dtypes always, and its values when they are concrete.

    Args:
      table: the table to check.
      num_pool_pages: pages in the KV pool; every index in use must lie in ``[0, num_pool_pages)``.
        None skips that check (``plan_decode``, which never sees the pool).
      batch_size: the batch the table must describe (e.g. ``q.shape[0]``), if known.

    Raises:
      ValueError: naming the argument and the bad value.
    """
    for name in ("page_indptr", "page_indices", "last_page_len"):
        array = getattr(table, name)
        if array.dtype != np.int32:  # np.int32 is jnp.int32's dtype, compared without jnp's lookup
            raise ValueError(f"page_table.{name} must be int32, got {array.dtype}")
        if array.ndim != 1:
            raise ValueError(f"page_table.{name} must be 1-D, got shape {array.shape}")
    if table.page_size < 1:
        raise ValueError(f"page_table.page_size must be >= 1, got {table.page_size}")
    num_requests = table.last_page_len.shape[0]
    if table.page_indptr.shape[0] != num_requests + 1:
        raise ValueError(
            f"page_table.page_indptr has shape {table.page_indptr.shape} but last_page_len has "
            f"{num_requests} requests; page_indptr needs {num_requests + 1} entries"
        )
    if batch_size is not None and num_requests != batch_size:
        raise ValueError(
            f"page_table describes {num_requests} requests but the batch has {batch_size}"
        )
    if not is_concrete(table.page_indptr, table.last_page_len):
        return
    indptr = np.asarray(table.page_indptr)
    last = np.asarray(table.last_page_len)
    steps = check_csr_offsets(
        indptr, "page_table", "page_indptr", "page_indices", table.page_indices.shape[0]
    )
    has_pages = steps > 0
    bad_len = np.where(has_pages, (last < 1) | (last > table.page_size), last != 0)
    if bad_len.any():
        b = int(np.argmax(bad_len))
        expected = f"[1, {table.page_size}]" if has_pages[b] else "0 (the request has no pages)"
        raise ValueError(f"page_table.last_page_len[{b}]={last[b]} must be in {expected}")
    if num_pool_pages is None or not is_concrete(table.page_indices):
        return
    used = np.asarray(table.page_indices)[: indptr[-1]]
    bad = (used < 0) | (used >= num_pool_pages)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"page_table.page_indices[{i}]={used[i]} is outside the pool of {num_pool_pages} pages"
        )
