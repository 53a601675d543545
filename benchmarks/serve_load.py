"""The HTTP server (``python -m models.llama.serve``) under load from a load generator nobody here
wrote: NVIDIA's aiperf (``aiperf profile``, OpenAI-compatible streaming chat), in a virtual
environment of its own (``make aiperf``: .venv-aiperf, benchmarks/peers/aiperf.txt), against
llama.cpp's OpenAI server (llama-cpp-python's ``python -m llama_cpp.server``, ``make llama-cpp``:
.venv-llamacpp) on the same weights.

The model: a seeded random checkpoint of Llama2-7B dimensions, ``--layers`` layers, float16 weights
(``peers.write_half_checkpoint``), with a tokenizer of one character per token written by the
``tokenizers`` package (``peers.write_char_tokenizer``) that both servers and aiperf read: the
server from the checkpoint directory, llama.cpp from the same weights and vocabulary written as an
f16 GGUF file (``llama_cpp_peer.write_gguf``), aiperf (transformers' ``AutoTokenizer``) from the
directory, so a prompt is the same tokens for everyone and nothing is downloaded.

Systems (``--systems``): ``fused`` (the server's defaults: chunked prefill, prefix caching),
``no-chunked-prefill`` (``--no-chunked-prefill``), ``no-prefix-caching`` (``--no-prefix-caching``),
``llama.cpp`` (one sequence at a time, reusing the previous prompt's longest common prefix; started
with ``--interrupt_requests False``, as its default cuts a stream short whenever another request
waits). Traces (``--traces``, aiperf's synthetic prompts from its Shakespeare corpus, one
``--seed`` for every system, so every system gets the same prompts at the same times):

- ``chat``: every request the same ``--system-prompt``-token system prompt and a short user turn
  (``--user-turn`` tokens, normal with ``--user-turn-stddev``), ``--chat-new-tokens`` new tokens;
- ``random``: prompts uniform over ``--prompt-tokens`` x [1 - r, 1 + r] (``--range-ratio`` r) and
  new tokens over ``--random-new-tokens`` x [1 - r, 1 + r] (aiperf's ``--random-range-ratio``, as
  ``vllm bench serve``'s random dataset);
- ``burst``: a long prompt arriving while requests decode, on a fixed schedule (aiperf's
  ``--fixed-schedule`` over a mooncake-trace file): ``--burst-decoders`` requests of
  ``--burst-decoder-prompt`` tokens asking ``--burst-decode-tokens`` new ones at 0 ms, then one of
  ``--burst-prompt`` tokens asking ``--burst-new-tokens`` at ``--burst-at-ms``. Reported: the
  decoders' inter-token latency per token (aiperf's per-request records: the gap before each streamed
  chunk after the first, one token a chunk here), its median and p99, and the long prompt's TTFT.
  What chunked prefill is for: without it the decoders wait out the whole prompt's prefill.

``chat`` and ``random`` at every ``--rates`` (Poisson arrivals, requests per second), ``--requests``
requests; ``burst`` once, its rate given as None. Greedy
(``temperature`` 0) and of exactly the asked length: this server with ``ignore_eos``, llama.cpp with
the end-of-sequence token's ``logit_bias`` at -100 (it has no ``ignore_eos``; this server refuses a
``logit_bias``). Each (system, trace, rate) runs on a fresh server process on a free port (nothing
cached from an earlier run): started, ``/ready`` (llama.cpp: ``/v1/models``) awaited, one short
warm-up request, ``/metrics`` scraped, aiperf run, ``/metrics`` scraped again, the server stopped.

Reported per system, trace and rate: the client's (aiperf's) TTFT and inter-token latency p50 / p99
(aiperf's inter-token latency: a request's (latency - TTFT) / (output tokens - 1), the percentiles
over requests), output tokens/s over the run, and from the server's ``/metrics`` (the difference of
the two scrapes: aiperf's requests only) its own TTFT histogram's mean beside the client's and the
prefix-cache hit rate (``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``);
llama.cpp's server has no ``/metrics``: its prefix reuse is read from its log
(``llama_cpp_prefix_reuse``). Ratios against llama.cpp at each trace and rate. JSON
(``serve_load.json``) and a plot (``serve_load.png``) in ``--out``; ``--artifacts DIR`` keeps each
run's server log and aiperf's own files (its per-request records).

    python benchmarks/serve_load.py                 # every system, both traces, rates 0.1 and 0.2
    python benchmarks/serve_load.py --smoke         # tiny model, 3 requests a trace, this server only
    python benchmarks/serve_load.py --systems fused llama.cpp --traces chat --rates 0.1

Every run that fails ends the run with an error, after the results are written.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness import free_port, http_get, kill_group, machine_info, run_isolated, save, stop, tail, wait_ready

SCHEMA_VERSION = 1
ROOT = Path(__file__).resolve().parent.parent
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
LLAMA_CPP_PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"
SERVED_NAME = "llama2-7b-dims"
SYSTEMS = {  # name -> this server's extra flags (None: llama.cpp's server)
    "fused": [],
    "no-chunked-prefill": ["--no-chunked-prefill"],
    "no-prefix-caching": ["--no-prefix-caching"],
    "llama.cpp": None,
}
TRACES = ("chat", "random", "burst")
REFERENCE = "llama.cpp"
EOS_ID = 2  # the checkpoint's end of sequence (peers.CHAR_SPECIAL_TOKENS)


# ---------------------------------------------------------------------------------------------
# Pure parts: the load generator's export, the server's /metrics, the summary (tests/test_benchmarks.py).

_UNIT_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}


def _metric(export: dict, name: str) -> dict:
    value = export.get(name)
    return value if isinstance(value, dict) else {}


def _in_ms(export: dict, name: str, stat: str) -> float | None:
    """``export[name][stat]`` in milliseconds (aiperf names each metric's unit), or None."""
    metric = _metric(export, name)
    value = metric.get(stat)
    if value is None:
        return None
    unit = metric.get("unit", "ms")
    if unit not in _UNIT_MS:
        raise ValueError(f"aiperf export: {name} in unknown unit {unit!r}")
    return float(value) * _UNIT_MS[unit]


def parse_aiperf_export(export: dict) -> dict:
    """The figures this benchmark reports from aiperf's summary export (``profile_export_aiperf.json``,
    schema 1.x: one object per metric with its ``unit``, ``avg``, ``p50``, ``p99``, ...); times in ms."""
    def avg(name):
        value = _metric(export, name).get("avg")
        return None if value is None else float(value)

    return {"requests": int(avg("request_count") or 0), "errors": int(avg("error_request_count") or 0),
            "ttft_p50_ms": _in_ms(export, "time_to_first_token", "p50"),
            "ttft_p99_ms": _in_ms(export, "time_to_first_token", "p99"),
            "ttft_mean_ms": _in_ms(export, "time_to_first_token", "avg"),
            "itl_p50_ms": _in_ms(export, "inter_token_latency", "p50"),
            "itl_p99_ms": _in_ms(export, "inter_token_latency", "p99"),
            "itl_mean_ms": _in_ms(export, "inter_token_latency", "avg"),
            "output_tokens_per_s": avg("output_token_throughput"),
            "requests_per_s": avg("request_throughput"),
            "input_tokens_mean": avg("input_sequence_length"),
            "output_tokens_mean": avg("output_sequence_length"),
            # From the responses' usage, where the server reports it (this one does, llama-cpp-python's
            # stream does not): how far the client's count of output tokens is from the server's, and the
            # prompt tokens the server found cached (usage.prompt_tokens_details.cached_tokens).
            "output_tokens_vs_usage_pct": avg("usage_completion_tokens_diff_pct"),
            "usage_cached_tokens": avg("total_usage_prompt_cache_read_tokens"),
            "aiperf_version": export.get("aiperf_version"),
            "complete": export.get("is_complete", True) and not export.get("was_cancelled", False)}


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _record_values(metrics: dict, name: str) -> list[float]:
    """A per-request record's metric, a time in ms (a list for list-valued ones such as inter_chunk_latency);
    a count (its unit "tokens", not a time unit) as it is."""
    metric = metrics.get(name)
    if not isinstance(metric, dict) or metric.get("value") is None:
        return []
    scale = _UNIT_MS.get(metric.get("unit", "ms"), 1.0)
    value = metric["value"]
    return [float(v) * scale for v in (value if isinstance(value, list) else [value])]


def burst_figures(records_jsonl: str, long_prompt: int) -> dict:
    """The burst trace from aiperf's per-request records (``profile_export.jsonl``): the decoders' gaps
    between streamed chunks (every one, pooled over the decoders: one token a chunk) at p50 and p99, their
    ratio, and the longest (a whole-prompt prefill stalls each decoder once, for all of it: one gap in a
    hundred or more, below p99), and the long prompt's (input of at least half ``long_prompt`` tokens) TTFT."""
    import numpy as np

    gaps, long_ttft, decoders = [], None, 0
    for line in records_jsonl.splitlines():
        if not line.strip():
            continue
        metrics = json.loads(line).get("metrics", {})
        isl = _record_values(metrics, "input_sequence_length")
        if not isl:
            continue
        if isl[0] >= long_prompt / 2:
            long_ttft = (_record_values(metrics, "time_to_first_token") or [None])[0]
        else:
            decoders += 1
            gaps += _record_values(metrics, "inter_chunk_latency")
    p50, p99 = (float(np.percentile(gaps, q)) if gaps else None for q in (50, 99))
    return {"decoders": decoders, "decode_gaps": len(gaps), "decode_itl_p50_ms": p50, "decode_itl_p99_ms": p99,
            "decode_itl_p99_over_p50": p99 / p50 if gaps and p50 else None,
            "decode_itl_max_ms": max(gaps) if gaps else None, "long_prompt_ttft_ms": long_ttft}


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """The samples of a Prometheus text exposition: (name, labels, value), comments skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        found = _SAMPLE.match(line)
        if not found:
            raise ValueError(f"/metrics: not a sample line: {line!r}")
        name, labels, value = found.groups()
        samples.append((name, dict(_LABEL.findall(labels or "")), float(value)))
    return samples


def metric_total(samples: list, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there are none)."""
    return sum(v for n, l, v in samples if n == name and all(l.get(k) == x for k, x in labels.items()))


def histogram_mean(before: list, after: list, name: str) -> tuple[float | None, int]:
    """(mean of the observations of histogram ``name`` between two scrapes, their count): the
    growth of ``name_sum`` over the growth of ``name_count``; None when nothing was observed."""
    count = metric_total(after, f"{name}_count") - metric_total(before, f"{name}_count")
    total = metric_total(after, f"{name}_sum") - metric_total(before, f"{name}_sum")
    return (total / count if count > 0 else None), int(count)


def server_figures(before: list | None, after: list | None) -> dict:
    """What the server's /metrics says of the requests between two scrapes (None where it has none)."""
    if before is None or after is None:
        return {"metrics": False}

    def grew(name, **labels):
        return metric_total(after, name, **labels) - metric_total(before, name, **labels)

    figures = {"metrics": True}
    for key, name in (("ttft", "vllm:time_to_first_token_seconds"), ("itl", "vllm:inter_token_latency_seconds"),
                      ("queue", "vllm:request_queue_time_seconds"), ("prefill", "vllm:request_prefill_time_seconds"),
                      ("e2e", "vllm:e2e_request_latency_seconds")):
        mean, count = histogram_mean(before, after, name)
        figures[f"{key}_mean_ms"] = None if mean is None else mean * 1e3
        figures[f"{key}_count"] = count
    queries, hits = grew("vllm:prefix_cache_queries_total"), grew("vllm:prefix_cache_hits_total")
    figures.update({"prefix_cache_queries": queries, "prefix_cache_hits": hits,
                    "prefix_cache_hit_rate": hits / queries if queries > 0 else None,
                    "prompt_tokens": grew("vllm:prompt_tokens_total"),
                    "generation_tokens": grew("vllm:generation_tokens_total"),
                    "finished": {reason: grew("vllm:request_success_total", finished_reason=reason)
                                 for reason in ("stop", "length", "abort", "error")}})
    return figures


_REUSED = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")


def llama_cpp_prefix_reuse(log: str) -> dict:
    """llama.cpp's prefix reuse from its server's log (llama-cpp-python, verbose: its default), which
    has no /metrics: per request ``Llama.generate: N prefix-match hit, remaining M prompt tokens to
    eval`` where it kept the previous request's first N tokens, and llama.cpp's ``prompt eval time =
    ... / M tokens`` for each prompt it evaluated. Hit rate: kept tokens over kept + evaluated ones,
    the prompt tokens as /metrics' counters count them."""
    reused = sum(int(m.group(1)) for m in _REUSED.finditer(log))
    evaluated = [int(m.group(1)) for m in _PROMPT_EVAL.finditer(log)]
    total = reused + sum(evaluated)
    return {"requests": len(evaluated), "prompt_tokens": total, "reused_tokens": reused,
            "hit_rate": reused / total if total else None}


def summarize(runs: list[dict]) -> list[dict]:
    """One row per run: the client's figures, the server's, and status."""
    rows = []
    for run in runs:
        row = {"system": run["system"], "trace": run["trace"], "rate": run["rate"], "status": run["status"]}
        if run["status"] == "ok":
            row.update(parse_aiperf_export(run["aiperf"]))
            server = server_figures(run.get("metrics_before"), run.get("metrics_after"))
            hit_rate = server.get("prefix_cache_hit_rate")
            if "server_log" in run:  # llama.cpp: no /metrics, its log
                server["log"] = run["server_log"]
                hit_rate = run["server_log"]["hit_rate"]
            row.update(run.get("burst", {}))
            row.update({"server_ttft_mean_ms": server.get("ttft_mean_ms"),
                        "server_itl_mean_ms": server.get("itl_mean_ms"),
                        "prefix_cache_hit_rate": hit_rate, "server": server})
        else:
            row["error"] = run.get("error")
        rows.append(row)
    return rows


RATIO_FIELDS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tokens_per_s")


def ratios(rows: list[dict], reference: str = REFERENCE) -> list[dict]:
    """Each system's figures over ``reference``'s at the same trace and rate (times: below 1 is
    faster than the reference; output tokens/s: above 1 is more)."""
    out = []
    ok = [r for r in rows if r["status"] == "ok"]
    for ref in (r for r in ok if r["system"] == reference):
        for row in ok:
            if row["system"] == reference or (row["trace"], row["rate"]) != (ref["trace"], ref["rate"]):
                continue
            out.append({"system": row["system"], "trace": row["trace"], "rate": row["rate"], "against": reference,
                        **{f: (row[f] / ref[f] if row.get(f) is not None and ref.get(f) else None)
                           for f in RATIO_FIELDS}})
    return out


def _fmt(value, spec=".0f", none="n/a"):
    return none if value is None else format(value, spec)


def _ratio(value):
    return _fmt(value, ".2f") + ("x" if value is not None else "")


def table(results: dict) -> str:
    lines = ["| trace | req/s | system | requests (errors) | TTFT p50 / p99 ms | TTFT mean ms client / server "
             "| ITL p50 / p99 ms | output tokens/s | prefix-cache hits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["summary"]:
        if r["status"] != "ok":
            lines.append(f"| {r['trace']} | {r['rate']} | {r['system']} | {r['status']}: {r.get('error')} "
                         "| | | | | |")
            continue
        hits = r.get("prefix_cache_hit_rate")
        lines.append(
            f"| {r['trace']} | {r['rate']} | {r['system']} | {r['requests']} ({r['errors']}) | "
            f"{_fmt(r['ttft_p50_ms'])} / {_fmt(r['ttft_p99_ms'])} | {_fmt(r['ttft_mean_ms'])} / "
            f"{_fmt(r['server_ttft_mean_ms'], none='no /metrics' if not r['server']['metrics'] else 'n/a')} | "
            f"{_fmt(r['itl_p50_ms'], '.1f')} / {_fmt(r['itl_p99_ms'], '.1f')} | "
            f"{_fmt(r['output_tokens_per_s'], '.1f')} | "
            f"{_fmt(None if hits is None else 100 * hits, '.0f')}{'%' if hits is not None else ''}"
            f"{' (its log)' if 'log' in r['server'] else ''} |")
    bursts = [r for r in results["summary"] if r["status"] == "ok" and r.get("decode_gaps")]
    if bursts:
        lines += ["", "| burst: system | decoders' inter-token latency per token, p50 / p99 / max ms | p99 / p50 "
                      "| the long prompt's TTFT ms |", "|---|---|---|---|"]
        lines += [f"| {r['system']} | {_fmt(r['decode_itl_p50_ms'], '.1f')} / {_fmt(r['decode_itl_p99_ms'], '.1f')} / "
                  f"{_fmt(r.get('decode_itl_max_ms'), '.0f')} | {_ratio(r['decode_itl_p99_over_p50'])} | "
                  f"{_fmt(r['long_prompt_ttft_ms'])} |" for r in bursts]
    if results["ratios"]:
        lines += ["", f"| trace | req/s | system / {REFERENCE} | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
                      "| output tokens/s |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['trace']} | {r['rate']} | {r['system']} | "
                  + " | ".join(_ratio(r[f]) for f in RATIO_FIELDS) + " |"
                  for r in results["ratios"]]
    return "\n".join(lines)


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["summary"] if r["status"] == "ok"]
    traces = [t for t in TRACES if any(r["trace"] == t for r in rows)] or list(TRACES[:1])
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, axes = plt.subplots(len(traces), 3, figsize=(14, 3.6 * len(traces)), squeeze=False)
    for i, trace in enumerate(traces):
        rates = sorted({r["rate"] for r in rows if r["trace"] == trace})
        width = 0.8 / max(1, len(systems))
        for j, (field, p99, label) in enumerate((("ttft_p50_ms", "ttft_p99_ms", "TTFT p50, p99 dot (ms)"),
                                                 ("itl_p50_ms", "itl_p99_ms", "inter-token latency p50, p99 dot (ms)"),
                                                 ("output_tokens_per_s", None, "output tokens/s"))):
            ax = axes[i][j]
            for k, system in enumerate(systems):
                mine = {r["rate"]: r for r in rows if (r["system"], r["trace"]) == (system, trace)}
                xs = [x + k * width for x in range(len(rates))]
                bars = ax.bar(xs, [(mine.get(rate) or {}).get(field) or 0.0 for rate in rates], width, label=system)
                if p99:
                    ax.plot(xs, [(mine.get(rate) or {}).get(p99) or float("nan") for rate in rates], "o",
                            color=bars.patches[0].get_facecolor() if bars.patches else None, markeredgecolor="black")
            ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(rates))],
                          ["fixed schedule" if r is None else f"{r} req/s" for r in rates])
            ax.set_title(f"{trace}: {label}")
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"aiperf against the HTTP server: Llama2 {s['model']} dims, {s['layers']} layers, float16 weights, "
                 f"{s['requests']} requests per run, {results['machine']['cpus']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------
# The servers and the load generator (the parent process).

def server_command(system: str, args, checkpoint: str, gguf: str | None, port: int) -> list[str]:
    if SYSTEMS[system] is None:
        return [str(args.llama_cpp_python), "-m", "llama_cpp.server", "--model", gguf, "--model_alias", SERVED_NAME,
                "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(args.context),
                "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--chat_format", "llama-2",
                "--flash_attn", "true", "--interrupt_requests", "false", "--verbose", "true"]  # its log: reuse
    command = [sys.executable, "-m", "models.llama.serve", "--checkpoint", checkpoint, "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", SERVED_NAME, "--max-batch", str(args.max_batch),
               "--log-level", "warning", "--enable-prompt-tokens-details", *SYSTEMS[system]]  # usage's cached tokens
    budget = getattr(args, "max_num_batched_tokens", None)
    if budget and "--no-chunked-prefill" not in SYSTEMS[system]:
        command += ["--max-num-batched-tokens", str(budget)]
    return command + (["--cache-gib", str(args.cache_gib)] if args.cache_gib else [])


def extra_inputs(system: str) -> dict:
    """Greedy, exactly the asked number of new tokens."""
    if SYSTEMS[system] is None:
        return {"temperature": 0, "logit_bias": {str(EOS_ID): -100}}
    return {"temperature": 0, "ignore_eos": True}


def burst_schedule(args) -> list[dict]:
    """The burst trace's requests as mooncake-trace rows (aiperf's fixed schedule): the decoders at 0
    ms, the long prompt at ``burst_at_ms``."""
    decoder = {"timestamp": 0, "input_length": args.burst_decoder_prompt, "output_length": args.burst_decode_tokens}
    return [dict(decoder) for _ in range(args.burst_decoders)] + [
        {"timestamp": args.burst_at_ms, "input_length": args.burst_prompt, "output_length": args.burst_new_tokens}]


def trace_arguments(trace: str, args, directory: str) -> list[str]:
    """aiperf's options for a trace: its dataset's shape, and (burst) its schedule, written to ``directory``."""
    if trace == "burst":
        path = os.path.join(directory, "burst.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in burst_schedule(args))
        return ["--input-file", path, "--custom-dataset-type", "mooncake_trace", "--fixed-schedule"]
    if trace == "chat":
        return ["--shared-system-prompt-length", str(args.system_prompt), "--isl", str(args.user_turn),
                "--isl-stddev", str(args.user_turn_stddev), "--osl", str(args.chat_new_tokens), "--osl-stddev", "0"]
    return ["--isl", str(args.prompt_tokens), "--osl", str(args.random_new_tokens),
            "--random-range-ratio", str(args.range_ratio)]


def aiperf_command(args, system: str, trace: str, rate: float | None, url: str, tokenizer: str,
                   artifacts: str) -> list[str]:
    arrivals = [] if trace == "burst" else ["--request-rate", str(rate), "--arrival-pattern", "poisson",
                                            "--request-count", str(args.requests)]
    return [str(args.aiperf), "profile", "--model", SERVED_NAME, "--url", url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", tokenizer, *arrivals, "--random-seed", str(args.seed), "--use-legacy-max-tokens",
            "--extra-inputs", json.dumps(extra_inputs(system)), "--request-timeout-seconds",
            str(args.request_timeout), "--output-artifact-dir", artifacts, "--ui", "none", "--no-server-metrics",
            "--no-gpu-telemetry", "--workers-max", "1", "--record-processors", "1",
            *trace_arguments(trace, args, artifacts)]


def warm_up(base: str, system: str) -> None:
    """One short request of its own (no prompt of the trace): llama.cpp allocates its buffers."""
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Good morning"}], "max_tokens": 4,
            **extra_inputs(system)}
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        if response.status != 200:
            raise RuntimeError(f"warm-up request: HTTP {response.status}")


def scrape(base: str) -> list | None:
    """The server's /metrics samples, or None when it serves none (llama-cpp-python's server)."""
    status, text = http_get(base + "/metrics")
    return parse_prometheus(text) if status == 200 else None


def run_bounded(command: list[str], timeout_s: float, **popen) -> int:
    """``command``'s exit code; past ``timeout_s`` it and every process it started are killed (aiperf
    runs its services as processes of its own) and TimeoutExpired is raised."""
    process = subprocess.Popen(command, start_new_session=True, **popen)
    try:
        return process.wait(timeout=timeout_s)
    finally:
        kill_group(process)


def run_point(args, system: str, trace: str, rate: float, checkpoint: str, gguf: str | None, scratch: str) -> dict:
    """One (system, trace, rate) on a fresh server; the aiperf export and both /metrics scrapes."""
    name = f"{system}-{trace}-{rate}"
    artifacts = os.path.join(scratch, name)
    os.makedirs(artifacts, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = os.path.join(artifacts, "server.log")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("RFA_API_KEY", None)
    point = {"system": system, "trace": trace, "rate": rate, "port": port}
    with open(log_path, "w") as log:
        command = server_command(system, args, checkpoint, gguf, port)
        point["server_command"] = command
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            start = time.monotonic()
            wait_ready(process, base + ("/v1/models" if SYSTEMS[system] is None else "/ready"), log_path,
                       args.start_timeout)
            point["ready_s"] = time.monotonic() - start
            warm_up(base, system)
            point["metrics_before"] = scrape(base)
            log.flush()
            log_start = os.path.getsize(log_path)  # what the server logs from here on is aiperf's requests
            command = aiperf_command(args, system, trace, rate, base, checkpoint, artifacts)
            point["aiperf_command"] = command
            # Not HF_HUB_OFFLINE: aiperf then looks a local tokenizer directory up in the hub's cache. Its
            # temporary files (the dataset's memory maps, its children's logs) in the run's directory.
            temporary = os.path.join(artifacts, "tmp")
            os.makedirs(temporary, exist_ok=True)
            aiperf_env = dict(os.environ, HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false",
                              TMPDIR=temporary, AIPERF_DATASET_MMAP_CACHE_ENABLED="false")
            for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONPATH"):
                aiperf_env.pop(key, None)
            budget = (args.burst_at_ms / 1e3 if rate is None else args.requests / rate * 3) + args.request_timeout + 300
            with open(os.path.join(artifacts, "aiperf.out"), "w") as out:
                returncode = run_bounded(command, budget, cwd=artifacts, env=aiperf_env, stdout=out,
                                         stderr=subprocess.STDOUT)
            point["metrics_after"] = scrape(base)
            if SYSTEMS[system] is None:
                with open(log_path, errors="replace") as f:
                    f.seek(log_start)
                    point["server_log"] = llama_cpp_prefix_reuse(f.read())
            if returncode != 0:
                raise RuntimeError(f"aiperf exited with code {returncode}:\n"
                                   f"{tail(os.path.join(artifacts, 'aiperf.out'))}")
            exports = sorted(Path(artifacts).rglob("profile_export_aiperf.json"))
            if not exports:
                raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json:\n"
                                   f"{tail(os.path.join(artifacts, 'aiperf.out'))}")
            point["aiperf"] = json.loads(exports[0].read_text())
            if trace == "burst":
                records = sorted(Path(artifacts).rglob("profile_export.jsonl"))
                if not records:
                    raise RuntimeError("aiperf wrote no per-request records (profile_export.jsonl)")
                point["burst"] = burst_figures(records[0].read_text(), args.burst_prompt)
            point["status"] = "ok"
        except (RuntimeError, OSError, subprocess.SubprocessError, urllib.error.URLError) as exc:
            point.update(status="error", error=f"{type(exc).__name__}: {exc}"[:4000], server_log_tail=tail(log_path))
        finally:
            stop(process)
    if point["status"] == "ok":
        parsed = parse_aiperf_export(point["aiperf"])
        expected = args.burst_decoders + 1 if trace == "burst" else args.requests
        if parsed["errors"] or parsed["requests"] != expected or not parsed["complete"]:
            point.update(status="error", error=f"{parsed['requests']} of {expected} requests completed, "
                                               f"{parsed['errors']} failed (aiperf's error summary: "
                                               f"{point['aiperf'].get('error_summary')})")
    return point


def llama_cpp_missing(python: Path) -> str | None:
    """Why llama.cpp's server cannot run here, or None."""
    if not python.exists():
        return f"not installed: no llama.cpp interpreter at {python} (make llama-cpp installs it)"
    check = subprocess.run([str(python), "-c", "import llama_cpp.server.app"], capture_output=True, text=True)
    if check.returncode != 0:
        return (f"llama-cpp-python's server extra is not installed in {python.parent.parent} "
                f"(make llama-cpp installs it): {check.stderr.strip().splitlines()[-1:]}")
    return None


# Texts both servers must split alike: the corpus aiperf draws prompts from is Shakespeare's English, and
# each server wraps them in Llama 2's chat template.
TOKENIZER_PROBES = ("Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:",
                    "[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nRough winds do shake the darling buds [/INST]",
                    "  two spaces, a\ttab, digits 0123456789 and {brackets} | ~")


def check_tokenizers_agree(gguf: str, tokenizer_json: str, llama_cpp_python) -> dict:
    """llama.cpp's ids of ``TOKENIZER_PROBES`` (``llama_cpp_peer.tokenize_point``) against the
    ``tokenizers`` package's on ``tokenizer_json``, the server's: a prompt must be the same tokens for
    both, or the two would not compute the same requests. Raises where they differ."""
    from tokenizers import Tokenizer

    ours = [Tokenizer.from_file(tokenizer_json).encode(text, add_special_tokens=False).ids
            for text in TOKENIZER_PROBES]
    theirs = run_isolated("llama_cpp_peer", "tokenize_point", {"model": gguf, "texts": list(TOKENIZER_PROBES)},
                          python=str(llama_cpp_python))
    if theirs["status"] != "ok":
        raise RuntimeError(f"llama.cpp could not tokenize: {theirs.get('error')}\n{theirs.get('log_tail', '')}")
    differ = [text for text, a, b in zip(TOKENIZER_PROBES, ours, theirs["ids"]) if a != b]
    if differ:
        raise RuntimeError(f"llama.cpp splits these texts unlike the server's tokenizer: {differ}")
    return {"texts": len(TOKENIZER_PROBES), "tokens": sum(map(len, ours)),
            "llama_cpp_python": theirs["version"], "llama_cpp_system_info": theirs["system_info"]}


SMOKE = {"model": "tiny", "layers": 2, "requests": 3, "rates": [2.0], "systems": ["fused"],
         "system_prompt": 96, "user_turn": 16, "user_turn_stddev": 4, "chat_new_tokens": 8, "prompt_tokens": 64,
         "random_new_tokens": 8, "max_batch": 4, "cache_gib": 0.05, "burst_decoder_prompt": 8,
         "burst_decode_tokens": 24, "burst_prompt": 120, "burst_new_tokens": 4, "burst_at_ms": 300}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="a quick functional check: the tiny model, this server alone, both traces at 2 "
                             "requests/s, 3 requests each (serve_load.SMOKE; options given still win)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    parser.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2], help="requests per second (Poisson)")
    parser.add_argument("--requests", type=int, default=16, help="requests per run")
    parser.add_argument("--model", default="7b", choices=["7b", "tiny"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the weights' and aiperf's seed")
    parser.add_argument("--system-prompt", type=int, default=1000, help="chat: tokens of the shared system prompt")
    parser.add_argument("--user-turn", type=int, default=32, help="chat: mean tokens of the user turn")
    parser.add_argument("--user-turn-stddev", type=int, default=8)
    parser.add_argument("--chat-new-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="random: mean prompt tokens")
    parser.add_argument("--random-new-tokens", type=int, default=48, help="random: mean new tokens")
    parser.add_argument("--range-ratio", type=float, default=0.75, help="random: uniform over mean x [1-r, 1+r]")
    parser.add_argument("--burst-decoders", type=int, default=4, help="burst: requests decoding when the long one comes")
    parser.add_argument("--burst-decoder-prompt", type=int, default=64)
    parser.add_argument("--burst-decode-tokens", type=int, default=160)
    parser.add_argument("--burst-prompt", type=int, default=4000, help="burst: the long prompt's tokens")
    parser.add_argument("--burst-new-tokens", type=int, default=8)
    parser.add_argument("--burst-at-ms", type=int, default=3000, help="burst: when the long prompt arrives")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="this server's chunked-prefill budget (default: the server's own)")
    parser.add_argument("--max-batch", type=int, default=8, help="this server's --max-batch")
    parser.add_argument("--cache-gib", type=float, default=2.0, help="this server's --cache-gib")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama.cpp's threads")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to be ready")
    parser.add_argument("--request-timeout", type=float, default=900.0, help="aiperf's per-request timeout")
    parser.add_argument("--aiperf", default=str(AIPERF), help="aiperf's command (make aiperf installs it)")
    parser.add_argument("--llama-cpp-python", default=str(LLAMA_CPP_PYTHON),
                        help="the interpreter of llama.cpp's environment (make llama-cpp)")
    parser.add_argument("--artifacts", help="keep each run's server log and aiperf artifacts (per-request records) "
                                            "in this directory (default: a temporary one, removed)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    if args.smoke:  # its settings as defaults: what the command line gives still wins
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    if not Path(args.aiperf).exists():
        raise SystemExit(f"no aiperf at {args.aiperf}: make aiperf installs it (.venv-aiperf)")
    args.aiperf, args.llama_cpp_python = Path(args.aiperf), Path(args.llama_cpp_python)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = {"schema_version": SCHEMA_VERSION, "machine": machine_info(), "settings": settings,
               "load_generator": {"name": "aiperf", "version": _aiperf_version(args.aiperf)}, "runs": []}
    skipped = {}
    if REFERENCE in args.systems:
        reason = llama_cpp_missing(args.llama_cpp_python)
        if reason:
            skipped[REFERENCE] = reason
            print(f"{REFERENCE}: skipped: {reason}", flush=True)
    with tempfile.TemporaryDirectory(prefix="serve-load-") as scratch:
        checkpoint = os.path.join(scratch, "checkpoint")
        written = run_isolated("peers", "write_half_checkpoint", {"model": args.model, "layers": args.layers,
                                                                    "seed": args.seed, "directory": checkpoint})
        if written["status"] != "ok":
            raise RuntimeError(f"could not write the checkpoint: {written.get('error')}\n{written.get('log_tail', '')}")
        vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
        tokenizer = run_isolated("peers", "write_char_tokenizer", {"directory": checkpoint, "vocab_size": vocab})
        if tokenizer["status"] != "ok":
            raise RuntimeError(f"could not write the tokenizer: {tokenizer.get('error')}")
        args.context = json.loads((Path(checkpoint) / "config.json").read_text())["max_position_embeddings"]
        gguf = None
        if REFERENCE in args.systems and REFERENCE not in skipped:
            gguf = os.path.join(scratch, "model-f16.gguf")
            converted = run_isolated("llama_cpp_peer", "write_gguf", {
                "checkpoint": checkpoint, "path": gguf, "tensor_type": "f16",
                "tokenizer": os.path.join(checkpoint, "tokenizer.json")}, python=str(args.llama_cpp_python))
            if converted["status"] != "ok":
                raise RuntimeError(f"could not write the GGUF file: {converted.get('error')}\n"
                                   f"{converted.get('log_tail', '')}")
            results["tokenizers_agree"] = check_tokenizers_agree(gguf, os.path.join(checkpoint, "tokenizer.json"),
                                                                 args.llama_cpp_python)
        results["checkpoint_bytes"] = written["bytes"]
        for trace in args.traces:
            for rate in ([None] if trace == "burst" else args.rates):
                for system in args.systems:
                    if system in skipped:
                        results["runs"].append({"system": system, "trace": trace, "rate": rate, "status": "skipped",
                                                "error": skipped[system]})
                        continue
                    print(f"{trace} at {rate} req/s: {system}", flush=True)
                    results["runs"].append(run_point(args, system, trace, rate, checkpoint, gguf,
                                                     args.artifacts or scratch))
                    if results["runs"][-1]["status"] != "ok":
                        print(f"  failed: {results['runs'][-1]['error'][:400]}", flush=True)
    results["summary"] = summarize(results["runs"])
    results["ratios"] = ratios(results["summary"])
    save(results, args.out, "serve_load.json", "serve_load.png", plot, table)
    failed = [f"{r['system']} {r['trace']} {r['rate']}" for r in results["runs"] if r["status"] == "error"]
    if failed:
        raise SystemExit(f"runs failed: {', '.join(failed)} (results written)")
    return results


def _aiperf_version(aiperf: Path) -> str | None:
    python = aiperf.parent / "python"
    if not python.exists():
        return None
    done = subprocess.run([str(python), "-c", "from importlib.metadata import version; print(version('aiperf'))"],
                          capture_output=True, text=True)
    return done.stdout.strip() or None


if __name__ == "__main__":
    main()
