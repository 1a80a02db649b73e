"""Host-side page allocator with reference counts, as serving engines keep it.

The device only ever sees the three page-table arrays; which pages are free, and how many
requests read each one, is bookkeeping on the host. A page shared by several requests (a common
prompt prefix) is freed when its last reader lets go.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class PoolExhaustedError(ValueError):
    """Raised when an allocation asks for more pages than are free."""


class PagePool:
    """A free list over ``num_pages`` pages, with a reference count per page.

    Pages are handed out lowest-index first, so runs are reproducible.

    Raises:
      TypeError: if ``num_pages`` (or a count or page given to a method) is not an int.
      ValueError: if ``num_pages < 1``.

    Example:
      >>> pool = PagePool(4)
      >>> a = pool.allocate(2); pool.share(a); pool.free(a); pool.num_free
      2
      >>> pool.free(a); pool.num_free
      4
    """

    def __init__(self, num_pages: int):
        _check_count("num_pages", num_pages, minimum=1)
        self.num_pages = int(num_pages)
        self._ref_counts = [0] * num_pages
        # A stack popped from the end; reversed so that page 0 goes first.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Pages with no reader."""
        return len(self._free)

    def ref_count(self, page: int) -> int:
        """How many requests currently hold ``page``."""
        self._check_page(page)
        return self._ref_counts[page]

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` free pages (reference count 1 each).

        Raises:
          PoolExhaustedError: if fewer than ``n`` pages are free (nothing is taken then).
        """
        _check_count("n", n, minimum=0)
        n = int(n)
        if n > len(self._free):
            raise PoolExhaustedError(
                f"cannot allocate {n} pages: only {len(self._free)} of {self.num_pages} are free"
            )
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._ref_counts[page] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Another request now reads ``pages`` too (each must be held already)."""
        pages = list(pages)
        for page in pages:
            self._check_page(page)
            if self._ref_counts[page] == 0:
                raise ValueError(f"cannot share page {page}: nobody holds it")
        for page in pages:
            self._ref_counts[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one reference to each page; a page with no reference left becomes free.

        Raises:
          ValueError: if a page is outside the pool or held by nobody (nothing is freed then).
        """
        pages = list(pages)
        drops: dict[int, int] = {}
        for page in pages:
            self._check_page(page)
            drops[page] = drops.get(page, 0) + 1
            if drops[page] > self._ref_counts[page]:
                raise ValueError(
                    f"cannot free page {page}: it has {self._ref_counts[page]} holder(s) and "
                    f"would be freed {drops[page]} time(s)"
                )
        for page in pages:
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free.append(page)

    def _check_page(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, (int, np.integer)):
            raise TypeError(f"a page must be an int, got {page!r}")
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is outside the pool of {self.num_pages} pages")


def _check_count(name: str, value, *, minimum: int) -> None:
    """A count must be an int (a float such as 2.5 pages has no meaning) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
