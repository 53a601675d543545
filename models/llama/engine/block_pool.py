"""The host side of a paged KV cache: which blocks are free, which sequences hold each block, and
which cached blocks hold which tokens, so that requests sharing a prompt prefix share its blocks.

Why on the host: the cache's tensors only hold keys and values; every step's block tables and slot
mappings are built here in numpy (as MindFormers' ``PagedAttentionMgr`` and vLLM do) and passed to
the graph as inputs.

**Prefix caching.** A block is found by its content: the tokens it holds, under the chain of full
blocks before it, named by a SHA-256 digest of that chain (a cheap hash whose collisions could be
forged would let one request read another's keys; vLLM's prefix cache had that flaw). Full blocks
are registered when the step that filled them has run; a sequence's last, partial block when the
sequence ends. A request's prompt is matched block by block against what is registered, the last
match possibly partial (a shared prefix that ends inside a block), but only when it saves at least
``MIN_PARTIAL_SHARE`` of a block: a partial match costs a copy of the whole block in every layer and
one more block while the copy is made, which a prompt sharing only its BOS token would pay for
nothing.

**Isolation.** A request's chain starts from a root named by its ``cache_salt`` (vLLM's and the
hosted APIs' name): requests of different salts never share a block, so one tenant cannot time
another's prompts through the cache. ``reset`` forgets every registration (after the model's
weights changed): nothing computed before it is found again, and sequences running across it
register nothing.

**Copy-on-write.** A registered block is never written again, nor is a block two sequences hold: a
sequence about to write into one (its shared prefix ends inside it) gets a fresh block, and the
step copies the shared block into it before it writes (``Growth.copies``). Blocks that no sequence
holds but that are registered stay cached until an allocation needs them, least recently released
first (a sequence releases its last block first, so a chain loses its tail before its start).
Block 0 is never handed out: a padded step's filler tokens read it.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

SCRATCH_BLOCK = 0
MIN_PARTIAL_SHARE = 0.5  # of a block: the least a partial match must save to be taken
_ROOT = b"root"


def chain_key(parent: bytes, tokens) -> bytes:
    """The digest naming a full block of ``tokens`` after the chain ``parent``."""
    return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


def cache_root(salt: str | bytes | None = None) -> bytes:
    """The root of the chains of requests with this ``cache_salt`` (None: the shared, unsalted one)."""
    if salt is None:
        return _ROOT
    if isinstance(salt, str):
        salt = salt.encode()
    if not isinstance(salt, bytes) or not salt:
        raise ValueError(f"cache_salt: expected a non-empty str or bytes, or None, got {salt!r:.80}")
    return hashlib.sha256(b"salt:" + salt).digest()


def prefix_keys(tokens, block_size: int, root: bytes = _ROOT) -> list[bytes]:
    """The chain digests of the full blocks of ``tokens``, in order, from ``root``."""
    keys, parent = [], root
    for i in range(len(tokens) // block_size):
        parent = chain_key(parent, tokens[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Match(NamedTuple):
    """What a prompt finds cached: the ``blocks`` holding its first ``tokens`` tokens (the last
    block possibly partly: ``tokens`` not a multiple of the block size)."""
    blocks: list[int]
    tokens: int

    def whole_blocks(self, block_size: int) -> "Match":
        """The match without its partial last block."""
        full = self.tokens // block_size
        return Match(self.blocks[:full], full * block_size)


@dataclass
class SequenceBlocks:
    """One sequence's blocks: ``blocks[i]`` holds its positions [i * block_size, (i + 1) * block_size);
    ``tokens`` are the ids whose keys the cache holds (``length`` of them); ``keys`` the chain
    digests of its leading full blocks that were registered, from ``root`` (its salt's); ``epoch``
    the pool's when it opened (a sequence older than the last ``reset`` registers nothing)."""
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    root: bytes = _ROOT
    epoch: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class Growth:
    """What a step writes for one sequence: the cache ``slots`` (block * block_size + offset) of its
    new tokens, and the (source, destination) block ``copies`` to make before (copy-on-write)."""
    slots: np.ndarray
    copies: list[tuple[int, int]]


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token positions (block 0 reserved); see the module's
    docstring. ``prefix_caching=False`` matches and registers nothing (every prompt is computed).
    ``min_partial``: the fewest tokens a partial match of a block may hold (default
    ``MIN_PARTIAL_SHARE`` of a block)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, min_partial: int | None = None):
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks: expected an int >= 2 (block 0 is the padding's), got {num_blocks!r}")
        if min_partial is None:
            min_partial = max(1, int(MIN_PARTIAL_SHARE * block_size))
        if not isinstance(min_partial, int) or not 1 <= min_partial <= block_size:
            raise ValueError(f"min_partial: expected an int in [1, {block_size}], got {min_partial!r}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.min_partial = min_partial
        self.epoch = 0  # counts resets
        self.refs = np.zeros(num_blocks, np.int64)
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # popped from the end: lowest first
        self._cached = OrderedDict()  # block -> None: registered, held by no sequence; oldest first
        self._children: dict[bytes, dict[tuple, int]] = {}  # chain digest -> {block's tokens: block}
        # chain digest -> the tokens of its registered blocks as a trie: a partial match walks it token
        # by token (at most a block's worth), however many blocks are cached under that chain
        self._tries: dict[bytes, _TrieNode] = {}
        self._entry: dict[int, tuple[bytes, tuple]] = {}  # registered block -> (its parent's digest, its tokens)
        self._deferred: list[int] = []  # blocks released by a copy-on-write, freed once the step ran

    # ---- capacity ----
    @property
    def usable(self) -> int:
        """Blocks a request can ever have (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones no sequence holds."""
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        return len(self._cached)

    @property
    def free(self) -> list[int]:
        """Blocks no sequence holds and no registration names (a copy: for checks and tests)."""
        return list(self._free)

    @property
    def cached_blocks(self) -> list[int]:
        """Registered blocks no sequence holds, the next to be evicted first (a copy)."""
        return list(self._cached)

    def registered(self, block: int) -> bool:
        return block in self._entry

    def pending_releases(self) -> list[int]:
        """Blocks replaced by a copy-on-write whose step has not yet settled (a copy)."""
        return list(self._deferred)

    # ---- blocks ----
    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            self._unregister(block)
        else:
            raise RuntimeError("BlockPool: no block left (admission must reserve what a request can grow to)")
        self.refs[block] = 1
        return block

    def _hold(self, block: int) -> None:
        self.refs[block] += 1
        self._cached.pop(block, None)

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._entry:
                self._cached[block] = None
            else:
                self._free.append(block)

    def _register(self, block: int, parent: bytes, tokens: tuple) -> None:
        children = self._children.setdefault(parent, {})
        if tokens not in children and block not in self._entry:
            children[tokens] = block
            self._entry[block] = (parent, tokens)
            node = self._tries.setdefault(parent, _TrieNode())
            for token in tokens:
                node = node.next.setdefault(token, _TrieNode())
                node.blocks[block] = None

    def _unregister(self, block: int) -> None:
        parent, tokens = self._entry.pop(block)
        del self._children[parent][tokens]
        if not self._children[parent]:
            del self._children[parent]
        path = [self._tries[parent]]
        for token in tokens:
            path.append(path[-1].next[token])
            del path[-1].blocks[block]
        for depth in range(len(tokens), 0, -1):  # nodes no block passes through any more go
            if not path[depth].blocks:
                del path[depth - 1].next[tokens[depth - 1]]
        if not path[0].next:
            del self._tries[parent]

    def reset(self) -> None:
        """Forgets every registration (the model's weights changed): cached blocks become free,
        held ones stay with their sequences, and those sequences register nothing more."""
        for block in self._cached:
            self._free.append(block)
        self._cached.clear()
        self._children.clear()
        self._tries.clear()
        self._entry.clear()
        self.epoch += 1

    # ---- sequences ----
    def match(self, prompt, root: bytes = _ROOT) -> Match:
        """The longest registered prefix of ``prompt`` (chains from ``root``: its salt's) that leaves at
        least its last token to compute (its logits are needed); a partial last block only if it
        holds ``min_partial`` tokens of it. Nothing is held yet."""
        if not self.prefix_caching:
            return Match([], 0)
        limit, bs = len(prompt) - 1, self.block_size
        blocks, parent, matched = [], root, 0
        while matched < limit:
            children = self._children.get(parent)
            if not children:
                break
            want = tuple(prompt[matched:matched + bs])
            block = children.get(want) if len(want) == bs else None
            if block is not None and matched + bs <= limit:
                blocks.append(block)
                parent, matched = chain_key(parent, want), matched + bs
                continue
            node, common = self._tries[parent], 0  # a partial match: the longest common start
            for token in want[:limit - matched]:
                node = node.next.get(token)
                if node is None:
                    break
                best, common = next(iter(node.blocks)), common + 1
            if common >= self.min_partial:
                blocks.append(best)
                matched += common
            break
        return Match(blocks, matched)

    def open(self, prompt, shared: list[int], matched: int, root: bytes = _ROOT) -> SequenceBlocks:
        """A sequence holding the ``shared`` blocks of ``match(prompt, root)``, ``matched`` tokens cached."""
        for block in shared:
            self._hold(block)
        keys = prefix_keys(prompt[:matched], self.block_size, root) if self.prefix_caching else []
        return SequenceBlocks(list(shared), list(prompt[:matched]), keys, root, self.epoch)

    def grow(self, seq: SequenceBlocks, count: int) -> Growth:
        """Blocks for ``count`` more tokens of ``seq`` (from position ``seq.length``); a block it
        shares or that is registered is replaced by a copy before the first write into it."""
        bs, start = self.block_size, seq.length
        copies = []
        first = start // bs
        if first < len(seq.blocks):
            block = seq.blocks[first]
            if self.refs[block] > 1 or block in self._entry:
                fresh = self._allocate()
                copies.append((block, fresh))
                seq.blocks[first] = fresh
                self._deferred.append(block)  # the copy reads it during the step
        while len(seq.blocks) < blocks_for(start + count, bs):
            seq.blocks.append(self._allocate())
        positions = np.arange(start, start + count)
        slots = np.asarray(seq.blocks, np.int64)[positions // bs] * bs + positions % bs
        return Growth(slots, copies)

    def commit(self, seq: SequenceBlocks, tokens) -> None:
        """After the step that wrote ``tokens`` at the end of ``seq`` ran: they are cached, and the
        full blocks they completed are registered."""
        seq.tokens.extend(int(t) for t in tokens)
        self.settle()
        if not self.prefix_caching or seq.epoch != self.epoch:
            return
        bs = self.block_size
        while len(seq.keys) < seq.length // bs:
            i = len(seq.keys)
            parent = seq.keys[-1] if seq.keys else seq.root
            block_tokens = tuple(seq.tokens[i * bs:(i + 1) * bs])
            self._register(seq.blocks[i], parent, block_tokens)
            seq.keys.append(chain_key(parent, block_tokens))

    def settle(self) -> None:
        """Blocks replaced by a copy-on-write are released once the step that copied them ran."""
        for block in self._deferred:
            self._release(block)
        self._deferred.clear()

    def close(self, seq: SequenceBlocks, keep: bool = True) -> None:
        """The sequence ended: with ``keep``, its partial last block is registered (its keys are final;
        not after a failed step, whose writes may be missing) and every block it held is released."""
        full = seq.length // self.block_size
        if (keep and self.prefix_caching and seq.epoch == self.epoch and seq.length % self.block_size
                and len(seq.blocks) > full and len(seq.keys) == full):
            self._register(seq.blocks[full], seq.keys[-1] if seq.keys else seq.root,
                           tuple(seq.tokens[full * self.block_size:]))
        for block in reversed(seq.blocks):  # last first: eviction takes a chain's tail before its start
            self._release(block)
        seq.blocks.clear()


class _TrieNode:
    """A token position in a chain's trie: the registered blocks whose tokens pass through it."""
    __slots__ = ("next", "blocks")

    def __init__(self):
        self.next: dict[int, _TrieNode] = {}
        self.blocks: dict[int, None] = {}  # ordered: the earliest registered first
