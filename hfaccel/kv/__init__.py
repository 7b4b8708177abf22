"""The paged KV memory: block bookkeeping, the pool of K/V tensors (and hybrid models' recurrent state), what each
layer of a model keeps, and transformers ``Cache`` views over the pool."""

from hfaccel.kv.block_manager import BlockCopy, BlockManager, CacheFullError, PrefixHit, slot_mapping
from hfaccel.kv.device_tables import DeviceBlockTables
from hfaccel.kv.hf_cache import PagedKV, PoolCache, PromptCache, SequenceKVCache, paged_reader_backend
from hfaccel.kv.layout import ModelLayout, kv_dims, local_kv_heads, model_layout
from hfaccel.kv.paged_cache import PagedCache
from hfaccel.kv.pool import KVPool, PackedStep, token_metadata

__all__ = [
    "BlockCopy",
    "BlockManager",
    "CacheFullError",
    "DeviceBlockTables",
    "KVPool",
    "ModelLayout",
    "PackedStep",
    "PagedCache",
    "PagedKV",
    "PoolCache",
    "PrefixHit",
    "PromptCache",
    "SequenceKVCache",
    "kv_dims",
    "local_kv_heads",
    "model_layout",
    "paged_reader_backend",
    "slot_mapping",
    "token_metadata",
]
