"""The paged engine driven by a machine: a hypothesis rule-based state machine adds requests
(shared prefixes, a shared BOS token, lengths at block edges, cache salts, greedy and sampled),
steps, aborts, poisons a request's row (NaN logits, or a sampler that raises), makes the next
model call fail, and swaps the model's weights, on the tiny model with budgets down to one sequence, with
whole-prompt prefill steps or chunked prefill (``max_num_batched_tokens`` of 2, 5 or 16: prompts
split over steps, mixed steps, decode tokens filling the budget). After every rule it checks what
must always hold:

- every block is free, cached or held, never two of them, never block 0; a block's reference count
  equals the sequences holding it; the blocks a sequence will write into are its own and
  unregistered (so a shared block is never written);
- the reservations are what each running request can still grow by, and fit in the pool;
- a request is waiting, running or ended, as the calls said; a running request's cache holds its
  prompt and every token it yielded but the last, which is pending (mid-prompt: the start of its
  prompt, no token yielded);
- no two running requests compute the same prompt block (one waits for the other's);
- a step taken with requests waiting and none running admits one (no livelock); each step's
  record is what its mode schedules: whole prompts or decode tokens, or (chunked prefill) a decode
  token of every request past its prompt and at most the budget, a prompt moving whenever the
  decode tokens leave room and one is unfinished;
- every finished greedy request's tokens equal the contiguous ``Generator``'s on its prompt alone,
  under the weights it ran with.

``make test`` runs a bounded, derandomized number of examples; ``make fuzz`` runs many random
ones (``RFA_FUZZ_EXAMPLES``). A counter-example hypothesis shrinks becomes a plain regression test
in test_serving.py.
"""
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

import mindspore as ms
import test_llama
from test_llama import CONFIG

from models.llama.engine import Generator, PagedGenerator, SamplingError
from models.llama.engine.block_pool import SCRATCH_BLOCK, blocks_for, prefix_keys
from models.llama.engine.kv_cache import STEP_TOKENS, block_bytes
from models.llama.model import DTYPES
from models.llama.weights import load_checkpoint

checkpoint = test_llama.checkpoint  # the tiny checkpoint fixture; graph comes from conftest.py
BS = 16
FUZZ_EXAMPLES = int(os.environ.get("RFA_FUZZ_EXAMPLES", "0"))  # make fuzz: many random examples
BUDGETS = ((3, 2), (6, 4), (12, 3))  # (usable blocks, max_batch): 3 blocks hold one 48-position sequence
# max_num_batched_tokens: whole prompts twice as often; 2 is under every max_batch (decode tokens fill it)
CHUNKS = (None, None, 2, 5, 16)
_tokens = np.random.default_rng(99)
PREFIXES = ([], [CONFIG.bos_token_id], [CONFIG.bos_token_id] + _tokens.integers(3, 256, 15).tolist(),
            [CONFIG.bos_token_id] + _tokens.integers(3, 256, 23).tolist())
TAILS = [_tokens.integers(3, 256, 40).tolist() for _ in range(3)]
TAIL_LENGTHS = (0, 1, 7, 8, 14, 15, 16, 17, 31, 32, 33)
COUNTS = {"steps": 0, "rules": 0, "examples": 0, "finished": 0, "checked": 0, "added": 0, "aborted": 0,
          "failed": 0, "chunked examples": 0, "mixed steps": 0, "split prompts": 0, "full steps": 0,
          "prompt steps in place": 0}


@dataclass
class Shadow:
    """What the machine knows of one request."""
    prompt: list
    max_new: int
    greedy: bool
    version: int  # of the weights when it was added
    eos: tuple = ()
    state: str = "waiting"  # running, finished, aborted, failed
    tokens: list = field(default_factory=list)
    mixed: bool = False  # the weights changed while it was unfinished: no reference
    cached: int | None = None  # prompt tokens it found cached when admitted (its step records say)
    computed: int = 0  # prompt tokens computed for it so far


class EngineMachine(RuleBasedStateMachine):
    resources = None  # set by the test: the model, its two weight sets, the generators, the references

    @initialize(budget=st.sampled_from(range(len(BUDGETS))), chunk=st.sampled_from(CHUNKS))
    def start(self, budget, chunk):
        r = self.resources
        self.paged = r["generators"][budget]
        # every example starts alike (the last one's teardown drained the generator): the first weights and
        # nothing cached, so that a replayed example behaves as it did (hypothesis refuses one that does not),
        # and so that no block another budget wrote is read (the budgets share one cache: budget_generators)
        if r["version"]:
            self._set_weights(0)
        self.paged.reset_prefix_cache()
        self.paged.max_num_batched_tokens = chunk
        self.chunk, self.split = chunk, set()
        COUNTS["chunked examples"] += chunk is not None
        self.poisoned, self.fail_next = {}, False  # poisoned: request id -> 'nan' or 'raises'
        self.shadow: dict[int, Shadow] = {}
        draw, call_prefill, call_decode = self.paged._draw, self.paged.prefill, self.paged.decode

        def broken_sampler(logits):
            raise RuntimeError("a bug of the sampler")

        def poisoning_draw(request, row):  # the real _draw, on a row made NaN or through a sampler that raises
            if self.poisoned.get(request.id) == "raises":
                request.sampling.draw = broken_sampler
            return draw(request, np.full_like(row, np.nan) if self.poisoned.get(request.id) == "nan" else row)

        def failing(call):
            def run(*args):
                if self.fail_next:
                    self.fail_next = False
                    raise RuntimeError("injected: the model call failed")
                return call(*args)
            return run

        self.paged._draw, self.paged.prefill, self.paged.decode = poisoning_draw, failing(call_prefill), \
            failing(call_decode)
        self.restore = lambda: setattr(self.paged, "_draw", draw) or setattr(self.paged, "prefill", call_prefill) \
            or setattr(self.paged, "decode", call_decode)
        COUNTS["examples"] += 1

    # ---- rules ----
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.sampled_from(range(len(TAILS))),
          length=st.sampled_from(TAIL_LENGTHS), max_new=st.integers(1, 12), greedy=st.booleans(),
          salt=st.sampled_from([None, None, "tenant"]), eos=st.booleans())
    def add(self, prefix, tail, length, max_new, greedy, salt, eos):
        prompt = (prefix + TAILS[tail][:length]) or [TAILS[tail][0]]
        eos_ids = (int(TAILS[tail][5]),) if eos else ()  # a token the tiny model does produce at times
        settings = dict(eos_ids=eos_ids, cache_salt=salt)
        if not greedy:
            settings.update(temperature=1.0, top_p=0.9, seed=len(self.shadow))
        need = blocks_for(len(prompt) + max_new - 1, BS)
        waiting = [r.id for r in self.paged.waiting]
        if need > self.paged.pool.usable:
            with pytest.raises(ValueError, match=f"need {need} blocks"):
                self.paged.add_request(prompt, max_new, **settings)
            assert [r.id for r in self.paged.waiting] == waiting
            return
        request = self.paged.add_request(prompt, max_new, **settings)
        self.shadow[request] = Shadow(prompt, max_new, greedy, self.resources["version"], eos_ids)
        COUNTS["added"] += 1

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.sampled_from(range(len(TAILS))),
          length=st.sampled_from(TAIL_LENGTHS), max_new=st.integers(1, 12), greedy=st.booleans())
    def add_another(self, prefix, tail, length, max_new, greedy):  # adds weigh twice as much as a rare rule
        self.add(prefix, tail, length, max_new, greedy, None, False)

    def _step(self):
        before = [r.id for r in self.paged.waiting], [r.id for r in self.paged.running]
        decoding = tuple(r.id for r in self.paged.running if r.seq.length >= len(r.prompt))
        mid_prompt = any(r.seq.length < len(r.prompt) for r in self.paged.running)
        counters = self.paged.prefilled_tokens, self.paged.cached_prompt_tokens
        COUNTS["steps"] += 1
        try:
            tokens = self.paged.step()
        except RuntimeError as exc:
            assert "injected" in str(exc)
            # the step's requests ended (the joining ones of a prefill, every running one of a decode)
            left = {r.id for r in self.paged.waiting} | {r.id for r in self.paged.running}
            assert {r.id for r in self.paged.running} <= set(before[1])
            for request in before[0] + before[1]:
                if request not in left:
                    self.shadow[request].state = "failed"
            return
        if before[0] and not before[1]:
            assert self.paged.last_step == "prefill", "requests waited with nothing running, and none was admitted"
        self._check_record(self.paged.last_record, tokens, decoding, mid_prompt or bool(before[0]), counters)
        for r in self.paged.running:
            if self.shadow[r.id].state == "waiting":
                self.shadow[r.id].state = "running"
        for token in tokens:
            record = self.shadow[token.request]
            assert record.state in ("waiting", "running")
            if token.error is not None:
                assert token.request in self.poisoned and token.token is None and token.finished
                assert isinstance(token.error, SamplingError if self.poisoned[token.request] == "nan" else RuntimeError)
                record.state = "failed"
                continue
            assert token.request not in self.poisoned
            assert 0 <= token.token < CONFIG.vocab_size
            record.tokens.append(token.token)
            record.state = "running"
            if token.finished:
                assert len(record.tokens) == record.max_new or token.token in record.eos
                record.state = "finished"
                self._check_finished(record)

    def _check_record(self, record, tokens, decoding, prompts_left, counters):
        """What the step held, against the scheduling rule of its mode; the prompt token counters
        and each request's cached and computed prompt tokens, against the records."""
        if record is None:
            assert not decoding and not prompts_left and not tokens
            return
        assert self.paged.prefilled_tokens - counters[0] == sum(n for _, n in record.prefill_tokens)
        assert self.paged.cached_prompt_tokens - counters[1] == sum(n for _, n in record.cached_tokens)
        for request, n in record.cached_tokens:
            assert self.shadow[request].cached is None and request in dict(record.prefill_tokens)
            self.shadow[request].cached = n
        for request, n in record.prefill_tokens:
            self.shadow[request].computed += n
        for request in record.first_tokens:
            shadow = self.shadow[request]
            assert shadow.cached + shadow.computed == len(shadow.prompt)
        assert self.paged.last_step == ("decode" if record.kind == "decode" else "prefill")
        in_place = record.kind == "decode" or record.total_tokens <= STEP_TOKENS  # the decode graph, blocks in place
        assert record.graph == ("decode" if in_place else "prefill")
        COUNTS["prompt steps in place"] += in_place and record.kind != "decode"
        assert record.total_tokens == len(record.decode_requests) + sum(n for _, n in record.prefill_tokens) > 0
        assert all(n > 0 for _, n in record.prefill_tokens) and len(self.paged.last_logits) == len(tokens)
        sampled = {t.request for t in tokens if t.error is None}
        assert set(record.first_tokens) == sampled - set(record.decode_requests)
        if self.chunk is None:
            assert record.kind in ("prefill", "decode")
            assert record.decode_requests == (decoding if record.kind == "decode" else ())
            return
        assert record.decode_requests == decoding  # every request past its prompt, every step
        assert record.total_tokens <= self.chunk
        COUNTS["mixed steps"] += record.kind == "mixed"
        COUNTS["full steps"] += record.total_tokens == self.chunk
        for request, n in record.prefill_tokens:
            if request not in record.first_tokens:
                self.split.add(request)
            elif request in self.split:
                COUNTS["split prompts"] += 1
        if len(decoding) < self.chunk and prompts_left and not self.paged.waiting:
            assert record.prefill_tokens, "a prompt was unfinished and the budget had room, yet none moved"

    @rule()
    def step(self):
        self._step()

    @rule()
    def step_again(self):  # steps weigh twice as much as any other rule
        self._step()

    @rule(data=st.data(), now=st.integers(0, 2))
    def abort(self, data, now):
        if now:  # the rules that end requests act one time in three: requests should also finish
            return
        request = data.draw(st.sampled_from(sorted(self.shadow) + [10 ** 6]))
        record = self.shadow.get(request)
        unfinished = record is not None and record.state in ("waiting", "running")
        assert self.paged.abort(request) == unfinished
        if unfinished:
            record.state = "aborted"

    @precondition(lambda self: any(r.state in ("waiting", "running") for r in self.shadow.values()))
    @rule(data=st.data(), now=st.integers(0, 2))
    def poison(self, data, now):
        """The request's next row of logits is NaN, or its sampler raises (any exception drawing a
        row: issue 64's F1): it must end alone, with its error."""
        if now:
            return
        unfinished = sorted(i for i, r in self.shadow.items() if r.state in ("waiting", "running"))
        self.poisoned[data.draw(st.sampled_from(unfinished))] = data.draw(st.sampled_from(["nan", "raises"]))

    @rule(now=st.integers(0, 2))
    def fail_the_next_call(self, now):
        self.fail_next = self.fail_next or not now

    def _set_weights(self, version):
        r = self.resources
        r["version"] = version
        for parameter, value in zip(r["model"].get_parameters(), r["weights"][version]):
            parameter.set_data(ms.Tensor(value))
        for generator in r["generators"]:
            generator.reset_prefix_cache()

    @rule()
    def swap_weights(self):
        """New weights, then ``reset_prefix_cache``: nothing the old weights computed is reused."""
        self._set_weights(1 - self.resources["version"])
        for record in self.shadow.values():
            if record.state in ("waiting", "running"):
                record.mixed = True

    # ---- what must always hold ----
    @invariant()
    def pool_is_consistent(self):
        COUNTS["rules"] += 1
        paged, pool = self.paged, self.paged.pool
        assert not pool.pending_releases()
        holders = np.zeros(pool.num_blocks, np.int64)
        for request in paged.running:
            for block in request.seq.blocks:
                holders[block] += 1
        assert (pool.refs == holders).all()
        assert pool.refs[SCRATCH_BLOCK] == 0
        free, cached = set(pool.free), set(pool.cached_blocks)
        held = set(np.flatnonzero(holders).tolist())
        assert len(free) == len(pool.free) and not (free & cached) and not (free & held) and not (cached & held)
        assert free | cached | held == set(range(1, pool.num_blocks))
        assert all(pool.registered(b) for b in cached)
        # a shared block is one every holder has filled (a reset may have unregistered it since): the
        # blocks a sequence will still write are its own and unregistered
        for request in paged.running:
            seq = request.seq
            for block in seq.blocks[seq.length // BS:]:
                assert pool.refs[block] == 1 and not pool.registered(block)
            total = blocks_for(len(request.prompt) + request.max_new_tokens - 1, BS)
            assert request.reserved == total - len(seq.blocks) >= 0
        assert paged.reserved == sum(r.reserved for r in paged.running) <= pool.available

    @invariant()
    def requests_are_where_the_calls_said(self):
        waiting = [r.id for r in self.paged.waiting]
        running = sorted(r.id for r in self.paged.running)
        assert waiting == [i for i, r in sorted(self.shadow.items()) if r.state == "waiting"]
        assert running == [i for i, r in sorted(self.shadow.items()) if r.state == "running"]
        assert len(running) <= self.paged.max_batch
        for request in self.paged.running:
            record = self.shadow[request.id]
            if not record.tokens:  # mid-prompt (chunked prefill): the start of its prompt computed
                assert self.chunk is not None and 0 < request.seq.length < len(record.prompt)
                assert request.seq.tokens == record.prompt[:request.seq.length]
                continue
            assert request.seq.tokens == record.prompt + record.tokens[:-1]
            assert request.pending == record.tokens[-1]

    @invariant()
    def no_two_requests_compute_one_block(self):
        """The prompt blocks mid-prompt requests have still to compute, by chain digest: a request
        whose next block another is computing waits, so they never meet (requests from before a
        reset aside: they register nothing, and the newer ones compute their own)."""
        pool, seen = self.paged.pool, set()
        for request in self.paged.running:
            if request.seq.length < len(request.prompt) and request.seq.epoch == pool.epoch and pool.prefix_caching:
                keys = set(prefix_keys(request.prompt, BS, request.root)[request.seq.length // BS:])
                assert not keys & seen
                seen |= keys

    def _check_finished(self, record):
        COUNTS["finished"] += 1
        if not record.greedy or record.mixed:
            return
        COUNTS["checked"] += 1
        assert record.tokens == self.resources["reference"](record.prompt, record.max_new, record.eos)

    def teardown(self):
        """Runs what is left to its end, then leaves the generator empty. Bounded: each step
        computes a prompt token or samples a token of an unfinished request, so more steps than
        their prompt tokens and new tokens is a livelock."""
        try:
            bound = sum(len(r.prompt) + r.max_new for r in self.shadow.values() if r.state in ("waiting", "running"))
            for _ in range(bound):
                if not self.paged.has_unfinished:
                    break
                self.fail_next = False
                self._step()
            assert not self.paged.has_unfinished, f"requests left unfinished after {bound} steps"
            assert (self.paged.pool.refs == 0).all() and self.paged.reserved == 0
            for record in self.shadow.values():
                COUNTS[record.state] = COUNTS.get(record.state, 0) + (record.state in ("aborted", "failed"))
        finally:
            for request in list(self.paged.waiting) + list(self.paged.running):
                self.paged.abort(request.id)
            self.restore()


def budget_generators(model) -> list[PagedGenerator]:
    """A generator per budget (its own block pool and scheduler: all that decides admission, queueing
    and eviction), all on the largest budget's cache and graphs, so that each graph compiles once for
    every budget. A smaller pool hands out only blocks that cache holds; an example drives one
    generator and its teardown empties it, and the next one's ``start`` resets the prefix cache: no
    block another budget wrote is read."""
    per_block = block_bytes(model.cache_config, BS, DTYPES["float32"])
    generators = [PagedGenerator(model, max_cache_bytes=(usable + 1) * per_block, max_batch=batch)
                  for usable, batch in BUDGETS]
    largest = max(generators, key=lambda generator: generator.num_blocks)
    for generator in generators:
        generator.cache, generator.prefill, generator.decode = largest.cache, largest.prefill, largest.decode
        generator.graphs = largest.graphs
    return generators


@pytest.mark.starts_first
def test_the_engine_holds_its_invariants_under_random_use(checkpoint, graph):
    model = load_checkpoint(checkpoint[1], progress=False)
    weights = [[p.asnumpy() for p in model.get_parameters()]]
    weights.append([w[::-1].copy() if w.ndim == 2 else w for w in weights[0]])  # each matrix's rows reversed
    generators = budget_generators(model)
    contiguous = Generator(model, slots=1)
    references = {}
    resources = dict(model=model, weights=weights, generators=generators, version=0)

    def reference(prompt, max_new, eos):
        key = (resources["version"], tuple(prompt), max_new, eos)
        if key not in references:
            references[key] = [t.token for t in contiguous.stream([prompt], max_new, eos_ids=eos)]
        return references[key]

    resources["reference"] = reference
    EngineMachine.resources = resources
    fuzz = FUZZ_EXAMPLES > 0
    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=FUZZ_EXAMPLES if fuzz else 60, stateful_step_count=60 if fuzz else 50,
        derandomize=not fuzz, database=None, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    compiled = generators[0].compile_log  # the budgets share the graphs: each compiled once for all of them
    assert len(set(compiled)) == len(compiled)
    print(f"\nengine state machine: {COUNTS['examples']} examples, {COUNTS['rules']} rules, "
          f"{COUNTS['steps']} engine steps, {COUNTS['finished']} requests finished, "
          f"{COUNTS['checked']} greedy ones checked against the contiguous generator; {COUNTS['added']} added, "
          f"{COUNTS['aborted']} aborted, {COUNTS['failed']} ended by a failure; chunked prefill: "
          f"{COUNTS['chunked examples']} examples, {COUNTS['mixed steps']} mixed steps, {COUNTS['split prompts']} "
          f"prompts prefilled over several steps, {COUNTS['full steps']} steps holding the whole budget; "
          f"{COUNTS['prompt steps in place']} steps with prompt tokens in place; graphs compiled for every budget "
          f"together: {compiled}")
    assert COUNTS["checked"] > 0 and COUNTS["steps"] > 0
    assert COUNTS["mixed steps"] > 0 and COUNTS["split prompts"] > 0 and COUNTS["full steps"] > 0
    assert COUNTS["prompt steps in place"] > 0
