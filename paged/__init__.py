"""The paged KV cache: CSR page table, host-side page pool, append, and decode attention.

Public API (names are part of the contract):

- ``PageTable`` (device or host arrays), ``host_page_table``, ``PagePool``, ``KVCache``,
  ``new_kv_cache``, ``append_kv``
- ``plan_decode``, ``plan_decode_tables``, ``DecodePlan``: the split-KV planner (host side, once
  per step; every table of a step in one call)
- ``decode_attention`` (``backend="auto" | "reference" | "pallas"``)
- ``CascadeLevels``, ``SharedLevel``, ``cascade_levels_from_shared_prefix``,
  ``cascade_levels_from_nested_prefixes``, ``cascade_decode_attention`` (``backend=``): decode
  with shared prefixes split into levels, merged exactly; ``plan_cascade``,
  ``find_shared_prefix_groups``, ``CascadeCrossover``, ``CASCADE_CROSSOVER``: which requests of a
  step share leading pages, and whether a shared level pays (host side, once a step)
- ``merge_state``, ``merge_states``: exact merging of partial attention states
- ``RopeParams``, ``Llama3Scaling``, ``apply_rope``, ``inverse_frequencies``: rotary embedding;
  ``YarnScaling``, ``yarn_inverse_frequencies``, ``yarn_mscale``, ``apply_rope_frequencies``:
  YaRN's frequencies and temperature (DeepSeek's long context)
- ``rope_append_kv`` (``backend=``): RoPE on new tokens' q and k, k and v written into pages
- ``prefill_chunks``, ``PrefillChunk``, ``truncated_page_table``, ``new_token_positions``,
  ``prefill_attention`` (``backend=``): chunked prefill against the paged cache
- ``LatentCache``, ``new_latent_cache``, ``append_latent``: the MLA latent cache (a latent and
  a RoPE key a token, under the same CSR page table); ``mla_decode_attention``
  (``backend="auto" | "reference" | "pallas_mgpu"``; ``"auto"`` is the reference until the
  kernel is measured on the H200), and ``mla_decode_absorbed_reference`` and
  ``mla_decode_unabsorbed_reference``: MLA decode, the two formulations (``docs/mla.md``)
- ``sparse_decode_attention`` (``backend=``) with a ``QuestSelection`` (``PageKeyBounds``,
  ``page_key_bounds``, ``update_page_key_bounds``, ``append_page_key_bounds``; ``append_kv`` and
  ``rope_append_kv`` keep them with ``key_bounds=``), a ``TokenSelection``
  (``lightning_indexer_top_k``) or a ``BlockSelection``: decode over a selected subset of the
  keys, as a smaller page table for ``decode_attention`` (``docs/sparse_decode.md``);
  ``recent_pages_selection``: the "recent pages only" baseline, a ``BlockSelection``
"""

from paged.attention_reference import merge_state, merge_states
from paged.cascade import (
    CascadeLevels,
    CascadePlan,
    SharedLevel,
    cascade_decode_attention,
    cascade_levels_from_nested_prefixes,
    cascade_levels_from_shared_prefix,
    plan_cascade_levels,
    validate_cascade_levels,
)
from paged.cascade_plan import (
    CASCADE_CROSSOVER,
    CascadeCrossover,
    CascadePlanCache,
    SharedPrefixGroup,
    find_shared_prefix_groups,
    plan_cascade,
)
from paged.decode import decode_attention
from paged.kv_cache import KVCache, append_kv, new_kv_cache
from paged.mla_cache import LatentCache, append_latent, new_latent_cache
from paged.mla_decode import mla_decode_attention
from paged.mla_reference import mla_decode_absorbed_reference, mla_decode_unabsorbed_reference
from paged.page_table import (
    PageTable,
    bucket_size,
    check_holds_new_tokens,
    host_page_table,
    validate_page_table,
)
from paged.plan import DecodePlan, plan_decode, plan_decode_tables
from paged.pool import PagePool, PoolExhaustedError
from paged.prefill import (
    PrefillChunk,
    new_token_positions,
    prefill_attention,
    prefill_chunks,
    truncated_page_table,
)
from paged.rope import (
    Llama3Scaling,
    RopeParams,
    YarnScaling,
    apply_rope,
    apply_rope_frequencies,
    inverse_frequencies,
    yarn_inverse_frequencies,
    yarn_mscale,
)
from paged.rope_append import rope_append_kv
from paged.sparse import sparse_decode_attention
from paged.sparse_blocks import BlockSelection
from paged.sparse_indexer import lightning_indexer_top_k
from paged.sparse_quest import (
    PageKeyBounds,
    QuestSelection,
    append_page_key_bounds,
    page_key_bounds,
    update_page_key_bounds,
)
from paged.sparse_recent import recent_pages_selection
from paged.sparse_tokens import TokenSelection

__all__ = [
    "CASCADE_CROSSOVER",
    "BlockSelection",
    "CascadeCrossover",
    "CascadeLevels",
    "CascadePlan",
    "CascadePlanCache",
    "DecodePlan",
    "KVCache",
    "LatentCache",
    "Llama3Scaling",
    "PageKeyBounds",
    "PagePool",
    "PageTable",
    "PoolExhaustedError",
    "PrefillChunk",
    "QuestSelection",
    "RopeParams",
    "SharedLevel",
    "SharedPrefixGroup",
    "TokenSelection",
    "YarnScaling",
    "append_kv",
    "append_latent",
    "append_page_key_bounds",
    "apply_rope",
    "apply_rope_frequencies",
    "bucket_size",
    "cascade_decode_attention",
    "cascade_levels_from_nested_prefixes",
    "cascade_levels_from_shared_prefix",
    "check_holds_new_tokens",
    "decode_attention",
    "find_shared_prefix_groups",
    "host_page_table",
    "inverse_frequencies",
    "lightning_indexer_top_k",
    "merge_state",
    "merge_states",
    "mla_decode_absorbed_reference",
    "mla_decode_attention",
    "mla_decode_unabsorbed_reference",
    "new_kv_cache",
    "new_latent_cache",
    "new_token_positions",
    "page_key_bounds",
    "plan_cascade",
    "plan_cascade_levels",
    "plan_decode",
    "plan_decode_tables",
    "prefill_attention",
    "prefill_chunks",
    "recent_pages_selection",
    "rope_append_kv",
    "sparse_decode_attention",
    "truncated_page_table",
    "update_page_key_bounds",
    "validate_cascade_levels",
    "validate_page_table",
    "yarn_inverse_frequencies",
    "yarn_mscale",
]
