"""The paged generator (models/llama/engine/paged.py) on the tiny random checkpoint of test_llama:
greedy tokens equal to the contiguous Generator's (the reference: its prefill and decode are checked
against full forwards in test_generation.py) in both modes and block sizes, cache rows equal to the
contiguous cache's bit for bit (copy-on-write included), prefix caching computing only what is not
cached and changing no token, requests joining, aborting and sampling each as they would alone,
blocks coming back, eviction under a small budget, and bad input refused with the others untouched.
The tests share their generators (``Engines``): each new one compiles its graphs."""
import threading

import mindspore as ms
import numpy as np
import pytest

import test_llama
from test_llama import CONFIG

from ms_rope_attention.paged import paged_calls
from models.llama.engine import Generator, PagedGenerator, SamplingError
from models.llama.engine.block_pool import blocks_for
from models.llama.engine.kv_cache import block_bytes
from models.llama.model import DTYPES
from models.llama.weights import load_checkpoint

checkpoint = test_llama.checkpoint  # the tiny checkpoint fixture; graph comes from conftest.py
pytestmark = pytest.mark.xdist_group("serving")  # one worker: the tests share their generators
SYSTEM = np.random.default_rng(11).integers(3, CONFIG.vocab_size, 37).tolist()  # ends inside block 3 of 16


class Engines:
    """The generators of a module's tests on one tiny model, one per settings and execution mode:
    a new generator compiles its graphs (most of a test's time), and one that served a test serves
    the next as a new one would. Each is handed out idle (``idle``), with nothing cached and its
    prompt counters at 0; after each test the model's weights are put back and a generator left
    otherwise (the test failed mid-way) is dropped, so no test sees another's leftovers."""

    def __init__(self, model):
        self.model, self.made, self.lent = model, {}, []
        self.weights = [p.asnumpy().copy() for p in model.get_parameters()]  # asnumpy shares the parameter's memory

    def _lend(self, key, make, idle):
        engine = self.made.get(key)
        if engine is None:
            engine = self.made[key] = make()
        assert idle(engine), f"{key}: in use by this test, or left busy by another"
        self.lent.append((key, idle))
        return engine

    def paged(self, max_num_batched_tokens=None, prefix_caching=True, **settings) -> PagedGenerator:
        """A ``PagedGenerator(model, **settings)``, one made before if alike in all but the token budget
        and prefix caching (set on it, its cache emptied: the graphs depend on neither). Making one
        compiles nothing: its first step does."""
        new = PagedGenerator(self.model, **settings)
        key = ("paged", ms.get_context("mode"), new.block_size, new.max_batch, new.num_blocks, str(new.cache_dtype))
        paged = self._lend(key, lambda: new, idle)
        paged.reset_prefix_cache()
        paged.pool.prefix_caching = prefix_caching
        paged.prefilled_tokens = paged.cached_prompt_tokens = 0
        paged.max_num_batched_tokens = max_num_batched_tokens
        assert paged.pool.cached == 0 and paged.pool.available == paged.pool.usable
        return paged

    def contiguous(self) -> Generator:
        """The reference: a contiguous ``Generator`` of one slot, prompts run one at a time (any slot
        count gives each prompt the tokens it gets alone: test_generation.py)."""
        return self._lend(("contiguous", ms.get_context("mode")), lambda: Generator(self.model, slots=1),
                          lambda generator: not generator.slots.busy.any())

    def give_back(self):
        for key, still_idle in self.lent:
            if key in self.made and not still_idle(self.made[key]):
                del self.made[key]
        self.lent.clear()
        for parameter, value in zip(self.model.get_parameters(), self.weights):
            if not np.array_equal(parameter.asnumpy(), value):
                parameter.set_data(ms.Tensor(value))


def idle(paged) -> bool:
    """No request, no block held or reserved, no method replaced."""
    return (not paged.has_unfinished and paged.reserved == 0 and not paged.pool.refs.any()
            and not paged.pool.pending_releases() and (paged.prefill, paged.decode) == paged.graphs
            and "_draw" not in vars(paged) and "grow" not in vars(paged.pool)
            and "copy_blocks" not in vars(paged.cache))


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_checkpoint(checkpoint[1], progress=False)


@pytest.fixture(scope="module")
def module_engines(model):
    return Engines(model)


@pytest.fixture
def engines(module_engines):
    yield module_engines
    module_engines.give_back()


def prompts_of(rng, *lengths, shared=SYSTEM):
    return [shared + rng.integers(3, CONFIG.vocab_size, n).tolist() for n in lengths]


def budget(model, blocks, block_size=16):
    return blocks * block_bytes(model.cache_config, block_size, DTYPES["float32"])


def shared_paged(engines, **settings):
    """The generator of every test whose requests fit in 63 blocks, 4 at a time (none of them depends
    on running out of either): one, its graphs compiled once."""
    return engines.paged(max_cache_bytes=budget(engines.model, 64), max_batch=4, **settings)


def small_paged(engines, **settings):
    """The generator of a small budget, 9 usable blocks, 8 requests at a time: requests queue and
    cached blocks are evicted for them. ``alone`` runs on it too (one request fits)."""
    return engines.paged(max_cache_bytes=budget(engines.model, 10), max_batch=8, **settings)


def alone(engines, prompt, new_tokens, **sampling):
    """A request's tokens when it is the only one (prefix caching off: nothing cached to find)."""
    paged = small_paged(engines, prefix_caching=False)
    return [t.token for t in paged.stream([prompt], new_tokens, eos_ids=(), **sampling)]


@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_tokens_equal_the_contiguous_generators(engines, mode, block_size, rng):
    """Four prompts of unequal lengths, three sharing a 37-token prefix, 20 new tokens each
    (crossing block boundaries): the same greedy tokens as the contiguous cache, and the decode
    steps run the paged kernel, once per layer and step."""
    prompts = prompts_of(rng, 5, 20, 1) + [rng.integers(3, CONFIG.vocab_size, 9).tolist()]
    want = engines.contiguous().generate(prompts, 20, eos_ids=()).tokens
    paged = engines.paged(max_cache_bytes=budget(engines.model, 64, block_size), block_size=block_size,
                          max_batch=4)  # blocks of 16: shared_paged's generator
    calls = paged_calls()
    got = paged.generate(prompts, 20, eos_ids=())
    assert got.tokens == want
    assert got.step_ms and paged_calls() - calls >= CONFIG.num_hidden_layers * len(got.step_ms)
    # with blocks of 16 the later prompts wait a step and find the first one's two full blocks; a
    # block of 128 holds the whole shared prefix unfinished, so nothing is shared while it is written
    assert paged.cached_prompt_tokens == (2 * 2 * 16 if block_size == 16 else 0)


def test_a_cached_prefix_is_not_computed_again_and_changes_no_token(model, engines, graph, rng):
    prompts = prompts_of(rng, 3, 30)
    paged = shared_paged(engines)
    first = paged.generate(prompts, 8, eos_ids=()).tokens
    computed, cached = paged.prefilled_tokens, paged.cached_prompt_tokens
    again = paged.generate(prompts, 8, eos_ids=()).tokens
    assert again == first
    warm_up = sum(len(p) for p in prompts)  # the warm-up computes whole prompts, caching off
    # all but each prompt's last token is cached (the first run registered prompt + generated tokens),
    # but a partial block is taken only when it holds half a block of the prompt: 40 and 67 tokens
    # find 39 - 32 = 7 and 66 - 64 = 2 tokens in their last blocks, which they compute again
    assert [len(p) for p in prompts] == [40, 67]
    reused = [32, 64]
    assert paged.prefilled_tokens - computed == warm_up + sum(len(p) - n for p, n in zip(prompts, reused))
    assert paged.cached_prompt_tokens - cached == sum(reused)
    cold = small_paged(engines, prefix_caching=False)  # alone()'s
    assert cold.generate(prompts, 8, eos_ids=()).tokens == first
    assert cold.cached_prompt_tokens == 0


@pytest.mark.parametrize("cache_dtype, tolerance", [("float32", 1e-4), ("float16", 1e-2)])
def test_logits_along_the_greedy_path_equal_a_full_forward(model, engines, graph, rng, cache_dtype, tolerance):
    """Each step's logits (``last_logits``) against one full forward over the prompt and the tokens
    generated before it: 1e-4 with a float32 cache (test_llama's), float16 / bfloat16 rounding of the
    keys and values with a float16 cache (as the contiguous cache's float16 test)."""
    (prompt,) = prompts_of(rng, 3)
    paged = shared_paged(engines, cache_dtype=cache_dtype)
    assert str(paged.cache.dtype) == {"float32": "Float32", "float16": "Float16"}[cache_dtype]
    paged.add_request(prompt, 12, eos_ids=())
    tokens, rows = [], []
    while paged.has_unfinished:
        tokens += [t.token for t in paged.step()]
        rows.append(paged.last_logits[0])
    full = test_llama.eager_logits(model, prompt + tokens[:-1])[len(prompt) - 1:]  # compiles no graph
    error = np.abs(np.stack(rows) - full).max()
    assert error <= tolerance and (cache_dtype == "float32" or error > 0)


def _paged_rows(paged, request, layer):
    seq = paged.running[[r.id for r in paged.running].index(request)].seq
    blocks = np.asarray(seq.blocks)
    keys, values = paged.cache.keys[layer].asnumpy(), paged.cache.values[layer].asnumpy()
    positions = np.arange(seq.length)
    return (keys[blocks[positions // 16], positions % 16], values[blocks[positions // 16], positions % 16])


def test_cache_rows_equal_the_contiguous_caches_copy_on_write_included(model, engines, graph, rng):
    """A prompt, then a second one sharing its first 44 tokens, whose block 2 (tokens 32..47) the
    first holds: the second copies it before writing (12 tokens of it shared: over half a block). Every key and value row of both, after
    prefill and after two decode steps, equals the contiguous cache's for the same tokens."""
    prompts = prompts_of(rng, 5, 4, shared=SYSTEM + rng.integers(3, CONFIG.vocab_size, 7).tolist())
    paged = shared_paged(engines)
    first = paged.add_request(prompts[0], 8, eos_ids=())
    paged.step()
    second = paged.add_request(prompts[1], 8, eos_ids=())
    paged.step()
    assert paged.last_step == "prefill" and paged.cached_prompt_tokens == 44
    blocks = [r.seq.blocks for r in paged.running]
    assert blocks[0][:2] == blocks[1][:2] and blocks[0][2] != blocks[1][2]  # shared, then copied
    for _ in range(2):
        paged.step()
    contiguous = engines.contiguous()
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


def test_requests_joining_and_aborting_mid_stream_get_their_own_tokens(model, engines, graph, rng):
    a, b, c = prompts_of(rng, 4, 21, 2)
    solo = {name: alone(engines, prompt, 10) for name, prompt in zip("abc", (a, b, c))}
    paged = shared_paged(engines)
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


def test_sampling_is_per_request_and_independent_of_the_batch(model, engines, graph, rng):
    sampled, greedy = prompts_of(rng, 6, 13)
    settings = dict(temperature=0.9, top_k=20, top_p=0.95, seed=3)
    want = alone(engines, sampled, 12, **settings)
    paged = shared_paged(engines)
    first = paged.add_request(greedy, 12, eos_ids=())
    second = paged.add_request(sampled, 12, eos_ids=(), **settings)
    got = {first: [], second: []}
    while paged.has_unfinished:
        for t in paged.step():
            got[t.request].append(t.token)
    assert got[second] == want
    assert got[first] == alone(engines, greedy, 12)


def test_blocks_come_back_and_a_small_budget_evicts_and_queues(model, engines, graph, rng):
    """A budget of 9 usable blocks: six distinct 30..40-token requests of 10 new tokens (3 blocks
    each) run three at a time, the rest queued; the cached blocks of finished ones are evicted for
    the next. Same tokens as the contiguous cache; every block back afterwards."""
    prompts = [rng.integers(3, CONFIG.vocab_size, n).tolist() for n in (30, 33, 36, 38, 31, 40)]
    want = engines.contiguous().generate(prompts, 10, eos_ids=()).tokens
    paged = small_paged(engines)
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


def test_bad_input_is_refused_and_leaves_the_other_requests_alone(model, engines, graph, rng):
    prompt = prompts_of(rng, 3)[0]
    want = alone(engines, prompt, 6)
    paged = engines.paged(max_cache_bytes=budget(model, 4), max_batch=2)  # the F1 tests' 3 usable blocks
    running = paged.add_request(prompt, 6, eos_ids=())
    paged.step()
    before = (paged.pool.refs.copy(), paged.pool.available, paged.reserved)
    with pytest.raises(ValueError, match="prompt: 300 tokens .* need 19 blocks .* holds 3"):
        paged.add_request([5] * 300, 1)
    with pytest.raises(ValueError, match=r"prompt: expected token ids"):
        paged.add_request([1, CONFIG.vocab_size], 1)
    with pytest.raises(ValueError, match="top_p"):
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
def test_bad_settings_are_refused(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PagedGenerator(model, **kwargs)


def test_the_default_budget_holds_max_batch_sequences_of_the_models_positions(model):
    paged = PagedGenerator(model, max_batch=3)
    assert paged.pool.usable == 3 * blocks_for(model.max_positions, 16)


# ---- the engine's hardening (security-review-2: F1, F3, F7, F8, F9, the thread rule, bad input) ----

def drain(paged, limit=400):
    """Steps until nothing is unfinished (a bounded number: a livelock fails instead of hanging);
    the tokens and errors of each request id."""
    tokens, errors = {}, {}
    for _ in range(limit):
        if not paged.has_unfinished:
            return tokens, errors
        for t in paged.step():
            if t.error is not None:
                errors[t.request] = t.error
            else:
                tokens.setdefault(t.request, []).append(t.token)
    raise AssertionError(f"still unfinished after {limit} steps: waiting {[r.id for r in paged.waiting]}, "
                         f"running {[r.id for r in paged.running]}")


def assert_pool_at_rest(paged):
    assert not paged.running and paged.reserved == 0 and not paged.pool.pending_releases()
    assert (paged.pool.refs == 0).all() and paged.pool.available == paged.pool.usable


@pytest.mark.parametrize("shared", [1, 10], ids=["bos-only", "partial-block"])
def test_a_request_sized_to_the_whole_cache_is_admitted_after_a_prefix_sharing_one(model, engines, graph, shared):
    """F1: 3 usable blocks. A request sharing ``shared`` leading tokens with a finished one, whose
    48 positions need all 3 blocks, is admitted (then the one queued behind it). Its partially
    matched block used to be counted twice (held, and copied), so it never fit, and FIFO admission
    held every later request too: ``stream`` spun forever. BOS alone is no longer matched at all
    (under half a block); 10 tokens are, and the match is cut to whole blocks when it does not fit."""
    paged = engines.paged(max_cache_bytes=budget(model, 4), max_batch=2)
    assert paged.pool.usable == 3
    first = list(range(1, 11))
    paged.add_request(first, 2, eos_ids=())
    drain(paged)
    whole = paged.add_request(first[:shared] + [7] * (40 - shared), 9, eos_ids=())  # 40 + 9 - 1 = 48 positions
    after = paged.add_request([5, 6], 3, eos_ids=())
    tokens, errors = drain(paged)
    assert not errors and len(tokens[whole]) == 9 and len(tokens[after]) == 3
    assert tokens[whole] == alone(engines, first[:shared] + [7] * (40 - shared), 9)
    assert_pool_at_rest(paged)


def test_the_prefix_cache_takes_a_partial_block_only_when_it_saves_half_a_block(model, engines, graph, rng):
    """F9: a prompt sharing its first 7 tokens with a cached one computes all its tokens (copying a
    whole block in every layer to save 7 positions of 16 costs more than it saves); 8 are reused."""
    paged = shared_paged(engines)
    base = rng.integers(3, CONFIG.vocab_size, 12).tolist()
    paged.add_request(base, 2, eos_ids=())
    drain(paged)
    for shared, reused in ((7, 0), (8, 8)):
        before = paged.cached_prompt_tokens
        paged.add_request(base[:shared] + [2] * 5, 2, eos_ids=())
        drain(paged)
        assert paged.cached_prompt_tokens - before == reused


def nan_row(model, token):
    """``token``'s embedding row NaN (``Engines`` puts it back after the test): the rows of a prompt
    holding it turn NaN, and only its own (attention never crosses sequences)."""
    table = model.model.embed_tokens.weight
    values = table.asnumpy()
    values[token] = np.nan
    table.set_data(ms.Tensor(values))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_whose_row_cannot_be_sampled_ends_alone_and_the_step_commits_the_others(
        model, engines, graph, rng, temperature):
    """F3: three requests prefilled together, the middle one's logits NaN. It ends with a
    ``SamplingError`` (no token: greedy's argmax of NaN used to be an arbitrary one, sampling raised
    out of ``step`` and left the request after it with no token pending, which the next decode fed
    as id -1), its blocks go back, nothing it wrote is cached, and the others get the tokens they
    get alone."""
    nan_row(model, 200)
    a, c = prompts_of(rng, 4, 9, shared=[])
    b = [5, 200, 6, 7]
    paged = shared_paged(engines)
    ids = [paged.add_request(p, 6, eos_ids=(), temperature=temperature, seed=1) for p in (a, b, c)]
    first = paged.step()
    assert [t.request for t in first] == ids and first[1].token is None and first[1].finished
    assert isinstance(first[1].error, SamplingError)
    assert [r.id for r in paged.running] == [ids[0], ids[2]]
    tokens, errors = drain(paged)
    assert not errors
    assert [first[0].token] + tokens[ids[0]] == alone(engines, a, 6, temperature=temperature, seed=1)
    assert [first[2].token] + tokens[ids[2]] == alone(engines, c, 6, temperature=temperature, seed=1)
    assert_pool_at_rest(paged)
    assert paged.pool.match(b + [1]).tokens == 0  # nothing of the failed request is cached
    with pytest.raises(SamplingError):
        list(paged.stream([b], 3))  # stream raises the request's error
    assert_pool_at_rest(paged)


def test_any_exception_drawing_a_row_ends_that_request_alone(model, engines, graph, rng, monkeypatch):
    """Issue 64 F1: three sampled requests, the middle one's draw raising a RuntimeError at its
    third token (numpy's "probabilities contain NaN" once, from a temperature of 5e-324). It ends
    with a last ``Token`` carrying that error after its two tokens, and the others, in the same
    steps, get the tokens they get alone (``_draw`` caught only ``SamplingError``: the step raised
    and ended every request in it); every block comes back."""
    a, b, c = prompts_of(rng, 4, 9, 6, shared=[])
    paged = shared_paged(engines)
    ids = [paged.add_request(p, 6, eos_ids=(), temperature=0.8, seed=1) for p in (a, b, c)]
    failure = RuntimeError("injected: the sampler broke")
    sampling = paged.waiting[1].sampling
    draw, draws = sampling.draw, []

    def breaking_draw(logits):
        draws.append(1)
        if len(draws) == 3:
            raise failure
        return draw(logits)

    monkeypatch.setattr(sampling, "draw", breaking_draw)
    tokens, errors = drain(paged)
    assert errors == {ids[1]: failure} and len(tokens[ids[1]]) == 2
    assert_pool_at_rest(paged)
    for request, prompt in ((ids[0], a), (ids[2], c)):  # alone, on the same graphs: no new compile
        paged.reset_prefix_cache()
        assert [t.token for t in paged.stream([prompt], 6, eos_ids=(), temperature=0.8, seed=1)] == tokens[request]


def test_a_step_that_fails_before_its_graph_runs_ends_its_requests_and_registers_nothing(model, engines, graph, rng):
    """F8: the second joining request's growth raises after the first one's copy-on-write swap put
    a block never copied into its table. Every request of the step ends, its blocks freed and none
    registered; an ``abort`` after it finds nothing (it used to register the uncopied block as
    cached, matchable later by another prompt)."""
    paged = shared_paged(engines)
    shared = rng.integers(3, CONFIG.vocab_size, 28).tolist()
    paged.add_request(shared, 2, eos_ids=())
    drain(paged)
    cached = set(paged.pool.cached_blocks)
    first = paged.add_request(shared[:24] + [9, 9], 4, eos_ids=())  # copies the cached partial block
    second = paged.add_request([4, 5, 6], 4, eos_ids=())
    grow, calls = paged.pool.grow, []

    def failing_grow(seq, count):
        calls.append(count)
        if len(calls) == 2:
            raise KeyboardInterrupt  # anything: Ctrl-C, a bug, the pool running dry
        return grow(seq, count)

    paged.pool.grow = failing_grow
    with pytest.raises(KeyboardInterrupt):
        paged.step()
    del paged.pool.grow  # the pool's own again
    assert not paged.abort(first) and not paged.abort(second)
    assert_pool_at_rest(paged)
    assert set(paged.pool.cached_blocks) <= cached


def test_abort_from_another_thread_waits_for_the_step(model, engines, graph, rng):
    """The thread rule: every public call holds the generator's lock. An ``abort`` issued while a
    decode step is inside the model returns only after the step has ended (it used to run at once,
    changing ``running`` and the pool under the step)."""
    paged = shared_paged(engines)
    ids = [paged.add_request(p, 8, eos_ids=()) for p in prompts_of(rng, 3, 5, shared=[])]
    paged.step()
    decode, inside, aborted, seen = paged.decode, threading.Event(), threading.Event(), []

    def slow_decode(*args):
        inside.set()
        seen.append(aborted.wait(0.5))  # an abort that does not wait for the step lands here
        return decode(*args)

    paged.decode = slow_decode
    thread = threading.Thread(target=lambda: (inside.wait(10), paged.abort(ids[1]), aborted.set()))
    thread.start()
    tokens = paged.step()
    thread.join(10)
    assert seen == [False] and aborted.is_set()
    assert [t.request for t in tokens] == ids and [r.id for r in paged.running] == ids[:1]
    paged.decode = decode
    drain(paged)
    assert_pool_at_rest(paged)


def test_a_cache_salt_isolates_requests_and_a_reset_forgets_every_prefix(model, engines, graph, rng):
    """F7: the same prompt under another salt shares nothing (no timing of another tenant's text);
    under the same salt it does. After the weights change and ``reset_prefix_cache``, nothing
    computed with the old weights is reused: the tokens are the new weights' alone."""
    paged = shared_paged(engines)
    prompt = rng.integers(3, CONFIG.vocab_size, 44).tolist()

    def cached_by(**salt):
        before = paged.cached_prompt_tokens
        paged.add_request(prompt, 3, eos_ids=(), **salt)
        tokens, _ = drain(paged)
        return paged.cached_prompt_tokens - before, next(iter(tokens.values()))

    assert cached_by(cache_salt="tenant-a")[0] == 0
    assert cached_by(cache_salt="tenant-b")[0] == 0
    assert cached_by()[0] == 0
    assert cached_by(cache_salt="tenant-a")[0] == 43
    assert cached_by(cache_salt=b"tenant-b")[0] == 43
    for parameter in model.get_parameters():  # new weights (Engines puts them back): each matrix's rows reversed
        if parameter.ndim == 2:
            parameter.set_data(ms.Tensor(parameter.asnumpy()[::-1].copy()))
    paged.reset_prefix_cache()
    assert paged.pool.cached == 0
    reused, tokens = cached_by(cache_salt="tenant-a")
    assert reused == 0 and tokens == alone(engines, prompt, 3)
    with pytest.raises(ValueError, match="cache_salt: expected a non-empty str or bytes"):
        paged.add_request(prompt, 3, cache_salt=7)


@pytest.mark.parametrize("call, message", [
    (lambda p: p.add_request(None, 2), "prompt: expected a list of token ids, got NoneType"),
    (lambda p: p.add_request("abc", 2), "prompt: expected a list of token ids, got str"),
    (lambda p: p.add_request([1, 2], 2.5), r"max_new_tokens: expected a positive int or one per prompt, got 2.5"),
    (lambda p: p.add_request([1, 2], None), r"max_new_tokens: expected a positive int or one per prompt, got None"),
    (lambda p: p.add_request([1, 2], True), r"max_new_tokens: expected a positive int"),
    (lambda p: p.add_request([1, 2], 2, temperature=float("nan")), "temperature: expected a finite number"),
    (lambda p: p.add_request([1, 2], 2, top_k=1.5), "top_k: expected an int >= 0"),
    (lambda p: p.add_request([1, 2], 2, seed=-1), "seed: expected an int >= 0, got -1"),
    (lambda p: p.add_request([1, 2], 2, seed="x"), "seed: expected an int >= 0"),
    (lambda p: p.add_request([1, 2], 2, eos_ids=5), "eos_ids: expected a list of token ids"),
    (lambda p: p.add_request([1, 2], 2, eos_ids=[1.5]), "eos_ids: expected a list of token ids"),
    (lambda p: p.add_request([1, 2], 2, cache_salt=""), "cache_salt: expected a non-empty str or bytes"),
])
def test_add_request_refuses_bad_input_by_name_and_queues_nothing(model, call, message):
    paged = PagedGenerator(model, max_cache_bytes=budget(model, 8))
    with pytest.raises(ValueError, match=message):
        call(paged)
    assert not paged.has_unfinished


def test_a_thousand_sampled_requests_run_without_an_exception(engines, graph):
    """The sampling crash at the default top_p (F2) across the engine: 1,000 requests of random
    prompts, temperatures and top_k / top_p (the default top_p among them) on a small cache, each
    drawing its first token in a prefill step beside others of other settings, half of them a second
    one in a decode step: about 1,500 draws in 390 steps (1..4 tokens each: 2,500 in 670 steps)."""
    paged = small_paged(engines)
    rng = np.random.default_rng(5)
    for i in range(1000):
        paged.add_request(rng.integers(0, CONFIG.vocab_size, int(rng.integers(1, 30))).tolist(),
                          int(rng.integers(1, 3)), temperature=float(rng.choice([0.0, 0.7, 1.0, 1.3])),
                          top_k=int(rng.choice([0, 0, 5])), top_p=float(rng.choice([1.0, 1.0, 0.9])), seed=i)
    tokens, errors = drain(paged, limit=10_000)
    assert not errors and len(tokens) == 1000
    assert_pool_at_rest(paged)
