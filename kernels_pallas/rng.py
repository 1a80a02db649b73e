"""The counter-based random number generator shared by sampling kernels and references.

What it is: Threefry-2x32 with 20 rounds (Salmon, Moraes, Dror and Shaw, "Parallel random
numbers: as easy as 1, 2, 3", SC 2011), the same block function JAX's default PRNG uses, written
in plain ``jnp`` uint32 arithmetic (add, xor, shifts), plus the maps from random bits to the
uniform, exponential and Gumbel noise that samplers need.

Why: a sampler's Pallas kernel and its pure-JAX reference must draw the very same numbers for the
same key, so that they pick the same tokens and a kernel can be checked token for token. A
counter-based generator makes every number a pure function of (key, counter): a kernel computes
the noise of the elements it owns in registers and never reads a noise array, and the reference
computes the same function over the whole array. Threefry-2x32 needs only 32-bit add, xor and
shifts (no 32x32->64 multiply-high, which Philox needs), the integer operations every Pallas
lowering has; the code below runs under ``jax.jit``, inside a ``pl.pallas_call`` body (the tests
run one), and on any broadcast shape. Inside a kernel, pass a row's key words as a pair of
arrays (two refs, or two loads) rather than slicing a ``[..., 2]`` array.

Counter layout (the contract; changing it changes every sampled token):

- Every row of a batch has its own two key words, ``row_keys(key, batch) -> uint32[B, 2]``:
  - ``key`` is one key: row ``b`` gets ``threefry2x32(key, (ROW_DOMAIN, b))``, both output
    words. Threefry is a bijection of the counter for a fixed key, so distinct rows get distinct
    key words, for any ``b < 2**32``; and a row's key does not depend on the batch size.
  - ``key`` is ``B`` keys: row ``b`` gets key ``b``'s own words, so a request's numbers depend
    on its key alone, never on the slot it sits in (an engine passes
    ``jax.random.fold_in(request_key, step)`` per row).
- Within a row, element ``column`` of stream ``stream`` (e.g. a rejection round) takes word
  ``column % 2`` of ``threefry2x32(row_key, (ELEMENT_DOMAIN | column // 2, stream))``, where
  ``ELEMENT_DOMAIN = 2**31`` sets the top bit of counter word 0. For a fixed row key,
  distinct ``(column, stream)`` pairs use distinct (counter, word) pairs for every
  ``column < 2**32`` and ``stream < 2**32``: no value is ever reused. One block call serves two
  adjacent columns, so a kernel that wants speed calls ``random_bit_pairs`` once per column pair
  (half the work of one call per element) and gets the same numbers as ``random_bits``.
- Streams in use (a new user takes a new number): 0, Gumbel-max noise
  (``sampling.api.EXPONENTIAL_STREAM``, column = token); 1, rejection-round uniforms
  (``sampling.api.ROUND_STREAM``, column = round); 2, speculative verification
  (``speculative.api.SPECULATIVE_STREAM``, columns ``4i .. 4i + 2`` for draft position ``i``);
  3, the block noise of a cost probe (``bench/gumbel_two_level_probe.py``, column = block; no
  sampler uses it).
- Domain separation, by counter word 0: element draws use ``[2**31, 2**32)``, row-key
  derivation uses ``ROW_DOMAIN = 2**31 - 1``, and JAX's own Threefry uses of a key stay below
  that: ``fold_in(key, d)`` is the block at counter ``(0, d)``, and ``split`` and
  ``random_bits`` count from 0 (below ``2**31 - 1`` for anything under ``2**31`` keys or words).
  So, by construction, no row key equals a block of element bits (even for a key used both as a
  one-key sampler key and as a per-row key), and no block of element bits equals a key that JAX
  derives from the same key (``fold_in(key, 1)`` is not the noise of columns 0 and 1 in stream
  1). Still, as with every ``jax.random`` function, treat a key given to a sampler as used up.

From bits to noise (the tails are where samplers go wrong, ``shared/anchors.md``):

- ``uniform_open(bits)``: ``(2j + 1) * 2**-24`` with ``j`` the top 23 bits: ``2**23`` equally
  likely values, each the centre of its cell of width ``2**-23``, from ``2**-24`` to
  ``1 - 2**-24``: never 0, never 1, and symmetric under ``u -> 1 - u``, so ``E[u] = 1/2``
  exactly. Every value is an exact float32 (odd integers below ``2**24`` are). 24 bits cannot be
  had: centred cells of width ``2**-24`` need spacing ``2**-25`` just below 1, which float32 lacks.
- ``exponential(bits)``: Exp(1) by inversion, split at the median so that both tails keep full
  relative precision. The top bit picks the half; the other 31 bits ``m`` give
  ``t = (2m + 1) * 2**-33`` in ``(0, 1/2]``, the centre of cell ``m`` of ``2**31`` equal cells
  of ``(0, 1/2)``, dense near 0 because float32 is. Lower half: ``E = -log1p(-t)`` (so
  ``P(E <= e) = t``); upper half: ``E = -log(t)`` (so ``P(E > e) = t``). The ``2**32`` bit
  patterns thus map one to one onto the centres of ``2**32`` equiprobable cells of the Exp(1)
  distribution, up to float32 rounding (``t`` is rounded to 24 significant bits, exact for
  ``m < 2**23``; the logarithm adds an ulp or two): relative error of ``E`` at most ``2**-22``.
  Smallest ``E``: ``2**-33`` (about 1.2e-10; the naive ``-log(u)`` stops at ``2**-24``, erasing
  every token whose probability is far below ``6e-8``); largest ``E``: ``33 ln 2`` (about 22.9).
  At every ``e``, ``|P(E <= e) - (1 - exp(-e))| <= 2**-33 + 2**-22 * e * exp(-e)``: half a cell
  from the discreteness, plus what the rounding moves across ``e``. In the tails this is a
  relative statement: ``P(E <= e) = (1 - exp(-e)) (1 +- 2**-22) +- 2**-33``, and
  ``P(E > e) = exp(-e) (1 +- 2**-22 e) +- 2**-33``; the mass beyond the extremes (``2**-33`` on
  each side) sits in the extreme cells. The cost is two logarithms and a select per element.
- ``gumbel(bits) = -log(exponential(bits))``, Gumbel(0, 1), in ``[-3.13, 22.9]``, so that
  ``argmax(logits + gumbel)`` and ``argmax(p / exponential)`` pick the same token from the same
  bits up to float rounding.

Example:
  >>> import jax
  >>> key = jax.random.key(0)
  >>> words = row_keys(key, 2)                      # uint32[2, 2]: rows 0 and 1
  >>> columns = jax.numpy.arange(4)
  >>> bits = random_bits(words[:, None, :], columns)  # uint32[2, 4]
  >>> noise = exponential(bits)                     # float32[2, 4], Exp(1), never 0
  >>> bits.shape, noise.dtype, bool((noise > 0).all())
  ((2, 4), dtype('float32'), True)
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

# Threefry-2x32 (Random123's threefry2x32_20): rotation amounts of rounds 0-7, repeated.
ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
# The key schedule's third word is key0 ^ key1 ^ KEY_PARITY (Skein's parity constant).
KEY_PARITY = 0x1BD11BDA
ROUNDS = 20  # a key injection after every 4 rounds, 5 in all
# Counter word 0 of row-key derivation, and the bit set in counter word 0 of every element draw:
# the two never meet, nor meet JAX's fold_in/split/random_bits counters (module docstring).
ROW_DOMAIN = np.uint32(0x7FFFFFFF)
ELEMENT_DOMAIN = np.uint32(0x80000000)

# Exact float32 powers of two for the bits-to-float maps.
_TWO_POW_MINUS_24 = np.float32(2.0**-24)
_TWO_POW_MINUS_33 = np.float32(2.0**-33)
_TOP_BIT = np.uint32(0x80000000)


def _as_uint32(x, name: str) -> jax.Array:
    """``x`` as a uint32 array; integers keep their bits mod 2**32, anything else is refused."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"{name} must be an integer array or int, got {type(x).__name__}")
        return jnp.asarray(x % 2**32, dtype=jnp.uint32)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype (uint32), got {dtype}")
    if isinstance(x, (np.ndarray, np.generic)):
        # NumPy wraps 64-bit integers mod 2**32 here; JAX without x64 would not be asked to.
        return jnp.asarray(np.asarray(x).astype(np.uint32))
    return jnp.asarray(x).astype(jnp.uint32)


def _rotate_left(x: jax.Array, amount: int) -> jax.Array:
    """32-bit left rotation from two logical shifts and an or (LLVM recognizes the idiom)."""
    return (x << amount) | (x >> (32 - amount))


def threefry2x32(key0, key1, counter0, counter1) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 block function with 20 rounds: two counter words to two random words.

    Implemented from the published description (Salmon et al. 2011; Random123's
    ``threefry2x32_20``): the key schedule is ``(key0, key1, key0 ^ key1 ^ 0x1BD11BDA)``; each
    round adds word 1 into word 0, rotates word 1 left by the round's constant and xors word 0
    into it; after rounds 3, 7, 11, 15 and 19 the injection ``s = 1..5`` adds schedule words
    ``s mod 3`` and ``(s + 1) mod 3``, plus ``s``. For a fixed key it is a bijection of the
    counter pair, which is what makes distinct counters give distinct blocks.

    Args:
      key0, key1: uint32 arrays (or ints), the two key words.
      counter0, counter1: uint32 arrays (or ints), the two counter words.
      All four broadcast against each other (NumPy rules); other integer dtypes are taken
      modulo ``2**32``.

    Returns:
      ``(word0, word1)``: two uint32 arrays of the broadcast shape.

    Raises:
      ValueError: an argument that is not an integer array or int, naming it.

    Example:
      >>> [hex(int(w)) for w in threefry2x32(0x13198A2E, 0x03707344, 0x243F6A88, 0x85A308D3)]
      ['0xc4923a9c', '0x483df7a0']
    """
    key0 = _as_uint32(key0, "key0")
    key1 = _as_uint32(key1, "key1")
    x0 = _as_uint32(counter0, "counter0")
    x1 = _as_uint32(counter1, "counter1")
    schedule = (key0, key1, key0 ^ key1 ^ np.uint32(KEY_PARITY))
    x0 = x0 + schedule[0]
    x1 = x1 + schedule[1]
    for injection in range(1, ROUNDS // 4 + 1):
        # Injection s follows rounds 4s-4 .. 4s-1, which use the first four rotations when s is
        # odd and the last four when s is even.
        rotations = ROTATIONS[:4] if injection % 2 == 1 else ROTATIONS[4:]
        for amount in rotations:
            x0 = x0 + x1
            x1 = _rotate_left(x1, amount) ^ x0
        x0 = x0 + schedule[injection % 3]
        x1 = x1 + schedule[(injection + 1) % 3] + np.uint32(injection)
    return x0, x1


def key_words(key) -> jax.Array:
    """The two 32-bit key words of a JAX PRNG key, or of an array of keys.

    Args:
      key: a typed key from ``jax.random.key`` (shape ``[]`` or ``[B]``, or any batch shape)
        whose implementation has two uint32 words of key data (threefry2x32, JAX's default), or
        legacy key data from ``jax.random.PRNGKey``: ``uint32[2]``, ``uint32[B, 2]``, or any
        ``uint32[..., 2]``. Traced keys work the same under ``jax.jit``.

    Returns:
      ``uint32[..., 2]``: ``[2]`` for one key, ``[B, 2]`` for ``B`` keys.

    Raises:
      ValueError: naming ``key``, for anything else: a key implementation whose key data is not
        two uint32 words (``rbg``, ``unsafe_rbg``, ``threefry4x32``, ``philox2x32``), an
        integer array that is not uint32 with a last axis of 2, a Python list.

    Example:
      >>> import jax
      >>> key_words(jax.random.key(42)).tolist(), key_words(jax.random.PRNGKey(42)).tolist()
      ([0, 42], [0, 42])
    """
    dtype = getattr(key, "dtype", None)
    shape = getattr(key, "shape", None)
    if dtype is None or shape is None:
        raise ValueError(
            f"key must be a JAX PRNG key (jax.random.key) or uint32[..., 2] key data "
            f"(jax.random.PRNGKey), got {type(key).__name__}"
        )
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(key)
        if data.dtype != jnp.uint32 or data.shape[-1:] != (2,):
            raise ValueError(
                f"key must be a PRNG key with two uint32 words of key data (threefry2x32, JAX's "
                f"default); got a {jax.random.key_impl(key)} key whose data is "
                f"{data.dtype}{list(data.shape[key.ndim :])}"
            )
        return data
    if dtype == jnp.uint32 and len(shape) >= 1 and shape[-1] == 2:
        return jnp.asarray(key)
    raise ValueError(
        f"key must be a JAX PRNG key (jax.random.key) or uint32[..., 2] key data "
        f"(jax.random.PRNGKey), got {dtype}{list(shape)}"
    )


def row_keys(key, batch: int) -> jax.Array:
    """Per-row key words for a batch of ``batch`` rows, from one key or from ``batch`` keys.

    Callers always turn a sampler's ``key`` into per-row words with this function, then draw
    row ``b``'s numbers from ``row_keys(key, batch)[b]`` and a column counter alone.

    Args:
      key: one key (typed ``[]`` or legacy ``uint32[2]``): row ``b`` gets the two words of
        ``threefry2x32(key, (ROW_DOMAIN, b))``, independent streams by row index (and the same
        words for row ``b`` whatever ``batch`` is); or ``batch`` keys (typed ``[batch]`` or
        legacy ``uint32[batch, 2]``): row ``b`` gets key ``b``'s words unchanged.
      batch: the number of rows, a static Python int.

    Returns:
      ``uint32[batch, 2]``.

    Raises:
      ValueError: a bad ``key`` (see ``key_words``), a key array whose length is not ``batch``
        or that has more than one batch axis, or a negative or non-integer ``batch``.

    Example:
      >>> import jax
      >>> row_keys(jax.random.key(0), 3).shape
      (3, 2)
      >>> keys = jax.random.split(jax.random.key(0), 3)
      >>> bool((row_keys(keys, 3) == jax.random.key_data(keys)).all())
      True
    """
    try:
        batch = operator.index(batch)
    except TypeError:
        raise ValueError(f"batch must be a static int, got {type(batch).__name__}") from None
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    words = key_words(key)
    if words.ndim == 1:
        rows = jnp.arange(batch, dtype=jnp.uint32)
        word0, word1 = threefry2x32(words[0], words[1], ROW_DOMAIN, rows)
        return jnp.stack([word0, word1], axis=-1)
    if words.ndim == 2 and words.shape[0] == batch:
        return words
    raise ValueError(
        f"key must be one key or {batch} keys (one per row), got key words of shape "
        f"{list(words.shape)}"
    )


def _split_key_words(row_key_words) -> tuple[jax.Array, jax.Array]:
    """``(word0, word1)`` from ``uint32[..., 2]`` or from a pair of uint32 arrays."""
    if isinstance(row_key_words, (tuple, list)):
        if len(row_key_words) != 2:
            raise ValueError(
                f"row_key_words must be uint32[..., 2] or a pair of uint32 arrays, got a "
                f"{type(row_key_words).__name__} of length {len(row_key_words)}"
            )
        return (
            _as_uint32(row_key_words[0], "row_key_words"),
            _as_uint32(row_key_words[1], "row_key_words"),
        )
    words = _as_uint32(row_key_words, "row_key_words")
    if words.ndim < 1 or words.shape[-1] != 2:
        raise ValueError(
            f"row_key_words must be uint32[..., 2] or a pair of uint32 arrays, got shape "
            f"{list(words.shape)}"
        )
    return words[..., 0], words[..., 1]


def random_bit_pairs(row_key_words, pair, stream=0) -> tuple[jax.Array, jax.Array]:
    """The 32 random bits of columns ``2 * pair`` and ``2 * pair + 1``, from one block call.

    The fast path for kernels: ``random_bits(words, 2 * p + i, s)`` is word ``i`` of
    ``random_bit_pairs(words, p, s)``, so a kernel that handles columns in even/odd halves pays
    one Threefry call per two elements. The block is
    ``threefry2x32(words, (ELEMENT_DOMAIN | pair, stream))``.

    Args:
      row_key_words: ``uint32[..., 2]`` (from ``row_keys``), or a pair ``(word0, word1)`` of
        uint32 arrays (the form to use inside a kernel, where the words come from two refs or
        two loads).
      pair: column-pair indices, an integer array or int in ``[0, 2**31)``.
      stream: stream numbers, an integer array or int in ``[0, 2**32)``.
      The key words' leading shape (all but the last axis), ``pair`` and ``stream`` broadcast
      against each other (NumPy rules).

    Returns:
      ``(even_bits, odd_bits)``, two uint32 arrays of the broadcast shape.

    Raises:
      ValueError: a ``row_key_words`` without a last axis of 2, or a non-integer argument.
    """
    word0, word1 = _split_key_words(row_key_words)
    counter0 = _as_uint32(pair, "pair") | ELEMENT_DOMAIN
    return threefry2x32(word0, word1, counter0, _as_uint32(stream, "stream"))


def random_bits(row_key_words, column, stream=0) -> jax.Array:
    """32 random bits for element ``column`` of stream ``stream`` of the row with these key words.

    The counter is ``(ELEMENT_DOMAIN | column // 2, stream)`` and the result is word
    ``column % 2`` of the block
    (module docstring): numbers depend on the row's key words, the column and the stream only.

    Args:
      row_key_words: ``uint32[..., 2]`` (from ``row_keys``), or a pair ``(word0, word1)`` of
        uint32 arrays. For a ``[B, V]`` grid pass ``words[:, None, :]`` and ``column`` of shape
        ``[V]``: the words' leading shape, ``column`` and ``stream`` broadcast (NumPy rules).
      column: column indices, an integer array or int in ``[0, 2**32)``.
      stream: stream numbers (e.g. a rejection round), an integer array or int in
        ``[0, 2**32)``; different streams give independent numbers for the same column.

    Returns:
      uint32 array of the broadcast shape.

    Raises:
      ValueError: a ``row_key_words`` without a last axis of 2, or a non-integer argument.

    Example:
      >>> import jax
      >>> words = row_keys(jax.random.key(7), 1)[0]         # uint32[2]
      >>> bits = random_bits(words, jax.numpy.arange(4))    # uint32[4]
      >>> even, odd = random_bit_pairs(words, jax.numpy.arange(2))
      >>> bool((bits[0::2] == even).all() and (bits[1::2] == odd).all())
      True
    """
    column = _as_uint32(column, "column")
    even_bits, odd_bits = random_bit_pairs(row_key_words, column >> 1, stream)
    return jnp.where((column & 1) == 1, odd_bits, even_bits)


def uniform_open(bits) -> jax.Array:
    """Uniform in the open interval (0, 1) from 32 random bits: never 0, never 1.

    ``u = (2j + 1) * 2**-24`` with ``j = bits >> 9`` (the top 23 bits): ``2**23`` equally
    likely exact float32 values from ``2**-24`` to ``1 - 2**-24``, each the centre of its cell
    of width ``2**-23``; the set is symmetric under ``u -> 1 - u``, so ``E[u] = 1/2`` exactly
    and ``P(u <= x)`` is within ``2**-24`` of ``x`` for every ``x`` in ``[0, 1]``.

    Args:
      bits: uint32 array (any shape), e.g. from ``random_bits``.

    Returns:
      float32 array of the same shape.

    Raises:
      ValueError: a non-integer ``bits``.

    Example:
      >>> uniform_open(np.uint32([0, 0xFFFFFFFF])).tolist() == [2.0**-24, 1 - 2.0**-24]
      True
    """
    bits = _as_uint32(bits, "bits")
    # Setting bit 0 of the top 24 bits (dropping bit 8 of the input) makes the odd numerator;
    # it is below 2**24, so its float32 conversion and the power-of-two scaling are exact.
    odd = (bits >> 8) | np.uint32(1)
    return odd.astype(jnp.int32).astype(jnp.float32) * _TWO_POW_MINUS_24


def exponential(bits) -> jax.Array:
    """Exp(1) noise from 32 random bits, exact in both tails to float32 precision.

    The top bit picks the half of the distribution; the low 31 bits ``m`` give
    ``t = (2m + 1) * 2**-33`` in ``(0, 1/2]`` (rounded to float32: exact for ``m < 2**23``,
    relative error at most ``2**-24`` above). Lower half: ``-log1p(-t)`` in ``[2**-33, ln 2]``;
    upper half: ``-log(t)`` in ``[ln 2, 33 ln 2]``. Each of the ``2**32`` bit patterns sits at
    the centre of its own equiprobable cell of Exp(1), so ``P(E <= e)`` is within
    ``2**-33 + 2**-22 * e * exp(-e)`` of ``1 - exp(-e)`` for every ``e``: full relative
    precision in the lower tail down to ``2**-33`` (what lets a token of tiny probability ``p``
    win ``argmax(p / E)`` at rate ``p``), and in the upper tail up to ``33 ln 2``. See the module
    docstring for the derivation.

    Args:
      bits: uint32 array (any shape), e.g. from ``random_bits``.

    Returns:
      float32 array of the same shape, every entry in ``[2**-33, 22.9]``: never 0, never inf.

    Raises:
      ValueError: a non-integer ``bits``.

    Example:
      >>> e = exponential(np.uint32([0, 0x80000000, 0x7FFFFFFF]))
      >>> float(e[0]) == 2.0**-33, round(float(e[1]), 3), round(float(e[2]), 4)
      (True, 22.874, 0.6931)
    """
    bits = _as_uint32(bits, "bits")
    upper_half = bits >= _TOP_BIT
    # (bits << 1) | 1 = 2m + 1 with the top bit shifted out: odd, so never 0, below 2**32, and
    # its float32 rounding is at most 2**32 exactly, which scales to t = 1/2 (E = ln 2 in both
    # halves, where they meet).
    t = ((bits << 1) | np.uint32(1)).astype(jnp.float32) * _TWO_POW_MINUS_33
    # Each half evaluates the logarithm whose argument carries t's relative precision: log1p(-t)
    # for small E (1 - t would round away every t below 2**-25), log(t) for large E.
    return jnp.where(upper_half, -jnp.log(t), -jnp.log1p(-t))


def gumbel(bits) -> jax.Array:
    """Gumbel(0, 1) noise from 32 random bits: ``-log(exponential(bits))``.

    Defined through ``exponential`` so that ``argmax(logits + gumbel(bits))`` (sampling from
    logits) and ``argmax(p / exponential(bits))`` (sampling from probabilities) are the same race
    on the same bits. Range ``[-log(33 ln 2), 33 ln 2]``, about ``[-3.13, 22.87]``; never inf.

    Args:
      bits: uint32 array (any shape), e.g. from ``random_bits``.

    Returns:
      float32 array of the same shape.

    Raises:
      ValueError: a non-integer ``bits``.

    Example:
      >>> bool(gumbel(np.uint32(0)) == -np.log(np.float32(2.0**-33)))
      True
    """
    return -jnp.log(exponential(bits))
