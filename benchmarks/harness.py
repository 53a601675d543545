"""What every benchmark here shares: each measurement in a fresh child process (its own peak memory,
its own compile), a memory watchdog that stops a run before it takes the machine down and reports it
as out of memory, min/median statistics, and a description of the machine and versions."""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import platform
import queue as queue_module
import resource
import statistics
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
    names = list(series)
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            series[name]()
            times[name].append(time.perf_counter() - start)
    return times


def stats(times: list[float]) -> dict:
    return {"times_s": times, "min_s": min(times), "median_s": statistics.median(times)}


def memory_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal")


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _child(module: str, function: str, kwargs: dict, queue) -> None:
    try:
        result = getattr(importlib.import_module(module), function)(**kwargs)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        queue.put({"status": "ok", **result})
    except ImportError as exc:
        queue.put({"status": "skipped", "error": f"not installed: {exc.name}"})
    except MemoryError:
        queue.put({"status": "oom", "error": "MemoryError"})
    except Exception as exc:  # reported in the results, not raised: one failed point must not lose the sweep
        text = f"{type(exc).__name__}: {exc}".strip()[:2000]
        oom = any(s in text.lower() for s in ("out of memory", "malloc", "memory not enough", "alloc"))
        queue.put({"status": "oom" if oom else "error", "error": text})


def run_isolated(module: str, function: str, kwargs: dict, *, memory_limit_bytes: int | None = None,
                 timeout_s: float = 3600.0, poll_s: float = 0.05) -> dict:
    """``module.function(**kwargs)`` (returning a dict) in a spawned process.

    The result gets ``status``: "ok", "oom" (the watchdog stopped it above ``memory_limit_bytes`` of
    resident memory, MindSpore failed to allocate, or the kernel's OOM killer struck), "error",
    "skipped" (an optional dependency is missing) or "timeout".
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(module, function, kwargs, queue))
    proc.start()
    deadline = time.monotonic() + timeout_s
    peak = 0
    while proc.is_alive():
        rss = _rss_bytes(proc.pid)
        peak = max(peak, rss)
        if memory_limit_bytes and rss > memory_limit_bytes:
            proc.kill()
            proc.join()
            return {"status": "oom", "error": f"stopped at {rss / 2**30:.1f} GiB resident "
                                              f"(limit {memory_limit_bytes / 2**30:.1f} GiB)",
                    "peak_rss_mb": rss / 2**20}
        if time.monotonic() > deadline:
            proc.kill()
            proc.join()
            return {"status": "timeout", "error": f"timed out after {timeout_s:.0f} s"}
        if not queue.empty():
            break
        time.sleep(poll_s)
    try:
        result = queue.get(timeout=10)
    except queue_module.Empty:
        result = None
    proc.join()
    if result is None:
        killed = proc.exitcode == -9
        return {"status": "oom" if killed else "error", "peak_rss_mb": peak / 2**20,
                "error": "killed by SIGKILL (the kernel's OOM killer?)" if killed else f"exit code {proc.exitcode}"}
    return result


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
