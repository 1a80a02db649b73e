"""The paged latent cache of multi-head latent attention (MLA), and the append into it.

MLA (DeepSeek-V2/V3) caches per token one compressed latent ``c`` (``kv_lora_rank`` = 512
values, after the model's RMSNorm of it) and one RoPE key ``k_rope`` (``qk_rope_head_dim`` = 64
values, already rotated), shared by every query head, instead of a key and a value per KV head.

Layout: two arrays under the same CSR page table (``paged.PageTable``), token-major:

- ``latent_pages``: ``[num_pages, page_size, kv_lora_rank]``
- ``rope_key_pages``: ``[num_pages, page_size, qk_rope_head_dim]``

Why two arrays rather than one ``[num_pages, page_size, 576]`` (``docs/mla.md`` has the long
form): the output matmul ``softmax @ c`` reads the latent only, and in its own array a page's
latent is one contiguous ``[page_size, 512]`` tile with rows of 1 KiB (bfloat16), the operand as
it is, not the first 512 columns of 576-wide rows. The one-array layout's advantage, one copy
per page, does not survive on Hopper: a TMA box is at most 256 elements wide, and with the 128-
byte swizzle a tensor-core operand wants, at most 64 bfloat16 columns, so a page arrives as 9
boxes in either layout (8 latent + 1 RoPE key). The two widths also stay independent parameters.
The cost: two page addresses per page and two scatters per append. A kernel that measures
faster on one array can concatenate the two once; nothing here depends on the choice but the
cache's own fields.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged.kv_cache import KVCache, _validate_append, token_slots
from paged.page_table import PageTable
from paged.rope import RopeParams, apply_rope

# DeepSeek-V2 / V2-Lite / V3 sizes.
DEFAULT_KV_LORA_RANK = 512
DEFAULT_QK_ROPE_HEAD_DIM = 64


@dataclasses.dataclass(frozen=True)
class LatentCache:
    """The latent pages of one MLA layer (a pytree).

    Attributes:
      latent_pages: ``[num_pages, page_size, kv_lora_rank]``, the normalized latents ``c``.
      rope_key_pages: ``[num_pages, page_size, qk_rope_head_dim]``, the rotated RoPE keys,
        same dtype.
    """

    latent_pages: jax.Array
    rope_key_pages: jax.Array

    @property
    def num_pages(self) -> int:
        return self.latent_pages.shape[0]

    @property
    def page_size(self) -> int:
        return self.latent_pages.shape[1]

    @property
    def kv_lora_rank(self) -> int:
        return self.latent_pages.shape[2]

    @property
    def qk_rope_head_dim(self) -> int:
        return self.rope_key_pages.shape[2]

    @property
    def dtype(self):
        return self.latent_pages.dtype

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies: ``(kv_lora_rank + qk_rope_head_dim) * itemsize``
        (1152 at 512 + 64 in bfloat16; a GQA cache holds ``2 * num_kv_heads * head_dim``)."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * jnp.dtype(self.dtype).itemsize


jax.tree_util.register_dataclass(
    LatentCache, data_fields=["latent_pages", "rope_key_pages"], meta_fields=[]
)


def validate_latent_cache(cache: LatentCache) -> None:
    """Raises ValueError if the cache's two arrays do not describe the same pages.

    Raises:
      ValueError: either array not 3-D, different ``num_pages`` or ``page_size``, different
        dtypes, or an odd ``qk_rope_head_dim`` (RoPE rotates pairs).
    """
    latent, rope_key = cache.latent_pages, cache.rope_key_pages
    if latent.ndim != 3:
        raise ValueError(
            "cache.latent_pages must have shape [num_pages, page_size, kv_lora_rank], "
            f"got {latent.shape}"
        )
    if rope_key.ndim != 3:
        raise ValueError(
            "cache.rope_key_pages must have shape [num_pages, page_size, qk_rope_head_dim], "
            f"got {rope_key.shape}"
        )
    if latent.shape[:2] != rope_key.shape[:2]:
        raise ValueError(
            f"cache.latent_pages {latent.shape} and cache.rope_key_pages {rope_key.shape} must "
            "agree on [num_pages, page_size]"
        )
    if latent.dtype != rope_key.dtype:
        raise ValueError(
            f"cache.latent_pages dtype {latent.dtype} differs from cache.rope_key_pages dtype "
            f"{rope_key.dtype}"
        )
    if rope_key.shape[2] % 2:
        raise ValueError(
            f"cache.rope_key_pages has qk_rope_head_dim={rope_key.shape[2]}, which must be even "
            "(RoPE rotates pairs)"
        )


def new_latent_cache(
    num_pages: int,
    page_size: int,
    kv_lora_rank: int = DEFAULT_KV_LORA_RANK,
    qk_rope_head_dim: int = DEFAULT_QK_ROPE_HEAD_DIM,
    dtype=jnp.bfloat16,
) -> LatentCache:
    """An all-zero latent pool.

    Raises:
      ValueError: a size below 1, or an odd ``qk_rope_head_dim``.

    Example:
      >>> cache = new_latent_cache(8, 16)
      >>> cache.latent_pages.shape, cache.rope_key_pages.shape, cache.bytes_per_token
      ((8, 16, 512), (8, 16, 64), 1152)
    """
    for name, value in [
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("kv_lora_rank", kv_lora_rank),
        ("qk_rope_head_dim", qk_rope_head_dim),
    ]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if qk_rope_head_dim % 2:
        raise ValueError(
            f"qk_rope_head_dim must be even (RoPE rotates pairs), got {qk_rope_head_dim}"
        )
    return LatentCache(
        jnp.zeros((num_pages, page_size, kv_lora_rank), dtype),
        jnp.zeros((num_pages, page_size, qk_rope_head_dim), dtype),
    )


def _validate_latent_append(cache, page_table, latent_new, rope_key_new, batch_indices, positions):
    validate_latent_cache(cache)
    if latent_new.ndim != 2 or latent_new.shape[1] != cache.kv_lora_rank:
        raise ValueError(
            f"latent_new must have shape [nnz, {cache.kv_lora_rank}] (the cache's kv_lora_rank), "
            f"got {latent_new.shape}"
        )
    if rope_key_new.ndim != 2 or rope_key_new.shape[1] != cache.qk_rope_head_dim:
        raise ValueError(
            f"rope_key_new must have shape [nnz, {cache.qk_rope_head_dim}] (the cache's "
            f"qk_rope_head_dim), got {rope_key_new.shape}"
        )
    if rope_key_new.shape[0] != latent_new.shape[0]:
        raise ValueError(
            f"rope_key_new has {rope_key_new.shape[0]} tokens but latent_new has "
            f"{latent_new.shape[0]}"
        )
    # Everything else append_kv checks applies unchanged: the page table against the pool, each
    # token's request and position, duplicates, two tokens on one (page, slot). A latent page is
    # a one-head NHD page, so append_kv's checks run on shape-only stand-ins (no copy is made).
    nnz = latent_new.shape[0]
    stand_in_pages = jax.ShapeDtypeStruct(
        (cache.num_pages, cache.page_size, 1, cache.kv_lora_rank), cache.dtype
    )
    stand_in_tokens = jax.ShapeDtypeStruct((nnz, 1, cache.kv_lora_rank), cache.dtype)
    _validate_append(
        KVCache(stand_in_pages, stand_in_pages, "NHD"),
        page_table,
        stand_in_tokens,
        stand_in_tokens,
        batch_indices,
        positions,
    )


def append_latent(
    cache: LatentCache,
    page_table: PageTable,
    latent_new: jax.Array,
    rope_key_new: jax.Array,
    batch_indices: jax.Array,
    positions: jax.Array,
    *,
    rope: RopeParams | None = None,
) -> LatentCache:
    """Writes ragged new tokens' latents and RoPE keys into their pages (reference).

    Token ``i`` goes to page ``page_indices[page_indptr[b] + p // page_size]``, slot
    ``p % page_size``, for ``b = batch_indices[i]`` and ``p = positions[i]``: ``append_kv``'s
    addressing (``paged.kv_cache.token_slots``), with the same checks and the same behaviour
    under ``jit`` (a token outside its request is dropped, nothing is written outside the pool).

    The latent is stored as given: normalizing it (the model's RMSNorm after ``W_DKV``) is the
    caller's job, as computing keys is for ``append_kv``.

    Args:
      cache: the latent pool.
      page_table: the table as it stands after the append (it already covers the new tokens).
      latent_new: ``[nnz, kv_lora_rank]``, the normalized latents (cast to the cache's dtype).
      rope_key_new: ``[nnz, qk_rope_head_dim]``, the RoPE keys: already rotated when ``rope`` is
        None, rotated here by ``positions`` (``paged.apply_rope``, in float32) otherwise.
      batch_indices: int ``[nnz]``, the request of each token.
      positions: int ``[nnz]``, each token's position in its request.
      rope: the model's RoPE parameters, or None for keys rotated already. (DeepSeek's
        checkpoints pair elements as ``RopeParams(interleaved=True)`` does; ``RopeParams`` does
        not carry YaRN: rotate with ``paged.rope.apply_rope_frequencies`` and
        ``yarn_inverse_frequencies`` and pass None.)

    Returns:
      The updated cache.

    Raises:
      ValueError: for a bad cache, shapes that do not match it, and (concrete inputs) what
        ``append_kv`` refuses: a position outside its request, a batch index outside the batch,
        the same token twice, two tokens on one (page, slot), page-table invariants.

    Example:
      >>> cache = new_latent_cache(4, 2, kv_lora_rank=2, qk_rope_head_dim=2, dtype=jnp.float32)
      >>> table = PageTable.from_page_lists([[3, 1]], seq_lens=[3], page_size=2)
      >>> latent = jnp.arange(6.0).reshape(3, 2)
      >>> out = append_latent(cache, table, latent, -latent, jnp.zeros(3, jnp.int32), jnp.arange(3))
      >>> out.latent_pages[:, :, 0].tolist()
      [[0.0, 0.0], [4.0, 0.0], [0.0, 0.0], [0.0, 2.0]]
    """
    _validate_latent_append(cache, page_table, latent_new, rope_key_new, batch_indices, positions)
    if rope is not None:
        rope_key_new = apply_rope(rope_key_new[:, None, :], positions, rope)[:, 0, :]
    pages, slots = token_slots(page_table, batch_indices, positions)
    latent_pages = cache.latent_pages.at[pages, slots].set(
        latent_new.astype(cache.dtype), mode="drop"
    )
    rope_key_pages = cache.rope_key_pages.at[pages, slots].set(
        rope_key_new.astype(cache.dtype), mode="drop"
    )
    return LatentCache(latent_pages, rope_key_pages)
