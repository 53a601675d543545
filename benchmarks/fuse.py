"""fuse() on the models users already have, before and after, same weights, same run: the time to
first token (prefill) of MindFormers 2.0.0's Llama (GRAPH_MODE) and of Hugging Face's Llama on
mindnlp 0.5.1 (PyNative), and mindnlp's decode step with its KV cache (DynamicCache).

One seeded Llama2-7B-dimension checkpoint (``peers.write_checkpoint``, a few decoder layers) serves
both libraries; each library runs in its own virtual environment and a child process of its own.
In that process the original model is timed, then ``fuse(model)`` (the report is kept), then the
fused model: the order cannot alternate without recompiling MindFormers' graph at every switch.
The first token's logits of both must agree (relative 1e-4) and the greedy decode tokens must be the
same. MindFormers' decode is not measured: its KV-cache path (``use_past``) is not fused.

    python benchmarks/fuse.py --lengths 2048 --layers 2 --repeats 2 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import machine_info, run_isolated, stats

ROOT = Path(__file__).resolve().parent.parent
PYTHONS = {"mindformers": ROOT / ".venv-mindformers" / "bin" / "python",
           "mindnlp": ROOT / ".venv-mindnlp" / "bin" / "python"}


def unequal_prompts(seed: int, lengths: list[int], vocab_size: int) -> list[list[int]]:
    """One seeded prompt per length (ids never 0, MindFormers' pad id)."""
    import peers

    return [peers.prompt_ids(seed + 1 + i, 1, n, vocab_size)[0] for i, n in enumerate(lengths)]


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def mindformers_point(checkpoint: str, length: int, repeats: int, seed: int) -> dict:
    """Child process, in MindFormers' environment: GRAPH_MODE prefill before and after fuse."""
    import mindspore as ms
    from mindspore import Tensor

    import peers
    from ms_rope_attention import fuse

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    lm, hf, build_s = peers.load_mindformers(checkpoint, length, 1, "float32")
    ids = Tensor(np.array(peers.prompt_ids(seed, 1, length, hf["vocab_size"]), np.int32))
    valid = Tensor(np.array([length], np.int32))

    def last_logits():
        return lm(ids, batch_valid_length=valid)[0].asnumpy().reshape(1, -1)

    compile_original, original, want = peers.timed_prefill(last_logits, repeats)
    start = time.perf_counter()
    report = fuse(lm)
    fuse_s = time.perf_counter() - start
    compile_fused, fused, got = peers.timed_prefill(last_logits, repeats)
    return {"report": str(report), "all_fused": report.all_fused, "fuse_s": fuse_s, "build_s": build_s,
            "compile_s": {"original": compile_original, "fused": compile_fused},
            "ttft": {"original": stats(original), "fused": stats(fused)}, "logits_relative": _relative(got, want)}


def mindnlp_point(checkpoint: str, length: int, repeats: int, seed: int, decode_steps: int,
                  batch_lengths: list[int]) -> dict:
    """Child process, in mindnlp's environment: PyNative prefill and decode steps before and after fuse,
    then HF's greedy ``generate`` on a batch of prompts of unequal lengths (left-padded, so every step
    has its sequences at different positions), with the fused sites' fallback announcements counted."""
    import logging

    from ms_rope_attention.fusion import mindnlp_compat
    mindnlp_compat.install()
    import mindnlp  # noqa: F401  (maps torch to mindtorch and transformers to HF's own)
    import torch
    import transformers

    import peers
    from ms_rope_attention import fuse

    start = time.perf_counter()
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    build_s = time.perf_counter() - start
    ids = torch.tensor(peers.prompt_ids(seed, 1, length, model.config.vocab_size))

    def last_logits():
        with torch.no_grad():
            return model(ids, logits_to_keep=1).logits[:, -1].float().numpy()

    def decode():
        """Per-step seconds of ``decode_steps`` greedy steps after a prefill, and the tokens."""
        with torch.no_grad():
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            tokens, steps = [int(token.item())], []
            for _ in range(decode_steps):
                begin = time.perf_counter()
                out = model(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                tokens.append(int(token.item()))
                steps.append(time.perf_counter() - begin)
        return steps, tokens

    prompts = unequal_prompts(seed, batch_lengths, model.config.vocab_size)
    fallbacks = []

    class Fallbacks(logging.Handler):
        def emit(self, record):
            if "rotary_fusion_fallback" in record.getMessage():
                fallbacks.append(record.getMessage())

    logging.getLogger("ms_rope_attention").addHandler(Fallbacks())

    def batch_decode():
        """Per-step seconds of HF's greedy generate on the unequal prompts, its tokens, and the
        fallback announcements made during it."""
        fallbacks.clear()
        stamps = peers.hf_stamps()
        tokens = peers.hf_generate(model, prompts, decode_steps + 1, "dynamic", streamer=stamps)
        return list(np.diff(stamps.times[1:])), tokens, list(fallbacks)

    def measure():
        compile_s, times, logits = peers.timed_prefill(last_logits, repeats)
        steps, tokens = decode()
        batch_steps, batch_tokens, batch_fallbacks = batch_decode()
        return {"ttft": stats(times), "first_call_s": compile_s, "decode_step": stats(steps),
                "tokens_per_s": 1.0 / statistics.median(steps), "batch_decode_step": stats(batch_steps),
                "batch_tokens": batch_tokens, "batch_fallbacks": batch_fallbacks}, logits, tokens

    original, want, want_tokens = measure()
    start = time.perf_counter()
    report = fuse(model)
    fuse_s = time.perf_counter() - start
    fused, got, tokens = measure()
    return {"report": str(report), "all_fused": report.all_fused, "fuse_s": fuse_s, "build_s": build_s,
            "original": original, "fused": fused, "logits_relative": _relative(got, want),
            "same_tokens": tokens == want_tokens, "tokens": tokens, "batch_lengths": batch_lengths,
            "batch_same_tokens": fused["batch_tokens"] == original["batch_tokens"]}


def mindformers_serving_point(checkpoint: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """Child process, in MindFormers' environment: its serving path, ``use_past=True`` (paged KV cache,
    block size 16, prompts packed in the TH layout), fused, then ``generate`` greedily on the batch
    right-padded with its pad id as MindFormers takes it. Unfused this path cannot run on a CPU."""
    import mindspore as ms

    import peers
    from ms_rope_attention import fuse

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    width = max(map(len, prompts))
    seq_length = -(-(width + new_tokens) // 16) * 16
    lm, _, build_s = peers.load_mindformers(checkpoint, seq_length, len(prompts), "float32", use_past=True,
                                            is_dynamic=True, use_flash_attention=True, block_size=16,
                                            num_blocks=len(prompts) * seq_length // 16)
    report = fuse(lm)
    start = time.perf_counter()
    out = lm.generate([p + [0] * (width - len(p)) for p in prompts], max_new_tokens=new_tokens, do_sample=False)
    generate_s = time.perf_counter() - start
    return {"report": str(report), "all_fused": report.all_fused, "build_s": build_s, "generate_s": generate_s,
            "tokens": [list(map(int, row))[len(p):len(p) + new_tokens] for row, p in zip(out, prompts)]}


def transformers_tokens_point(checkpoint: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """Child process, in mindnlp's environment: transformers' own Llama (4.57.1's modeling code on
    mindtorch), unfused, greedy ``generate`` on each prompt alone: the reference tokens."""
    from ms_rope_attention.fusion import mindnlp_compat
    mindnlp_compat.install()
    import mindnlp  # noqa: F401
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
            tokens.append([int(t) for t in out[0, len(prompt):].numpy()])
    return {"tokens": tokens, "eos_token_id": model.config.eos_token_id}


def through_eos(tokens: list[int], eos: int) -> list[int]:
    """A greedy sequence up to and including its first end-of-sequence token (each library stops or
    pads differently after it)."""
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def serving_agreement(checkpoint: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """MindFormers' fused serving path against transformers on the same weights: their greedy tokens."""
    served = run_isolated("fuse", "mindformers_serving_point", {"checkpoint": checkpoint, "prompts": prompts,
                                                                 "new_tokens": new_tokens},
                          python=str(PYTHONS["mindformers"]))
    reference = run_isolated("fuse", "transformers_tokens_point", {"checkpoint": checkpoint, "prompts": prompts,
                                                                   "new_tokens": new_tokens},
                             python=str(PYTHONS["mindnlp"]))
    result = {"mindformers": served, "transformers": reference}
    if served["status"] == "ok" and reference["status"] == "ok":
        eos = reference["eos_token_id"]
        result["same_tokens"] = all(through_eos(a, eos) == through_eos(b, eos)
                                    for a, b in zip(served["tokens"], reference["tokens"]))
    return result


def summarise(runs: list[dict]) -> list[dict]:
    rows = []
    for run in runs:
        if run["status"] != "ok":
            rows.append({"library": run["library"], "S": run["length"], "status": run["status"],
                         "error": run.get("error")})
            continue
        ttft_times = run["ttft"] if run["library"] == "mindformers" else {
            k: run[k]["ttft"] for k in ("original", "fused")}
        row = {"library": run["library"], "S": run["length"], "status": "ok", "all_fused": run["all_fused"],
               "original_ttft_median_s": ttft_times["original"]["median_s"],
               "original_ttft_min_s": ttft_times["original"]["min_s"],
               "fused_ttft_median_s": ttft_times["fused"]["median_s"], "fused_ttft_min_s": ttft_times["fused"]["min_s"],
               "ttft_speedup": ttft_times["original"]["median_s"] / ttft_times["fused"]["median_s"],
               "logits_relative": run["logits_relative"]}
        if run["library"] == "mindnlp":
            row.update({"original_decode_step_median_s": run["original"]["decode_step"]["median_s"],
                        "fused_decode_step_median_s": run["fused"]["decode_step"]["median_s"],
                        "decode_speedup": run["original"]["decode_step"]["median_s"]
                        / run["fused"]["decode_step"]["median_s"], "same_tokens": run["same_tokens"],
                        "batch_lengths": run["batch_lengths"],
                        "original_batch_step_median_s": run["original"]["batch_decode_step"]["median_s"],
                        "fused_batch_step_median_s": run["fused"]["batch_decode_step"]["median_s"],
                        "batch_speedup": run["original"]["batch_decode_step"]["median_s"]
                        / run["fused"]["batch_decode_step"]["median_s"],
                        "batch_same_tokens": run["batch_same_tokens"],
                        "fused_batch_fallbacks": len(run["fused"]["batch_fallbacks"])})
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| library | S | TTFT original (s) | TTFT fused (s) | speed-up | decode step original / fused (ms) "
             "| batch decode step original / fused (ms), fallbacks |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['library']} | {r['S']} | {r['status']}: {r.get('error')} | | | | |")
            continue
        decode = (f"{r['original_decode_step_median_s'] * 1e3:.0f} / {r['fused_decode_step_median_s'] * 1e3:.0f}"
                  f" ({r['decode_speedup']:.2f}x)" if "decode_speedup" in r else "not fused (use_past)")
        batch = (f"{r['original_batch_step_median_s'] * 1e3:.0f} / {r['fused_batch_step_median_s'] * 1e3:.0f}"
                 f" ({r['batch_speedup']:.2f}x), {r['fused_batch_fallbacks']}" if "batch_speedup" in r else "")
        lines.append(f"| {r['library']} | {r['S']} | {r['original_ttft_median_s']:.2f} | {r['fused_ttft_median_s']:.2f} "
                     f"| {r['ttft_speedup']:.2f}x | {decode} | {batch} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the Llama2-7B-dimension model")
    parser.add_argument("--model", default="7b", help="models.llama preset the checkpoint's dimensions come from")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--batch-lengths", type=int, nargs="+", default=[512, 384, 256, 128],
                        help="mindnlp: prompt lengths of the left-padded batch generate decodes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--libraries", nargs="+", default=list(PYTHONS), choices=list(PYTHONS))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="fuse-weights-") as checkpoint:
        written = run_isolated("peers", "write_checkpoint", {"model": args.model, "layers": args.layers,
                                                              "seed": args.seed, "directory": checkpoint})
        if written["status"] != "ok":
            raise RuntimeError(f"could not write the weights: {written.get('error')}")
        for length in args.lengths:
            for library in args.libraries:
                base = {"library": library, "length": length}
                if not PYTHONS[library].exists():
                    runs.append({**base, "status": "skipped", "error": f"{PYTHONS[library]} missing (make thirdparty)"})
                    continue
                kwargs = {"checkpoint": checkpoint, "length": length, "repeats": args.repeats, "seed": args.seed}
                if library == "mindnlp":
                    kwargs.update(decode_steps=args.decode_steps, batch_lengths=args.batch_lengths)
                runs.append({**base, **run_isolated("fuse", f"{library}_point", kwargs, python=str(PYTHONS[library]))})
                print(f"{library} S={length}: {runs[-1]['status']}", flush=True)
        serving = None
        if set(args.libraries) == set(PYTHONS) and all(python.exists() for python in PYTHONS.values()):
            vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
            serving = serving_agreement(checkpoint, unequal_prompts(args.seed, args.batch_lengths, vocab),
                                        args.decode_steps)
            print(f"MindFormers use_past=True (fused) against transformers: same tokens "
                  f"{serving.get('same_tokens')}", flush=True)
    rows = summarise(runs)
    result = {"benchmark": "fuse", "machine": machine_info(), "settings": vars(args), "runs": runs, "rows": rows,
              "serving": serving}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuse.json").write_text(json.dumps(result, indent=2, default=str))
    print(table(rows))
    for run in runs:
        if run.get("report"):
            print(f"\n{run['library']} S={run['length']}:\n{run['report']}")
    print(f"wrote {out / 'fuse.json'}")
    disagreeing = disagreements(rows)
    if serving is not None and serving.get("same_tokens") is not True:
        disagreeing.append("MindFormers use_past=True against transformers")
    if disagreeing:
        raise RuntimeError(f"fused and original models disagree: {disagreeing}")
    return result


def disagreements(rows: list[dict]) -> list[str]:
    """Rows whose fused model computed other logits (beyond 1e-4 relative) or other greedy tokens."""
    return [f"{r['library']} S={r['S']}" for r in rows if r["status"] == "ok" and
            (r["logits_relative"] > 1e-4 or r.get("same_tokens") is False or r.get("batch_same_tokens") is False)]


if __name__ == "__main__":
    main()
