"""The bad-input matrix (tests/bad_inputs.py: 150 distinct bad calls over every layout) in both modes:
the functional op eagerly, and inside a GRAPH_MODE Cell where every error is a compile-time one or the
kernel's launch check. Each mode runs in a subprocess; a case that kills it is recorded as a crash and
the run goes on from the next case, so a crash fails that case instead of the whole test run."""
import json
import os
import subprocess
import sys

import pytest

import bad_inputs

CASES = bad_inputs.cases()
WORKER = os.path.join(os.path.dirname(__file__), "bad_inputs.py")


def run_mode(mode):
    """{case index: result dict}; a case whose process died gets {"crashed": return code}."""
    results, start = {}, 0
    while start < len(CASES):
        proc = subprocess.run([sys.executable, WORKER, mode, str(start)], capture_output=True, text=True,
                              timeout=900, cwd=os.path.dirname(WORKER))
        started = None
        for line in proc.stdout.splitlines():
            if not line.startswith("{"):
                continue
            entry = json.loads(line)
            if entry.get("started"):
                started = entry["index"]
            else:
                results[entry["index"]] = entry
        if proc.returncode == 0:
            break
        crashed = started if started is not None else start
        results[crashed] = {"crashed": proc.returncode, "stderr": proc.stderr[-1500:]}
        start = crashed + 1
    return results


@pytest.fixture(scope="module", params=["pynative", pytest.param("graph", marks=pytest.mark.integration)])
def mode_results(request):
    return request.param, run_mode(request.param)


def test_matrix_has_at_least_120_cases():
    assert len(CASES) >= 120 and len({case_id for case_id, *_ in CASES}) == len(CASES)


@pytest.mark.starts_first
def test_every_bad_input_raises_its_clear_error(mode_results):
    mode, results = mode_results
    failures = []
    for index, (case_id, _, error, message) in enumerate(CASES):
        result = results.get(index)
        if result is None or "crashed" in result:
            failures.append(f"{case_id}: {'crashed ' + str(result['crashed']) if result else 'no result'}")
        elif result["raised"] is None:
            failures.append(f"{case_id}: accepted")
        elif mode == "graph" and case_id.split("-", 1)[1] in bad_inputs.DATA_DEPENDENT:
            if result["raised"] != "RuntimeError" or message not in result["message"]:
                failures.append(f"{case_id}: {result['raised']}: {result['message'][:300]}")
        elif result["raised"] != error or message not in result["message"]:
            failures.append(f"{case_id}: {result['raised']}: {result['message'][:300]}")
    assert not failures, f"{mode}: {len(failures)} of {len(CASES)} cases:\n" + "\n".join(failures)
