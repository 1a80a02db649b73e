"""Hypothesis strategies shared by the whole test suite: distributions, ragged batches, page tables.

One module, so that every test of a sampler sees the same hard distributions and every test of an
attention kernel the same hard batches (``docs/testing.md``).

Shapes come from the caller, values from hypothesis. Every strategy here takes its static sizes
(vocabulary size, batch size, page size, pool size, padded index count) as plain ints and draws
only values: lengths inside a bucket, page placements, probabilities. Interpret-mode Pallas and
``jax.jit`` compile once per shape, so a strategy that drew shapes would make every example a
fresh compilation and the suite would crawl.

Contents:

- Probability vectors (float64 NumPy, non-negative, summing to 1 within 1e-12):
  ``simplex_points``, ``near_one_hot``, ``uniform_distributions``, ``tied_distributions``,
  ``distributions_with_zeros``, ``distributions_with_tiny_values``; ``probability_vectors`` draws
  from any of them and ``probability_matrices`` stacks rows of mixed kinds.
- Ragged batches: ``sequence_lengths`` (one length, biased towards the page-boundary edge cases),
  ``ragged_seq_lens`` (a batch of them), ``fixed_total_seq_lens`` (a batch whose token count is
  fixed, for appends whose ``nnz`` is a static shape).
- Page tables: ``PagedBucket`` (the static sizes of one compiled bucket), ``scattered_page_tables``
  (requests' pages drawn from a random permutation of the pool) and
  ``page_tables_with_shared_prefix`` (requests that share their first pages read-only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from hypothesis import strategies as st

import paged

# A probability far below float32's smallest normal number (1.2e-38 is the limit; 1e-30 is still
# normal in float32 but vanishes next to any ordinary entry when summed).
TINY_PROBABILITY = 1e-30

# Mass left outside the favourite token by ``near_one_hot``: from "one-hot up to rounding" to
# "clearly not one-hot".
NEAR_ONE_HOT_REMAINDERS = (1e-15, 1e-9, 1e-6, 1e-3, 0.1)

IntOrStrategy = int | st.SearchStrategy[int]


def _as_strategy(value: IntOrStrategy) -> st.SearchStrategy[int]:
    return value if isinstance(value, st.SearchStrategy) else st.just(value)


def _normalized(weights: Sequence[float]) -> np.ndarray:
    """``weights / sum(weights)`` in float64. Equal weights stay exactly equal (same division)."""
    weights = np.asarray(weights, dtype=np.float64)
    total = weights.sum()
    if not total > 0:
        raise ValueError(f"weights must have a positive sum, got {weights}")
    return weights / total


# Weights a strategy normalizes. Bounded away from 0 so that "zero" and "tiny" stay the business
# of the strategies that mean them; subnormals are excluded for the same reason.
_POSITIVE_WEIGHT = st.floats(min_value=1e-6, max_value=1.0, allow_subnormal=False)


# --------------------------------------------------------------------------------------------
# Probability vectors
# --------------------------------------------------------------------------------------------


@st.composite
def simplex_points(draw, vocab_size: IntOrStrategy) -> np.ndarray:
    """A strictly positive distribution over ``vocab_size`` tokens (a point inside the simplex).

    Args:
      vocab_size: an int (a fixed shape, as kernel tests need) or a strategy of ints (as exact
        enumeration over small vocabularies wants).

    Returns:
      float64 ``[vocab_size]``, every entry > 0, summing to 1 within 1e-12. Hypothesis favours
      boundary floats, so equal entries are common here too; ``tied_distributions`` guarantees
      them.
    """
    size = draw(_as_strategy(vocab_size))
    return _normalized(draw(st.lists(_POSITIVE_WEIGHT, min_size=size, max_size=size)))


@st.composite
def near_one_hot(draw, vocab_size: IntOrStrategy) -> np.ndarray:
    """Almost all mass on one token; the rest (1e-15 to 0.1) spread over the others at random.

    Where samplers meet their cumulative-sum rounding: the favourite's running sum reaches 1 - eps
    and the last tokens decide whether ``u`` near 1 still finds a token.
    """
    size = draw(_as_strategy(vocab_size))
    favourite = draw(st.integers(0, size - 1))
    if size == 1:
        return np.ones(1)
    remainder = draw(st.sampled_from(NEAR_ONE_HOT_REMAINDERS))
    others = _normalized(draw(st.lists(_POSITIVE_WEIGHT, min_size=size - 1, max_size=size - 1)))
    probabilities = np.insert(others * remainder, favourite, 1.0 - remainder)
    return probabilities / probabilities.sum()


@st.composite
def uniform_distributions(draw, vocab_size: IntOrStrategy) -> np.ndarray:
    """Every token ``1 / vocab_size``: all tokens tie, the worst case for any cut-off."""
    size = draw(_as_strategy(vocab_size))
    return np.full(size, 1.0 / size)


@st.composite
def tied_distributions(draw, vocab_size: IntOrStrategy, max_levels: int = 3) -> np.ndarray:
    """Entries take one of at most ``max_levels`` values, so many are exactly equal.

    A top-k or top-p cut-off lands inside a group of ties as often as not; the ties survive
    normalization exactly because equal weights divided by the same sum stay equal.
    """
    size = draw(_as_strategy(vocab_size))
    levels = draw(
        st.lists(_POSITIVE_WEIGHT, min_size=1, max_size=max_levels, unique=True).map(sorted)
    )
    return _normalized(draw(st.lists(st.sampled_from(levels), min_size=size, max_size=size)))


@st.composite
def distributions_with_zeros(draw, vocab_size: IntOrStrategy) -> np.ndarray:
    """Some tokens (possibly all but one) have probability exactly 0.

    A sampler must never return a zero-probability token, whatever its random number.
    """
    size = draw(_as_strategy(vocab_size))
    weights = draw(st.lists(_POSITIVE_WEIGHT, min_size=size, max_size=size))
    zeroed = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    keep = draw(st.integers(0, size - 1))  # at least one token keeps its mass
    zeroed[keep] = False
    return _normalized([0.0 if z else w for w, z in zip(weights, zeroed, strict=True)])


@st.composite
def distributions_with_tiny_values(draw, vocab_size: IntOrStrategy) -> np.ndarray:
    """Some tokens have probability about ``TINY_PROBABILITY`` (1e-30), the rest ordinary mass.

    Tiny entries underflow in float32 sums and in ``exp`` of their logits; a sampler may pick one
    only with its (negligible) probability, and an exact enumeration must still account for it.
    """
    size = draw(_as_strategy(vocab_size))
    weights = draw(st.lists(_POSITIVE_WEIGHT, min_size=size, max_size=size))
    tiny = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    keep = draw(st.integers(0, size - 1))
    tiny[keep] = False
    return _normalized([TINY_PROBABILITY if t else w for w, t in zip(weights, tiny, strict=True)])


PROBABILITY_KINDS = {
    "simplex": simplex_points,
    "near_one_hot": near_one_hot,
    "uniform": uniform_distributions,
    "ties": tied_distributions,
    "zeros": distributions_with_zeros,
    "tiny": distributions_with_tiny_values,
}


def probability_vectors(
    vocab_size: IntOrStrategy, kinds: Sequence[str] = tuple(PROBABILITY_KINDS)
) -> st.SearchStrategy[np.ndarray]:
    """A distribution of one of the given kinds (default: all of ``PROBABILITY_KINDS``).

    Example:
      >>> from hypothesis import given
      >>> @given(probability_vectors(5))
      ... def check(p):
      ...     assert p.shape == (5,) and (p >= 0).all() and abs(p.sum() - 1) < 1e-12
      >>> check()
    """
    unknown = set(kinds) - set(PROBABILITY_KINDS)
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {list(PROBABILITY_KINDS)}")
    return st.one_of(*(PROBABILITY_KINDS[kind](vocab_size) for kind in kinds))


@st.composite
def probability_matrices(
    draw, batch_size: int, vocab_size: int, kinds: Sequence[str] = tuple(PROBABILITY_KINDS)
) -> np.ndarray:
    """float64 ``[batch_size, vocab_size]``: each row a distribution of its own, independently drawn
    kind, so one batch mixes ties, zeros and near-one-hot rows as a real batch would."""
    rows = [draw(probability_vectors(vocab_size, kinds)) for _ in range(batch_size)]
    return np.stack(rows) if rows else np.zeros((0, vocab_size))


# --------------------------------------------------------------------------------------------
# Ragged batches
# --------------------------------------------------------------------------------------------


def edge_lengths(page_size: int, max_seq_len: int, min_len: int = 0) -> list[int]:
    """The lengths where paged code goes wrong, inside ``[min_len, max_seq_len]``: empty, one
    token, one short of a page, a full page, a page plus one, two pages, and the longest."""
    candidates = (0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size, max_seq_len)
    return sorted({n for n in candidates if min_len <= n <= max_seq_len})


def sequence_lengths(page_size: int, max_seq_len: int, *, min_len: int = 0) -> st.SearchStrategy:
    """One request's length: an edge case (``edge_lengths``) half the time, any length otherwise."""
    if not 0 <= min_len <= max_seq_len:
        raise ValueError(f"need 0 <= min_len <= max_seq_len, got {min_len} and {max_seq_len}")
    return st.one_of(
        st.sampled_from(edge_lengths(page_size, max_seq_len, min_len)),
        st.integers(min_len, max_seq_len),
    )


def ragged_seq_lens(
    batch_size: int, page_size: int, max_seq_len: int, *, min_len: int = 0
) -> st.SearchStrategy[list[int]]:
    """``batch_size`` lengths in ``[min_len, max_seq_len]``, mixing empty, 1, page_size,
    page_size + 1 and long requests (``min_len=1`` excludes empty requests)."""
    return st.lists(
        sequence_lengths(page_size, max_seq_len, min_len=min_len),
        min_size=batch_size,
        max_size=batch_size,
    )


@st.composite
def fixed_total_seq_lens(
    draw, batch_size: int, total: int, max_seq_len: int | None = None
) -> list[int]:
    """``batch_size`` non-negative lengths summing to exactly ``total`` (each at most
    ``max_seq_len``).

    For appends: ``append_kv`` takes ``nnz = total`` new tokens, a static shape, so a fixed total
    lets hypothesis vary how the tokens spread over the requests without a recompilation.
    """
    limit = total if max_seq_len is None else max_seq_len
    if batch_size * limit < total:
        raise ValueError(f"{batch_size} requests of at most {limit} tokens cannot hold {total}")
    if batch_size == 0:
        if total:
            raise ValueError(f"an empty batch cannot hold {total} tokens")
        return []
    lengths = [0] * batch_size
    remaining = total
    # Hand tokens out in random-sized chunks to random requests with room left; a chunk may be
    # a whole request's worth, so lengths of 0 and of ``limit`` both occur.
    while remaining:
        open_requests = [b for b in range(batch_size) if lengths[b] < limit]
        b = draw(st.sampled_from(open_requests))
        chunk = draw(st.integers(1, min(remaining, limit - lengths[b])))
        lengths[b] += chunk
        remaining -= chunk
    return lengths


# --------------------------------------------------------------------------------------------
# Page tables
# --------------------------------------------------------------------------------------------


def pages_needed(seq_len: int, page_size: int) -> int:
    """``ceil(seq_len / page_size)``: the pages a request of ``seq_len`` tokens holds."""
    return -(-seq_len // page_size)


@dataclasses.dataclass(frozen=True)
class PagedBucket:
    """The static sizes of one compiled shape bucket of a paged batch.

    Everything here is a shape; a test draws values (lengths up to ``max_seq_len``, the placement
    of pages in the pool) inside the bucket, and every example reuses one compilation.

    Attributes:
      batch_size: requests in the batch.
      page_size: tokens per page.
      max_seq_len: longest request.
      num_pool_pages: pages in the KV pool (default: what the longest batch needs, plus one spare
        page per request, so some pool pages are always unused).
      num_indices: padded length of ``page_indices`` (default ``paged.bucket_size`` of the most
        pages the batch can hold).

    Example:
      >>> bucket = PagedBucket(batch_size=3, page_size=16, max_seq_len=40)
      >>> bucket.max_pages_per_request, bucket.num_pool_pages, bucket.num_indices
      (3, 12, 16)
    """

    batch_size: int
    page_size: int
    max_seq_len: int
    num_pool_pages: int = 0
    num_indices: int = 0

    def __post_init__(self):
        if self.batch_size < 0 or self.page_size < 1 or self.max_seq_len < 0:
            raise ValueError(f"invalid bucket {self}")
        most_pages = self.batch_size * self.max_pages_per_request
        if not self.num_pool_pages:
            object.__setattr__(self, "num_pool_pages", most_pages + self.batch_size)
        if not self.num_indices:
            object.__setattr__(self, "num_indices", paged.bucket_size(most_pages))
        if self.num_pool_pages < most_pages or self.num_indices < most_pages:
            raise ValueError(
                f"num_pool_pages={self.num_pool_pages} and num_indices={self.num_indices} must "
                f"both hold the {most_pages} pages of {self.batch_size} requests of "
                f"{self.max_seq_len} tokens"
            )

    @property
    def max_pages_per_request(self) -> int:
        return pages_needed(self.max_seq_len, self.page_size)


@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """A drawn page table together with what it was built from.

    The test's oracle reads ``seq_lens`` and ``page_lists`` (plain Python, drawn here) rather than
    anything computed by ``paged``, so the code under test cannot vouch for itself.

    Attributes:
      page_table: the table, ``page_indices`` padded to the bucket's ``num_indices``.
      seq_lens: each request's length.
      page_lists: each request's pages, in token order.
    """

    page_table: paged.PageTable
    seq_lens: list[int]
    page_lists: list[list[int]]


@st.composite
def scattered_page_tables(
    draw,
    bucket: PagedBucket,
    seq_lens: st.SearchStrategy[list[int]] | Sequence[int] | None = None,
) -> PagedBatch:
    """A page table whose requests' pages are scattered over the pool in random order.

    The pages handed out are a random permutation of the whole pool, so consecutive pages of one
    request are far apart, requests interleave, page 0 is sometimes used and sometimes not, and
    the table is padded to the bucket's fixed ``num_indices``.

    Args:
      bucket: the static sizes.
      seq_lens: the lengths, or a strategy for them (default ``ragged_seq_lens`` over the bucket).

    Example:
      >>> from hypothesis import given
      >>> @given(scattered_page_tables(PagedBucket(batch_size=2, page_size=4, max_seq_len=9)))
      ... def check(batch):
      ...     assert batch.page_table.page_indices.shape == (16,)  # bucket_size(2 * 3 pages)
      >>> check()
    """
    if seq_lens is None:
        seq_lens = ragged_seq_lens(bucket.batch_size, bucket.page_size, bucket.max_seq_len)
    lengths = list(draw(seq_lens) if isinstance(seq_lens, st.SearchStrategy) else seq_lens)
    if len(lengths) != bucket.batch_size or any(n > bucket.max_seq_len for n in lengths):
        raise ValueError(f"seq_lens {lengths} do not fit the bucket {bucket}")
    order = draw(st.permutations(range(bucket.num_pool_pages)))
    page_lists, start = [], 0
    for length in lengths:
        count = pages_needed(length, bucket.page_size)
        page_lists.append(list(order[start : start + count]))
        start += count
    table = paged.PageTable.from_page_lists(
        page_lists, lengths, bucket.page_size, num_indices=bucket.num_indices
    )
    return PagedBatch(table, lengths, page_lists)


@st.composite
def page_tables_with_shared_prefix(draw, bucket: PagedBucket) -> PagedBatch:
    """Requests that all start with the same full pages (a shared prompt), then go their own way.

    The shared pages appear once per request in ``page_indices``, as a serving engine lists a
    prefix it shares read-only. Every request has at least the shared prefix; with a prefix of 0
    pages the table is an ordinary scattered one.
    """
    page_size = bucket.page_size
    shared_pages = draw(st.integers(0, bucket.max_seq_len // page_size))
    prefix_len = shared_pages * page_size
    own_lens = draw(ragged_seq_lens(bucket.batch_size, page_size, bucket.max_seq_len - prefix_len))
    order = draw(st.permutations(range(bucket.num_pool_pages)))
    prefix, rest = list(order[:shared_pages]), list(order[shared_pages:])
    page_lists, lengths, start = [], [], 0
    for own_len in own_lens:
        # The prefix fills its pages, so a request's own tokens start on a fresh page.
        count = pages_needed(own_len, page_size)
        page_lists.append(prefix + rest[start : start + count])
        lengths.append(prefix_len + own_len)
        start += count
    table = paged.PageTable.from_page_lists(
        page_lists, lengths, page_size, num_indices=bucket.num_indices
    )
    return PagedBatch(table, lengths, page_lists)
