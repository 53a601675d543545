"""The generation engines over the Llama net: ``Generator`` (a contiguous cache, slots of a capacity
bucket; ``contiguous.py``) and ``PagedGenerator`` (a block-paged cache with prefix caching, what a
server drives; ``paged.py``, its step's scheduling, graphs and commit in ``paged_scheduler.py``,
``paged_graphs.py`` and ``paged_step.py``), on one spine (``common.Engine``), their caches
(``kv_cache.py``), the paged cache's ``BlockPool`` (``block_pool.py``) and the command line (``cli.py``).
docs/llama.md#generation and docs/serving.md#the-paged-generator."""
from .block_pool import BlockPool
from .common import Generation, SamplingError, Token, sample
from .contiguous import Generator, Sequence
from .kv_cache import KVCache, PagedKVCache
from .paged import PagedGenerator

__all__ = ["BlockPool", "Generation", "Generator", "KVCache", "PagedGenerator", "PagedKVCache", "SamplingError",
           "Sequence", "Token", "sample"]
