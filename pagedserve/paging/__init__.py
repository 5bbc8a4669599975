"""KV memory in fixed-size blocks: allocation, reference counts, prefix caching, copy-on-write."""

from pagedserve.paging.block_manager import BlockManager, BlockTable, PrefixMatch

__all__ = ["BlockManager", "BlockTable", "PrefixMatch"]
