"""Where the suite's time goes (issue 66): a pytest plugin that, when RFA_SUITE_PROFILE names a directory,
writes one JSON line per test (each xdist worker its own file): the wall time of setup, call and teardown,
MindSpore's graph compiles (how many graphs compiled, and the seconds spent in the graph executors' compile
entry points), the seconds of Python's cyclic garbage collections (MindSpore runs a full one before every compile), the
processes the test started and their CPU time (the children's rusage).
``python tests/suite_profile.py DIR`` sums the lines by module and by kind (docs/testing.md)."""
import gc
import json
import os
import resource
import subprocess
import time

import pytest


class _Counters:
    """Compiles and spawns of the running test; nested compiles (a cell compiling a cell) count once."""

    def __init__(self):
        self.compiles = 0
        self.compile_s = 0.0
        self.spawns = 0
        self.gc_s = 0.0
        self._depth = 0
        self._gc_start = 0.0
        gc.callbacks.append(self._timed_gc)

    def _timed_gc(self, phase, info):
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_start

    def timed_compile(self, compile_method, compiled):
        """``compile_method`` timed; a call counts as a compile where ``compiled(result, cache_size_before)``
        (the executors return early, in microseconds, for a graph they already hold)."""
        counters = self

        def compile(*args, **kwargs):
            if counters._depth:
                return compile_method(*args, **kwargs)
            counters._depth += 1
            cache_size, start = len(_jit_cache()), time.perf_counter()
            try:
                result = compile_method(*args, **kwargs)
            finally:
                counters._depth -= 1
                counters.compile_s += time.perf_counter() - start
            counters.compiles += bool(compiled(result, cache_size))
            return result
        return compile


def _jit_cache():
    from mindspore.common import api
    return api.ms_compile_cache


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class SuiteProfile:
    def __init__(self, directory: str, worker: str):
        os.makedirs(directory, exist_ok=True)
        self._out = open(os.path.join(directory, f"{worker}.jsonl"), "a", buffering=1)
        self._counters = _Counters()
        self._record = {}
        from mindspore.common import api
        # A Cell's compile returns (phase, whether it compiled); a function's adds its phase to the jit cache.
        api._CellGraphExecutor.compile = self._counters.timed_compile(
            api._CellGraphExecutor.compile, lambda result, _: result[1])
        api._JitExecutor.compile = self._counters.timed_compile(
            api._JitExecutor.compile, lambda _, cache_size: len(_jit_cache()) > cache_size)
        popen_init = subprocess.Popen.__init__
        counters = self._counters

        def counted_init(popen, *args, **kwargs):
            counters.spawns += 1
            popen_init(popen, *args, **kwargs)
        subprocess.Popen.__init__ = counted_init

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        counters = self._counters
        counters.compiles, counters.compile_s, counters.spawns, counters.gc_s = 0, 0.0, 0, 0.0
        self._record = {"nodeid": item.nodeid, "module": item.nodeid.split("::")[0], "phases": {}, "outcome": "passed"}
        children, cpu, start = _children_cpu(), time.process_time(), time.perf_counter()
        yield
        self._record.update(wall_s=round(time.perf_counter() - start, 4),
                            cpu_s=round(time.process_time() - cpu, 4),
                            children_cpu_s=round(_children_cpu() - children, 4),
                            compiles=counters.compiles, compile_s=round(counters.compile_s, 4),
                            spawns=counters.spawns, gc_s=round(counters.gc_s, 4))
        self._out.write(json.dumps(self._record) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        self._record["phases"][report.when] = round(report.duration, 4)
        if report.outcome != "passed":
            self._record["outcome"] = report.outcome


def pytest_configure(config):
    directory = os.environ.get("RFA_SUITE_PROFILE")
    if directory:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        config.pluginmanager.register(SuiteProfile(directory, worker), "rfa_suite_profile")


def summary(directory: str) -> str:
    """The tests' time by module and by kind, as Markdown: a test's compile seconds are compiles, the rest of a
    test that started processes is processes (mostly waiting on them), the rest of any other test running."""
    import glob
    tests = [json.loads(line) for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))) for line in open(path)]
    modules, kinds = {}, {"compiles": 0.0, "processes": 0.0, "running": 0.0}
    for test in tests:
        rest = max(test["wall_s"] - test["compile_s"], 0.0)
        kinds["compiles"] += test["compile_s"]
        kinds["processes" if test["spawns"] else "running"] += rest
        row = modules.setdefault(test["module"], dict(tests=0, wall_s=0.0, compile_s=0.0, compiles=0, spawns=0,
                                                      children_cpu_s=0.0, slowest_s=0.0))
        row["tests"] += 1
        row["slowest_s"] = max(row["slowest_s"], test["wall_s"])
        for key in ("wall_s", "compile_s", "compiles", "spawns", "children_cpu_s"):
            row[key] += test[key]
    total = sum(row["wall_s"] for row in modules.values()) or 1.0
    lines = [f"{len(tests)} tests, {total:.0f} s of test time (summed over workers), "
             + ", ".join(f"{kind} {seconds:.0f} s ({seconds / total:.0%})" for kind, seconds in kinds.items()),
             f"{sum(t['compiles'] for t in tests)} graph compiles; garbage collections "
             f"{sum(t.get('gc_s', 0.0) for t in tests):.0f} s", "",
             "| module | tests | time s | share | compiles | compile s | processes | their CPU s | slowest test s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in sorted(modules.items(), key=lambda item: -item[1]["wall_s"]):
        lines.append(f"| {name.removeprefix('tests/')} | {row['tests']} | {row['wall_s']:.0f} | {row['wall_s'] / total:.1%} "
                     f"| {row['compiles']} | {row['compile_s']:.0f} | {row['spawns']} | {row['children_cpu_s']:.0f} "
                     f"| {row['slowest_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    print(summary(sys.argv[1]))
