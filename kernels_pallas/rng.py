"""The counter-based random number generator shared by sampling kernels and references.

What it is: two block functions from Salmon, Moraes, Dror and Shaw, "Parallel random numbers:
as easy as 1, 2, 3" (SC 2011), written in plain ``jnp`` uint32 arithmetic, plus the maps from
random bits to the uniform, exponential and Gumbel noise that samplers need:

- Threefry-2x32 with 20 rounds, the block function JAX's default PRNG uses, for the rows' keys
  and the few numbers a row draws (rejection rounds, speculative verification);
- Philox-4x32-10 for the per-token Gumbel noise (``noise_bits``), where the generator's cost per
  word decides the Gumbel-max kernel's speed. Philox gives four words a call for two 32-bit
  multiplies a round, about fifteen instructions a word on a GPU, against about forty for
  Threefry's two words of twenty add-rotate-xor rounds.

Why: a sampler's Pallas kernel and its pure-JAX reference must draw the very same numbers for the
same key, so that they pick the same tokens and a kernel can be checked token for token. A
counter-based generator makes every number a pure function of (key, counter): a kernel computes
the noise of the elements it owns in registers and never reads a noise array, and the reference
computes the same function over the whole array. Everything here uses only 32-bit integer
operations (Philox's 32x32->64 multiply is built from four 16-bit products, ``mulhilo32``; a
GPU kernel passes one ``mul.hi.u32`` instead), so it runs under ``jax.jit``, inside a
``pl.pallas_call`` body (the tests run one), and on any broadcast shape. Inside a kernel, pass a row's key words as a pair of
arrays (two refs, or two loads) rather than slicing a ``[..., 2]`` array.

Counter layout (the contract; changing it changes every sampled token):

- Every row of a batch has its own two key words, ``row_keys(key, batch) -> uint32[B, 2]``:
  - ``key`` is one key: row ``b`` gets ``threefry2x32(key, (ROW_DOMAIN, b))``, both output
    words. Threefry is a bijection of the counter for a fixed key, so distinct rows get distinct
    key words, for any ``b < 2**32``; and a row's key does not depend on the batch size.
  - ``key`` is ``B`` keys: row ``b`` gets key ``b``'s own words, so a request's numbers depend
    on its key alone, never on the slot it sits in (an engine passes
    ``jax.random.fold_in(request_key, step)`` per row).
- Within a row, element ``column`` of a Threefry stream ``stream`` (a rejection round) takes word
  ``column % 2`` of ``threefry2x32(row_key, (ELEMENT_DOMAIN | column // 2, stream))``, where
  ``ELEMENT_DOMAIN = 2**31`` sets the top bit of counter word 0. For a fixed row key,
  distinct ``(column, stream)`` pairs use distinct (counter, word) pairs for every
  ``column < 2**32`` and ``stream < 2**32``: no value is ever reused. One block call serves two
  adjacent columns, so a kernel that wants speed calls ``random_bit_pairs`` once per column pair
  (half the work of one call per element) and gets the same numbers as ``random_bits``.
- Per-token noise (Philox): token ``column`` of stream ``stream`` takes word ``column % 4`` of
  ``philox4x32(row_key, (column // 4, stream, 0, 0))`` (``noise_bits``; ``noise_bit_quads``
  gives a kernel the four words of one call). Philox is a bijection of the counter for a fixed
  key, so distinct ``(column, stream)`` never share a word.
- Streams in use (a new user takes a new number): 0, Gumbel-max noise
  (``sampling.api.EXPONENTIAL_STREAM``, Philox, column = token); 1, rejection-round uniforms
  (``sampling.api.ROUND_STREAM``, column = round); 2, speculative verification
  (``speculative.api.SPECULATIVE_STREAM``, columns ``4i .. 4i + 2`` for draft position ``i``);
  3, the block noise of a cost probe (``bench/probes/gumbel_two_level.py``, column = block; no
  sampler uses it).
- Domain separation of the Threefry draws, by counter word 0 (Philox noise is another block
  function, with its own counters from 0): element draws use ``[2**31, 2**32)``, row-key
  derivation uses ``ROW_DOMAIN = 2**31 - 1``, and JAX's own Threefry uses of a key stay below
  that: ``fold_in(key, d)`` is the block at counter ``(0, d)``, and ``split`` and
  ``random_bits`` count from 0 (below ``2**31 - 1`` for anything under ``2**31`` keys or words).
  So, by construction, no row key equals a block of element bits (even for a key used both as a
  one-key sampler key and as a per-row key), and no block of element bits equals a key that JAX
  derives from the same key (``fold_in(key, 1)`` is not the noise of columns 0 and 1 in stream
  1). Still, as with every ``jax.random`` function, treat a key given to a sampler as used up.

From bits to noise (the tails are where samplers go wrong, ``docs/peers.md``):

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
- ``gumbel(bits)``: ``-log`` of the same cell's ``E``, Gumbel(0, 1), in ``[-3.13, 22.9]``,
  computed with two ``log2`` and a short polynomial and within ``2**-21 max(1, |G|)`` of the
  exact value, so that ``argmax(logits + gumbel)`` and ``argmax(p / exponential)`` pick the
  same token from the same bits up to float rounding.

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

# Philox-4x32-10 (Random123's philox4x32_10): round multipliers and the key's Weyl increments.
PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10

# gumbel(): for t in (0, 1/4], h(t) = log(-log1p(-t) / t) ~= t * q(t), with q the degree-4
# least-squares Chebyshev fit on [0, 1/4] (float64, then rounded to float32; coefficients of
# t**0 .. t**4): |t q(t) - h(t)| is 2**-23.1 at most in float64 (tests/test_rng.py checks it
# against 2**-22.5) and 2**-22.9 with Horner's rule in float32. h(t) = t/2 + 5t**2/24 + ... is
# what the exact series starts with.
GUMBEL_TAIL_COEFFICIENTS = tuple(
    np.float32(c)
    for c in (
        0.5000003576278687,
        0.20828887820243835,
        0.12620098888874054,
        0.07507500797510147,
        0.11430664360523224,
    )
)
_LN2 = np.float32(np.log(2.0))
_LN_LN2 = np.float32(np.log(np.log(2.0)))
_SECOND_QUARTER = np.uint32(0x40000000)

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


# ----------------------------------------------------------------------------------------------
# Philox-4x32-10: the per-token noise of the Gumbel-max race


def mulhilo32(a, multiplier: int) -> tuple[jax.Array, jax.Array]:
    """``(high, low)`` 32-bit words of the 64-bit product ``a * multiplier``, in uint32 only.

    The portable form (XLA on any backend, Pallas interpret mode): the high word from four
    16 x 16-bit products, whose partial sums fit in 32 bits. A GPU kernel passes its own
    ``mulhilo`` to ``philox4x32`` instead (one ``mul.hi.u32`` instruction,
    ``kernels_pallas/gumbel.py``); both give the same bits.

    Args:
      a: uint32 array (any shape).
      multiplier: a Python int in ``[0, 2**32)``.

    Returns:
      two uint32 arrays of ``a``'s shape.

    Example:
      >>> [hex(int(w)) for w in mulhilo32(np.uint32(0xFFFFFFFF), 0xFFFFFFFF)]
      ['0xfffffffe', '0x1']
    """
    a = _as_uint32(a, "a")
    a_low, a_high = a & np.uint32(0xFFFF), a >> 16
    b_low, b_high = np.uint32(multiplier & 0xFFFF), np.uint32(multiplier >> 16)
    low_low = a_low * b_low
    low_high = a_low * b_high
    high_low = a_high * b_low
    carry = (
        (low_low >> 16) + (low_high & np.uint32(0xFFFF)) + (high_low & np.uint32(0xFFFF))
    ) >> 16
    high = a_high * b_high + (low_high >> 16) + (high_low >> 16) + carry
    return high, a * np.uint32(multiplier)


def philox4x32(key0, key1, counter0, counter1, counter2, counter3, *, mulhilo=mulhilo32):
    """The Philox-4x32 block function with 10 rounds: four counter words to four random words.

    Implemented from the published description (Salmon et al. 2011; Random123's
    ``philox4x32_10``): each round multiplies counter words 0 and 2 by ``PHILOX_MULTIPLIERS``,
    and the new words are ``(hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0)``; the key words grow by
    ``PHILOX_WEYL`` between rounds. For a fixed key it is a bijection of the counter, so
    distinct counters give distinct blocks. Four words a call at about two multiplies and two
    xors a word a round make it the cheaper generator per word on a GPU (module docstring).

    Args:
      key0, key1: uint32 arrays (or ints), the key words.
      counter0, counter1, counter2, counter3: uint32 arrays (or ints), the counter words.
      All six broadcast against each other (NumPy rules).
      mulhilo: ``(a, multiplier) -> (high, low)``, ``mulhilo32`` unless a kernel brings a
        faster one with the same bits.

    Returns:
      four uint32 arrays of the broadcast shape.

    Raises:
      ValueError: an argument that is not an integer array or int, naming it.

    Example:
      >>> [hex(int(w)) for w in philox4x32(0, 0, 0, 0, 0, 0)]
      ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    k0 = _as_uint32(key0, "key0")
    k1 = _as_uint32(key1, "key1")
    c0 = _as_uint32(counter0, "counter0")
    c1 = _as_uint32(counter1, "counter1")
    c2 = _as_uint32(counter2, "counter2")
    c3 = _as_uint32(counter3, "counter3")
    c0, c1, c2, c3 = jnp.broadcast_arrays(c0, c1, c2, c3)
    for round_index in range(PHILOX_ROUNDS):
        if round_index > 0:
            k0 = k0 + np.uint32(PHILOX_WEYL[0])
            k1 = k1 + np.uint32(PHILOX_WEYL[1])
        high0, low0 = mulhilo(c0, PHILOX_MULTIPLIERS[0])
        high2, low2 = mulhilo(c2, PHILOX_MULTIPLIERS[1])
        c0, c1, c2, c3 = high2 ^ c1 ^ k0, low2, high0 ^ c3 ^ k1, low0
    return c0, c1, c2, c3


def noise_bit_quads(row_key_words, quad, stream=0, *, mulhilo=mulhilo32):
    """The 32 random bits of columns ``4 q .. 4 q + 3`` of a noise stream, from one Philox call.

    Word ``w`` of ``philox4x32(row_key, (q, stream, 0, 0))`` is column ``4 q + w``'s: the fast
    path for kernels, which call it once per four columns (``noise_bits`` gives the same bits
    column by column).

    Args:
      row_key_words: ``uint32[..., 2]`` (from ``row_keys``), or a pair ``(word0, word1)``.
      quad: column-quad indices, an integer array or int in ``[0, 2**32)``.
      stream: stream numbers, an integer array or int in ``[0, 2**32)``.
      mulhilo: as for ``philox4x32``.

    Returns:
      ``(bits0, bits1, bits2, bits3)``, four uint32 arrays of the broadcast shape.
    """
    word0, word1 = _split_key_words(row_key_words)
    return philox4x32(word0, word1, quad, stream, 0, 0, mulhilo=mulhilo)


def noise_bits(row_key_words, column, stream=0) -> jax.Array:
    """32 random bits for token ``column`` of noise stream ``stream``: word ``column % 4`` of
    ``philox4x32(row_key, (column // 4, stream, 0, 0))`` (module docstring).

    Args:
      row_key_words: ``uint32[..., 2]`` or a pair of uint32 arrays; for a ``[B, V]`` grid pass
        ``words[:, None, :]`` and ``column`` of shape ``[V]``.
      column: column indices, an integer array or int in ``[0, 2**32)``.
      stream: stream numbers, an integer array or int.

    Returns:
      uint32 array of the broadcast shape.

    Example:
      >>> import jax
      >>> words = row_keys(jax.random.key(7), 1)[0]
      >>> bits = noise_bits(words, jax.numpy.arange(8))
      >>> quads = noise_bit_quads(words, jax.numpy.arange(2))
      >>> bool(all((bits[w::4] == quads[w]).all() for w in range(4)))
      True
    """
    column = _as_uint32(column, "column")
    words = noise_bit_quads(row_key_words, column >> 2, stream)
    lane = column & np.uint32(3)
    return jnp.where(
        lane < 2,
        jnp.where(lane == 0, words[0], words[1]),
        jnp.where(lane == 2, words[2], words[3]),
    )


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


def gumbel(bits, *, log2=jnp.log2) -> jax.Array:
    """Gumbel(0, 1) noise from 32 random bits: ``-log E`` for the ``E`` of ``exponential(bits)``,
    computed with two base-2 logarithms and a short polynomial instead of three logarithms.

    The same cell of the distribution as ``exponential``: ``t = (2m + 1) * 2**-33`` from the low
    31 bits ``m``, the top bit picks the half. Three pieces, each with the argument that keeps
    full precision:

    - upper half (``E = -ln t``, ``E >= ln 2``): ``G = -ln(-ln t)``, as
      ``-ln 2 * log2(-log2 t) - ln ln 2``;
    - lower half, ``t >= 1/4`` (``E = -ln(1 - t)`` in ``[0.29, 0.69]``): the same formula on
      ``x = 1 - t``, which float32 holds to about ``1.5 * 2**-25`` (``t``'s own rounding
      and the subtraction's), a relative error of ``E`` below about ``2**-22.2``;
    - lower half, ``t < 1/4`` (small ``E``, where ``1 - t`` would erase ``t``): ``E = t e^h(t)``
      with ``h(t) = log(-log1p(-t) / t)`` smooth on ``[0, 1/4]``, so ``G = -ln t - h(t)``, with
      ``h ~= t q(t)`` (``GUMBEL_TAIL_COEFFICIENTS``, error ``2**-22.9``).

    Against ``-log`` of the exact cell centre (float64), the error is within
    ``2**-21 max(1, |G|)`` with an exact ``log2`` (``tests/test_rng.py`` measures it over every
    tail pattern it can enumerate; the worst seen is ``2**-21.4`` of ``max(1, |G|)``). It grows
    with ``|G|`` because float32 rounds ``log2 t`` (up to 33 in magnitude) and ``G`` itself. An absolute
    error ``d`` in ``G`` is a relative error ``d`` in ``E``: a token's chance of winning the
    race moves by a factor within ``exp(+-2d)``.

    Why not ``-log(exponential(bits))``: that is three logarithms (``log1p`` and ``log`` for
    the halves, as a select evaluates both, then ``log``), and the race kernel computes one
    ``G`` per token; this is two ``log2`` and five multiply-adds, which a GPU runs as two
    special-function instructions (``log2=`` lets a kernel pass its ``lg2.approx``).

    Args:
      bits: uint32 array (any shape), e.g. from ``noise_bits``.
      log2: the base-2 logarithm to use, ``jnp.log2`` unless a kernel brings its own.

    Returns:
      float32 array of the same shape, in ``[-log(33 ln 2), 33 ln 2]``, about
      ``[-3.13, 22.87]``: never inf.

    Raises:
      ValueError: a non-integer ``bits``.

    Example:
      >>> g = gumbel(np.uint32([0, 0x80000000, 0x7FFFFFFF]))
      >>> round(float(g[0]), 3), round(float(g[1]), 3), round(float(g[2]), 4)
      (22.874, -3.13, 0.3665)
    """
    bits = _as_uint32(bits, "bits")
    # As in exponential(): 2m + 1, odd and below 2**32, so t is in (0, 1/2], never 0.
    t = ((bits << 1) | np.uint32(1)).astype(jnp.float32) * _TWO_POW_MINUS_33
    lower_tail = bits < _SECOND_QUARTER  # lower half, t < 1/4
    middle = (bits >= _SECOND_QUARTER) & (bits < _TOP_BIT)  # lower half, t >= 1/4
    x = jnp.where(middle, 1.0 - t, t)  # E = -ln x, except in the lower tail
    log2_x = log2(x)  # < 0: x <= 3/4 always
    # -ln(-ln x) = -ln(ln 2 * -log2 x)
    from_double_log = -_LN2 * log2(-log2_x) - _LN_LN2
    c0, c1, c2, c3, c4 = GUMBEL_TAIL_COEFFICIENTS
    h = t * ((((c4 * t + c3) * t + c2) * t + c1) * t + c0)
    # Lower tail: x = t, so -ln t = -ln 2 * log2_x.
    from_series = -_LN2 * log2_x - h
    return jnp.where(lower_tail, from_series, from_double_log)
