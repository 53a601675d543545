"""The HTTP server (``python -m models.llama.serve``) under hostile and careless clients, measured
(issue 64): a normal chat trace alone, then the same trace beside each attack, all against one server
on the tiny model (``--model tiny``: random weights, a word-level tokenizer of ``w<i>`` words, a
context of 512) on a free loopback port.

The normal trace: ``--requests`` streamed chat requests, one every ``--interval`` seconds (an open
loop: a refused request does not hurry the next one, so the trace spans the attack), each on a
connection of its own; greedy, ``--max-tokens`` new tokens (``ignore_eos``), prompts of 16-48 words.
Every trace has the same prompt lengths (``--seed``) and words of its own, so no trace finds another's
prompts in the prefix cache; one untimed trace warms the server up first. Per request: its TTFT (sent
to its first chunk with content) and its outcome:

- ok: 200, a stream to ``[DONE]`` without an error event, finished by length or stop;
- refused: 429 or 503 answered within ``REFUSED_WITHIN_S`` (or the connection refused) while the
  attack holds a cap (below): the server said no at once, as it should when full;
- failed: anything else (another status, a refusal while no cap is held, a stream cut short or
  carrying an error event, no answer within ``--request-timeout``).

The attacks (``--attacks``), in this order, after the trace alone (the baseline):

- ``idle``: ``--max-connections`` TCP connections that send nothing, the server started with
  ``--max-connections`` and ``--header-timeout`` (128 by default: above the disconnect attack's 64
  streams and the trace, so only this attack fills it). The cap is held until the server has closed
  the last of them, so every request sent after that must succeed. A server without those flags
  (issue 64's F2 not in) gets neither, and the attack is skipped, saying so.
- ``large-bodies``: eight concurrent chat bodies of 100,001 two-word messages (about 4 MiB, under
  the server's ``--max-body-bytes``), sent half a second before the trace; the cap is held until the
  last is answered. The server's resident memory (``VmRSS``) before, at its peak (every 0.1 s) and
  ``SETTLE_S`` after the last answer.
- ``poison``: requests with ``temperature`` 5e-324 and 1e-310 in turn, every 0.25 s while the trace
  runs (their answers are reported; no cap is held).
- ``disconnect``: 64 streamed requests of 256 new tokens that close their connection after their
  first chunk, sent with the trace; the cap is held while any of them is open. The trace's requests
  sent before the last of them left queue behind their prompts (first come, first served: 64 requests
  of one client are ahead of them, which is fairness between clients, a gateway's job); they must not
  fail, and their count and longest TTFT are reported, but the percentiles and the 2x rule are over
  the requests sent after the streams left: what the disconnects cost once they happened.
- ``sigterm``: SIGTERM once the trace's middle request has its first chunk. The requests in flight
  must finish, later ones be refused (503 while the server drains, the connection refused once it
  has exited), and the process exit 0 within ``--drain-budget`` seconds. It ends the server, so it
  runs last, on the server the others ran on.

Reported per attack: the trace's TTFT p50 / p99 over its ok requests, its ok, refused and failed
counts, its p99 over the baseline's, and PASS or FAIL by the issue's rule: no failed request, at
least one ok, the p99 at most ``P99_LIMIT`` times the baseline's, and the attack's own conditions
(the idle connections closed by the server with a request sent after; the exit code 0). JSON
(``serve_faults.json``), a plot (``serve_faults.png``) and the server's log
(``serve_faults-server.log``) in ``--out``.

    python benchmarks/serve_faults.py                  # every attack, 96 requests a trace (about 3 minutes)
    python benchmarks/serve_faults.py --smoke          # 8 requests a trace: poison, disconnect, sigterm
    python benchmarks/serve_faults.py --attacks idle poison --server-args "--max-batch 4"

An attack that fails the rule ends the run with an error, after the results are written.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from harness import free_port, machine_info, rss_bytes, save, stop, tail, wait_ready

SCHEMA_VERSION = 1
ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
VOCAB = 256  # the tiny preset's: words w3..w255 (w0 is the unknown word, w1 and w2 BOS and EOS)
ATTACKS = ("idle", "large-bodies", "poison", "disconnect", "sigterm")  # run in this order: sigterm ends the server
REFUSAL_STATUSES = (429, 503)
REFUSED_WITHIN_S = 1.0  # what "answered at once" means for a refusal
P99_LIMIT = 2.0  # the issue's rule: no attack moves the trace's p99 TTFT past twice its value alone
POISONED_TEMPERATURES = (5e-324, 1e-310)  # subnormals: logits / temperature overflows (issue 64, F1)
LARGE_BODIES, LARGE_BODY_MESSAGES = 8, 100_001
DISCONNECTING_STREAMS, DISCONNECTING_TOKENS = 64, 256
SETTLE_S = 3.0  # after the large bodies are answered, before the server's memory is read again
CAP_FLAGS = ("--max-connections", "--header-timeout")


# ---------------------------------------------------------------------------------------------
# Pure parts: the outcome of a request, the summary and the rule (tests/test_benchmarks.py).

def percentile(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def outcome(record: dict) -> str:
    """"ok", "refused" or "failed" (the module's docstring); ``record["cap_held"]``: whether the attack
    held a cap when the request was sent."""
    if (record["status"] == 200 and record["done"] and record["error"] is None
            and record["finish_reason"] in ("length", "stop")):
        return "ok"
    refusal = record["status"] in REFUSAL_STATUSES or record["connection_refused"]
    at_once = record["answered_s"] is not None and record["answered_s"] <= REFUSED_WITHIN_S
    return "refused" if record["cap_held"] and refusal and at_once else "failed"


def failure(record: dict) -> str:
    """What went wrong with a failed request, in a few words (counted in the summary)."""
    if record["status"] is None:
        return (record["error"] or "no answer").split(":")[0]
    if record["status"] != 200:
        return f"HTTP {record['status']}"
    if record["error"] is not None:
        return "an error event"
    return "no [DONE]" if not record["done"] else f"finish_reason {record['finish_reason']}"


def judge(row: dict) -> list[str]:
    """Why ``row`` (an attack's summary) fails the issue's rule: nothing when it passes."""
    reasons = list(row["problems"])
    if row["failed"]:
        kinds = ", ".join(f"{kind}: {n}" for kind, n in row["failures"].items())
        reasons.append(f"{row['failed']} of {row['requests']} normal requests failed ({kinds})")
    if not row["ok"]:
        reasons.append("no normal request was served")
    ratio = row["p99_over_alone"]
    if ratio is not None and ratio > P99_LIMIT:
        reasons.append(f"the p99 TTFT is {ratio:.2f}x its value alone (at most {P99_LIMIT:g}x)")
    return reasons


def summarize(attack: str, records: list[dict], alone_p99_ms: float | None, problems=()) -> dict:
    """One row: the trace's TTFT p50 / p99 over its ok requests, its counts, the p99 over the trace's
    alone (``alone_p99_ms``; None for the baseline itself) and the verdict. Requests marked ``queued``
    (sent while the attack's own requests were ahead of them in the queue) count as ok or failed but not
    in the percentiles: their count and longest TTFT are reported apart."""
    outcomes = [outcome(r) for r in records]
    served = [(r["ttft_s"] * 1e3, r.get("queued", False)) for r, o in zip(records, outcomes)
              if o == "ok" and r["ttft_s"] is not None]
    ttfts = [t for t, queued in served if not queued]
    p99 = percentile(ttfts, 99)
    row = {"attack": attack, "requests": len(records), "ok": outcomes.count("ok"),
           "refused": outcomes.count("refused"), "failed": outcomes.count("failed"),
           "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": p99,
           "queued": sum(queued for _, queued in served),
           "queued_ttft_max_ms": max((t for t, queued in served if queued), default=None),
           "p99_over_alone": p99 / alone_p99_ms if p99 is not None and alone_p99_ms else None,
           "failures": dict(Counter(failure(r) for r, o in zip(records, outcomes) if o == "failed")),
           "problems": list(problems)}
    row["reasons"] = judge(row)
    row["verdict"] = "FAIL" if row["reasons"] else "PASS"
    return row


def not_run(attack: str, verdict: str, reason: str) -> dict:
    """The row of an attack that did not run: SKIPPED (it cannot, here) or FAIL (it broke)."""
    return {"attack": attack, "verdict": verdict, "reasons": [reason]}


def _fmt(value, spec=".0f"):
    return "n/a" if value is None else format(value, spec)


def table(results: dict) -> str:
    lines = ["| attack | requests | ok | refused | failed | TTFT p50 / p99 ms | p99 / alone | queued: most ms | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in results["summary"]:
        if "requests" not in row:
            lines.append(f"| {row['attack']} | | | | | | | | {row['verdict']}: {row['reasons'][0]} |")
            continue
        ratio = row["p99_over_alone"]
        queued = f"{row['queued']}: {row['queued_ttft_max_ms']:.0f}" if row.get("queued") else "-"
        lines.append(f"| {row['attack']} | {row['requests']} | {row['ok']} | {row['refused']} | {row['failed']} | "
                     f"{_fmt(row['ttft_p50_ms'], '.1f')} / {_fmt(row['ttft_p99_ms'], '.1f')} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} | {queued} | {row['verdict']} |")
    lines.append("")
    for row in results["summary"]:
        details = results["runs"].get(row["attack"], {}).get("details")
        if details:
            lines.append(f"{row['attack']}: {json.dumps(details)}")
        if row["verdict"] == "FAIL" and "requests" in row:
            lines.append(f"{row['attack']} FAILS: {'; '.join(row['reasons'])}")
    return "\n".join(lines)


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["summary"] if "requests" in r]
    names = [r["attack"] for r in rows]
    xs = np.arange(len(rows))
    fig, (ttft, counts) = plt.subplots(1, 2, figsize=(13, 4.2))
    nan = float("nan")  # no bar: no ok request
    ttft.bar(xs - 0.2, [r["ttft_p50_ms"] or nan for r in rows], 0.4, label="p50")
    ttft.bar(xs + 0.2, [r["ttft_p99_ms"] or nan for r in rows], 0.4, label="p99",
             color=["tab:red" if r["verdict"] == "FAIL" else "tab:orange" for r in rows])
    alone = next((r["ttft_p99_ms"] for r in rows if r["attack"] == "alone"), None)
    if alone:
        ttft.axhline(P99_LIMIT * alone, color="black", linestyle="--", linewidth=1,
                     label=f"{P99_LIMIT:g}x the p99 alone")
    ttft.set_xticks(xs, names)
    ttft.set_yscale("log")  # an attack may move it a hundredfold
    ttft.set_ylabel("ms")
    ttft.set_title("the normal trace's TTFT (red: the attack fails the rule)")
    ttft.legend(fontsize=8)
    bottom = np.zeros(len(rows))
    for key, colour in (("ok", "tab:green"), ("refused", "tab:gray"), ("failed", "tab:red")):
        values = np.array([r[key] for r in rows], dtype=float)
        counts.bar(xs, values, 0.6, bottom=bottom, label=key, color=colour)
        bottom += values
    counts.set_xticks(xs, names)
    counts.set_title("the normal trace's requests")
    counts.legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"the HTTP server on the tiny model beside each attack: {s['requests']} streamed chat requests, "
                 f"one every {s['interval']} s, {s['max_tokens']} new tokens, {results['machine']['cpus']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------
# The client: the trace and the attacks (httpx, one event loop; raw sockets for the idle connections).

def trace_bodies(requests: int, max_tokens: int, seed: int, run: int) -> list[dict]:
    """The trace's requests: prompt lengths from ``seed`` alone (every run the same shape), words from
    ``(seed, run)`` (each run's own, nothing found in the prefix cache)."""
    lengths = random.Random(seed).choices(range(16, 49), k=requests)
    words = random.Random(f"{seed}-{run}")
    return [{"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
             "messages": [{"role": "user", "content": " ".join(f"w{words.randrange(3, VOCAB)}" for _ in range(n))}]}
            for n in lengths]


def large_body() -> bytes:
    """A chat body of 100,001 short messages, about 4 MiB (issue 64's F3 reproduction)."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "w5 w6"} for i in range(LARGE_BODY_MESSAGES)]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()


async def send_chat(client, url: str, body: dict, timeout_s: float, first_chunk: asyncio.Event | None = None,
                    leave_after_first: bool = False) -> dict:
    """One streamed request: its status, when it was answered (headers) and its first content came
    (seconds after it was sent), whether the stream reached ``[DONE]``, its finish reason, its error
    (an error event, another status's body, an exception). ``leave_after_first``: close the
    connection at the first content chunk."""
    import httpx

    record = {"status": None, "answered_s": None, "ttft_s": None, "done": False, "finish_reason": None,
              "error": None, "connection_refused": False}
    start = time.monotonic()

    async def exchange():
        async with client.stream("POST", url, json=body) as response:
            record["status"], record["answered_s"] = response.status_code, time.monotonic() - start
            if response.status_code != 200:
                record["error"] = (await response.aread()).decode(errors="replace")[:300]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    record["done"] = True
                    return
                event = json.loads(data)
                if "error" in event:
                    record["error"] = json.dumps(event["error"])[:300]
                for choice in event.get("choices", ()):
                    record["finish_reason"] = choice.get("finish_reason") or record["finish_reason"]
                    if choice.get("delta", {}).get("content") and record["ttft_s"] is None:
                        record["ttft_s"] = time.monotonic() - start
                        if first_chunk is not None:
                            first_chunk.set()
                        if leave_after_first:
                            return

    try:
        await asyncio.wait_for(exchange(), timeout_s)
    except asyncio.TimeoutError:
        record["error"] = f"no answer within {timeout_s:g} s"
    except httpx.ConnectError as exc:  # on loopback: nothing listens (a connect timeout is another class)
        record.update(connection_refused=True, answered_s=time.monotonic() - start, error=f"ConnectError: {exc}")
    except (httpx.HTTPError, ValueError) as exc:  # the connection broke, or a line was not JSON
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
    record["finished_s"] = time.monotonic() - start
    return record


class Attacks:
    """The trace and each attack against one server (``process``, at ``port``)."""

    def __init__(self, client, process, port: int, args):
        self.client, self.process, self.port, self.args = client, process, port, args
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.runs = 0
        self.queued_until: float | None = None  # the trace queues behind the attack's own requests until then

    async def trace(self, first_chunks: list[asyncio.Event] | None = None) -> tuple[float, list[dict]]:
        """(its start, its records): the trace's requests at their times, each with ``sent_at``."""
        args = self.args
        bodies = trace_bodies(args.requests, args.max_tokens, args.seed, self.runs)
        self.runs += 1
        start = time.monotonic()

        async def one(i, body):
            await asyncio.sleep(max(0.0, start + i * args.interval - time.monotonic()))
            sent = time.monotonic()
            record = await send_chat(self.client, self.url, body, args.request_timeout,
                                     first_chunks[i] if first_chunks else None)
            return {"i": i, "sent_at": sent, **record}

        return start, list(await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies))))

    async def alone(self):
        start, records = await self.trace()
        return start, records, lambda sent: False, {}, []

    async def idle(self):
        n, timeout = self.args.max_connections, self.args.header_timeout

        async def closed_by_server(reader):
            try:
                while await reader.read(4096):  # whatever it answers (a 408?), until it closes
                    pass
            except OSError:
                pass
            return time.monotonic()

        connections, watchers = [], []
        try:
            for _ in range(n):
                connections.append(await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), 5))
            opened = time.monotonic()
            watchers = [asyncio.create_task(closed_by_server(reader)) for reader, _ in connections]
            start, records = await self.trace()
            done, _ = await asyncio.wait(watchers, timeout=max(0.0, opened + timeout + 5 - time.monotonic()))
        finally:
            for watcher in watchers:
                watcher.cancel()
            for _, writer in connections:
                writer.close()
        closes = sorted(w.result() for w in done)
        released = closes[-1] if len(closes) == n else float("inf")
        problems = []
        if len(closes) < n:
            problems.append(f"{n - len(closes)} of {n} idle connections still open {timeout + 5:g} s after they "
                            "were opened (no header timeout?)")
        elif not any(r["sent_at"] > released for r in records):
            problems.append("no normal request was sent after the server closed the idle connections "
                            "(lengthen the trace: --requests, --interval)")
        details = {"connections": n, "header_timeout_s": timeout, "closed_by_server": len(closes),
                   "first_closed_after_s": closes[0] - opened if closes else None,
                   "last_closed_after_s": closes[-1] - opened if len(closes) == n else None}
        return start, records, lambda sent: sent < released, details, problems

    async def large_bodies(self):
        import httpx

        body, pid = large_body(), self.process.pid
        before = peak = rss_bytes(pid)
        sampling = True

        async def sample():
            nonlocal peak
            while sampling:
                peak = max(peak, rss_bytes(pid))
                await asyncio.sleep(0.1)

        async def send():
            try:
                response = await self.client.post(self.url, content=body, timeout=self.args.large_body_timeout,
                                                   headers={"Content-Type": "application/json"})
                answer = response.status_code
            except httpx.HTTPError as exc:
                answer = type(exc).__name__
            return answer, time.monotonic()

        sampler = asyncio.create_task(sample())
        try:
            senders = [asyncio.create_task(send()) for _ in range(LARGE_BODIES)]
            await asyncio.sleep(0.5)
            start, records = await self.trace()
            answers = await asyncio.gather(*senders)
            await asyncio.sleep(SETTLE_S)
        finally:
            sampling = False
            await sampler
        released = max(t for _, t in answers)
        after = rss_bytes(pid)
        details = {"bodies": LARGE_BODIES, "body_bytes": len(body),
                   "answers": dict(Counter(str(a) for a, _ in answers)),
                   "last_answered_after_s": released - start,
                   "rss_before_mb": before / 2**20, "rss_peak_mb": peak / 2**20, "rss_after_mb": after / 2**20,
                   "rss_after_s": SETTLE_S}
        return start, records, lambda sent: sent < released, details, []

    async def poison(self):
        import httpx

        async def poisoned(temperature):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "w9 w8 w7"}], "ignore_eos": True,
                    "max_tokens": self.args.max_tokens, "temperature": temperature}
            try:
                response = await self.client.post(self.url, json=body, timeout=self.args.request_timeout)
                return str(response.status_code)
            except httpx.HTTPError as exc:
                return type(exc).__name__

        trace = asyncio.create_task(self.trace())
        attackers = []
        while not trace.done():
            attackers.append(asyncio.create_task(poisoned(POISONED_TEMPERATURES[len(attackers) % 2])))
            await asyncio.wait([trace], timeout=0.25)
        start, records = trace.result()
        answers = await asyncio.gather(*attackers)
        details = {"temperatures": list(POISONED_TEMPERATURES), "requests": len(answers),
                   "answers": dict(Counter(answers))}
        return start, records, lambda sent: False, details, []

    async def disconnect(self):
        body = {"model": MODEL, "max_tokens": DISCONNECTING_TOKENS, "ignore_eos": True, "stream": True}

        async def leave(i):  # ended by its first chunk, or by the request timeout
            record = await send_chat(self.client, self.url,
                                     {**body, "messages": [{"role": "user", "content": f"w{3 + i} w7"}]},
                                     self.args.request_timeout, leave_after_first=True)
            return record, time.monotonic()

        streams = [asyncio.create_task(leave(i)) for i in range(DISCONNECTING_STREAMS)]
        start, records = await self.trace()
        left = await asyncio.gather(*streams)
        released = max(t for _, t in left)
        self.queued_until = released  # until then the trace's requests queue behind the streams' prompts
        details = {"streams": DISCONNECTING_STREAMS,
                   "left_after_first_chunk": sum(r["ttft_s"] is not None for r, _ in left),
                   "answers": dict(Counter(str(r["status"]) for r, _ in left)),
                   "last_left_after_s": released - start}
        return start, records, lambda sent: sent < released, details, []

    async def sigterm(self):
        args = self.args
        first_chunks = [asyncio.Event() for _ in range(args.requests)]
        middle = args.requests // 2
        trace = asyncio.create_task(self.trace(first_chunks))
        problems = []
        try:
            await asyncio.wait_for(first_chunks[middle].wait(), middle * args.interval + args.request_timeout)
        except asyncio.TimeoutError:
            problems.append(f"the trace's middle request (#{middle}) never streamed: SIGTERM sent anyway")
        signalled = time.monotonic()
        self.process.send_signal(signal.SIGTERM)

        def exit_code():  # and when: watched from the signal on
            try:
                return self.process.wait(args.drain_budget), time.monotonic()
            except subprocess.TimeoutExpired:
                return None, None

        exited = asyncio.get_running_loop().run_in_executor(None, exit_code)
        start, records = await trace
        code, exited_at = await exited
        if code is None:
            problems.append(f"the server had not exited {args.drain_budget:g} s after the signal")
        elif code != 0:
            problems.append(f"the server exited with code {code} (0 expected: a drain)")
        in_flight = [r for r in records if r["sent_at"] < signalled < r["sent_at"] + r["finished_s"]]
        details = {"signalled_after_s": signalled - start, "in_flight_at_signal": len(in_flight),
                   "sent_after_signal": sum(r["sent_at"] >= signalled for r in records), "exit_code": code,
                   "exited_after_s": None if code is None else exited_at - signalled}
        return start, records, lambda sent: sent >= signalled, details, problems


def attack_budget(args) -> float:
    """Seconds an attack may take in all: the trace's span and every wait of its own, with room."""
    return (args.requests * args.interval + args.request_timeout + args.large_body_timeout + args.drain_budget
            + args.header_timeout + 120)


async def run_attacks(process, port: int, args, attacks: list[str], skips: dict) -> tuple[list[dict], dict]:
    """The warm-up, the baseline, then each attack: (summary rows, each run's records and details)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)  # a connection per request
    rows, runs = [], {}
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.request_timeout, connect=5.0),
                                 trust_env=False) as client:
        bench = Attacks(client, process, port, args)
        await bench.trace()  # the warm-up: untimed, its records dropped
        alone_p99 = None
        for name in ["alone", *attacks]:
            if name in skips:
                rows.append(not_run(name, "SKIPPED", skips[name]))
                print(f"{name}: skipped: {skips[name]}", flush=True)
                continue
            if process.poll() is not None:
                rows.append(not_run(name, "FAIL", f"not run: the server had exited with code {process.returncode}"))
                continue
            print(f"{name}", flush=True)
            bench.queued_until = None
            try:
                start, records, cap_held, details, problems = await asyncio.wait_for(
                    getattr(bench, name.replace("-", "_"))(), attack_budget(args))
            except Exception as exc:  # noqa: BLE001  one attack that cannot run must not lose the others
                rows.append(not_run(name, "FAIL", f"the attack could not run: {type(exc).__name__}: {exc}"[:1000]))
                continue
            for record in records:
                sent = record.pop("sent_at")
                record.update(cap_held=cap_held(sent), sent_s=sent - start,
                              queued=bench.queued_until is not None and sent < bench.queued_until)
                record["outcome"] = outcome(record)
            row = summarize(name, records, alone_p99, problems)
            if name == "alone":
                alone_p99 = row["ttft_p99_ms"]
            rows.append(row)
            runs[name] = {"records": records, "details": details}
    return rows, runs


def server_command(port: int, args, cap_flags: bool) -> list[str]:
    command = [sys.executable, "-m", "models.llama.serve", "--model", MODEL, "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning"]
    if cap_flags:
        command += ["--max-connections", str(args.max_connections), "--header-timeout", str(args.header_timeout)]
    return command + shlex.split(args.server_args)


def start_server(args, log_path: Path, cap_flags: bool) -> tuple[subprocess.Popen, int, list[str]]:
    """The server, ready; RuntimeError (its log's tail) when it is not."""
    port = free_port()
    command = server_command(port, args, cap_flags)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("RFA_API_KEY", None)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        wait_ready(process, f"http://127.0.0.1:{port}/ready", log_path, args.start_timeout)
    except BaseException:
        stop(process)
        raise
    return process, port, command


def lacks_cap_flags(log_path: Path) -> bool:
    """Whether the server refused the connection cap's flags (argparse: unrecognized arguments)."""
    text = tail(log_path)
    return "unrecognized arguments" in text and any(flag in text for flag in CAP_FLAGS)


SMOKE = {"requests": 8, "interval": 0.25, "attacks": ["poison", "disconnect", "sigterm"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="a quick functional check: 8 requests a trace, the poison, disconnect and sigterm "
                             "attacks (serve_faults.SMOKE; options given still win)")
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--requests", type=int, default=96,
                        help="the normal trace's requests (a p99 over 24 would be their slowest)")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between the trace's requests")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens of each trace request")
    parser.add_argument("--seed", type=int, default=0, help="the trace's prompts")
    parser.add_argument("--max-connections", type=int, default=128,
                        help="the server's connection cap, and the idle attack's connections")
    parser.add_argument("--header-timeout", type=float, default=2.0,
                        help="the server's seconds for a connection's request headers to arrive")
    parser.add_argument("--server-args", default="", help="more flags for the server, one string")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds a normal request may take")
    parser.add_argument("--large-body-timeout", type=float, default=120.0,
                        help="seconds a large body may take to be answered")
    parser.add_argument("--drain-budget", type=float, default=60.0,
                        help="sigterm: seconds after the trace for the server to exit")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds the server may take to be ready")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    if args.smoke:  # its settings as defaults: what the command line gives still wins
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    attacks = [a for a in ATTACKS if a in args.attacks]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "serve_faults-server.log"
    skips = {}
    cap_flags = "idle" in attacks
    try:
        process, port, command = start_server(args, log_path, cap_flags)
    except RuntimeError:
        if not (cap_flags and lacks_cap_flags(log_path)):
            raise
        skips["idle"] = f"the server does not take {' and '.join(CAP_FLAGS)} (issue 64's F2 is not in this checkout)"
        print(f"idle: {skips['idle']}: the server is started without them", flush=True)
        process, port, command = start_server(args, log_path, cap_flags=False)
    try:
        rows, runs = asyncio.run(run_attacks(process, port, args, attacks, skips))
    finally:
        stop(process)
    results = {"schema_version": SCHEMA_VERSION, "machine": machine_info(), "settings": vars(args),
               "server_command": command, "server_log": str(log_path), "rule": {
                   "refused_within_s": REFUSED_WITHIN_S, "p99_limit": P99_LIMIT}, "summary": rows, "runs": runs}
    save(results, args.out, "serve_faults.json", "serve_faults.png", plot, table)
    failed = [r["attack"] for r in rows if r["verdict"] == "FAIL"]
    if failed:
        raise SystemExit(f"attacks failing the rule: {', '.join(failed)} (results written)")
    return results


if __name__ == "__main__":
    main()
