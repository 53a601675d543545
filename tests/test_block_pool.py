"""The paged KV cache's host-side bookkeeping (models/llama/engine/block_pool.py), step by step: which
blocks are handed out (never block 0), reference counts of shared prefixes, what ``match`` finds
(the chain of full blocks, the cap that leaves the last prompt token to compute, partial blocks),
copy-on-write, the cache slots of new tokens, LRU eviction of cached blocks, and when blocks are
registered (after the step that wrote them; a partial last block at close, not after a failure).

Why: a mistake here does not crash. It lets a request read another request's keys, overwrite a
prefix other requests share, or lose blocks, and the model tests only see the generated tokens.
These tests drive ``BlockPool`` the way ``serving.PagedGenerator`` does (match, open, grow, the
step, commit, close) and check its state after each call.
"""
import random

import numpy as np
import pytest

import models.llama.engine.block_pool as bp

BlockPool, Growth, SCRATCH_BLOCK = bp.BlockPool, bp.Growth, bp.SCRATCH_BLOCK
blocks_for, prefix_keys = bp.blocks_for, bp.prefix_keys

BS = 16


def token_pool(num_blocks: int, **settings) -> BlockPool:
    """A pool whose partial matches may hold a single token: the matching mechanism at its finest
    grain (the default, half a block, is tested on its own below)."""
    return BlockPool(num_blocks, BS, min_partial=1, **settings)


def tokens(start: int, count: int) -> list[int]:
    """``count`` distinct token ids from ``start`` (tests pick starts far apart)."""
    return list(range(start, start + count))


X, Y, Z, W = tokens(100, BS), tokens(200, BS), tokens(300, BS), tokens(400, BS)  # one block each


def prefill(pool: BlockPool, prompt):
    """What ``PagedGenerator`` does for a joining request: match, open, grow by the uncached
    rest, (the step runs), commit. Returns (seq, growth, matched)."""
    shared, matched = pool.match(prompt)
    seq = pool.open(prompt, shared, matched)
    growth = pool.grow(seq, len(prompt) - matched)
    pool.commit(seq, prompt[matched:])
    return seq, growth, matched


def decode(pool: BlockPool, seq, token: int) -> Growth:
    """One decode step of ``seq``: grow by one token, (the step runs), commit."""
    growth = pool.grow(seq, 1)
    pool.commit(seq, [token])
    return growth


# ---- helpers of the module ----

def test_blocks_for_and_prefix_keys():
    assert [blocks_for(n, BS) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert prefix_keys(X[:15], BS) == []
    keys = prefix_keys(X + Y + [1, 2, 3], BS)  # full blocks only
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)  # SHA-256 digests
    assert keys[0] == prefix_keys(X, BS)[0]
    assert prefix_keys(Z + Y, BS)[1] != keys[1]  # the same tokens under another chain: another key


# ---- allocation ----

def test_block_zero_is_never_handed_out_and_running_out_raises():
    pool = token_pool(5)
    assert pool.usable == 4 and pool.available == 4 and pool.cached == 0
    seq = pool.open([], [], 0)
    growth = pool.grow(seq, 4 * BS)
    assert seq.blocks == [1, 2, 3, 4] and SCRATCH_BLOCK not in seq.blocks
    assert growth.copies == [] and pool.available == 0
    assert pool.refs[SCRATCH_BLOCK] == 0 and list(pool.refs[1:]) == [1, 1, 1, 1]
    pool.commit(seq, tokens(0, 4 * BS))
    with pytest.raises(RuntimeError, match="no block left"):
        pool.grow(seq, 1)  # position 64: a fifth block
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, BS)  # block 0 alone: nothing to hand out


def test_blocks_of_a_closed_sequence_go_back():
    pool = token_pool(6)
    seq, _, _ = prefill(pool, tokens(0, 40))  # 2 full blocks + 8 tokens
    held = list(seq.blocks)
    assert len(held) == 3 and pool.available == 2 and pool.cached == 0
    pool.close(seq)
    assert seq.blocks == [] and all(pool.refs[b] == 0 for b in held)
    # the 2 full blocks (registered at commit) and the partial one (at close) stay cached
    assert pool.cached == 3 and pool.available == 5 == pool.usable
    other = pool.open([], [], 0)
    pool.grow(other, 5 * BS)  # every block again: the cached ones are evicted, none is lost
    assert sorted(other.blocks) == [1, 2, 3, 4, 5] and pool.available == 0 and pool.cached == 0


def test_uncached_blocks_go_back_to_the_free_list():
    pool = BlockPool(4, BS, prefix_caching=False)
    seq, _, _ = prefill(pool, tokens(0, 40))
    first = list(seq.blocks)
    pool.close(seq)
    assert pool.cached == 0 and pool.available == 3
    again, _, _ = prefill(pool, tokens(1000, 40))
    assert sorted(again.blocks) == sorted(first)


def test_available_counts_free_and_cached_blocks():
    pool = token_pool(8)
    a, _, _ = prefill(pool, X + Y)  # 2 blocks held
    b, _, _ = prefill(pool, Z)  # 1 block held
    assert pool.available == 7 - 3 and pool.cached == 0
    pool.close(a)
    assert pool.cached == 2 and pool.available == 7 - 1
    pool.close(b)
    assert pool.cached == 3 and pool.available == 7


def test_running_out_raises_only_when_no_cached_block_is_left():
    pool = token_pool(3)
    a, _, _ = prefill(pool, X)
    b, _, _ = prefill(pool, Y)
    pool.close(b)  # Y's block cached
    assert pool.available == 1
    c, _, _ = prefill(pool, Z)  # takes Y's block
    assert c.blocks == [2] and pool.match(Y + [1]) == ([], 0)
    with pytest.raises(RuntimeError):
        pool.grow(pool.open([], [], 0), 1)
    assert a.blocks == [1] and pool.refs[1] == 1 and pool.refs[2] == 1


# ---- reference counts ----

def test_sequences_on_a_matched_prefix_share_its_blocks():
    pool = token_pool(8)
    a, _, _ = prefill(pool, X + Y)
    prefix = list(a.blocks)
    pool.close(a)
    assert pool.cached == 2 and all(pool.refs[blk] == 0 for blk in prefix)

    b_shared, b_matched = pool.match(X + Y + [1])
    c_shared, c_matched = pool.match(X + Y + [2])
    assert b_shared == c_shared == prefix and b_matched == c_matched == 2 * BS
    b = pool.open(X + Y + [1], b_shared, b_matched)
    c = pool.open(X + Y + [2], c_shared, c_matched)
    assert b.blocks == c.blocks == prefix and b.length == c.length == 2 * BS
    assert [pool.refs[blk] for blk in prefix] == [2, 2] and pool.cached == 0  # held: out of the cache
    for seq, token in ((b, 1), (c, 2)):
        growth = pool.grow(seq, 1)
        assert growth.copies == []  # the prefix ends on a block boundary: nothing shared is written
        pool.commit(seq, [token])
    assert b.blocks[2] != c.blocks[2]

    pool.close(b)
    assert [pool.refs[blk] for blk in prefix] == [1, 1]
    assert pool.match(X + Y + [3]) == (prefix, 2 * BS)  # still registered while c holds them
    cached_before = pool.cached
    pool.close(c)
    assert [pool.refs[blk] for blk in prefix] == [0, 0]
    assert pool.cached == cached_before + 3  # the shared blocks and c's last block: cached, not free
    assert pool.match(X + Y + [3]) == (prefix, 2 * BS)


# ---- match ----

def test_match_follows_the_chain_of_full_blocks():
    pool = token_pool(8)
    a, _, _ = prefill(pool, X + Y)
    x_block, y_block = a.blocks
    pool.close(a)
    assert pool.match(X + Y + [1]) == ([x_block, y_block], 2 * BS)
    assert pool.match(Z + Y + [1]) == ([], 0)  # Y's tokens, but after another first block
    assert pool.match(Y + [1]) == ([], 0)  # Y's tokens, but as a first block
    assert pool.match(X + Z + [1]) == ([x_block], BS)


def test_match_leaves_the_last_prompt_token_to_compute():
    pool = token_pool(8)
    prompt = X + Y
    a, _, _ = prefill(pool, prompt)
    first, second = a.blocks
    pool.close(a)

    assert pool.match(prompt) == ([first, second], 2 * BS - 1)  # the last block partially
    assert pool.match(prompt[:BS + 1]) == ([first], BS)  # one token past a full block: it is matched whole
    assert pool.match(prompt[:BS]) == ([first], BS - 1)
    assert pool.match(prompt[:2]) == ([first], 1)
    assert pool.match(prompt[:1]) == ([], 0)
    assert pool.match([]) == ([], 0)

    # the same prompt again: only its last token is computed, into a copy of the registered block
    seq, growth, matched = prefill(pool, prompt)
    assert matched == 2 * BS - 1
    fresh = seq.blocks[1]
    assert seq.blocks[0] == first and fresh not in (first, second)
    assert growth.copies == [(second, fresh)]
    assert list(growth.slots) == [fresh * BS + BS - 1]
    assert pool.refs[second] == 0 and pool.cached == 1  # released by the commit, still cached
    assert pool.match(prompt + [1]) == ([first, second], 2 * BS)


def test_partial_match_inside_a_registered_partial_block():
    pool = token_pool(8)
    prompt = tokens(0, 20)  # a full block and 4 tokens
    a, _, _ = prefill(pool, prompt)
    first, last = a.blocks
    # the partial block is registered only when the sequence ends
    assert pool.match(prompt[:18] + [999, 998]) == ([first], BS)
    pool.close(a)
    assert pool.cached == 2

    assert pool.match(prompt[:18] + [999, 998]) == ([first, last], 18)
    assert pool.match(prompt + [7]) == ([first, last], 20)
    assert pool.match(prompt) == ([first, last], 19)  # the cap holds inside a partial block too
    assert pool.match(prompt[:BS] + [555, 556]) == ([first], BS)  # nothing in common: no partial block
    assert pool.match(tokens(0, 3)) == ([first], 2)  # a partial match of a full block


def test_prefix_caching_off_matches_and_registers_nothing():
    pool = BlockPool(6, BS, prefix_caching=False)
    prompt = tokens(0, 40)
    a, _, matched = prefill(pool, prompt)
    assert matched == 0 and a.keys == []
    assert pool.match(prompt) == ([], 0)  # committed full blocks are not registered
    pool.close(a)
    assert pool.cached == 0 and pool.available == pool.usable
    assert pool.match(prompt) == ([], 0) and pool.match(prompt + [1]) == ([], 0)


def test_prefix_caching_switched_off_ignores_what_is_cached():
    """PagedGenerator.warm_up switches caching off on a pool that may hold cached blocks: they are
    not matched meanwhile, nothing new is registered, and they are found again after."""
    pool = token_pool(8)
    a, _, _ = prefill(pool, X + Y)
    chain = list(a.blocks)
    pool.close(a)
    pool.prefix_caching = False
    assert pool.match(X + Y + [1]) == ([], 0)
    b, _, matched = prefill(pool, Z + W + [5])
    assert matched == 0 and b.keys == []
    pool.close(b)
    assert pool.cached == 2
    pool.prefix_caching = True
    assert pool.match(Z + W + [5, 6]) == ([], 0)
    assert pool.match(X + Y + [1]) == (chain, 2 * BS)


# ---- copy-on-write ----

def cached_prompt(num_blocks: int):
    """A pool in which a closed 20-token prompt left its full block and its partial one cached:
    (pool, prompt, first block, last block)."""
    pool = token_pool(num_blocks)
    prompt = tokens(0, 20)
    a, _, _ = prefill(pool, prompt)
    first, last = a.blocks
    pool.close(a)
    return pool, prompt, first, last


def test_a_shared_partial_block_is_copied_and_released_after_the_step():
    pool, prompt, first, last = cached_prompt(8)

    b_prompt, c_prompt = prompt[:18] + [900, 901], prompt[:18] + [800]
    b = pool.open(b_prompt, *pool.match(b_prompt))
    c = pool.open(c_prompt, *pool.match(c_prompt))
    assert b.blocks == c.blocks == [first, last] and b.length == c.length == 18
    assert pool.refs[first] == pool.refs[last] == 2

    growth = pool.grow(b, 2)
    fresh = b.blocks[1]
    assert growth.copies == [(last, fresh)] and b.blocks == [first, fresh] and fresh != last
    assert list(growth.slots) == [fresh * BS + 2, fresh * BS + 3]
    assert pool.refs[last] == 2 and pool.refs[fresh] == 1  # the copy reads it during the step
    pool.settle()  # the step ran
    assert pool.refs[last] == 1 and pool.refs[first] == 2

    growth = pool.grow(c, 1)
    other = c.blocks[1]
    assert growth.copies == [(last, other)] and other not in (last, fresh)
    assert pool.refs[last] == 1
    pool.commit(c, [800])  # commit settles
    assert pool.refs[last] == 0
    assert pool.match(prompt + [1]) == ([first, last], 20)  # registered, so cached, not free


def test_a_registered_block_held_by_one_sequence_is_still_copied():
    pool = token_pool(8)
    prompt = tokens(0, 20)
    a, _, _ = prefill(pool, prompt)
    last = a.blocks[1]
    pool.close(a)
    b = pool.open(prompt + [5], *pool.match(prompt + [5]))
    assert pool.refs[last] == 1
    growth = pool.grow(b, 1)
    assert growth.copies == [(last, b.blocks[1])] and b.blocks[1] != last
    assert pool.refs[last] == 1  # until the step ran
    pool.commit(b, [5])
    assert pool.refs[last] == 0 and pool.cached >= 1


def test_a_sequences_own_unregistered_block_is_written_in_place():
    pool = token_pool(6)
    seq, growth, _ = prefill(pool, tokens(0, 10))
    block = seq.blocks[0]
    assert growth.copies == []
    for position in range(10, BS):
        growth = decode(pool, seq, position)
        assert growth.copies == [] and seq.blocks == [block]
        assert list(growth.slots) == [block * BS + position]
    growth = decode(pool, seq, 99)  # the next block
    assert growth.copies == [] and len(seq.blocks) == 2 and seq.blocks[0] == block
    assert list(growth.slots) == [seq.blocks[1] * BS]


# ---- slots ----

def test_slots_map_positions_across_block_boundaries():
    pool = token_pool(8)
    a = pool.open([], [], 0)
    pool.grow(a, BS)  # block 1
    b = pool.open([], [], 0)
    pool.grow(b, BS)  # block 2
    pool.close(a, keep=False)  # block 1 free again: the next sequence's blocks are not contiguous
    seq = pool.open([], [], 0)
    first = pool.grow(seq, 14)
    pool.commit(seq, tokens(0, 14))
    assert seq.blocks == [1] and list(first.slots) == list(range(16, 30))
    growth = pool.grow(seq, 20)  # positions 14..33
    assert seq.blocks == [1, 3, 4]
    expected = [1 * BS + 14, 1 * BS + 15] + [3 * BS + i for i in range(BS)] + [4 * BS + 0, 4 * BS + 1]
    assert list(growth.slots) == expected and growth.copies == []
    positions = np.arange(14, 34)
    assert np.array_equal(growth.slots, np.asarray(seq.blocks)[positions // BS] * BS + positions % BS)


# ---- eviction ----

def _three_cached_blocks():
    """A pool of 3 usable blocks, all cached: X's, then Y's, then Z's released (oldest first)."""
    pool = token_pool(4)
    held = {}
    for name, prompt in (("x", X), ("y", Y), ("z", Z)):
        seq, _, _ = prefill(pool, prompt)
        held[name] = seq.blocks[0]
        pool.close(seq)
    assert pool.cached == 3 and pool.available == 3
    return pool, held


def test_eviction_reuses_the_least_recently_released_cached_block():
    pool, held = _three_cached_blocks()
    seq, _, matched = prefill(pool, W)
    assert matched == 0 and seq.blocks == [held["x"]]
    assert pool.match(X + [1]) == ([], 0)  # unregistered: no longer found
    assert pool.match(Y + [1]) == ([held["y"]], BS)
    assert pool.match(Z + [1]) == ([held["z"]], BS)
    assert pool.cached == 2
    seq2, _, _ = prefill(pool, tokens(500, BS))
    assert seq2.blocks == [held["y"]] and pool.match(Y + [1]) == ([], 0)


def test_holding_a_cached_block_takes_it_out_of_the_eviction_order():
    pool, held = _three_cached_blocks()
    seq, growth, matched = prefill(pool, X + [7])  # holds X's block, computes one token
    assert matched == BS and seq.blocks[0] == held["x"]
    assert seq.blocks[1] == held["y"]  # the oldest block no sequence holds
    pool.close(seq)  # X's block released again: now the most recent but one
    assert pool.match(X + [7, 1]) == ([held["x"], held["y"]], BS + 1)
    other, _, _ = prefill(pool, W)
    assert other.blocks == [held["z"]]  # Z's block was released before X's
    assert pool.match(X + [1]) == ([held["x"]], BS)


def test_eviction_takes_a_chains_tail_before_its_start():
    """A closed sequence releases its last block first, so the eviction order keeps the start of a
    prefix (what most requests share) findable longest."""
    pool = token_pool(4)
    a, _, _ = prefill(pool, X + Y)
    chain = list(a.blocks)
    pool.close(a)
    seq, _, _ = prefill(pool, Z)  # the free block
    assert pool.match(X + Y + [1]) == (chain, 2 * BS)
    pool.close(seq)
    other, _, _ = prefill(pool, W)  # evicts the least recently released: Y's block, the chain's tail
    assert pool.match(X + Y + [1]) == (chain[:1], BS)


# ---- registration ----

def test_close_without_keep_registers_nothing():
    pool = token_pool(6)
    prompt = tokens(0, 40)
    a, _, _ = prefill(pool, prompt)
    full = a.blocks[:2]
    pool.close(a, keep=False)
    assert pool.cached == 2  # the full blocks, registered when their step ran
    assert pool.match(prompt + [1]) == (full, 2 * BS)  # not the partial block
    assert pool.available == pool.usable

    # a failed step (PagedGenerator._failed): grown, never committed
    pool = token_pool(6)
    seq = pool.open(prompt, *pool.match(prompt))
    pool.grow(seq, len(prompt))
    pool.settle()
    pool.close(seq, keep=False)
    assert pool.cached == 0 and pool.available == pool.usable
    assert pool.match(prompt + [1]) == ([], 0)


def test_a_failed_step_after_a_copy_releases_both_blocks():
    pool, prompt, first, last = cached_prompt(6)
    seq = pool.open(prompt + [1], *pool.match(prompt + [1]))
    growth = pool.grow(seq, 1)
    (source, fresh), = growth.copies
    assert source == last
    pool.settle()
    pool.close(seq, keep=False)
    assert pool.refs[first] == pool.refs[last] == pool.refs[fresh] == 0
    assert pool.available == pool.usable and pool.cached == 2
    assert pool.match(prompt + [1]) == ([first, last], 20)


def test_commit_registers_full_blocks_only_after_the_step():
    pool = token_pool(8)
    prompt = tokens(0, 40)
    a = pool.open(prompt, *pool.match(prompt))
    pool.grow(a, len(prompt))
    assert pool.match(prompt + [1]) == ([], 0)  # the step has not run: nothing to share
    pool.commit(a, prompt)
    assert pool.match(prompt + [1]) == (a.blocks[:2], 2 * BS)  # the partial third block: at close

    for token in range(40, 47):
        decode(pool, a, token)
    growth = pool.grow(a, 1)  # position 47 completes the third block
    full = prompt + list(range(40, 48))
    assert pool.match(full + [1]) == (a.blocks[:2], 2 * BS)
    pool.commit(a, [47])
    assert growth.copies == []
    assert pool.match(full + [1]) == (a.blocks[:3], 3 * BS)


# ---- everything together ----

@pytest.mark.parametrize("seed", range(12))
def test_random_use_keeps_the_bookkeeping_consistent(seed):
    """Random prefills, decodes, closes and failed steps against a shadow of the cache's contents
    (copies applied, tokens written at their slots): every match's blocks hold the prompt's
    tokens, every sequence's blocks hold its tokens, every block is free, cached or held (by as
    many sequences as its count says), block 0 never."""
    rng = random.Random(seed)
    pool = token_pool(12, prefix_caching=seed % 4 != 3)
    content = {b: [None] * BS for b in range(pool.num_blocks)}
    bases = [tokens(0, 48), tokens(0, 20) + tokens(700, 28), tokens(900, 40)]
    live = []

    def write(growth, new_tokens):
        for source, destination in growth.copies:
            content[destination] = list(content[source])
        for slot, token in zip(growth.slots, new_tokens):
            content[int(slot) // BS][int(slot) % BS] = token

    for _ in range(120):
        roll = rng.random()
        if roll < 0.4 and len(live) < 4:
            base = rng.choice(bases)
            prompt = base[:rng.randint(1, len(base))] + [rng.randint(1, 3) for _ in range(rng.randint(0, 3))]
            shared, matched = pool.match(prompt)
            assert matched <= max(len(prompt) - 1, 0) and len(shared) == blocks_for(matched, BS)
            assert [content[shared[i // BS]][i % BS] for i in range(matched)] == prompt[:matched]
            need = blocks_for(len(prompt) + 4, BS) - matched // BS
            if need > pool.available - sum(1 for b in set(shared) if pool.refs[b] == 0):
                continue  # what _admit reserves
            seq = pool.open(prompt, shared, matched)
            growth = pool.grow(seq, len(prompt) - matched)
            write(growth, prompt[matched:])
            if rng.random() < 0.1:  # the step failed
                pool.settle()
                pool.close(seq, keep=False)
                continue
            pool.commit(seq, prompt[matched:])
            live.append(seq)
        elif roll < 0.8 and live:
            seq = rng.choice(live)
            if seq.length % BS == 0 and pool.available == 0:
                continue
            token = rng.randint(1, 3)
            write(pool.grow(seq, 1), [token])
            pool.commit(seq, [token])
        elif live:
            pool.close(live.pop(rng.randrange(len(live))), keep=rng.random() < 0.9)

        holders = {}
        for seq in live:
            for block in seq.blocks:
                holders[block] = holders.get(block, 0) + 1
            assert [content[seq.blocks[i // BS]][i % BS] for i in range(seq.length)] == seq.tokens
        assert pool.refs[SCRATCH_BLOCK] == 0 and SCRATCH_BLOCK not in holders
        assert [int(pool.refs[b]) for b in range(1, pool.num_blocks)] == \
            [holders.get(b, 0) for b in range(1, pool.num_blocks)]
        assert pool.available == pool.usable - len(holders)
        if not pool.prefix_caching:
            assert pool.cached == 0


# ---- partial matches worth their copy, salts, reset ----

def test_a_partial_match_must_hold_half_a_block_by_default():
    """A partial match copies a whole block to save its tokens: under half a block (a shared BOS,
    a few words) it is not taken. Candidates are found by their first half block, not by a scan."""
    pool = BlockPool(8, BS)
    assert pool.min_partial == BS // 2
    a, _, _ = prefill(pool, X)
    (block,) = a.blocks
    pool.close(a)
    assert pool.match([X[0], 1, 2]) == ([], 0)  # BOS-like: one token in common
    assert pool.match(X[:7] + [1]) == ([], 0)
    assert pool.match(X[:8] + [1]) == ([block], 8)
    assert pool.match(X[:12] + [1, 2]) == ([block], 12)
    with pytest.raises(ValueError, match=r"min_partial: expected an int in \[1, 16\], got 0"):
        BlockPool(8, BS, min_partial=0)


def test_whole_blocks_drops_a_partial_last_block():
    match = bp.Match([3, 5, 7], 2 * BS + 4)
    assert match.whole_blocks(BS) == ([3, 5], 2 * BS)
    assert bp.Match([3], BS).whole_blocks(BS) == ([3], BS)


def test_chains_of_different_salts_never_meet():
    pool = BlockPool(8, BS)
    salted = bp.cache_root("tenant")
    assert salted != bp.cache_root(None) and salted == bp.cache_root(b"tenant") != bp.cache_root("other")
    shared, matched = pool.match(X + Y, salted)
    a = pool.open(X + Y, shared, matched, salted)
    pool.grow(a, 2 * BS)
    pool.commit(a, X + Y)
    chain = list(a.blocks)
    pool.close(a)
    assert pool.match(X + Y + [1]) == ([], 0)
    assert pool.match(X + Y + [1], bp.cache_root("other")) == ([], 0)
    assert pool.match(X + Y + [1], salted) == (chain, 2 * BS)
    with pytest.raises(ValueError, match="cache_salt: expected a non-empty str or bytes, or None, got 3"):
        bp.cache_root(3)


def test_reset_forgets_every_prefix_and_a_sequence_across_it_registers_nothing():
    pool = token_pool(8)
    a, _, _ = prefill(pool, X + Y)
    b, _, _ = prefill(pool, Z + [1, 2])
    pool.close(a)
    assert pool.cached == 2
    pool.reset()
    assert pool.cached == 0 and pool.available == pool.usable - len(b.blocks)
    assert pool.match(X + Y + [1]) == ([], 0) and pool.match(Z + [1, 2, 3]) == ([], 0)
    decode(pool, b, 3)
    pool.close(b)  # opened before the reset: its blocks were computed by the old weights
    assert pool.cached == 0 and pool.available == pool.usable
    assert pool.match(Z + [1, 2, 3, 4]) == ([], 0)
    c, _, _ = prefill(pool, Z + [5])  # after the reset, registration works again
    chain = list(c.blocks)
    pool.close(c)
    assert pool.match(Z + [5, 6]) == (chain, BS + 1)


def test_a_block_two_sequences_share_across_a_reset_is_never_written_and_comes_back():
    """make fuzz's shrunk counter-example: two running sequences share a registered full block when
    the pool is reset, which unregisters it while both still hold it. Neither writes into it (each
    writes past it, into its own block), and once both end it is free, not cached."""
    pool = token_pool(8)
    a, _, _ = prefill(pool, X + [1])
    b, _, matched = prefill(pool, X + [2])
    assert matched == BS and a.blocks[0] == b.blocks[0]
    shared = a.blocks[0]
    pool.reset()
    assert pool.refs[shared] == 2 and not pool.registered(shared)
    for seq in (a, b):
        growth = decode(pool, seq, 3)
        assert growth.copies == [] and all(int(slot) // BS != shared for slot in growth.slots)
    pool.close(a)
    pool.close(b)
    assert pool.cached == 0 and pool.available == pool.usable and shared in pool.free

