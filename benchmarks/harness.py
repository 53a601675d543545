"""What every benchmark here shares: each measurement in a fresh child process (its own peak memory,
its own compile), a memory watchdog that stops a run before it takes the machine down and reports it
as out of memory, min/median statistics, a description of the machine and versions, and a server
process's life (a free loopback port, waiting for it to be ready, stopping it and its children)."""
from __future__ import annotations

import importlib
import json
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def timed_calls(fn, calls: int) -> list[float]:
    """The seconds of each of ``calls`` calls of ``fn``."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(seconds of the first call, which includes compilation, then ``repeats`` timed calls)."""
    first = timed_calls(fn, 1)[0]
    return first, timed_calls(fn, repeats)


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


# ---------------------------------------------------------------------------------------------
# This CPU's peaks and read bandwidth, measured in the run whose figures they scale (peaks.c).

PEAKS_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peaks.c")
# probe -> (the /proc/cpuinfo flags it needs, the compiler flags of its library). The float32 probe
# takes the first of FLOAT32_PROBES this CPU has (and the compiler builds); each library holds only
# its own instructions, so a CPU without an instruction set never runs them.
PROBES = {
    "avx512": ({"avx512f", "fma"}, ["-mavx512f", "-mfma"]),
    "avx2": ({"avx2", "fma"}, ["-mavx2", "-mfma"]),
    "generic": (set(), []),
    "bf16": ({"avx512f", "avx512bw", "avx512_bf16"}, ["-mavx512f", "-mavx512bw", "-mavx512bf16"]),
    "amx": ({"amx_tile", "amx_bf16"}, ["-mamx-tile", "-mamx-bf16"]),
}
FLOAT32_PROBES = ("avx512", "avx2", "generic")
_PROBE_LIBRARIES: dict = {}  # probe -> (ctypes library or None, reason it is unavailable)


def cpu_flags() -> set[str]:
    """The CPU feature flags of this machine (empty where /proc/cpuinfo is unavailable): the same
    reading as ms_rope_attention.cpu_runtime.cpu_flags, which this module does not import (it runs
    under the peers' interpreters too, and importing it imports MindSpore)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def c_compiler() -> tuple[list[str] | None, str]:
    """(argv of the C compiler, its description), or (None, why there is none): ``CC`` when set
    (and then only it), else the first of cc, gcc, clang on PATH."""
    import shlex
    import shutil

    if os.environ.get("CC"):
        argv = shlex.split(os.environ["CC"])
        if not argv or not shutil.which(argv[0]):
            return None, f"no C compiler: CC={os.environ['CC']!r} is not found"
    else:
        found = next((name for name in ("cc", "gcc", "clang") if shutil.which(name)), None)
        if found is None:
            return None, "no C compiler: none of cc, gcc, clang is on PATH (set CC)"
        argv = [found]
    try:
        version = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"no C compiler: {' '.join(argv)} --version failed ({exc})"
    return argv, f"{' '.join(argv)}: {(version.splitlines() or ['unknown version'])[0]}"


def probe_library(probe: str):
    """(ctypes library of ``probe``, None) compiled from peaks.c in a temporary directory, once per
    process, or (None, the reason it is unavailable: the CPU lacks its flags, no compiler, the
    compiler failed). Never raises."""
    import ctypes
    import shutil

    if probe in _PROBE_LIBRARIES:
        return _PROBE_LIBRARIES[probe]
    needed, flags = PROBES[probe]
    missing = sorted(needed - cpu_flags())
    if missing:
        result = (None, f"not available: this CPU lacks {', '.join(missing)}")
    else:
        compiler, about = c_compiler()
        if compiler is None:
            result = (None, f"not available: {about}")
        else:
            scratch = tempfile.mkdtemp(prefix="peaks-")
            try:
                out = os.path.join(scratch, f"peaks_{probe}.so")
                cmd = [*compiler, "-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
                       f"-DPROBE_{probe.upper()}", *flags, PEAKS_SOURCE, "-o", out]
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                    if done.returncode != 0:
                        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                        result = (None, f"not available: {' '.join(cmd[:1] + flags)} failed: {' / '.join(tail)}")
                    else:
                        lib = ctypes.CDLL(out)  # mapped: the file may go
                        lib.peaks_compute.restype = ctypes.c_double
                        lib.peaks_compute.argtypes = [ctypes.c_int, ctypes.c_double]
                        lib.peaks_read.restype = ctypes.c_double
                        lib.peaks_read.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                                                   ctypes.POINTER(ctypes.c_double)]
                        lib.peaks_kernel.restype = ctypes.c_char_p
                        result = (lib, None)
                except (OSError, subprocess.SubprocessError) as exc:
                    result = (None, f"not available: {' '.join(cmd[:1])} failed: {exc}")
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    _PROBE_LIBRARIES[probe] = result
    return result


_COMPUTE_ERRORS = {-1: "no CPU in this process's affinity mask", -2: "a thread could not be created",
                   -3: "the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"}


def _compute_peak(probe: str, threads: int, seconds: float, repeats: int) -> tuple[list[float] | None, str]:
    """(GFLOP/s of each repeat, the kernel's description) or (None, why not)."""
    lib, reason = probe_library(probe)
    if lib is None:
        return None, reason
    rates = []
    for _ in range(repeats):
        rate = lib.peaks_compute(threads, seconds)
        if rate <= 0:
            return None, f"not available: {_COMPUTE_ERRORS.get(int(rate), f'error {rate}')}"
        rates.append(rate / 1e9)
    return rates, lib.peaks_kernel().decode()


def arithmetic_peaks(seconds: float = 0.5, repeats: int = 3) -> dict:
    """This CPU's arithmetic peaks on every core (one pinned thread per CPU of this process, each
    running its own register-only loop for ``seconds``; the best of ``repeats``), from peaks.c
    compiled now with the system's C compiler: float32 FMA on the widest vectors the CPU has
    (AVX-512, else AVX2, else SSE2 / scalar multiply + add), bfloat16 dot products (vdpbf16ps) where
    it has avx512_bf16, and AMX bfloat16 tiles (tdpbf16ps) where it has amx_bf16. A probe that
    cannot run is None, with its reason in ``unavailable``; nothing here raises."""
    threads = len(os.sched_getaffinity(0))
    result = {"threads": threads, "seconds_per_repeat": seconds, "repeats": repeats, "unavailable": {}}
    for probe in FLOAT32_PROBES:
        if PROBES[probe][0] <= cpu_flags():
            rates, about = _compute_peak(probe, threads, seconds, repeats)
            if rates is not None:
                break
            result["unavailable"][f"float32 {probe}"] = about
    for key, probe in (("float32_fma", None), ("bfloat16_dot", "bf16"), ("bfloat16_amx", "amx")):
        if probe is not None:
            rates, about = _compute_peak(probe, threads, seconds, repeats)
        result[f"{key}_gflops"] = max(rates) if rates else None
        result[f"{key}_repeats_gflops"] = rates
        if rates:
            result[f"{key}_kernel"] = about
        else:
            result["unavailable"][key] = about
    result["compiler"] = c_compiler()[1]
    result["method"] = (f"benchmarks/peaks.c compiled at run time; {threads} threads, one pinned to each CPU of the "
                        f"process, each its own register-only loop of independent accumulators for {seconds} s; "
                        f"GFLOP/s summed over the threads, best of {repeats}. FLOP: 2 per multiply-add (64 per zmm "
                        "vdpbf16ps, 16384 per tdpbf16ps).")
    return result


def peak_fractions(gflops: float, peaks: dict | None) -> dict:
    """``gflops`` as a fraction of each peak ``arithmetic_peaks`` measured (None where it has none)."""
    peaks = peaks or {}
    return {f"fraction_of_{key}_peak": gflops / peaks[f"{key}_gflops"] if peaks.get(f"{key}_gflops") else None
            for key in ("float32_fma", "bfloat16_dot", "bfloat16_amx")}


def last_level_cache_bytes() -> int | None:
    """The size of this CPU's last-level cache (the highest level in sysfs), or None."""
    import glob

    best = None
    for folder in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(f"{folder}/level") as f:
                level = int(f.read())
            with open(f"{folder}/size") as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        size = int(text.rstrip("KMGkmg")) * scale
        if best is None or level > best[0] or (level == best[0] and size > best[1]):
            best = (level, size)
    return best[1] if best else None


def read_bandwidth(repeats: int = 10, size: int | None = None) -> dict:
    """Bytes per second this machine reads on every core: one pinned thread per CPU of the process,
    each summing its own slice of one buffer (first touched by that thread) with its vector loads
    (peaks.c's read loop, the float32 probe's build), the bytes of all slices over the time from the
    first thread's start to the last one's end, best of ``repeats`` passes. The buffer is at least
    1 GiB and 4x the last-level cache (at most a quarter of the memory). The one probe behind every
    "% of bandwidth" figure; without a C compiler, a numpy sum over the same buffer on every core
    (its method says so). ``size`` overrides the buffer's size (tests)."""
    llc = last_level_cache_bytes()
    if size is None:
        size = min(max(2**30, 4 * (llc or 0)), memory_total_bytes() // 4)
    threads = len(os.sched_getaffinity(0))
    lib, reason = None, "no float32 probe for this CPU"
    for probe in FLOAT32_PROBES:
        if PROBES[probe][0] <= cpu_flags():
            lib, reason = probe_library(probe)
            if lib is not None:
                break
    base = {"buffer_bytes": size, "last_level_cache_bytes": llc, "threads": threads}
    if lib is not None:
        import ctypes

        rates = (ctypes.c_double * repeats)()
        best = lib.peaks_read(threads, size, repeats, rates)
        if best > 0:
            name = f"C read loop ({probe} build), one thread per core"
            return {"bytes_per_s": best, "probe": name, "probes_gb_per_s": {name: best / 1e9},
                    "repeats_gb_per_s": [r / 1e9 for r in rates], **base,
                    "method": f"benchmarks/peaks.c's read loop ({probe} build, compiled at run time): {threads} "
                              f"threads, one pinned to each CPU, each summing its own slice of a {size / 2**30:.2f} "
                              f"GiB buffer ({size / llc:.1f}x the last-level cache) it touched first; all bytes over "
                              f"the first start to the last end, best of {repeats} passes" if llc else
                              f"benchmarks/peaks.c's read loop ({probe} build): {threads} threads over "
                              f"{size / 2**30:.2f} GiB, best of {repeats} passes"}
        reason = f"peaks_read failed ({best})"
    return {**_numpy_read_bandwidth(size, threads, repeats, reason), **base}


def _numpy_read_bandwidth(size: int, threads: int, repeats: int, reason: str) -> dict:
    """The fallback when peaks.c cannot run: a threaded numpy sum (which releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    block = np.ones(size // 4, np.float32)
    slices = np.array_split(block, threads)
    with ThreadPoolExecutor(threads) as pool:
        times = timed_calls(lambda: list(pool.map(np.sum, slices)), repeats)
    name = "numpy sum, one slice per core"
    return {"bytes_per_s": block.nbytes / min(times), "probe": name,
            "probes_gb_per_s": {name: block.nbytes / min(times) / 1e9},
            "repeats_gb_per_s": [block.nbytes / t / 1e9 for t in times],
            "method": f"{name} over {size / 2**30:.2f} GiB, best of {repeats} (peaks.c's read loop {reason})"}


def rss_bytes(pid: int) -> int:
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
        rss = rss_bytes(proc.pid)
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


# ---------------------------------------------------------------------------------------------
# A server process (benchmarks/serve_load.py, serve_faults.py): started in a session of its own, so
# stopping it stops whatever it started.

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of a GET, an error status included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def tail(path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ("" when there is none)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def wait_ready(process, url: str, log_path, timeout_s: float) -> None:
    """Until ``url`` answers 200; RuntimeError (with the log's tail) if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was ready:\n"
                               f"{tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s:\n{tail(log_path)}")
        try:
            if http_get(url, timeout=5)[0] == 200:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)


def stop(process, timeout_s: float = 60.0) -> None:
    """SIGTERM (this project's server drains: its requests are done by now), then its whole process group."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    kill_group(process)


def kill_group(process) -> None:
    """The processes left in ``process``'s group (it was started in a session of its own)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


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

    from ms_rope_attention import linear
    from ms_rope_attention.cpu_kernel import bfloat16_units, kernel_isa

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": model, "cpus": os.cpu_count(),
            "memory_gib": round(memory_total_bytes() / 2**30, 1), "python": platform.python_version(),
            "mindspore": mindspore.__version__, "numpy": numpy.__version__, "kernel_isa": kernel_isa(),
            # which units run bfloat16 products past a few rows in this process (and so in each child: the
            # same CPU and RFA_BF16_GEMM), and why
            "bf16_engine": linear.bf16_engine() if linear.onednn() else "none: built without oneDNN",
            # which units the fused attention's bfloat16 products run on, and why ("" without bfloat16 arithmetic)
            "bf16_attention_units": bfloat16_units()}


if __name__ == "__main__":
    _child_main(*sys.argv[1:])
