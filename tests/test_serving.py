"""The paged generator (models/llama/serving.py) on the tiny random checkpoint of test_llama:
greedy tokens equal to the contiguous Generator's (the reference: its prefill and decode are checked
against full forwards in test_generation.py) in both modes and block sizes, cache rows equal to the
contiguous cache's bit for bit (copy-on-write included), prefix caching computing only what is not
cached and changing no token, requests joining, aborting and sampling each as they would alone,
blocks coming back, eviction under a small budget, and bad input refused with the others untouched."""
import numpy as np
import pytest

import test_llama
from test_llama import CONFIG

from ms_rope_attention.paged import paged_calls
from models.llama.block_pool import blocks_for
from models.llama.generate import Generator
from models.llama.kv_cache import block_bytes
from models.llama.model import DTYPES
from models.llama.serving import PagedGenerator
from models.llama.weights import load_checkpoint

checkpoint, graph = test_llama.checkpoint, test_llama.graph
SYSTEM = np.random.default_rng(11).integers(3, CONFIG.vocab_size, 37).tolist()  # ends inside block 3 of 16


def prompts_of(rng, *lengths, shared=SYSTEM):
    return [shared + rng.integers(3, CONFIG.vocab_size, n).tolist() for n in lengths]


def budget(model, blocks, block_size=16):
    return blocks * block_bytes(model.cache_config, block_size, DTYPES["float32"])


def alone(model, prompt, new_tokens, **sampling):
    """A request's tokens when it is the only one."""
    paged = PagedGenerator(model, max_cache_bytes=budget(model, 64), prefix_caching=False)
    return [t.token for t in paged.stream([prompt], new_tokens, eos_ids=(), **sampling)]


@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_tokens_equal_the_contiguous_generators(checkpoint, mode, block_size, rng):
    """Four prompts of unequal lengths, three sharing a 37-token prefix, 20 new tokens each
    (crossing block boundaries): the same greedy tokens as the contiguous cache, and the decode
    steps run the paged kernel, once per layer and step."""
    model = load_checkpoint(checkpoint[1], progress=False)
    prompts = prompts_of(rng, 5, 20, 1) + [rng.integers(3, CONFIG.vocab_size, 9).tolist()]
    want = Generator(model, slots=4).generate(prompts, 20, eos_ids=()).tokens
    paged = PagedGenerator(model, max_cache_bytes=budget(model, 64, block_size), block_size=block_size,
                           max_batch=4)
    calls = paged_calls()
    got = paged.generate(prompts, 20, eos_ids=())
    assert got.tokens == want
    assert got.step_ms and paged_calls() - calls >= CONFIG.num_hidden_layers * len(got.step_ms)
    # with blocks of 16 the later prompts wait a step and find the first one's two full blocks; a
    # block of 128 holds the whole shared prefix unfinished, so nothing is shared while it is written
    assert paged.cached_prompt_tokens == (2 * 2 * 16 if block_size == 16 else 0)


def test_a_cached_prefix_is_not_computed_again_and_changes_no_token(checkpoint, graph, rng):
    model = load_checkpoint(checkpoint[1], progress=False)
    prompts = prompts_of(rng, 3, 30)
    paged = PagedGenerator(model, max_cache_bytes=budget(model, 64), max_batch=2)
    first = paged.generate(prompts, 8, eos_ids=()).tokens
    computed, cached = paged.prefilled_tokens, paged.cached_prompt_tokens
    again = paged.generate(prompts, 8, eos_ids=()).tokens
    assert again == first
    warm_up = sum(len(p) for p in prompts)  # the warm-up computes whole prompts, caching off
    assert paged.prefilled_tokens - computed == warm_up + len(prompts)  # each prompt's last token only
    assert paged.cached_prompt_tokens - cached == sum(len(p) - 1 for p in prompts)
    cold = PagedGenerator(model, max_cache_bytes=budget(model, 64), max_batch=2, prefix_caching=False)
    assert cold.generate(prompts, 8, eos_ids=()).tokens == first
    assert cold.cached_prompt_tokens == 0


@pytest.mark.parametrize("cache_dtype, tolerance", [("float32", 1e-4), ("float16", 1e-2)])
def test_logits_along_the_greedy_path_equal_a_full_forward(checkpoint, graph, rng, cache_dtype, tolerance):
    """Each step's logits (``last_logits``) against one full forward over the prompt and the tokens
    generated before it: 1e-4 with a float32 cache (test_llama's), float16 / bfloat16 rounding of the
    keys and values with a float16 cache (as the contiguous cache's float16 test)."""
    model = load_checkpoint(checkpoint[1], progress=False)
    (prompt,) = prompts_of(rng, 3)
    paged = PagedGenerator(model, max_cache_bytes=budget(model, 32), cache_dtype=cache_dtype)
    assert str(paged.cache.dtype) == {"float32": "Float32", "float16": "Float16"}[cache_dtype]
    paged.add_request(prompt, 12, eos_ids=())
    tokens, rows = [], []
    while paged.has_unfinished:
        tokens += [t.token for t in paged.step()]
        rows.append(paged.last_logits[0])
    full = test_llama.bsh_logits(model, prompt + tokens[:-1])[len(prompt) - 1:]
    error = np.abs(np.stack(rows) - full).max()
    assert error <= tolerance and (cache_dtype == "float32" or error > 0)


def _paged_rows(paged, request, layer):
    seq = paged.running[[r.id for r in paged.running].index(request)].seq
    blocks = np.asarray(seq.blocks)
    keys, values = paged.cache.keys[layer].asnumpy(), paged.cache.values[layer].asnumpy()
    positions = np.arange(seq.length)
    return (keys[blocks[positions // 16], positions % 16], values[blocks[positions // 16], positions % 16])


def test_cache_rows_equal_the_contiguous_caches_copy_on_write_included(checkpoint, graph, rng):
    """A prompt, then a second one sharing its first 37 tokens, whose block 2 (tokens 32..47) the
    first holds: the second copies it before writing. Every key and value row of both, after
    prefill and after two decode steps, equals the contiguous cache's for the same tokens."""
    model = load_checkpoint(checkpoint[1], progress=False)
    prompts = prompts_of(rng, 12, 4)
    paged = PagedGenerator(model, max_cache_bytes=budget(model, 32), max_batch=2)
    first = paged.add_request(prompts[0], 8, eos_ids=())
    paged.step()
    second = paged.add_request(prompts[1], 8, eos_ids=())
    paged.step()
    assert paged.last_step == "prefill" and paged.cached_prompt_tokens == 37
    blocks = [r.seq.blocks for r in paged.running]
    assert blocks[0][:2] == blocks[1][:2] and blocks[0][2] != blocks[1][2]  # shared, then copied
    for _ in range(2):
        paged.step()
    contiguous = Generator(model, slots=2)
    tokens = {r.id: list(r.seq.tokens) for r in paged.running}
    for request in (first, second):
        with contiguous.open(tokens[request]) as seq:
            assert seq.length == len(tokens[request])
            for layer in range(CONFIG.num_hidden_layers):
                rows = contiguous.cache.rows(0, 0, seq.length)  # each open takes slot 0
                want_k = contiguous.cache.keys[layer].asnumpy()[rows]
                want_v = contiguous.cache.values[layer].asnumpy()[rows]
                got_k, got_v = _paged_rows(paged, request, layer)
                np.testing.assert_allclose(got_k, want_k, rtol=0, atol=1e-5)
                np.testing.assert_allclose(got_v, want_v, rtol=0, atol=1e-5)


def test_requests_joining_and_aborting_mid_stream_get_their_own_tokens(checkpoint, graph, rng):
    model = load_checkpoint(checkpoint[1], progress=False)
    a, b, c = prompts_of(rng, 4, 21, 2)
    solo = {name: alone(model, prompt, 10) for name, prompt in zip("abc", (a, b, c))}
    paged = PagedGenerator(model, max_cache_bytes=budget(model, 64), max_batch=3)
    got = {"a": [], "b": [], "c": []}
    ids = {paged.add_request(a, 10, eos_ids=()): "a"}
    for _ in range(3):
        for t in paged.step():
            got[ids[t.request]].append(t.token)
    ids[paged.add_request(b, 10, eos_ids=())] = "b"
    for _ in range(2):
        for t in paged.step():
            got[ids[t.request]].append(t.token)
    assert paged.abort(next(i for i, n in ids.items() if n == "a"))
    ids[paged.add_request(c, 10, eos_ids=())] = "c"
    while paged.has_unfinished:
        for t in paged.step():
            got[ids[t.request]].append(t.token)
    assert got["b"] == solo["b"] and got["c"] == solo["c"]
    assert 0 < len(got["a"]) < 10 and got["a"] == solo["a"][:len(got["a"])]
    assert not paged.abort(12345)


def test_sampling_is_per_request_and_independent_of_the_batch(checkpoint, graph, rng):
    model = load_checkpoint(checkpoint[1], progress=False)
    sampled, greedy = prompts_of(rng, 6, 13)
    settings = dict(temperature=0.9, top_k=20, top_p=0.95, seed=3)
    want = alone(model, sampled, 12, **settings)
    paged = PagedGenerator(model, max_cache_bytes=budget(model, 64))
    first = paged.add_request(greedy, 12, eos_ids=())
    second = paged.add_request(sampled, 12, eos_ids=(), **settings)
    got = {first: [], second: []}
    while paged.has_unfinished:
        for t in paged.step():
            got[t.request].append(t.token)
    assert got[second] == want
    assert got[first] == alone(model, greedy, 12)


def test_blocks_come_back_and_a_small_budget_evicts_and_queues(checkpoint, graph, rng):
    """A budget of 9 usable blocks: six distinct 30..40-token requests of 10 new tokens (3 blocks
    each) run three at a time, the rest queued; the cached blocks of finished ones are evicted for
    the next. Same tokens as the contiguous cache; every block back afterwards."""
    model = load_checkpoint(checkpoint[1], progress=False)
    prompts = [rng.integers(3, CONFIG.vocab_size, n).tolist() for n in (30, 33, 36, 38, 31, 40)]
    want = Generator(model, slots=6).generate(prompts, 10, eos_ids=()).tokens
    paged = PagedGenerator(model, max_cache_bytes=budget(model, 10), max_batch=8)
    assert paged.pool.usable == 9
    running = []
    tokens = [[] for _ in prompts]
    for event in paged.stream(prompts, 10, eos_ids=()):
        tokens[event.request].append(event.token)
        running.append(len(paged.running))
    assert tokens == want
    assert max(running) == 3
    assert paged.reserved == 0 and not paged.running
    assert paged.pool.available == paged.pool.usable and (paged.pool.refs == 0).all()


def test_bad_input_is_refused_and_leaves_the_other_requests_alone(checkpoint, graph, rng):
    model = load_checkpoint(checkpoint[1], progress=False)
    prompt = prompts_of(rng, 3)[0]
    want = alone(model, prompt, 6)
    paged = PagedGenerator(model, max_cache_bytes=budget(model, 8), max_batch=2)
    running = paged.add_request(prompt, 6, eos_ids=())
    paged.step()
    before = (paged.pool.refs.copy(), paged.pool.available, paged.reserved)
    with pytest.raises(ValueError, match="prompt: 300 tokens .* need 19 blocks .* holds 7"):
        paged.add_request([5] * 300, 1)
    with pytest.raises(ValueError, match=r"prompt: expected token ids"):
        paged.add_request([1, CONFIG.vocab_size], 1)
    with pytest.raises(ValueError, match="sampling"):
        paged.add_request([1, 2], 1, top_p=0)
    with pytest.raises(ValueError, match="stream: 1 requests of add_request"):
        next(paged.stream([[1, 2]], 1))
    assert (paged.pool.refs == before[0]).all() and (paged.pool.available, paged.reserved) == before[1:]
    tokens = [t.token for t in paged.step()]
    while paged.has_unfinished:
        tokens += [t.token for t in paged.step()]
    assert tokens == want[1:] and running == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=24), "block_size: expected a positive multiple of 16"),
    (dict(max_batch=0), "max_batch: expected a positive int"),
    (dict(max_cache_bytes=1000), "max_cache_bytes: 1000 bytes hold 0 block"),
    (dict(max_cache_bytes=1 << 60), "max_cache_bytes: .* over 80% of the memory available"),
    (dict(cache_dtype="bfloat16"), "cache_dtype: a bfloat16 KV cache cannot be a graph's Parameter"),
])
def test_bad_settings_are_refused(checkpoint, kwargs, message):
    model = load_checkpoint(checkpoint[1], progress=False)
    with pytest.raises(ValueError, match=message):
        PagedGenerator(model, **kwargs)


def test_the_default_budget_holds_max_batch_sequences_of_the_models_positions(checkpoint):
    model = load_checkpoint(checkpoint[1], progress=False)
    paged = PagedGenerator(model, max_batch=3)
    assert paged.pool.usable == 3 * blocks_for(model.max_positions, 16)
