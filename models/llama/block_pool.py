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
match possibly partial (a shared prefix that ends inside a block).

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

import numpy as np

SCRATCH_BLOCK = 0
_ROOT = b"root"


def chain_key(parent: bytes, tokens) -> bytes:
    """The digest naming a full block of ``tokens`` after the chain ``parent``."""
    return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


def prefix_keys(tokens, block_size: int) -> list[bytes]:
    """The chain digests of the full blocks of ``tokens``, in order."""
    keys, parent = [], _ROOT
    for i in range(len(tokens) // block_size):
        parent = chain_key(parent, tokens[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class SequenceBlocks:
    """One sequence's blocks: ``blocks[i]`` holds its positions [i * block_size, (i + 1) * block_size);
    ``tokens`` are the ids whose keys the cache holds (``length`` of them); ``keys`` the chain
    digests of its leading full blocks that were registered."""
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)

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
    docstring. ``prefix_caching=False`` matches and registers nothing (every prompt is computed)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks: expected an int >= 2 (block 0 is the padding's), got {num_blocks!r}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = np.zeros(num_blocks, np.int64)
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # popped from the end: lowest first
        self._cached = OrderedDict()  # block -> None: registered, held by no sequence; oldest first
        self._children: dict[bytes, dict[tuple, int]] = {}  # chain digest -> {block's tokens: block}
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

    def _unregister(self, block: int) -> None:
        parent, tokens = self._entry.pop(block)
        del self._children[parent][tokens]
        if not self._children[parent]:
            del self._children[parent]

    # ---- sequences ----
    def match(self, prompt) -> tuple[list[int], int]:
        """The longest registered prefix of ``prompt`` that leaves at least its last token to compute
        (its logits are needed): (blocks, tokens they hold of it). Nothing is held yet."""
        if not self.prefix_caching:
            return [], 0
        limit, bs = len(prompt) - 1, self.block_size
        blocks, parent, matched = [], _ROOT, 0
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
            best, best_len = None, 0  # a partial match: the longest common start among the children
            for tokens, candidate in children.items():
                common = _common_prefix(tokens, want)
                if common > best_len:
                    best, best_len = candidate, common
            if best is not None:
                blocks.append(best)
                matched += min(best_len, limit - matched)
            break
        return blocks, matched

    def open(self, prompt, shared: list[int], matched: int) -> SequenceBlocks:
        """A sequence holding the ``shared`` blocks of ``match(prompt)``, ``matched`` tokens cached."""
        for block in shared:
            self._hold(block)
        keys = prefix_keys(prompt[:matched], self.block_size) if self.prefix_caching else []
        return SequenceBlocks(list(shared), list(prompt[:matched]), keys)

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
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(seq.keys) < seq.length // bs:
            i = len(seq.keys)
            parent = seq.keys[-1] if seq.keys else _ROOT
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
        if keep and self.prefix_caching and seq.length % self.block_size and len(seq.blocks) > full:
            self._register(seq.blocks[full], seq.keys[-1] if seq.keys else _ROOT,
                           tuple(seq.tokens[full * self.block_size:]))
        for block in reversed(seq.blocks):  # last first: eviction takes a chain's tail before its start
            self._release(block)
        seq.blocks.clear()


def _common_prefix(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
