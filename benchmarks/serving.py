"""Serving on the paged KV cache (models/llama/engine/paged.py) against the contiguous cache it replaces
and transformers, on one seeded random checkpoint (``peers.write_checkpoint``: Llama2-7B dimensions,
``--layers`` layers, float32), each point in a fresh process, greedy tokens compared across systems.

Three parts, each selectable with ``--parts``:

- ``steps``: the decode step of one sequence at each ``--contexts`` cached tokens, the contiguous
  ``Generator`` against the ``PagedGenerator`` (blocks of 16), ``--rounds`` rounds, the order turning
  every round; median and min step over ``--new-tokens`` tokens.
- ``prefix``: the TTFT of a request whose 1024-token system prompt (+ a 64-token user turn) another
  request left in the cache, against the same request with nothing cached (a fresh system prompt
  each round, so nothing is cached by accident); the tokens of both must equal the same request
  computed with prefix caching off.
- ``trace``: a seeded request trace replayed in real time: ``--requests`` arrivals (Poisson,
  ``--rate`` per second), prompt lengths log-uniform over 64..4096 (``--max-prompt``), 32..256 new
  tokens (``--new-tokens-range``), half of the requests opening with one common 1024-token system
  prompt (``--system-prompt``). Systems: the contiguous generator (its
  API takes a list of prompts: the requests that arrived run as one ``stream`` each time it is
  free), the paged one without and with prefix caching (``add_request`` as they arrive, ``step``),
  and transformers with a StaticCache (batches of what arrived, left padded). Every system gets the
  same KV cache budget (``--budget-gib``): the contiguous generator as slots of the capacity
  bucket its longest request needs, the paged one as blocks. Reported: TTFT and time per output
  token p50/p99, output tokens per second over the whole replay, the most sequences in flight.

    python benchmarks/serving.py                       # every part, the default trace
    python benchmarks/serving.py --parts steps prefix  # the two short parts

Greedy tokens that differ between systems end the run with an error (after the results are written).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time

import numpy as np

from harness import machine_info, run_isolated, save, turned
from peers import hf_generate, hf_stamps

SCHEMA_VERSION = 1
USER_TURN = 64
GIB = 2 ** 30


def _model(checkpoint: str, max_positions: int):
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    from models.llama.weights import load_checkpoint

    return load_checkpoint(checkpoint, max_positions=max_positions, progress=False)


def _ids(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, n).tolist()


# ---------------------------------------------------------------------------------------------
# Points (child processes).

def step_point(system: str, checkpoint: str, context: int, new_tokens: int, seed: int) -> dict:
    """One prompt of ``context`` tokens, then ``new_tokens`` decode steps."""
    from models.llama.engine import Generator
    from models.llama.engine import PagedGenerator

    lm = _model(checkpoint, context + new_tokens)
    prompt = _ids(np.random.default_rng(seed + context), context, lm.vocab_size)
    if system == "contiguous":
        gen = Generator(lm, slots=1, capacity=context + new_tokens)
    else:
        budget = (context + new_tokens + 64) * 2 * lm.config.num_hidden_layers * lm.config.num_key_value_heads \
            * lm.config.dim_per_head * lm.cache_dtype.itemsize
        gen = PagedGenerator(lm, max_cache_bytes=budget, max_batch=1, prefix_caching=False)
    gen.warm_up([prompt[:16]])
    result = gen.generate([prompt], new_tokens, eos_ids=())
    return {"step_ms": [s for _, s in result.step_ms], "ttft_s": result.ttft_s, "tokens": result.tokens[0]}


def prefix_point(checkpoint: str, rounds: int, new_tokens: int, seed: int, system_prompt: int = 1024) -> dict:
    """Per round: a fresh system prompt; request A (system + user turn A) with nothing cached, then
    request B (system + user turn B) finding the system prompt in the cache; B's tokens against B
    computed by a generator without prefix caching."""
    from models.llama.engine import PagedGenerator

    lm = _model(checkpoint, system_prompt + USER_TURN + new_tokens)
    rng = np.random.default_rng(seed)
    kwargs = dict(max_cache_bytes=None, max_batch=2)
    cached, cold = PagedGenerator(lm, **kwargs), PagedGenerator(lm, prefix_caching=False, **kwargs)
    warm_up = [_ids(rng, system_prompt + USER_TURN, lm.vocab_size)]
    cached.warm_up(warm_up), cold.warm_up(warm_up)
    rows = []
    for _ in range(rounds):
        system = _ids(rng, system_prompt, lm.vocab_size)
        a, b = (system + _ids(rng, USER_TURN, lm.vocab_size) for _ in range(2))
        ttft = {}
        for name, gen, prompt in (("nothing cached", cached, a), ("system prompt cached", cached, b),
                                  ("prefix caching off", cold, b)):
            before = gen.cached_prompt_tokens
            start = time.perf_counter()
            tokens = []
            for event in gen.stream([prompt], new_tokens, eos_ids=()):
                if not tokens:
                    ttft[name] = time.perf_counter() - start
                tokens.append(event.token)
            ttft[name + " tokens"] = tokens
            ttft[name + " cached"] = gen.cached_prompt_tokens - before
        rows.append(ttft)
    return {"rounds": rows}


def _trace(shape: dict, vocab: int) -> list[dict]:
    """The seeded requests of a trace ``shape`` (requests, rate, seed, max_prompt, system_prompt,
    new_tokens = [lo, hi])."""
    rng = np.random.default_rng(shape["seed"])
    system = _ids(rng, shape["system_prompt"], vocab)
    arrivals = np.cumsum(rng.exponential(1 / shape["rate"], shape["requests"]))
    low, high = shape["new_tokens"]
    trace = []
    for arrival in arrivals:
        length = int(round(np.exp(rng.uniform(np.log(min(64, shape["max_prompt"])), np.log(shape["max_prompt"])))))
        shared = bool(rng.random() < 0.5) and length > len(system)
        prompt = (system + _ids(rng, length - len(system), vocab)) if shared else _ids(rng, length, vocab)
        trace.append({"arrival_s": float(arrival), "prompt": prompt, "new_tokens": int(rng.integers(low, high + 1)),
                      "shared_system_prompt": shared})
    return trace


def _positions(shape: dict) -> int:
    return shape["max_prompt"] + shape["new_tokens"][1]


def trace_point(system: str, checkpoint: str, shape: dict, budget_gib: float) -> dict:
    """The trace replayed against ``system``; per request its arrival, token times and tokens."""
    if system == "hf-static":
        return _hf_trace(checkpoint, shape)
    from models.llama.engine import Generator
    from models.llama.engine.kv_cache import bucket_capacity, cache_bytes
    from models.llama.engine import PagedGenerator

    lm = _model(checkpoint, _positions(shape))
    trace = _trace(shape, lm.vocab_size)
    budget = int(budget_gib * GIB)
    longest = max(len(r["prompt"]) + r["new_tokens"] for r in trace)
    if system == "contiguous":
        capacity = bucket_capacity(longest, lm.max_positions)  # every slot holds the longest request
        fits = [s for s in range(1, 65) if cache_bytes(lm.cache_config, s, capacity, lm.cache_dtype) <= budget]
        slots = max(fits, default=1)  # one slot even over the budget: the system must run at all
        gen = Generator(lm, slots=slots, capacity=capacity)
        gen.warm_up([trace[0]["prompt"][:16]])
    else:
        gen = PagedGenerator(lm, max_cache_bytes=budget, max_batch=32, prefix_caching=system == "paged-prefix")
        gen.warm_up([_ids(np.random.default_rng(1), 16, lm.vocab_size)])
    times = [[] for _ in trace]
    tokens = [[] for _ in trace]
    most = 0
    start = time.perf_counter()
    now = lambda: time.perf_counter() - start  # noqa: E731
    pending = list(range(len(trace)))
    if system == "contiguous":
        while pending:
            arrived = [i for i in pending if trace[i]["arrival_s"] <= now()]
            if not arrived:
                time.sleep(max(0.0, trace[pending[0]]["arrival_s"] - now()))
                continue
            pending = [i for i in pending if i not in arrived]
            most = max(most, min(len(arrived), gen.slots_count))
            for event in gen.stream([trace[i]["prompt"] for i in arrived], [trace[i]["new_tokens"] for i in arrived],
                                    eos_ids=()):
                times[arrived[event.request]].append(now())
                tokens[arrived[event.request]].append(event.token)
    else:
        ids = {}
        while pending or gen.has_unfinished:
            for i in [i for i in pending if trace[i]["arrival_s"] <= now()]:
                ids[gen.add_request(trace[i]["prompt"], trace[i]["new_tokens"], eos_ids=())] = i
                pending.remove(i)
            if not gen.has_unfinished:
                time.sleep(max(0.0, trace[pending[0]]["arrival_s"] - now()))
                continue
            for event in gen.step():
                times[ids[event.request]].append(now())
                tokens[ids[event.request]].append(event.token)
            most = max(most, len(gen.running))
    info = {"slots": slots if system == "contiguous" else None,
            "blocks": gen.num_blocks if system != "contiguous" else None,
            "cached_prompt_tokens": getattr(gen, "cached_prompt_tokens", 0)}
    return {"requests": [{"arrival_s": r["arrival_s"], "times_s": t, "tokens": k, "prompt_tokens": len(r["prompt"]),
                          "shared_system_prompt": r["shared_system_prompt"]} for r, t, k in zip(trace, times, tokens)],
            "most_in_flight": most, **info}


def budget_point(checkpoint: str, shape: dict, budget_gib: float) -> dict:
    """How many of the trace's sequences the budget holds at once, whatever the arrivals: the
    contiguous generator's slots (each the capacity bucket of the longest request), and the paged
    one's requests taken in trace order (repeated as needed), each reserving the blocks of its
    prompt and new tokens, no prefix shared."""
    from models.llama.engine.block_pool import blocks_for
    from models.llama.engine.kv_cache import block_bytes, bucket_capacity, cache_bytes

    lm = _model(checkpoint, _positions(shape))
    trace = _trace(shape, lm.vocab_size)
    budget = int(budget_gib * GIB)
    capacity = bucket_capacity(max(len(r["prompt"]) + r["new_tokens"] for r in trace), lm.max_positions)
    slots = max([s for s in range(1, 257) if cache_bytes(lm.cache_config, s, capacity, lm.cache_dtype) <= budget],
                default=0)
    blocks = budget // block_bytes(lm.cache_config, 16, lm.cache_dtype) - 1
    held, used = 0, 0
    while True:
        need = blocks_for(len(trace[held % len(trace)]["prompt"]) + trace[held % len(trace)]["new_tokens"] - 1, 16)
        if used + need > blocks:
            break
        used, held = used + need, held + 1
    return {"contiguous_slots": slots, "contiguous_capacity": capacity, "paged_sequences": held,
            "paged_blocks": blocks, "ratio": held / slots if slots else float("inf")}


def _hf_trace(checkpoint: str, shape: dict) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    lm = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                       attn_implementation="sdpa").eval()
    trace = _trace(shape, lm.config.vocab_size)

    hf_generate(lm, [trace[0]["prompt"][:16]], 2, "static")
    times = [[] for _ in trace]
    tokens = [[] for _ in trace]
    start = time.perf_counter()
    pending, most = list(range(len(trace))), 0
    while pending:
        now = time.perf_counter() - start
        arrived = [i for i in pending if trace[i]["arrival_s"] <= now]
        if not arrived:
            time.sleep(max(0.0, trace[pending[0]]["arrival_s"] - now))
            continue
        pending = [i for i in pending if i not in arrived]
        most = max(most, len(arrived))
        stamps = hf_stamps()
        out = hf_generate(lm, [trace[i]["prompt"] for i in arrived], max(trace[i]["new_tokens"] for i in arrived),
                          "static", stamps)
        stamp = [t - start for t in stamps.times[1:]]
        for row, i in enumerate(arrived):
            n = trace[i]["new_tokens"]  # the batch runs to its longest request; each keeps its own count
            times[i], tokens[i] = stamp[:n], out[row][:n]
    return {"requests": [{"arrival_s": r["arrival_s"], "times_s": t, "tokens": k, "prompt_tokens": len(r["prompt"]),
                          "shared_system_prompt": r["shared_system_prompt"]} for r, t, k in zip(trace, times, tokens)],
            "most_in_flight": most, "backend_ran": f"transformers {transformers.__version__}, StaticCache"}


# ---------------------------------------------------------------------------------------------
# The parent: points in turn, summaries, table, plot.

def _percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def summarize_trace(point: dict) -> dict:
    reqs = point["requests"]
    ttft = [r["times_s"][0] - r["arrival_s"] for r in reqs if r["times_s"]]
    tpot = [(r["times_s"][-1] - r["times_s"][0]) / (len(r["times_s"]) - 1) for r in reqs if len(r["times_s"]) > 1]
    span = max(r["times_s"][-1] for r in reqs if r["times_s"]) - min(r["arrival_s"] for r in reqs)
    out_tokens = sum(len(r["tokens"]) for r in reqs)
    return {"ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "tpot_p50_ms": _percentile(tpot, 50) * 1e3, "tpot_p99_ms": _percentile(tpot, 99) * 1e3,
            "tokens_per_s": out_tokens / span, "most_in_flight": point["most_in_flight"]}


def table(results: dict) -> str:
    lines = []
    steps = results.get("steps")
    if steps:
        lines += ["| cached tokens | contiguous step (median / min) | paged step (median / min) | paged / contiguous |",
                  "|---|---|---|---|"]
        for context, row in sorted(steps["summary"].items(), key=lambda kv: int(kv[0])):
            c, p = row["contiguous"], row["paged"]
            lines.append(f"| {context} | {c['median_ms']:.1f} / {c['min_ms']:.1f} ms | {p['median_ms']:.1f} / "
                         f"{p['min_ms']:.1f} ms | {p['median_ms'] / c['median_ms']:.2f}x |")
    prefix = results.get("prefix")
    if prefix:
        s = prefix["summary"]
        lines += ["", f"prefix caching, {results['settings']['system_prompt']}-token system prompt + {USER_TURN}-token "
                      "turn: TTFT "
                      f"{s['cached_ms']:.0f} ms cached against {s['uncached_ms']:.0f} ms uncached (median of "
                      f"{s['rounds']}): {s['ratio']:.2f}x; tokens identical: {s['tokens_identical']}"]
    trace = results.get("trace")
    if trace:
        lines += ["", "| system | TTFT p50 / p99 | time per output token p50 / p99 | output tokens/s "
                      "| most in flight |",
                  "|---|---|---|---|---|"]
        for system, s in trace["summary"].items():
            lines.append(f"| {system} | {s['ttft_p50_s']:.1f} / {s['ttft_p99_s']:.1f} s | {s['tpot_p50_ms']:.0f} / "
                         f"{s['tpot_p99_ms']:.0f} ms | {s['tokens_per_s']:.1f} | {s['most_in_flight']} |")
        lines.append(f"greedy tokens identical across systems: {trace['tokens_identical']}")
        held = trace.get("budget", {})
        if held.get("status") == "ok":
            lines.append(f"the {results['settings']['budget_gib']} GiB budget holds {held['contiguous_slots']} "
                         f"sequences in the contiguous cache (slots of {held['contiguous_capacity']} positions) "
                         f"and {held['paged_sequences']} of the trace's in the paged one: {held['ratio']:.1f}x")
        for system, error in trace.get("failed", {}).items():
            lines.append(f"{system}: not measured ({error})")
    return "\n".join(lines)


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = results.get("trace")
    fig, axes = plt.subplots(1, 2 if trace else 1, figsize=(11 if trace else 6, 4), squeeze=False)
    steps = results.get("steps")
    ax = axes[0][0]
    if steps:
        contexts = sorted(steps["summary"], key=int)
        for system in ("contiguous", "paged"):
            ax.plot([int(c) for c in contexts], [steps["summary"][c][system]["median_ms"] for c in contexts], "o-",
                    label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cached tokens")
        ax.set_ylabel("decode step, median (ms)")
        ax.set_title("decode step, one sequence")
        ax.legend()
    if trace:
        ax = axes[0][1]
        names = list(trace["summary"])
        ax.bar(names, [trace["summary"][n]["ttft_p50_s"] for n in names])
        ax.set_ylabel("TTFT p50 (s)")
        ax.set_title(f"trace of {results['settings']['requests']} requests")
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["steps", "prefix", "trace"],
                        choices=["steps", "prefix", "trace"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0.2, help="trace arrivals per second")
    parser.add_argument("--budget-gib", type=float, default=2.0, help="the trace's KV cache budget")
    parser.add_argument("--systems", nargs="+", default=["contiguous", "paged", "paged-prefix", "hf-static"])
    parser.add_argument("--model", default="7b", help="the preset of the random checkpoint (tiny for a smoke run)")
    parser.add_argument("--max-prompt", type=int, default=4096, help="the trace's longest prompt")
    parser.add_argument("--system-prompt", type=int, default=1024, help="tokens of the shared system prompt")
    parser.add_argument("--new-tokens-range", type=int, nargs=2, default=[32, 256], metavar=("LOW", "HIGH"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    results = {"schema_version": SCHEMA_VERSION, "machine": machine_info(), "settings": vars(args)}
    with tempfile.TemporaryDirectory(prefix="serving-") as checkpoint:
        run_isolated("peers", "write_checkpoint", {"model": args.model, "layers": args.layers, "seed": args.seed,
                                                   "directory": checkpoint})
        if "steps" in args.parts:
            runs = []
            for r in range(args.rounds):
                for context in args.contexts:
                    for system in turned(["contiguous", "paged"], r + context):
                        print(f"steps: round {r + 1}, {context} cached, {system}", flush=True)
                        runs.append({"round": r, "context": context, "system": system, **run_isolated(
                            "serving", "step_point", {"system": system, "checkpoint": checkpoint,
                                                      "context": context, "new_tokens": args.new_tokens,
                                                      "seed": args.seed})})
            summary = {}
            for context in args.contexts:
                row = {}
                for system in ("contiguous", "paged"):
                    points = [p for p in runs if p["context"] == context and p["system"] == system
                              and p["status"] == "ok"]
                    steps = [s for p in points for s in p["step_ms"]]
                    row[system] = {"median_ms": statistics.median(steps), "min_ms": min(steps)} if steps else None
                tokens = {p["system"]: p["tokens"] for p in runs if p["context"] == context and p["status"] == "ok"}
                row["tokens_identical"] = len({tuple(t) for t in tokens.values()}) == 1
                summary[str(context)] = row
            results["steps"] = {"runs": runs, "summary": summary}
        if "prefix" in args.parts:
            print("prefix: one process, cached and uncached requests in turn", flush=True)
            point = run_isolated("serving", "prefix_point", {"checkpoint": checkpoint, "rounds": args.rounds + 1,
                                                             "new_tokens": 8, "seed": args.seed,
                                                             "system_prompt": args.system_prompt})
            rows = point.get("rounds", [])
            cached = [r["system prompt cached"] for r in rows]
            uncached = [r["nothing cached"] for r in rows]
            results["prefix"] = {"point": point, "summary": {
                "rounds": len(rows), "cached_ms": statistics.median(cached) * 1e3,
                "uncached_ms": statistics.median(uncached) * 1e3,
                "ratio": statistics.median(cached) / statistics.median(uncached),
                "tokens_identical": all(r["system prompt cached tokens"] == r["prefix caching off tokens"]
                                        for r in rows),
                "cached_tokens": [r["system prompt cached cached"] for r in rows]}}
        if "trace" in args.parts:
            shape = {"requests": args.requests, "rate": args.rate, "seed": args.seed, "max_prompt": args.max_prompt,
                     "system_prompt": args.system_prompt, "new_tokens": args.new_tokens_range}
            points = {}
            for system in args.systems:
                if system == "hf-static" and importlib.util.find_spec("transformers") is None:
                    points[system] = {"status": "skipped", "error": "transformers is not installed (make bench "
                                                                    "installs it)"}
                    print(f"trace: {system} skipped: {points[system]['error']}", flush=True)
                    continue
                print(f"trace: {system}", flush=True)
                points[system] = run_isolated("serving", "trace_point", {
                    "system": system, "checkpoint": checkpoint, "shape": shape, "budget_gib": args.budget_gib})
            ok = {s: p for s, p in points.items() if p["status"] == "ok"}
            held = run_isolated("serving", "budget_point", {"checkpoint": checkpoint, "shape": shape,
                                                            "budget_gib": args.budget_gib})
            tokens = {s: [r["tokens"] for r in p["requests"]] for s, p in ok.items()}
            results["trace"] = {"points": points, "summary": {s: summarize_trace(p) for s, p in ok.items()},
                                "budget": held,
                                "tokens_identical": len({str(t) for t in tokens.values()}) == 1,
                                "failed": {s: p.get("error") for s, p in points.items() if p["status"] != "ok"}}
    save(results, args.out, "serving.json", "serving.png", plot, table)
    disagree = ([f"steps at {c}" for c, row in results.get("steps", {}).get("summary", {}).items()
                 if not row["tokens_identical"]]
                + (["prefix"] if "prefix" in results and not results["prefix"]["summary"]["tokens_identical"] else [])
                + (["trace"] if "trace" in results and not results["trace"]["tokens_identical"] else []))
    if disagree:
        raise SystemExit(f"greedy tokens differ across systems in: {', '.join(disagree)} (results written)")
    return results


if __name__ == "__main__":
    main()
