"""Chunked causal prefill attention over the paged KV cache (Pallas, Triton lowering).

What it computes: the same function as ``paged_decode`` with ``q_len = L > 1``, for the long
query runs of a prompt chunk (hundreds of tokens). Each request's newest ``L`` tokens are the
last ``L`` of its sequence, their keys already in the pool (``paged.prefill`` appends a chunk's
keys before its attention); token ``l`` sits at position ``seq_len - L + l`` and attends, with
grouped-query heads, to the keys at positions ``0 .. seq_len - L + l`` (its own included). The
keys live in pages of a KV pool reached through the CSR page table (``page_indptr``,
``page_indices``, ``last_page_len``), exactly the arrays ``paged_decode`` reads.

What it optimizes. ``paged_decode`` puts all ``L x G`` query rows of a KV head in one tile,
which is right for a few tokens (the KV stream dominates) and impossible for hundreds. A prompt
chunk is the opposite regime: every key is used by ``L x G`` query rows, so the work is
compute-bound at long chunks, and the kernel is a FlashAttention-2 forward pass over pages:

- Grid ``(request, KV head, query block)``. A program takes ``block_q`` consecutive new tokens of
  one request and the ``G`` query heads that share the KV head: ``block_q x G`` query rows,
  token-major (``paged_decode.head_major`` row order), padded to a power of two of at least 16
  rows in registers only (q loaded with a row mask, output rows stored with a row mask). Query
  blocks, not split-KV, give the parallelism: a 512-token chunk at ``G = 4`` and 16 tokens a
  block is 32 programs per (request, KV head), 256 for one Llama-3-8B request, with no partial
  states and no merge.
- Each program walks its request's pages straight through ``page_indices`` (no gathered copy
  of the cache), ``pages_per_step`` pages of ``[page_size, head_dim]`` a step, with an online
  softmax in float32, base 2 (``log2 e`` folded into the logit scale), as ``paged_decode``.
- Causal early stop: the loop ends at the causal bound of the block's last token; pages wholly
  after it are never read. A block's loop is split in two: steps whose keys every row of the
  block sees (up to and including the block's first token) run without any mask, and only the
  last few steps, those that cross the block's diagonal or the sequence's end, pay for the
  per-row causal mask (``block_key_range``). Over a whole prompt (a chunk starting at position 0) the work is about half the
  ``L x L`` rectangle; for a chunk behind a long prefix it is the prefix plus half the chunk's
  square.
- The grid's query-block axis runs in reverse (block ``n - 1`` first): programs launch in grid
  order, and the last blocks of a chunk see the most keys, so the longest programs start first
  and the short ones fill the tail.

The kernel never reads or writes outside its arrays, whatever the page table says: page-index
loads past the causal bound are masked (they fetch page 0, a valid page, whose logits are then
masked out and whose values are zeroed, so stale or NaN data in unused slots never reaches the
output); page numbers, page ranges and last-page lengths are clamped (the public API validates
them only when they are concrete); query/output rows past the block's real rows are masked. A
request shorter than ``L`` (possible only under jit) gets ``o = 0``, ``lse = -inf`` for its
queries at negative positions, and an empty request (no pages) for all of them.

Shapes: ``q [B, L, H, D]``; pool ``[num_pages, KVH, page_size, D]`` (HND) or ``[num_pages,
page_size, KVH, D]`` (NHD); outputs ``o [B, L, H, D]`` in q's dtype and ``lse [B, L, H]``
float32, natural log. ``H = G x KVH``; ``D`` and ``page_size`` powers of two (Triton tiles).

Distance from the floor. At long chunks the kernel is compute-bound: its FLOPs are ``4 x B x H x
D x (sum over query tokens of the keys each sees)`` (two multiply-adds a logit: ``q.k`` and
``p.v``), and the floor is those FLOPs at the H200's dense bfloat16 tensor peak, 989 TFLOP/s
nominal. A 512-token chunk at 16K context is 135 GFLOP, a 137 us floor, against 64 MiB of K and
V (16 us at the copy bandwidth), so bytes are not the limit. For scale, the FlashAttention-3
paper puts FlashAttention-2's forward pass at about 35% of an H100's peak. The measured time,
TFLOP/s and share of that peak, against the reference, are in the newest prefill report
(``docs/benchmark_results/README.md`` lists it). The prefill benchmark can also sweep the launch
parameters; ``launch_parameters`` holds the defaults.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import online_softmax
from kernels_pallas.online_softmax import LOG2_E, MASKED_LOGIT
from kernels_pallas.paged_decode import dot_rows, head_major, token_major
from kernels_pallas.platform import whole_array
from kernels_pallas.x64 import runs_in_32_bits

# Launch parameters. Not yet swept on a GPU (``python -m bench prefill`` does it; these
# defaults reached 288-295 TFLOP/s on an H200, module docstring). They are FlashAttention-2's
# usual Hopper shape scaled to what 4 warps hold in registers: a 64-row query tile (16 tokens x
# G = 4) against 64 keys a step (4 pages of 16), so the float32 accumulator (64 x 128) and the
# logits tile (64 x 64) take 96 registers a thread.
TARGET_QUERY_ROWS = 64
TARGET_BLOCK_KEYS = 64
MIN_BLOCK_KEYS = 16  # a tensor-core dot needs at least 16 keys a step
DEFAULT_LAUNCH = {"block_q": 16, "pages_per_step": 4, "num_warps": 4, "num_stages": 2}
# Tuned entries by (head_dim, rows of a G-head group padded to a power of two, page_size); empty
# until a GPU sweep fills it (the keys of ``launch_parameters``).
LAUNCH_TABLE: dict[tuple[int, int, int], dict[str, int]] = {}
# Tiles of this many elements or more hold a float32 accumulator of rows x head_dim that spills
# from 4 warps' registers (128 a thread, before the logits); give them 8.
WIDE_TILE_ELEMENTS = 128 * 128


def launch_parameters(head_dim: int, group_size: int, page_size: int) -> dict[str, int]:
    """Launch parameters of ``paged_prefill`` for an attention shape.

    ``block_q`` tokens make about ``TARGET_QUERY_ROWS`` query rows (``block_q x G``, a power of
    two), ``pages_per_step`` pages make about ``TARGET_BLOCK_KEYS`` keys a step (at least 16,
    the smallest tensor-core tile); a table entry, where the sweep has made one, wins.

    Example:
      >>> launch_parameters(128, 4, 16)
      {'block_q': 16, 'pages_per_step': 4, 'num_warps': 4, 'num_stages': 2}
      >>> launch_parameters(64, 1, 16)["block_q"], launch_parameters(64, 8, 64)["pages_per_step"]
      (64, 1)
    """
    group_rows = pl.next_power_of_2(group_size)
    block_q = max(1, TARGET_QUERY_ROWS // group_rows)
    pages_per_step = max(1, TARGET_BLOCK_KEYS // page_size, -(-MIN_BLOCK_KEYS // page_size))
    num_warps = 8 if dot_rows(block_q * group_size) * head_dim >= WIDE_TILE_ELEMENTS else 4
    derived = {"block_q": block_q, "pages_per_step": pages_per_step, "num_warps": num_warps}
    key = (head_dim, group_rows, page_size)
    return {**DEFAULT_LAUNCH, **derived, **LAUNCH_TABLE.get(key, {})}


def block_key_range(first_position, block_tokens, seq_len, block_keys):
    """Which of a request's keys one query block reads, and how many steps need no mask.

    The block holds ``block_tokens`` consecutive new tokens, the first at position
    ``first_position`` (``seq_len - q_len + first_token``) of a ``seq_len``-token sequence; the
    token at position ``t`` sees the keys at positions ``<= t``. Works on Python ints (host,
    tests) and int32 scalars (in the kernel).

    Returns:
      ``(keys_needed, num_steps, unmasked_steps)``: the block's last token's bound (keys past it
      are never read: the causal early stop), the key steps of ``block_keys`` covering it, and
      how many leading steps every row sees whole (keys up to and including the block's first
      token's position, all real tokens: no mask there).
    """
    keys_needed = jnp.clip(first_position + block_tokens, 0, seq_len)
    num_steps = pl.cdiv(keys_needed, block_keys)
    unmasked_steps = jnp.clip(first_position + 1, 0, seq_len) // block_keys
    return keys_needed, num_steps, unmasked_steps


def paged_prefill_kernel(
    page_indices_ref,  # [num_indices] int32
    page_indptr_ref,  # [batch + 1] int32
    last_page_len_ref,  # [batch] int32
    q_ref,  # [batch * KVH * q_len * G, head_dim], rows (b, kv head, token, g)
    k_pages_ref,  # [num_pages, page_size, head_dim], this program's KV head
    v_pages_ref,  # [num_pages, page_size, head_dim]
    o_ref,  # [batch * KVH * q_len * G, head_dim] in q's dtype, rows as in q_ref
    lse_ref,  # [batch * KVH * q_len * G] float32
    *,
    q_len: int,
    group_size: int,
    block_q: int,
    rows: int,
    num_kv_heads: int,
    pages_per_step: int,
    logit_scale_log2: float,
    logits_soft_cap: float | None,
    sm_scale: float,
    precision,
):
    request = pl.program_id(0)
    kv_head = pl.program_id(1)
    num_query_blocks = pl.cdiv(q_len, block_q)  # static
    # Reversed: the grid launches in order and the last blocks see the most keys (docstring).
    query_block = num_query_blocks - 1 - pl.program_id(2)
    num_pages, page_size, head_dim = k_pages_ref.shape
    num_indices = page_indices_ref.shape[0]
    block_keys = pages_per_step * page_size

    # The request's pages and length. Clamped: under jit the table is not validated, and these
    # few scalar ops keep every access inside page_indices and the pool whatever it says.
    page_start = jnp.clip(page_indptr_ref[request], 0, num_indices)
    page_end = jnp.clip(page_indptr_ref[request + 1], page_start, num_indices)
    last_page_len = jnp.clip(last_page_len_ref[request], 0, page_size)
    seq_len = jnp.where(
        page_end > page_start, (page_end - page_start - 1) * page_size + last_page_len, 0
    )

    # This block's tokens: first_token .. first_token + block_tokens - 1 of the chunk (the last
    # block of a chunk that block_q does not divide has fewer).
    first_token = query_block * block_q
    block_tokens = jnp.minimum(block_q, q_len - first_token)
    row_ids = jnp.arange(rows)
    row_is_real = row_ids < block_tokens * group_size
    first_row = ((request * num_kv_heads + kv_head) * q_len + first_token) * group_size
    q = plgpu.load(
        q_ref.at[pl.ds(first_row, rows), :], mask=row_is_real[:, None], other=0.0
    )  # [rows, head_dim]

    # Causal bounds, as counts of the request's keys. Token l of the chunk sits at position
    # seq_len - q_len + l and sees the keys before position seq_len - q_len + l + 1; a position
    # below 0 (a request shorter than q_len, only under jit) sees none.
    first_position = seq_len - q_len + first_token  # the block's first token
    # The loop stops at the last token's bound; keys after it are never read (their pages are
    # masked to page 0 below, so their values must be zeroed and their logits masked for every
    # row, padding rows included: hence the bounds are cut to keys_needed, not seq_len).
    keys_needed, num_steps, unmasked_steps = block_key_range(
        first_position, block_tokens, seq_len, block_keys
    )
    visible_keys = jnp.clip(first_position + row_ids // group_size + 1, 0, keys_needed)  # [rows]
    pages_needed = pl.cdiv(keys_needed, page_size)

    def load_pages(i):
        first = page_start + i * pages_per_step
        page_is_needed = i * pages_per_step + jnp.arange(pages_per_step) < pages_needed
        pages = plgpu.load(
            page_indices_ref.at[pl.ds(first, pages_per_step)], mask=page_is_needed, other=0
        )  # [pages_per_step]
        return jnp.clip(pages, 0, num_pages - 1)  # a bad index reads a wrong page, never past

    def step(i, state, *, masked: bool):
        pages = load_pages(i)
        k = k_pages_ref[pages].reshape(block_keys, head_dim)
        v = v_pages_ref[pages].reshape(block_keys, head_dim)
        logits = online_softmax.scaled_logits(
            q,
            k,
            logit_scale_log2=logit_scale_log2,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            precision=precision,
        )  # [rows, block_keys] float32, base 2
        visible = None
        if masked:
            key_index = i * block_keys + jnp.arange(block_keys)  # [block_keys], in the request
            visible = key_index[None, :] < visible_keys[:, None]  # [rows, block_keys]
            logits = jnp.where(visible, logits, MASKED_LOGIT)
            # A zero weight times a NaN (in an unused slot, or in page 0 fetched for a page past
            # the bound) is still NaN: zero every value past the bound.
            v = jnp.where((key_index < keys_needed)[:, None], v, jnp.zeros_like(v))
        return online_softmax.update(state, logits, v, visible, precision=precision)

    state = online_softmax.initial_state(rows, head_dim)
    state = lax.fori_loop(0, unmasked_steps, functools.partial(step, masked=False), state)
    state = lax.fori_loop(unmasked_steps, num_steps, functools.partial(step, masked=True), state)
    out, lse = online_softmax.finish(state)
    plgpu.store(
        o_ref.at[pl.ds(first_row, rows), :], out.astype(o_ref.dtype), mask=row_is_real[:, None]
    )
    plgpu.store(lse_ref.at[pl.ds(first_row, rows)], lse, mask=row_is_real)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@runs_in_32_bits  # x64 mode: kernels_pallas/x64.py
@functools.partial(
    jax.jit,
    static_argnames=(
        "layout",
        "sm_scale",
        "logits_soft_cap",
        "block_q",
        "pages_per_step",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def paged_prefill(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_indices: jax.Array,
    page_indptr: jax.Array,
    last_page_len: jax.Array,
    *,
    layout: str,
    sm_scale: float,
    logits_soft_cap: float | None,
    block_q: int = DEFAULT_LAUNCH["block_q"],
    pages_per_step: int = DEFAULT_LAUNCH["pages_per_step"],
    num_warps: int = DEFAULT_LAUNCH["num_warps"],
    num_stages: int = DEFAULT_LAUNCH["num_stages"],
    interpret: bool = False,
):
    """Causal attention of each request's last ``L`` tokens over its paged keys (module docstring).

    Args:
      q: ``[B, L, H, D]``, the new tokens' queries (``L`` static, any ``L >= 1``); ``H`` a
        multiple of the pool's KV heads.
      k_pages, v_pages: ``[num_pages, KVH, page_size, D]`` (``layout="HND"``) or
        ``[num_pages, page_size, KVH, D]`` (``"NHD"``), in q's dtype.
      page_indices, page_indptr, last_page_len: the CSR page table, int32 ``[num_indices]``,
        ``[B + 1]``, ``[B]``; it covers the new tokens. The public API validates concrete tables;
        the kernel clamps, so an invalid one gives wrong values, never an access outside an array.
      layout, sm_scale, logits_soft_cap: as in ``paged.decode_attention``.
      block_q: new tokens a program (a power of two); its tile holds ``block_q x G`` rows.
      pages_per_step: pages a loop step (a power of two); ``pages_per_step x page_size`` keys.
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas interpret mode (CPU).

    Returns:
      ``(o [B, L, H, D] in q's dtype, lse [B, L, H] float32)``, lse in natural log; a query that
      sees no key gets ``o = 0``, ``lse = -inf``.

    Raises:
      ValueError: for a layout other than HND/NHD, ``q`` not 4-D, head counts that do not
        divide, a pool whose shape, head_dim or dtype does not match q's, a ``head_dim`` or
        ``page_size`` that is not a power of two (or a ``head_dim`` below 16), or a
        ``block_q``/``pages_per_step`` that is not a power of two.
    """
    if q.ndim != 4:
        raise ValueError(f"q must have shape [batch, q_len, num_q_heads, head_dim], got {q.shape}")
    batch, q_len, num_q_heads, head_dim = q.shape
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape or k_pages.shape[-1] != head_dim:
        raise ValueError(
            f"k_pages and v_pages must both be [num_pages, ..., head_dim={head_dim}] pools, got "
            f"{k_pages.shape} and {v_pages.shape}"
        )
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(
            f"the pools' dtypes ({k_pages.dtype}, {v_pages.dtype}) differ from q's {q.dtype}"
        )
    num_pages = k_pages.shape[0]
    if layout == "HND":
        _, num_kv_heads, page_size, _ = k_pages.shape
        kv_spec = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda b, h, j: (0, h, 0, 0))
    elif layout == "NHD":
        _, page_size, num_kv_heads, _ = k_pages.shape
        kv_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda b, h, j: (0, 0, h, 0))
    else:
        raise ValueError(f"layout must be 'HND' or 'NHD', got {layout!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    if not _is_power_of_two(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 (a Triton tile), got {head_dim}")
    for name, value in (
        ("page_size", page_size),
        ("block_q", block_q),
        ("pages_per_step", pages_per_step),
    ):
        if not _is_power_of_two(value):
            raise ValueError(f"{name} must be a power of two, got {value}")
    group_size = num_q_heads // num_kv_heads
    rows = dot_rows(block_q * group_size)
    total_rows = batch * num_q_heads * q_len
    # Rows grouped by (request, KV head), token-major inside: a query block's block_q x G rows
    # are consecutive. A copy of q (B L H D elements, a few MiB, nothing next to the dots).
    q_rows = head_major(q, num_kv_heads).reshape(total_rows, head_dim)
    out_shape = (
        jax.ShapeDtypeStruct((total_rows, head_dim), q.dtype),
        jax.ShapeDtypeStruct((total_rows,), jnp.float32),
    )
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        paged_prefill_kernel,
        q_len=q_len,
        group_size=group_size,
        block_q=block_q,
        rows=rows,
        num_kv_heads=num_kv_heads,
        pages_per_step=pages_per_step,
        logit_scale_log2=sm_scale * LOG2_E,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        precision=precision,
    )
    o, lse = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, pl.cdiv(q_len, block_q)),
        in_specs=[
            whole_array(page_indices.shape),
            whole_array(page_indptr.shape),
            whole_array(last_page_len.shape),
            whole_array(q_rows.shape),
            kv_spec,
            kv_spec,
        ],
        out_specs=(whole_array(out_shape[0].shape), whole_array(out_shape[1].shape)),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_prefill_{layout}_q{block_q}_p{pages_per_step}_w{num_warps}_s{num_stages}",
    )(page_indices, page_indptr, last_page_len, q_rows, k_pages, v_pages)
    o = token_major(o.reshape(batch, num_q_heads * q_len, head_dim), q_len, num_kv_heads)
    lse = token_major(lse.reshape(batch, num_q_heads * q_len), q_len, num_kv_heads)
    return o.reshape(q.shape), lse.reshape(q.shape[:-1])


def prefill_flops(seq_lens, q_len: int, num_q_heads: int, head_dim: int) -> int:
    """FLOPs of the attention (the compute floor's numerator): ``4 x H x D`` per (query, visible
    key) pair, over each request's last ``q_len`` tokens (host-side; ``seq_lens`` concrete).

    Example:
      >>> prefill_flops([3], 2, 1, 1)  # the two new tokens see 2 and 3 keys
      20
    """
    visible = 0
    for seq_len in seq_lens:
        seq_len = int(seq_len)
        for token in range(q_len):
            visible += max(0, min(seq_len, seq_len - q_len + token + 1))
    return 4 * num_q_heads * head_dim * visible
