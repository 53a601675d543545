"""What every benchmark here shares: each measurement in a fresh child process (its own peak memory,
its own compile), a memory watchdog that stops a run before it takes the machine down and reports it
as out of memory, min/median statistics, and a description of the machine and versions."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(seconds of the first call, which includes compilation, then ``repeats`` timed calls)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, times


def alternate(series: dict, repeats: int, max_rounds: int = 10, budget_s: float = 30.0) -> dict:
    """{name: times} of callables run side by side in one process: after a warm-up round, as many
    rounds as fit in about ``budget_s`` (at least ``repeats``, at most ``max_rounds``), the order
    turning every round: a thread pool still spinning after one series (OpenMP pools wait actively
    for a while) slows whichever runs next, so no series may always follow the same one. (Measured:
    right after a numpy GEMM the kernel's best time was 135 ms at S=2048, against 130-133 ms for the
    same call later in the round.)"""
    start = time.perf_counter()
    for fn in series.values():
        fn()  # warm-up: scratch allocation, first touch
    rounds = max(repeats, min(max_rounds, int(budget_s / (time.perf_counter() - start))))
    times = {name: [] for name in series}
    for i in range(rounds):
        for name in turned(list(series), i):
            start = time.perf_counter()
            series[name]()
            times[name].append(time.perf_counter() - start)
    return times


def turned(items: list, i: int) -> list:
    """``items`` rotated by ``i``: round i's order, so that no item always runs right after the same one."""
    k = i % len(items) if items else 0
    return items[k:] + items[:k]


def stats(times: list[float]) -> dict:
    return {"times_s": times, "min_s": min(times), "median_s": statistics.median(times)}


def memory_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal")


def read_bandwidth() -> dict:
    """Bytes per second this machine reads on every core: the best of a threaded numpy sum and, when
    installed, PyTorch's sum (the faster probe is the stricter yardstick), over 1 GiB, best of 10."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    cores = os.cpu_count()
    block = np.ones(2**28, np.float32)
    slices = np.array_split(block, cores)
    probes = {}
    with ThreadPoolExecutor(cores) as pool:  # numpy's reductions release the GIL
        probes["numpy sum, one slice per core"] = lambda: list(pool.map(np.sum, slices))
        if importlib.util.find_spec("torch") is not None:
            import torch

            torch.set_num_threads(cores)
            tensor = torch.from_numpy(block)
            probes["torch sum"] = lambda: float(tensor.sum())
        best = {}
        for name, probe in probes.items():
            times = []
            for _ in range(10):
                start = time.perf_counter()
                probe()
                times.append(time.perf_counter() - start)
            best[name] = block.nbytes / min(times)
    name = max(best, key=best.get)
    return {"bytes_per_s": best[name], "probe": name, "probes_gb_per_s": {k: v / 1e9 for k, v in best.items()}}


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _child_main(module: str, function: str, kwargs_path: str, result_path: str) -> None:
    """Entry of a point's process (``python harness.py MODULE FUNCTION KWARGS.json RESULT.json``)."""
    with open(kwargs_path) as f:
        kwargs = json.load(f)
    try:
        result = {"status": "ok", **getattr(importlib.import_module(module), function)(**kwargs)}
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError as exc:
        result = {"status": "skipped", "error": f"not installed: {exc.name}"}
    except MemoryError:
        result = {"status": "oom", "error": "MemoryError"}
    except Exception as exc:  # reported in the results, not raised: one failed point must not lose the sweep
        text = f"{type(exc).__name__}: {exc}".strip()[:2000]
        oom = any(s in text.lower() for s in ("out of memory", "malloc", "memory not enough", "alloc"))
        result = {"status": "oom" if oom else "error", "error": text}
    with open(result_path, "w") as f:
        json.dump(result, f, default=lambda x: x.item() if hasattr(x, "item") else str(x))


def run_isolated(module: str, function: str, kwargs: dict, *, python: str | None = None,
                 memory_limit_bytes: int | None = None, timeout_s: float = 3600.0, poll_s: float = 0.05) -> dict:
    """``module.function(**kwargs)`` (JSON in, a JSON-able dict out) in a fresh process.

    ``python`` runs it under another interpreter (a peer installed in a virtual environment of its own,
    whose packages must not mix with this one's); the child then sees only this folder besides its own
    packages. The result gets ``status``: "ok", "oom" (the watchdog stopped it above
    ``memory_limit_bytes`` of resident memory, the framework failed to allocate, or the kernel's OOM
    killer struck), "error", "skipped" (an optional dependency is missing) or "timeout".
    The child's own output (a peer's framework logs) goes to a file, not the terminal, so the sweep's
    progress line stays readable; a point that failed or timed out carries its last lines as ``log_tail``.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    path = [here] if python else [p for p in sys.path if p and os.path.isdir(p)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    with tempfile.TemporaryDirectory(prefix="point-") as scratch:
        kwargs_path, result_path = os.path.join(scratch, "kwargs.json"), os.path.join(scratch, "result.json")
        with open(kwargs_path, "w") as f:
            json.dump(kwargs, f)
        with open(os.path.join(scratch, "output.log"), "w+") as log:
            proc = subprocess.Popen([python or sys.executable, os.path.join(here, "harness.py"), module, function,
                                     kwargs_path, result_path], env=env, stdout=log, stderr=subprocess.STDOUT)
            result = _wait(proc, result_path, memory_limit_bytes, timeout_s, poll_s)
            if result["status"] in ("error", "timeout"):
                log.seek(0)
                result["log_tail"] = "".join(log.readlines()[-40:])
        return result


def _wait(proc, result_path: str, memory_limit_bytes: int | None, timeout_s: float, poll_s: float) -> dict:
    """The child's result, once it exits (or the watchdog's verdict)."""
    deadline = time.monotonic() + timeout_s
    peak = 0
    while proc.poll() is None:
        rss = _rss_bytes(proc.pid)
        peak = max(peak, rss)
        if memory_limit_bytes and rss > memory_limit_bytes:
            proc.kill()
            proc.wait()
            return {"status": "oom", "error": f"stopped at {rss / 2**30:.1f} GiB resident "
                                              f"(limit {memory_limit_bytes / 2**30:.1f} GiB)",
                    "peak_rss_mb": rss / 2**20}
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return {"status": "timeout", "error": f"timed out after {timeout_s:.0f} s"}
        time.sleep(poll_s)
    if not os.path.exists(result_path):
        killed = proc.returncode == -9
        return {"status": "oom" if killed else "error", "peak_rss_mb": peak / 2**20,
                "error": "killed by SIGKILL (the kernel's OOM killer?)" if killed else f"exit code {proc.returncode}"}
    with open(result_path) as f:
        result = json.load(f)
    if result.get("status") == "ok":
        result.setdefault("peak_rss_mb", peak / 2**20)  # as sampled every poll_s (a lower bound)
    return result


def save(results: dict, out: str, json_name: str, png_name: str, plot, table) -> None:
    """A benchmark's results as ``out/json_name``, its plot (``plot(results, path)``) as ``out/png_name``,
    then ``table(results)`` printed."""
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / json_name).write_text(json.dumps(results, indent=2))
    plot(results, out / png_name)
    print(table(results))
    print(f"wrote {out / json_name} and {out / png_name}")


def machine_info() -> dict:
    import mindspore
    import numpy

    from ms_rope_attention.cpu_kernel import kernel_isa

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": model, "cpus": os.cpu_count(),
            "memory_gib": round(memory_total_bytes() / 2**30, 1), "python": platform.python_version(),
            "mindspore": mindspore.__version__, "numpy": numpy.__version__, "kernel_isa": kernel_isa()}


if __name__ == "__main__":
    _child_main(*sys.argv[1:])
