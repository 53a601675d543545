"""Llama2 time-to-first-token: fused RoPE+FlashAttention vs the unfused path and vs what a user would
pick instead (Hugging Face transformers' LlamaForCausalLM with PyTorch sdpa, and MindFormers' Llama,
each when installed), over prompt lengths.

Every system runs on identical weights and prompt (a checksum of the weights and the last token's
logits, which must agree across systems, prove it): with a peer in the sweep and no --checkpoint, the
seeded random weights are written once as a Hugging Face checkpoint that every system loads.
Each length is measured in ``--rounds`` rounds; a round runs every system once, each in a fresh
process, in an order that turns every round, so a machine that slows down or speeds up during the
sweep (shared cloud cores drift by tens of percent within minutes) moves every system alike instead
of whichever happened to run then. In each process the model is built (Llama2-7B dimensions, a few
layers), the prefill is compiled or warmed up once (reported as compile time, not in TTFT), then the
prefill + first-token choice is timed ``--repeats`` times; a point's min and median are over all its
rounds' times. The same process also times one layer's
attention alone and the embedding/norm/LM-head part, which give the attention share of TTFT and the
extrapolation to the model's full depth: full = head + per_layer * full_layers, where
per_layer = (TTFT - head) / layers. A fitted exponent b of TTFT ~ S^b summarises growth per backend.
A point that runs out of memory is reported as such (the watchdog stops it first).

    python benchmarks/ttft.py                      # make bench: 7B dims, 2 layers, S = 512..2048, 2 rounds
    python benchmarks/ttft.py --lengths 512 1024 2048 4096 8192 16384 --rounds 3   # make bench-full
    python benchmarks/ttft.py --lengths 32768 --systems fused   # the long-context option
    python benchmarks/ttft.py --checkpoint /path/to/Llama-2-7b-hf --layers 32 --device Ascend
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import arithmetic_peaks, machine_info, memory_total_bytes, run_isolated, save, stats, timed, turned
from peers import prompt_ids, timed_prefill, weights_checksum

SCHEMA_VERSION = 4  # 4: the bfloat16 systems, each run's "precision"; 3: one run per process and round
BACKENDS = ("fused", "unfused")  # this project's two paths, in MindSpore, in --dtype
PEERS = {"hf": "Hugging Face transformers LlamaForCausalLM (sdpa), PyTorch",
         "mindformers": "MindFormers LlamaForCausalLM, MindSpore GRAPH_MODE (its own virtual environment)"}
# The checkpoint's weights rounded to bfloat16 at load: this project computing in bfloat16 (compute_dtype,
# float32 activations between its ops) and transformers in bfloat16 (every activation bfloat16).
BFLOAT16 = {"fused-bfloat16": "this project, compute_dtype='bfloat16' (fused op; projections on machine.bf16_engine's units)",
            "hf-bfloat16": "Hugging Face transformers LlamaForCausalLM (sdpa), PyTorch, torch.bfloat16"}
MINDFORMERS_PYTHON = Path(__file__).resolve().parent.parent / ".venv-mindformers" / "bin" / "python"
SYSTEMS = BACKENDS + tuple(PEERS) + tuple(BFLOAT16)
LOGITS_RTOL = 1e-3  # the systems' agreement on peers.LOGITS_PROBE's logits, relative to the largest logit
# bfloat16 systems against fused's float32 logits: a few 2^-8 roundings per layer (tests/test_compute_dtype.py
# measures 1-2e-2 on a tiny model for both this project and transformers).
BFLOAT16_LOGITS_RTOL = 6e-2


def precision(system: str, dtype: str) -> str:
    """The arithmetic a system runs in: bfloat16 for the BFLOAT16 systems, --dtype for the others."""
    return "bfloat16" if system in BFLOAT16 else dtype


# ---------------------------------------------------------------------------------------------
# One measured point of this project's model (child process); the peers' are peers.hf_prefill_point
# and peers.mindformers_prefill_point.

def ttft_point(model: str, layers: int, dtype: str, batch: int, backend: str, length: int, repeats: int,
               checkpoint: str | None, seed: int, device: str, compute_dtype: str = "float32") -> dict:
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    ms.set_device(device)
    ms.set_context(mode=ms.GRAPH_MODE)
    from models.llama import LlamaForCausalLM, preset
    from models.llama.engine import Generator
    from models.llama.weights import load_checkpoint

    start = time.perf_counter()
    if checkpoint:
        lm = load_checkpoint(checkpoint, dtype=dtype, backend=backend, logits="last", num_layers=layers,
                             max_positions=length, progress=False, compute_dtype=compute_dtype)
    else:
        ms.set_seed(seed)
        config = preset(model, num_hidden_layers=layers)
        lm = LlamaForCausalLM(config, dtype=dtype, backend=backend, logits="last",
                              max_positions=max(config.max_position_embeddings, length), compute_dtype=compute_dtype)
    build_s = time.perf_counter() - start
    config = lm.config
    rng = np.random.default_rng(seed)
    prompts = prompt_ids(seed, batch, length, config.vocab_size)
    generator = Generator(lm, slots=batch)  # the prefill writes the prompts' rotated keys into its cache
    compile_s, ttft, probe_logits = timed_prefill(lambda: generator.prefill_logits(prompts), repeats)

    attention = lm.model.layers[0].self_attn.prefill_attention
    hidden_q = config.num_attention_heads * config.dim_per_head
    hidden_kv = config.num_key_value_heads * config.dim_per_head
    q, k, v = (Tensor(rng.standard_normal((batch, length, n), dtype=np.float32)).astype(lm.model.norm.weight.dtype)
               for n in (hidden_q, hidden_kv, hidden_kv))

    class Attention(nn.Cell):
        def __init__(self):
            super().__init__()
            self.attention = attention

        def construct(self, q, k, v):
            return self.attention(q, k, v)

    class Head(nn.Cell):
        """Everything outside the decoder layers: embedding, final norm, LM head on the last token."""

        def __init__(self):
            super().__init__()
            self.lm = lm
            self.matmul = ops.MatMul(transpose_b=True)  # as the model does (a .T would copy the whole head)

        def construct(self, ids):
            h = self.lm.model.norm(self.lm.model.embed_tokens(ids))[:, -1, :]
            if self.lm.tie_word_embeddings:
                return self.matmul(h, self.lm.model.embed_tokens.weight.astype(h.dtype))
            return self.lm.lm_head(h)  # the model's own projection op, in its compute dtype

    attention_net, head_net = Attention(), Head()
    ids = Tensor(np.array(prompts, np.int32))
    _, attention_times = timed(lambda: attention_net(q, k, v)[0].asnumpy(), repeats)
    _, head_times = timed(lambda: head_net(ids).asnumpy(), repeats)
    # bfloat16 arithmetic packs the projections' weights for oneDNN (no longer the checkpoint's tensors): the
    # bfloat16 systems compare the embedding's rows instead (peers.hf_prefill_point does the same)
    probe = (lm.model.embed_tokens.weight if lm.compute_dtype == "bfloat16" else lm.model.layers[0].mlp.down_proj.weight)
    probe = probe[:8].astype(ms.float32).asnumpy()
    return {"backend_ran": lm.backend, "compute_ran": lm.compute_dtype, "build_s": build_s, "compile_s": compile_s, "ttft": stats(ttft),
            "attention": stats(attention_times), "head": stats(head_times), "weights_checksum": weights_checksum(probe),
            "logits_probe": probe_logits}


# ---------------------------------------------------------------------------------------------
# Pure parts (tested in tests/test_benchmarks.py).

def fit_exponent(lengths, times) -> float | None:
    """b in time ~ a * length^b, least squares in log-log; None with fewer than 2 points."""
    points = [(length, t) for length, t in zip(lengths, times) if t is not None and t > 0]
    if len({length for length, _ in points}) < 2:
        return None
    x, y = np.log([p[0] for p in points]), np.log([p[1] for p in points])
    return float(np.polyfit(x, y, 1)[0])


def extrapolate(ttft_s: float, head_s: float, layers: int, full_layers: int) -> tuple[float, float]:
    """(per-layer seconds, full-depth TTFT seconds) from a model of ``layers`` layers."""
    per_layer = max(ttft_s - head_s, 0.0) / layers
    return per_layer, head_s + per_layer * full_layers


def merge_rounds(runs: list[dict]) -> list[dict]:
    """One record per (system, length) from its rounds' processes: the times of every round together,
    the highest peak memory, the median compile time. A point is only as good as its worst round: one
    that ran out of memory or failed makes the point so."""
    merged = []
    for key in dict.fromkeys((r["backend"], r["length"]) for r in runs):
        rounds = [r for r in runs if (r["backend"], r["length"]) == key]
        failed = [r for r in rounds if r["status"] != "ok"]
        if failed:
            merged.append({k: v for k, v in failed[0].items() if k != "round"})
            continue
        point = {k: v for k, v in rounds[0].items() if k != "round"}
        for part in ("ttft", "attention", "head"):
            point[part] = stats([t for r in rounds for t in r[part]["times_s"]])
        point["compile_s"] = float(np.median([r["compile_s"] for r in rounds]))
        point["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rounds)
        point["rounds"] = len(rounds)
        merged.append(point)
    return merged


def summarize(runs: list[dict], layers: int, full_layers: int) -> dict:
    """Per-length rows (every system side by side, each one's TTFT over fused; the rounds of a point
    merged) and the growth exponent per system."""
    runs = merge_rounds(runs)
    rows = []
    for length in sorted({r["length"] for r in runs}):
        row = {"length": length}
        for run in (r for r in runs if r["length"] == length):
            cell = {"status": run["status"]}
            if run["status"] == "ok":
                ttft, head = run["ttft"]["min_s"], run["head"]["min_s"]
                per_layer, full = extrapolate(ttft, head, layers, full_layers)
                cell.update({"ttft_min_s": ttft, "ttft_median_s": run["ttft"]["median_s"], "per_layer_s": per_layer,
                             "full_depth_s": full, "attention_share": min(1.0, run["attention"]["min_s"] * layers / ttft),
                             "compile_s": run["compile_s"], "peak_rss_mb": run["peak_rss_mb"],
                             "rounds": run["rounds"], "timed": len(run["ttft"]["times_s"])})
            else:
                cell["error"] = run.get("error", "")
            row[run["backend"]] = cell
        fused = row.get("fused", {})
        for other in SYSTEMS[1:]:
            cell = row.get(other, {})
            if fused.get("status") == "ok" and cell.get("status") == "ok":
                row[f"{other}_over_fused"] = cell["ttft_min_s"] / fused["ttft_min_s"]
                row[f"{other}_over_fused_full_depth"] = cell["full_depth_s"] / fused["full_depth_s"]
        if "unfused_over_fused" in row:
            row["fused_ttft_change"] = 1 / row["unfused_over_fused_full_depth"] - 1
        ours, theirs = row.get("fused-bfloat16", {}), row.get("hf-bfloat16", {})
        if ours.get("status") == "ok" and theirs.get("status") == "ok":
            row["hf-bfloat16_over_fused-bfloat16"] = theirs["ttft_min_s"] / ours["ttft_min_s"]
        rows.append(row)
    exponents = {}
    for backend in SYSTEMS:
        ok = [(r["length"], r[backend]["full_depth_s"]) for r in rows if r.get(backend, {}).get("status") == "ok"]
        if ok:
            exponents[backend] = fit_exponent(*zip(*ok))
    return {"rows": rows, "exponents": exponents}


RESULT_KEYS = {"schema_version": int, "machine": dict, "settings": dict, "runs": list, "summary": dict}
RUN_KEYS = {"backend": str, "length": int, "round": int, "status": str}
OK_RUN_KEYS = {"ttft": dict, "attention": dict, "head": dict, "compile_s": float, "peak_rss_mb": float,
               "weights_checksum": float, "backend_ran": str}


def validate(results: dict) -> None:
    """Raise ValueError unless ``results`` has the documented results.json shape."""
    def need(obj, keys, where):
        for key, kind in keys.items():
            if key not in obj:
                raise ValueError(f"{where}: missing {key!r}")
            if not isinstance(obj[key], kind) and not (kind is float and isinstance(obj[key], int)):
                raise ValueError(f"{where}.{key}: expected {kind.__name__}, got {type(obj[key]).__name__}")

    need(results, RESULT_KEYS, "results")
    for i, run in enumerate(results["runs"]):
        need(run, RUN_KEYS, f"runs[{i}]")
        if run["status"] == "ok":
            need(run, OK_RUN_KEYS, f"runs[{i}]")
            for part in ("ttft", "attention", "head"):
                need(run[part], {"times_s": list, "min_s": float, "median_s": float}, f"runs[{i}].{part}")
        elif "error" not in run:
            raise ValueError(f"runs[{i}]: status {run['status']!r} without an error message")
    need(results["summary"], {"rows": list, "exponents": dict}, "summary")


def same_weights(runs: list[dict]) -> bool:
    """One weights checksum per precision (the bfloat16 systems read the same weights rounded once)."""
    ok = [r for r in runs if r["status"] == "ok"]
    return all(len({r["weights_checksum"] for r in ok if r.get("precision") == p}) <= 1
               for p in {r.get("precision") for r in ok})


def logits_disagree(runs: list[dict]) -> list[str]:
    """Per length, the systems whose last-token logits differ from fused's (or the first system's) by more
    than LOGITS_RTOL of the largest (BFLOAT16_LOGITS_RTOL for the bfloat16 systems): the proof that every
    system computed the same model."""
    problems = []
    for length in sorted({r["length"] for r in runs}):
        ok = [r for r in runs if r["length"] == length and r["status"] == "ok" and r.get("logits_probe")]
        ok.sort(key=lambda r: r["backend"] != "fused")
        if not ok:
            continue
        reference = np.array(ok[0]["logits_probe"])
        scale = max(np.abs(reference).max(), 1e-6)
        for run in ok[1:]:
            error = np.abs(np.array(run["logits_probe"]) - reference).max() / scale
            if error > (BFLOAT16_LOGITS_RTOL if run["backend"] in BFLOAT16 else LOGITS_RTOL):
                problems.append(f"{run['backend']} vs {ok[0]['backend']} at S={length}: {error:.2e} relative")
    return problems


# ---------------------------------------------------------------------------------------------

def sweep(args, progress=True) -> dict:
    with tempfile.TemporaryDirectory(prefix="ttft-weights-") as scratch:
        return _sweep(args, scratch, progress)


def _sweep(args, scratch: str, progress: bool) -> dict:
    from tqdm import tqdm

    from models.llama import preset
    from models.llama.weights import read_config
    from ms_rope_attention.compute import native_half_dtypes

    limit = int(args.memory_limit_gb * 2**30)
    peaks = arithmetic_peaks(args.peak_seconds)  # this CPU's peaks, before the points (nothing else runs)
    checkpoint = args.checkpoint
    if any(system in PEERS or system in BFLOAT16 for system in args.systems) and not checkpoint:
        # One set of weights for every system: the seeded random model, written once.
        written = run_isolated("peers", "write_checkpoint", {"model": args.model, "layers": args.layers,
                                                              "seed": args.seed, "directory": scratch})
        if written["status"] != "ok":
            raise RuntimeError(f"could not write the shared weights: {written.get('error')}")
        checkpoint = scratch
    # Round r of a length runs every system once, in the order turned by r (see the module docstring).
    points = [(length, r, system) for length in args.lengths for r in range(args.rounds)
              for system in turned(list(args.systems), r)]
    runs, not_again = [], {}  # system -> the record of a point it cannot run in any later round or length
    bar = tqdm(points, desc="TTFT sweep", unit="process", disable=not progress)
    for length, round_, system in bar:
        bar.set_postfix_str(f"{system} S={length} round {round_ + 1}/{args.rounds}")
        base = {"backend": system, "length": length, "round": round_, "precision": precision(system, args.dtype)}
        if system in not_again:
            runs.append({**base, **not_again[system]})
            continue
        if system in PEERS or system == "hf-bfloat16":
            module, function = "peers", f"{system.split('-')[0]}_prefill_point"
            kwargs = {"checkpoint": checkpoint, "length": length, "repeats": args.repeats, "seed": args.seed,
                      "batch": args.batch, "dtype": base["precision"]}
        else:
            module, function, kwargs = "ttft", "ttft_point", {
                "model": args.model, "layers": args.layers, "dtype": args.dtype, "batch": args.batch,
                "backend": system.split("-")[0], "length": length, "repeats": args.repeats, "checkpoint": checkpoint,
                "seed": args.seed, "device": args.device, "compute_dtype": base["precision"]}
        python = args.mindformers_python if system == "mindformers" else None
        if system == "fused-bfloat16" and "bfloat16" not in native_half_dtypes():
            result = {"status": "skipped", "error": "this CPU has no bfloat16 instructions (avx512_bf16 / AMX-BF16)"}
        elif python and not Path(python).exists():
            result = {"status": "skipped", "error": f"not installed: no MindFormers interpreter at {python} "
                                                    "(make bench installs it)"}
        else:
            result = run_isolated(module, function, kwargs, python=python, memory_limit_bytes=limit,
                                  timeout_s=args.timeout)
        if result["status"] == "oom":  # a longer prompt needs at least as much memory
            not_again[system] = {"status": "oom", "error": "not run: this or a shorter length already ran out of memory"}
        if result["status"] == "skipped":  # a peer that is not installed
            not_again[system] = {"status": "skipped", "error": result["error"]}
        runs.append({**base, **result})
    # Extrapolate to the depth of the model the layers come from.
    full_layers = (read_config(args.checkpoint)[0] if args.checkpoint else preset(args.model)).num_hidden_layers
    results = {"schema_version": SCHEMA_VERSION, "machine": machine_info(), "peaks": peaks,
               "settings": {**vars(args), "full_layers": full_layers}, "runs": runs,
               "summary": summarize(runs, args.layers, full_layers)}
    if not same_weights(runs):
        raise RuntimeError("systems ran on different weights (checksums differ): the comparison is void")
    disagreeing = logits_disagree(runs)
    if disagreeing:
        raise RuntimeError(f"systems computed different logits on the same weights and prompt: {disagreeing}")
    validate(results)
    return results


NAMES = {"fused": "fused", "unfused": "unfused", "hf": "HF transformers", "mindformers": "MindFormers",
         "fused-bfloat16": "fused bf16", "hf-bfloat16": "HF transformers bf16"}
COLORS = {"fused": "tab:blue", "unfused": "tab:red", "hf": "tab:orange", "mindformers": "tab:green",
          "fused-bfloat16": "tab:purple", "hf-bfloat16": "tab:brown"}


def table(results: dict) -> str:
    """Markdown: TTFT of every system (min / median), each one over fused, full-depth TTFT, attention
    share and peak memory."""
    s = results["settings"]
    rows = results["summary"]["rows"]
    systems = [name for name in SYSTEMS if any(name in r for r in rows)]
    others = [name for name in systems if name != "fused"]
    bf16_pair = set(BFLOAT16) <= set(systems)
    head = ["S"] + [f"{NAMES[n]} TTFT min / median" for n in systems] + [f"{NAMES[n]} / fused" for n in others]
    head += ["HF transformers bf16 / fused bf16"] if bf16_pair else []
    head += [f"full depth ({s['full_layers']} layers) " + " / ".join(NAMES[n] for n in systems),
             "attention share " + " / ".join(NAMES[n] for n in systems), "peak RSS " + " / ".join(NAMES[n] for n in systems)]
    lines = [f"Llama2 {s['model']} dims, {s['layers']} layers (extrapolated to {s['full_layers']}), {s['dtype']}, "
             f"batch {s['batch']}, min / median of {s['rounds']} rounds x {s['repeats']} timed prefills (one process "
             "per system and round, the order turning every round)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ms(x):
        return f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s"

    def cell(c, fmt):
        if c.get("status") == "ok":
            return fmt(c)
        return {"oom": "out of memory", None: "-"}.get(c.get("status"), c.get("status"))

    for row in rows:
        cells = [str(row["length"])]
        cells += [cell(row.get(n, {}), lambda c: f"{ms(c['ttft_min_s'])} / {ms(c['ttft_median_s'])}") for n in systems]
        cells += [f"{row[f'{n}_over_fused']:.2f}x" if f"{n}_over_fused" in row else "-" for n in others]
        if bf16_pair:
            ratio = row.get("hf-bfloat16_over_fused-bfloat16")
            cells.append(f"{ratio:.2f}x" if ratio is not None else "-")
        cells.append(" / ".join(cell(row.get(n, {}), lambda c: ms(c["full_depth_s"])) for n in systems))
        cells.append(" / ".join(cell(row.get(n, {}), lambda c: format(c["attention_share"], ".0%")) for n in systems))
        cells.append(" / ".join(cell(row.get(n, {}), lambda c: format(c["peak_rss_mb"] / 1024, ".1f") + " GB")
                                for n in systems))
        lines.append("| " + " | ".join(cells) + " |")
    exps = results["summary"]["exponents"]
    lines.append("Fitted growth exponent b (full-depth TTFT ~ S^b): " + ", ".join(
        f"{NAMES[k]} {v:.2f}" if v is not None else f"{NAMES[k]} n/a" for k, v in exps.items()))
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["summary"]["rows"]
    exps = results["summary"]["exponents"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3))
    for backend, color in COLORS.items():
        pts = [(r["length"], r[backend]["full_depth_s"]) for r in rows if r.get(backend, {}).get("status") == "ok"]
        if not pts:
            continue
        x, y = zip(*pts)
        label = NAMES[backend] + (f" (b = {exps[backend]:.2f})" if exps.get(backend) is not None else "")
        left.plot(x, y, "o", color=color, label=label)
        if exps.get(backend) is not None and len(x) > 1:
            slope, icpt = np.polyfit(np.log(x), np.log(y), 1)
            xs = np.geomspace(min(x), max(x), 50)
            left.plot(xs, np.exp(icpt) * xs ** slope, "-", color=color, alpha=0.6)
        oom = [r["length"] for r in rows if r.get(backend, {}).get("status") == "oom"]
        if oom:  # x marks at the bottom edge: measured nothing, ran out of memory
            left.plot(oom, [min(y)] * len(oom), "x", color=color, markersize=9,
                      label=f"{NAMES[backend]}: out of memory at S >= {min(oom)}")
    s = results["settings"]
    left.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="TTFT (s, min over rounds)",
             title=f"Llama2 {s['model']} TTFT, extrapolated to {s['full_layers']} layers")
    left.legend()
    left.grid(True, which="both", alpha=0.3)
    for other, color in list(COLORS.items())[1:]:
        ratio = [(r["length"], r[f"{other}_over_fused"]) for r in rows if f"{other}_over_fused" in r]
        if ratio:
            right.plot(*zip(*ratio), "o-", color=color, label=f"{NAMES[other]} / fused")
    right.axhline(1.0, color="gray", lw=0.8)
    right.legend()
    lengths = [r["length"] for r in rows]
    right.set_xlim(min(lengths) / 1.2, max(lengths) * 1.2)
    right.set(xscale="log", xlabel="prompt length (tokens)", ylabel="TTFT / fused TTFT (measured layers)",
              title="each system over fused (same weights; > 1: fused faster)")
    right.grid(True, which="both", alpha=0.3)
    m = results["machine"]
    fig.suptitle(f"{m['cpu']} ({m['cpus']} cores), MindSpore {m['mindspore']}, {s['dtype']}, batch {s['batch']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="7b", choices=["7b", "13b", "70b", "tiny"])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers actually run (memory)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    # The defaults are make bench's sweep, about a quarter of an hour on 2 cores with every system;
    # make bench-full passes the long one.
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048],
                        help="prompt lengths (add 32768 for the long-context point; give --systems fused for it)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS,
                        help="this project's backends (fused, unfused) and peers (hf: transformers + PyTorch; "
                             "mindformers: MindFormers' Llama), each reported as skipped when not installed")
    parser.add_argument("--mindformers-python", default=str(MINDFORMERS_PYTHON),
                        help="the interpreter of MindFormers' own virtual environment (its pinned transformers "
                             "4.57 cannot share one with the hf peer's transformers 5)")
    parser.add_argument("--device", default="CPU", help="CPU, or Ascend where the op package is installed")
    parser.add_argument("--checkpoint", help="real weights (Hugging Face or Meta directory) instead of random ones")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds per length: every system once per round, each in a fresh process")
    parser.add_argument("--repeats", type=int, default=1, help="timed prefills per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-limit-gb", type=float, default=round(0.85 * memory_total_bytes() / 2**30, 1),
                        help="a point whose resident memory exceeds this is stopped and reported out of memory")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per point")
    parser.add_argument("--peak-seconds", type=float, default=0.5,
                        help="duration of each repeat of the CPU's peak probes (harness.arithmetic_peaks)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if min(args.layers, args.batch, args.rounds, args.repeats, *args.lengths) < 1:
        parser.error("--layers, --batch, --rounds, --repeats and --lengths must be positive")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = sweep(args)
    save(results, args.out, "results.json", "ttft.png", plot, table)
    return results


if __name__ == "__main__":
    main()
