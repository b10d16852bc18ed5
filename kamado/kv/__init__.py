from kamado.kv.block_pool import BlockPool, OutOfBlocks
from kamado.kv.cache import KVCache, bytes_per_block

__all__ = ["BlockPool", "KVCache", "OutOfBlocks", "bytes_per_block"]
