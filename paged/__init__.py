"""The paged KV cache: CSR page table, host-side page pool, append, and decode attention.

Public API (names are part of the contract):

- ``PageTable``, ``PagePool``, ``KVCache``, ``new_kv_cache``, ``append_kv``
- ``plan_decode``, ``DecodePlan``: the split-KV planner (host side, once per step)
- ``decode_attention`` (``backend="auto" | "reference" | "pallas"``)
- ``merge_state``, ``merge_states``: exact merging of partial attention states
"""

from paged.attention_reference import merge_state, merge_states
from paged.decode import decode_attention
from paged.kv_cache import KVCache, append_kv, new_kv_cache
from paged.page_table import PageTable, bucket_size, validate_page_table
from paged.plan import DecodePlan, plan_decode
from paged.pool import PagePool, PoolExhaustedError

__all__ = [
    "DecodePlan",
    "KVCache",
    "PagePool",
    "PageTable",
    "PoolExhaustedError",
    "append_kv",
    "bucket_size",
    "decode_attention",
    "merge_state",
    "merge_states",
    "new_kv_cache",
    "plan_decode",
    "validate_page_table",
]
