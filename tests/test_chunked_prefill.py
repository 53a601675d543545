"""Chunked prefill in the paged generator (``PagedGenerator(max_num_batched_tokens=N)``), on the
tiny random checkpoint of test_llama, read from each step's ``last_record`` (never from timings):
every running request decodes a token in every step while a long prompt is prefilled, and no step
holds more than N tokens, a step whose decode tokens fill N holding only them (the prompts
wait); greedy tokens equal to the contiguous ``Generator``'s (and so to whole-prompt prefill's)
with and without shared prefixes, cached prefixes still found; a request sharing the prefix of one
mid-prompt waits for its blocks and then shares them; a half-filled block is not registered while
its request runs; an abort between chunks and a failed mixed step give every block back.
tests/test_engine_states.py drives all of it at random too. The tests share their generators
(test_serving's ``Engines``): each new one compiles its graphs."""
import numpy as np
import pytest

import test_llama
import test_serving
from test_llama import CONFIG
from test_serving import assert_pool_at_rest, budget, drain

from models.llama.engine import PagedGenerator
from models.llama.engine.kv_cache import STEP_TOKENS
from models.llama.engine.paged import StepRecord

checkpoint = test_llama.checkpoint  # the tiny checkpoint fixture; graph comes from conftest.py
pytestmark = pytest.mark.xdist_group("chunked_prefill")  # one worker: the tests share their generators
model, module_engines, engines = test_serving.model, test_serving.module_engines, test_serving.engines  # fixtures
SYSTEM = np.random.default_rng(11).integers(3, CONFIG.vocab_size, 37).tolist()  # ends inside block 3 of 16


def tokens_of(rng, n):
    return rng.integers(3, CONFIG.vocab_size, n).tolist()


def generator(engines, tokens):
    """The module's generator, of a budget of ``tokens`` a step: 31 usable blocks and ``max_batch=5``
    hold every test's requests at once (none of them depends on running out of either), so the tests
    share one, its graphs compiled once."""
    return engines.paged(max_cache_bytes=budget(engines.model, 32), max_batch=5, max_num_batched_tokens=tokens)


def reference(engines, prompts, counts):
    """Each prompt's greedy tokens from the contiguous cache (prompts run one at a time)."""
    return engines.contiguous().generate(prompts, counts, eos_ids=()).tokens


def past_prompt(paged):
    """The running requests whose prompt is computed: each must decode a token in the next step."""
    return tuple(r.id for r in paged.running if r.seq.length >= len(r.prompt))


def run(paged, limit, budget_tokens=None):
    """Steps to the end, checking each step's record against the rule of the token budget; the
    tokens per request id and the records."""
    tokens, records = {}, []
    for _ in range(limit):
        if not paged.has_unfinished:
            return tokens, records
        decoding = past_prompt(paged)
        prompts_left = sum(max(0, len(r.prompt) - r.seq.length) for r in paged.running) + \
            sum(len(r.prompt) for r in paged.waiting)
        for t in paged.step():
            assert t.error is None
            tokens.setdefault(t.request, []).append(t.token)
        record = paged.last_record
        records.append(record)
        assert paged.last_step == ("decode" if record.kind == "decode" else "prefill")
        if budget_tokens is None:
            continue
        assert record.decode_requests == decoding  # every request past its prompt, every step
        if len(decoding) >= budget_tokens:
            assert record.kind == "decode" and record.prompt_tokens == 0
        else:
            assert record.total_tokens <= budget_tokens
            assert record.prompt_tokens > 0 or prompts_left == 0 or paged.waiting
        if 0 < len(decoding) < STEP_TOKENS:  # beside decode tokens: within the decode graph's 16 tokens
            assert record.total_tokens <= STEP_TOKENS
        assert record.graph == ("decode" if record.kind == "decode" or record.total_tokens <= STEP_TOKENS
                                else "prefill")
    raise AssertionError(f"unfinished after {limit} steps")


def cached_per_request(prompts_by_id, records):
    """Each request's cached prefix, as the records say when it was admitted; checked against
    the prompt tokens they say it computed."""
    computed, cached = {}, {}
    for record in records:
        for request, n in record.prefill_tokens:
            computed[request] = computed.get(request, 0) + n
        for request, n in record.cached_tokens:
            assert request not in cached
            cached[request] = n
    assert all(cached[i] + computed[i] == len(p) for i, p in prompts_by_id.items())
    return {i: cached[i] for i in prompts_by_id}


def test_running_requests_decode_every_step_while_a_long_prompt_is_prefilled(model, engines, mode, rng):
    """A budget of 8 tokens: two requests decode while a 40-token prompt (5 budgets) arrives. Each
    of its 7 steps holds both decode tokens and 6 of its tokens (4 in the last, which samples its
    first token); no step holds more than 8; everyone's tokens are the contiguous cache's. In both
    modes (the graphs are ``ms.jit`` in PyNative)."""
    a, b, long = tokens_of(rng, 3), tokens_of(rng, 5), tokens_of(rng, 40)
    want = reference(engines, [a, b, long], [20, 20, 6])
    paged = generator(engines, 8)
    ids = [paged.add_request(a, 20, eos_ids=()), paged.add_request(b, 20, eos_ids=())]
    paged.step()
    assert paged.last_record == StepRecord("prefill", (), ((ids[0], 3), (ids[1], 5)), tuple(ids),
                                           ((ids[0], 0), (ids[1], 0)), graph="decode")  # 8 tokens: in place
    paged.step()
    assert paged.last_record == StepRecord("decode", tuple(ids), graph="decode") and paged.last_step == "decode"
    ids.append(paged.add_request(long, 6, eos_ids=()))
    tokens, records = run(paged, 100, budget_tokens=8)
    chunks = [r for r in records if r.prefill_tokens]
    assert [r.prefill_tokens for r in chunks] == [((ids[2], 6),)] * 6 + [((ids[2], 4),)]
    assert all(r.kind == "mixed" and r.decode_requests == tuple(ids[:2]) and r.total_tokens <= 8 and
               r.graph == "decode" for r in chunks)
    assert [r.first_tokens for r in chunks] == [()] * 6 + [(ids[2],)]
    assert all(ids[2] not in r.decode_requests for r in records[:7])  # no token before its prompt's last
    assert [tokens[i] for i in ids] == [want[0][2:], want[1][2:], want[2]]
    assert paged.prefilled_tokens == 48 and paged.cached_prompt_tokens == 0
    assert_pool_at_rest(paged)


def test_decode_tokens_filling_the_budget_all_run_and_the_prompt_waits(model, engines, graph, rng):
    """A budget of 3 with three requests decoding: their three tokens fill it, and the prompt
    that arrives waits (steps of decode tokens only, the decode graph) until one of them ends, then
    takes what the others leave: 1 token a step beside two decode tokens, 2 beside one, 3 alone."""
    prompts = [tokens_of(rng, 1) for _ in range(3)]
    long = tokens_of(rng, 9)
    want = reference(engines, prompts + [long], [4, 6, 8, 3])
    paged = generator(engines, 3)
    ids = [paged.add_request(p, n, eos_ids=()) for p, n in zip(prompts, (4, 6, 8))]
    first = paged.step()
    assert paged.last_record == StepRecord("prefill", (), tuple((i, 1) for i in ids), tuple(ids),
                                           tuple((i, 0) for i in ids), graph="decode")
    ids.append(paged.add_request(long, 3, eos_ids=()))
    graphs, calls = (paged.prefill, paged.decode), []
    paged.prefill, paged.decode = [lambda *args, g=g, n=n: calls.append(n) or g(*args)
                                   for g, n in zip(graphs, ("prefill", "decode"))]
    tokens, records = run(paged, 100, budget_tokens=3)
    paged.prefill, paged.decode = graphs
    assert records[:3] == [StepRecord("decode", tuple(ids[:3]), graph="decode")] * 3  # request 0 ends in the third
    assert calls == ["decode"] * len(records)  # steps of 3 tokens: every one in place
    assert records[3] == StepRecord("mixed", tuple(ids[1:3]), ((ids[3], 1),), (), ((ids[3], 0),),
                                    graph="decode")  # admitted
    assert records[4] == StepRecord("mixed", tuple(ids[1:3]), ((ids[3], 1),), graph="decode")  # request 1 ends
    assert [r.prefill_tokens for r in records[5:8]] == [((ids[3], 2),)] * 2 + [((ids[3], 3),)]  # 2 ends in 6
    assert records[7] == StepRecord("prefill", (), ((ids[3], 3),), (ids[3],), graph="decode")
    assert [[t.token] + tokens[i] for t, i in zip(first, ids)] + [tokens[ids[3]]] == want
    assert_pool_at_rest(paged)


@pytest.mark.parametrize("chunk", [None, 5, 16])
def test_chunked_tokens_equal_the_contiguous_generators_and_prefixes_are_still_shared(model, engines, graph, rng,
                                                                                       chunk):
    """Five prompts of mixed lengths, three sharing a 37-token prefix, queued at once: the same
    greedy tokens with every budget as the contiguous cache (so as with whole-prompt prefill,
    ``chunk=None``). The later two sharing ones wait for the first's two full blocks (chunked:
    until the chunk completing them has run) and find them: 32 tokens cached each."""
    prompts = [SYSTEM + tokens_of(rng, n) for n in (5, 20, 1)] + [tokens_of(rng, 9), tokens_of(rng, 70)]
    want = reference(engines, prompts, 10)
    paged = generator(engines, chunk)
    ids = [paged.add_request(p, 10, eos_ids=()) for p in prompts]
    tokens, records = run(paged, 200, budget_tokens=chunk)
    assert [tokens[i] for i in ids] == want
    assert cached_per_request(dict(zip(ids, prompts)), records) == dict(zip(ids, [0, 32, 32, 0, 0]))
    assert paged.cached_prompt_tokens == 64 and paged.prefilled_tokens == sum(map(len, prompts)) - 64
    # one prefill graph for every chunk shape (dynamic shapes), whichever budgets the generator served
    # before; a second PagedGenerator on the same model compiles it twice on main too (its first two
    # calls), never once per shape
    prefills = [entry for entry in paged.compile_log if entry[0] == "_PagedPrefill"]
    assert len(prefills) <= 2 and (chunk is not None or sum(r.graph == "prefill" for r in records) >= 2)
    if chunk is not None:
        assert all(r.prompt_tokens <= chunk for r in records) and sum(len(r.first_tokens) for r in records) == 5
        # chunks of at most 16 tokens: in place, in the decode graph of their padded token count
        assert all(r.graph == "decode" for r in records)
        assert {t for name, t in paged.compile_log if name == "_PagedDecode"} <= {1, 2, 4, 8, 16}
    assert_pool_at_rest(paged)


@pytest.mark.parametrize("abort", [False, True], ids=["shares", "abort-between-chunks"])
def test_a_request_sharing_the_prefix_of_one_mid_prompt_waits_for_its_blocks(model, engines, graph, rng, abort):
    """A 74-token prompt prefilled 8 tokens a step; after 3 steps (24 tokens: block 0 full and
    registered, block 1 half filled and not), a second prompt with the same first 64 tokens arrives.
    It waits while the first computes the blocks it would share, then finds all four (64 tokens).
    Aborted between chunks instead, the first gives its blocks back at once, the half-filled one
    registered as its ending sequence's partial last block (its 8 keys are final), and the second
    runs, sharing the 24 tokens computed."""
    prefix = tokens_of(rng, 64)
    first, second = prefix + tokens_of(rng, 10), prefix + tokens_of(rng, 6)
    want = reference(engines, [first, second], 5)
    paged = generator(engines, 8)
    one = paged.add_request(first, 5, eos_ids=())
    for _ in range(3):
        paged.step()
    (running,) = paged.running
    assert running.seq.length == 24 and paged.last_record.prefill_tokens == ((one, 8),)
    assert paged.pool.registered(running.seq.blocks[0]) and not paged.pool.registered(running.seq.blocks[1])
    two = paged.add_request(second, 5, eos_ids=())
    if abort:
        assert paged.abort(one)
        assert_pool_at_rest(paged)
        assert paged.pool.cached == 2
    tokens, records = run(paged, 100, budget_tokens=8)
    joined = next(i for i, r in enumerate(records) if two in dict(r.prefill_tokens))
    cached = cached_per_request({two: second}, records)[two]
    if abort:
        assert joined == 0 and cached == 24 and one not in tokens
    else:
        assert sum(dict(r.prefill_tokens).get(one, 0) for r in records[:joined]) >= 64 - 24
        assert cached == 64 and tokens[one] == want[0]
    assert tokens[two] == want[1]
    assert_pool_at_rest(paged)


def test_beside_decode_tokens_a_step_holds_16_tokens_in_place_and_alone_a_prompt_takes_the_budget(model, engines, graph,
                                                                                                     rng):
    """A budget of 64: two requests decode while a 40-token prompt arrives. Each step holds their two
    decode tokens and 14 of its tokens (12 in the last), 16 in all, and runs the decode graph (its
    chunk read and written in place); alone, a 40-token prompt is one step of the prefill graph.
    Prompts whose first write lands in a cached block they share run in place too, one or two in a
    step, each block copied before the step (``PagedKVCache.copy_blocks``), the copied blocks' keys
    and values equal to the originals. Everyone's tokens are the contiguous cache's."""
    a, b, long, lone = tokens_of(rng, 3), tokens_of(rng, 5), tokens_of(rng, 40), tokens_of(rng, 40)
    copying = [lone[:24] + [t, t] for t in (9, 8, 7)]  # each shares lone's first 24 tokens: 8 in a copied block
    want = reference(engines, [a, b, long, lone] + copying, [20, 20, 6, 3, 3, 3, 3])
    paged = generator(engines, 64)
    ids = [paged.add_request(a, 20, eos_ids=()), paged.add_request(b, 20, eos_ids=())]
    paged.step()
    paged.step()
    ids.append(paged.add_request(long, 6, eos_ids=()))
    tokens, records = run(paged, 100, budget_tokens=64)
    chunks = [r for r in records if r.prefill_tokens]
    assert [r.prefill_tokens for r in chunks] == [((ids[2], 14),)] * 2 + [((ids[2], 12),)]
    assert all(r.kind == "mixed" and r.total_tokens <= STEP_TOKENS and r.graph == "decode" for r in chunks)
    assert [tokens[i] for i in ids] == [want[0][2:], want[1][2:], want[2]]
    alone = paged.add_request(lone, 3, eos_ids=())
    tokens, records = run(paged, 10, budget_tokens=64)
    assert records[0] == StepRecord("prefill", (), ((alone, 40),), (alone,), ((alone, 0),), graph="prefill")
    assert tokens[alone] == want[3]
    copy_blocks, copied = paged.cache.copy_blocks, []

    def recording(pairs):
        copied.append(list(pairs))
        copy_blocks(pairs)
        for source, target in pairs:
            for cache in (*paged.cache.keys, *paged.cache.values):
                np.testing.assert_array_equal(cache.asnumpy()[target], cache.asnumpy()[source])
    paged.cache.copy_blocks = recording
    one = paged.add_request(copying[0], 3, eos_ids=())
    tokens, records = run(paged, 10, budget_tokens=64)
    assert records[0] == StepRecord("prefill", (), ((one, 2),), (one,), ((one, 24),), graph="decode")
    assert tokens[one] == want[4]
    two = [paged.add_request(p, 3, eos_ids=()) for p in copying[1:]]
    tokens, records = run(paged, 10, budget_tokens=64)
    assert records[0] == StepRecord("prefill", (), tuple((i, 2) for i in two), tuple(two), tuple((i, 24) for i in two),
                                    graph="decode")
    assert [tokens[i] for i in two] == want[5:]
    assert [len(pairs) for pairs in copied if pairs] == [1, 2]
    del paged.cache.copy_blocks
    assert_pool_at_rest(paged)


def test_a_failed_mixed_step_ends_every_request_of_it_and_registers_nothing(model, engines, graph, rng):
    """A mixed step (a decode token and a prompt chunk) whose model call raises: both requests end,
    every block comes back, the blocks registered before it are all that is registered, and the
    same prompt runs again to the contiguous cache's tokens."""
    short, long = tokens_of(rng, 4), tokens_of(rng, 40)
    paged = generator(engines, 8)
    ids = [paged.add_request(short, 10, eos_ids=()), paged.add_request(long, 4, eos_ids=())]
    for _ in range(3):
        paged.step()
    assert paged.last_record.kind == "mixed"
    registered = [b for b in range(paged.num_blocks) if paged.pool.registered(b)]
    prefill, decode = paged.prefill, paged.decode

    def failing(*args):
        raise RuntimeError("injected")

    paged.prefill = paged.decode = failing  # the mixed step runs in place (the decode graph)
    with pytest.raises(RuntimeError, match="injected"):
        paged.step()
    paged.prefill, paged.decode = prefill, decode
    assert not paged.abort(ids[0]) and not paged.abort(ids[1])
    assert_pool_at_rest(paged)
    assert [b for b in range(paged.num_blocks) if paged.pool.registered(b)] == registered
    again = paged.add_request(long, 4, eos_ids=())
    tokens, _ = drain(paged)
    assert tokens[again] == reference(engines, [long], 4)[0]
    assert_pool_at_rest(paged)


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "8"])
def test_a_bad_token_budget_is_refused_by_name(model, value):
    with pytest.raises(ValueError, match="max_num_batched_tokens: expected an int >= 1"):
        PagedGenerator(model, max_cache_bytes=budget(model, 4), max_num_batched_tokens=value)


def test_the_token_budget_changes_only_while_nothing_is_unfinished(model):
    paged = PagedGenerator(model, max_cache_bytes=budget(model, 4), max_num_batched_tokens=np.int64(4))
    assert paged.max_num_batched_tokens == 4 and type(paged.max_num_batched_tokens) is int
    paged.max_num_batched_tokens = None
    request = paged.add_request([1, 2, 3], 2)
    with pytest.raises(ValueError, match="max_num_batched_tokens: 1 requests are unfinished"):
        paged.max_num_batched_tokens = 8
    with pytest.raises(ValueError, match="max_num_batched_tokens: expected"):
        paged.max_num_batched_tokens = 0
    assert paged.abort(request)
    paged.max_num_batched_tokens = 8
    assert paged.max_num_batched_tokens == 8
