"""Generation on the in-place KV cache (models/llama/engine/kv_cache.py, contiguous.py) on the tiny random
checkpoint of test_llama: logits of prefill / decode steps / chunks against one full forward, cache
rows against a one-shot prefill, compiled graphs that do not grow with steps, continuous batching,
streaming, and bad input refused before anything is written. Logit tolerance as in test_llama."""
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from ms_rope_attention.cpu_kernel import decode_calls

from models.llama.engine import Generator, Token
from models.llama.engine.kv_cache import BUCKET, bucket_capacity, token_bucket
from models.llama.weights import load_checkpoint
import test_llama
from test_llama import ATOL, eager_logits, ids_of

checkpoint = test_llama.checkpoint  # the tiny checkpoint fixture; graph comes from conftest.py
# One worker runs this file, in order: MindSpore 2.10 compiles a jit Cell's dynamic-shape graph once
# more, at its first new input shape, for instances after the first of the same construct in a
# process (a minimal Cell with set_inputs does it too), so the compile counts below depend on what
# ran before them in the process (see docs/llama.md).
pytestmark = pytest.mark.xdist_group("generation")


@pytest.fixture(scope="module")
def shared_generators():
    """What ``generators`` shares: a generator per execution mode and slot count."""
    return {}


@pytest.fixture
def generators(shared_generators, checkpoint):
    """``generators(slots)``: a generator of the default model shared by the tests whose property
    needs no fresh compile (each compiles its graphs once for the module, not once a test). In
    GRAPH_MODE each call resets it to a fresh generator's cache, every row zero (asserted); in
    PyNative its rows stay as the last test left them (``fill`` says why), which changes no token.
    A test must leave every slot free (checked, and freed, after it)."""
    used = []

    def generator(slots: int) -> Generator:
        key = (ms.get_context("mode"), slots)
        if key not in shared_generators:
            shared_generators[key] = Generator(load_checkpoint(checkpoint[1], progress=False), slots=slots)
            shared_generators[key].reserve(1)
        gen = shared_generators[key]
        if key[0] == ms.GRAPH_MODE:
            fill(gen, 0.0)
            assert not any(tensor.asnumpy().any() for tensor in (*gen.cache.keys, *gen.cache.values))
        used.append(gen)
        return gen
    yield generator
    taken = [slot for gen in used for slot in range(gen.slots_count) if gen.slots.busy[slot]]
    for gen in used:
        for slot in range(gen.slots_count):
            gen.slots.release(slot)
    assert not taken, f"the test left slots {taken} taken"


def fill(gen, value):
    """Every cache row of ``gen`` set to ``value``. In PyNative only before its graphs compile: rows
    set after that gave continuous batching other tokens than a fresh generator's."""
    assert ms.get_context("mode") == ms.GRAPH_MODE or gen.compiles == 0, gen.compile_log
    for tensor in (*gen.cache.keys, *gen.cache.values):
        tensor.set_data(Tensor(np.full(tensor.shape, value, np.float32)))


def test_this_file_runs_in_one_worker(request):
    """The group above holds: under pytest-xdist's loadgroup a grouped test's id carries its group
    (pytest 9.2 dropped it silently, so the file's tests spread over the workers)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        assert request.node.nodeid.endswith("@generation"), request.node.nodeid


@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_prefill_steps_and_a_chunk_equal_one_full_forward(checkpoint, backend, mode, rng):
    """A prefill, one-token steps, then a 7-token chunk (a speculative block, padded to 8 tokens),
    all through the cache of slot 1 of 3: the logits of one full forward over the same tokens. Three
    graphs: the prefill and the decode graphs of 1 and of 8 tokens. The full forward runs in PyNative,
    in either mode: a reference that compiles nothing. The unfused backend on the first layer only:
    its attention compiles in seconds a layer and graph, and every layer runs the same code (that
    each keeps its own cache rows, the fused model's two layers show)."""
    _, path = checkpoint
    model = load_checkpoint(path, backend=backend, progress=False, num_layers=1 if backend == "unfused" else None)
    (ids,) = ids_of(rng, 30)
    full = eager_logits(model, ids)
    gen = Generator(model, slots=3)
    with gen.open(ids[:3], max_positions=len(ids)) as other, gen.open(ids[:19]) as sequence:  # slots 0 and 1
        got = [sequence.logits[None]] + [sequence.append([ids[pos]]) for pos in range(19, 23)]
        got += [sequence.append(ids[23:29]), sequence.append([ids[29]])]
        assert sequence.length == 30 and other.length == 3
    assert sequence.closed and gen.slots.free() == [0, 1, 2]
    assert np.abs(np.concatenate(got) - full[18:]).max() <= ATOL
    assert gen.compiles == 3


def test_padded_steps_touch_only_their_rows_and_the_scratch_row(checkpoint, generators, mode, rng):
    """Three sequences decode in steps padded to 4 tokens: with NaN in every cache row no sequence
    has written (the scratch rows included), each gets the tokens it gets alone, and afterwards every
    row past a sequence's length is still NaN but the scratch row the padding wrote."""
    _, path = checkpoint
    prompts = ids_of(rng, 7, 3, 12)
    alone = generators(1)
    expected = [alone.generate([p], 4, eos_ids=()).tokens[0] for p in prompts]
    gen = generators(3)
    fill(gen, np.nan)
    assert gen.generate(prompts, 4, eos_ids=()).tokens == expected
    rows = gen.cache.keys[0].asnumpy()
    capacity = gen.cache.capacity
    for slot, prompt in enumerate(prompts):
        used = len(prompt) + 3  # the prompt and every sampled token but the last
        assert np.isfinite(rows[slot * capacity:slot * capacity + used]).all()
        assert np.isnan(rows[slot * capacity + used:(slot + 1) * capacity]).all()
    scratch = rows[gen.cache.scratch_start:]
    assert gen.cache.scratch == 31 and np.isfinite(scratch[-1]).all() and np.isnan(scratch[:-1]).all()
    assert [token_bucket(n) for n in (1, 2, 3, 4, 5, 9, 128)] == [1, 2, 4, 4, 8, 16, 128]
    assert [gen.cache.padded_tokens(n) for n in (3, 33, 49, 65)] == [4, 64, 64, 65]
    # Eight slots of 19 rows: the scratch rows are capped at a slot's (no sequence of the call may be
    # longer than the cos/sin table): a step of 9 tokens is padded to 16, one of 33 not to 64.
    short = Generator(load_checkpoint(path, progress=False, max_positions=19), slots=8, capacity=19)
    prompts = ids_of(rng, *range(2, 17, 2))
    expected = [alone.generate([p], 3, eos_ids=()).tokens[0] for p in prompts]
    assert short.generate(prompts, 3, eos_ids=()).tokens == expected
    assert short.cache.scratch == 19 and [short.cache.padded_tokens(n) for n in (5, 9, 33)] == [8, 16, 33]


def test_cache_rows_equal_the_rotated_keys_of_a_full_prefill(generators, graph):
    """Rows written one decode step at a time (keys rotated by the step) equal the rows one prefill
    of the same tokens writes (keys rotated inside the fused op), in every layer; one generator,
    its rows reset to zero between the two."""
    prompt = ids_of(np.random.default_rng(3), 9)[0]
    gen = generators(2)
    tokens = gen.generate([prompt], 8, eos_ids=()).tokens[0]
    sequence = prompt + tokens[:-1]  # the last token is sampled, never cached
    n = len(sequence)
    stepped = [rows.asnumpy()[:n] for rows in (*gen.cache.keys, *gen.cache.values)]
    gen = generators(2)
    gen.prefill_logits([sequence])
    for a, b in zip(stepped, (*gen.cache.keys, *gen.cache.values)):
        b = b.asnumpy()[:n]
        assert np.abs(a - b).max() <= 1e-5 and np.abs(a).max() > 0.1


def test_decode_steps_run_the_kernels_decode_path(generators, mode, rng):
    """Each decode step of the fused model calls the kernel's decode path once per layer (the
    prefill does not): the step's one token per sequence against the cache takes that path."""
    gen = generators(2)
    gen.warm_up(ids_of(rng, 5, 9))
    before = decode_calls()
    steps = 4
    gen.generate(ids_of(rng, 5, 9), steps + 1, eos_ids=())  # its warm-up is done: a prefill, then the steps
    assert decode_calls() - before == steps * gen.model.config.num_hidden_layers


def test_graphs_compile_once_per_capacity_bucket(checkpoint, mode, rng):
    """Prompts of any length and any number of steps reuse the two graphs; a prompt past the bucket
    grows the cache to the next one (two more graphs), and a smaller request after it does not."""
    _, path = checkpoint
    model = load_checkpoint(path, progress=False, max_positions=2048)
    gen = Generator(model, slots=2)
    # Two prompt lengths first: MindSpore 2.10 may compile a dynamic-shape jit Cell once more at its
    # first new input shape (docs/llama.md); one of four CI runs counted an extra compilation,
    # so the counts below start after it. A failure prints the compile log (capacity, graph, token count).
    for n in (3, 9):
        gen.generate(ids_of(rng, n), 2, eos_ids=())
    first = gen.compiles
    assert gen.capacity == BUCKET and first >= 2, gen.compile_log
    for n, steps in ((17, 9), (40, 30)):
        gen.generate(ids_of(rng, n), steps, eos_ids=())
        assert (gen.capacity, gen.compiles) == (BUCKET, first), (n, steps, gen.compile_log)
    for n in (BUCKET + 5, BUCKET + 9):
        gen.generate(ids_of(rng, n), 3, eos_ids=())
    grown = gen.compiles
    assert gen.capacity == 2 * BUCKET and grown >= first + 2, gen.compile_log
    gen.generate(ids_of(rng, 4), 3, eos_ids=())
    assert (gen.capacity, gen.compiles) == (2 * BUCKET, grown), gen.compile_log
    assert [bucket_capacity(n, 2048) for n in (1, 512, 513, 1500, 5000)] == [512, 512, 1024, 2048, 2048]


def test_continuous_batching_gives_each_prompt_its_own_tokens(generators, mode, rng):
    """Five prompts of different lengths and budgets through 2 slots: prompts join as others finish
    (one at EOS), and every prompt gets exactly the tokens it gets alone; the tokens are the argmax
    of a full forward (in PyNative: no graph per length) over prompt + tokens."""
    prompts = ids_of(rng, 5, 12, 1, 30, 8)
    budgets = [6, 2, 9, 4, 5]
    alone = generators(1)
    expected = [alone.generate([p], n, eos_ids=()).tokens[0] for p, n in zip(prompts, budgets)]
    eos = expected[2][3]  # prompt 2 stops at its 4th token (if that token does not come earlier)
    stop = expected[2].index(eos) + 1
    batch = generators(2)
    events = list(batch.stream(prompts, budgets, eos_ids=(eos,)))
    got = [[e.token for e in events if e.request == i] for i in range(len(prompts))]
    want = [t[:t.index(eos) + 1] if eos in t else t for t in expected]
    assert got == want and len(got[2]) == stop
    first_finish = next(i for i, e in enumerate(events) if e.finished)
    assert next(i for i, e in enumerate(events) if e.request == 2) > first_finish  # joined a freed slot
    assert sum(e.finished for e in events) == len(prompts) and all(isinstance(e, Token) for e in events)
    assert batch.slots.free() == [0, 1]  # every slot released
    for prompt, tokens in zip(prompts, want):
        assert tokens == eager_logits(batch.model, prompt + tokens[:-1]).argmax(-1)[len(prompt) - 1:].tolist()


def test_generation_leaves_the_parameter_names_alone(checkpoint, generators, graph, rng):
    """The generator's graphs hold the model without renaming its parameters: a model saved after
    generating still writes (and loads) Hugging Face names, a freshly loaded model's."""
    gen = generators(1)
    gen.generate(ids_of(rng, 5), 2, eos_ids=())
    names = list(load_checkpoint(checkpoint[1], progress=False).parameters_dict())
    assert list(gen.model.parameters_dict()) == names and names[0] == "model.embed_tokens.weight"


def test_stream_yields_tokens_as_they_come(generators, graph, rng):
    gen = generators(2)
    prompts = ids_of(rng, 4, 9)
    stream = gen.stream(prompts, 3, eos_ids=())
    first = [next(stream), next(stream)]  # the prefill's first token of each prompt, before any decode step
    assert [e.request for e in first] == [0, 1] and not any(e.finished for e in first)
    rest = list(stream)
    assert len(rest) == 4 and [e.finished for e in rest][-2:] == [True, True]


def test_an_abandoned_stream_leaves_nothing_behind(generators, graph, rng):
    gen = generators(2)
    prompts = ids_of(rng, 6, 11)
    expected = gen.generate(prompts, 5, eos_ids=()).tokens
    stream = gen.stream(ids_of(rng, 20, 3), 8, eos_ids=())
    next(stream), next(stream), next(stream)
    stream.close()
    assert gen.slots.free() == [0, 1]
    assert gen.generate(prompts, 5, eos_ids=()).tokens == expected


def test_stops_at_eos(generators, graph, rng):
    gen = generators(1)
    prompt = ids_of(rng, 6)
    free = gen.generate(prompt, 5, eos_ids=()).tokens[0]
    stopped = gen.generate(prompt, 5, eos_ids=(free[1],)).tokens[0]
    assert stopped == free[:free.index(free[1]) + 1]


def test_float16_cache_of_a_float32_model(checkpoint, graph, rng):
    """A float16 cache (half the bytes a step reads) keeps the logits within float16 rounding of the
    keys and values: 1e-2 on O(1) logits."""
    _, path = checkpoint
    model = load_checkpoint(path, progress=False)
    (ids,) = ids_of(rng, 25)
    full = eager_logits(model, ids)
    gen = Generator(model, slots=1, cache_dtype="float16")
    with gen.open(ids[:20], max_positions=len(ids)) as sequence:
        got = [sequence.logits[None]] + [sequence.append([t]) for t in ids[20:]]
    error = np.abs(np.concatenate(got) - full[19:]).max()
    assert 0 < error <= 1e-2
    assert gen.cache.dtype == gen.cache.keys[1].dtype and str(gen.cache.dtype) == "Float16"


@pytest.mark.parametrize("call, message", [
    (lambda g: g.generate([], 3), r"prompts: expected a non-empty list"),
    (lambda g: g.generate([[1, 2], []], 3), r"prompts\[1\]: empty"),
    (lambda g: g.generate([[1, 999]], 3), r"prompts\[0\]: expected token ids in \[0, 256\)"),
    (lambda g: g.generate([[1, 2]], 0), r"max_new_tokens: expected a positive int"),
    (lambda g: g.generate([[1, 2]], [3, 4]), r"max_new_tokens: expected a positive int or one per prompt"),
    (lambda g: g.generate([[1] * 500], 20), r"max_new_tokens: prompts\[0\] \(500 tokens\) \+ 20 new tokens need "
                                            r"519 cached positions, beyond the model's cos/sin cache of 512 "),
    (lambda g: g.generate([[1, 2]], 3, temperature=-1.0), r"temperature: expected a finite number >= 0"),
    (lambda g: g.prefill_logits([[1]] * 3), r"prompts: 3 prompts in one prefill, the generator has 2 slots"),
])
def test_bad_input_is_refused_before_anything_is_written(checkpoint, graph, call, message):
    _, path = checkpoint
    gen = Generator(load_checkpoint(path, progress=False), slots=2)
    with pytest.raises(ValueError, match=message):
        call(gen)
    assert gen.cache is None or not any(k.asnumpy().any() for k in gen.cache.keys)
    assert gen.slots.free() == [0, 1]


def test_a_bfloat16_cache_is_refused_before_mindspore_fails_on_it(checkpoint):
    model = load_checkpoint(checkpoint[1], progress=False)
    with pytest.raises(ValueError, match="cache_dtype: a bfloat16 KV cache cannot be a graph's Parameter"):
        Generator(model, cache_dtype="bfloat16")


def test_a_fixed_capacity_too_small_is_refused(checkpoint, graph):
    _, path = checkpoint
    model = load_checkpoint(path, progress=False)
    gen = Generator(model, slots=1, capacity=16)
    with pytest.raises(ValueError, match=r"capacity: a prompt and its new tokens need 20 cache positions, the "
                                         r"generator's capacity is 16"):
        gen.generate([[1] * 15], 6)
    with pytest.raises(ValueError, match=r"capacity: expected an int in \[1, 512\]"):
        Generator(model, capacity=1000)
    with pytest.raises(ValueError, match=r"slots: expected a positive int, got 0"):
        Generator(model, slots=0)


def test_open_sequences_keep_their_slots_and_refuse_what_would_break_them(checkpoint, graph, rng):
    """A stream and a prefill beside an open sequence use the other slot and leave the sequence's
    cache as it was (its next logits equal a fresh one's); growing the cache, a third sequence, too
    many tokens and a closed sequence are refused naming the argument."""
    model = load_checkpoint(checkpoint[1], max_positions=2048, progress=False)
    gen = Generator(model, slots=2)
    prompt, more = ids_of(rng, 9, 4)
    with gen.open(prompt) as sequence:
        assert gen.capacity == 512 and sequence.length == 9
        gen.generate([[5, 6, 7]], 3, eos_ids=())
        gen.prefill_logits([[8, 9]])
        kept = sequence.append(more)
        with pytest.raises(ValueError, match=r"capacity: 600 positions need a larger cache than the 512 of the 1 "
                                             r"open sequence\(s\)"):
            gen.open([1], max_positions=600)
        with gen.open([1, 2]):
            with pytest.raises(ValueError, match=r"open: all 2 slots hold open sequences"):
                gen.open([3])
            with pytest.raises(ValueError, match=r"prompts: 1 prompts in one prefill, 0 slots are free"):
                gen.prefill_logits([[1]])
        with pytest.raises(ValueError, match=r"tokens: expected 1..16 token ids"):
            sequence.append(list(range(17)))
        with pytest.raises(ValueError, match=r"tokens: expected token ids in \[0, 256\)"):
            sequence.append([256])
    with gen.open(prompt) as fresh:
        assert np.array_equal(fresh.append(more), kept)
    with pytest.raises(ValueError, match="append: the sequence is closed"):
        sequence.append([1])
    assert gen.slots.free() == [0, 1]


def test_a_cache_over_the_memory_limit_is_refused_before_it_is_allocated(monkeypatch):
    """8 slots of 2^20 positions of the tiny model: 4.00 GiB, over a default limit of 80% of 2 GiB."""
    from models.llama import LlamaForCausalLM, preset
    from models.llama.engine import common

    monkeypatch.setattr(common, "available_memory", lambda: 2 * common.GIB)
    gen = Generator(LlamaForCausalLM(preset("tiny"), max_positions=2 ** 20))
    message = (r"slots=8 x capacity=1048576 positions \(600000 needed\) would take 4.00 GiB, over the limit "
               r"of 1.60 GiB")
    with pytest.raises(ValueError, match=message):
        gen.generate([[1]], 600_000)
    assert gen.cache is None and gen.capacity == 0


def test_a_cache_growth_over_the_limit_keeps_the_cache_it_has(checkpoint, graph):
    """cache_memory_limit between the bytes of the 512- and the 1024-position bucket of one slot."""
    model = load_checkpoint(checkpoint[1], max_positions=2048, progress=False)
    gen = Generator(model, slots=1, cache_memory_limit=400_000)  # 265,728 and 527,872 bytes
    tokens = gen.generate([[1, 2, 3]], 4, eos_ids=()).tokens
    with pytest.raises(ValueError, match=r"slots=1 x capacity=1024 positions \(600 needed\) would take 0.00 GiB"):
        gen.generate([[1]], 600)
    assert gen.capacity == 512 and gen.generate([[1, 2, 3]], 4, eos_ids=()).tokens == tokens
    with pytest.raises(ValueError, match="cache_memory_limit: expected a positive int of bytes, got 0"):
        Generator(model, cache_memory_limit=0)


def test_cli_sizes_the_slots_to_the_prompts_and_takes_a_memory_limit():
    from models.llama.engine.cli import main

    with pytest.raises(ValueError, match=r"slots=1 x capacity=512 positions .* over the limit of 0.00 GiB"):
        main(["--model", "tiny", "--ids", "1,2", "--max-new-tokens", "2", "--cache-memory-limit", "1e-6"])
