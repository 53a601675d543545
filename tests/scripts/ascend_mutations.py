"""Mutation checks of the Ascend kernels on the emulation: each mutation removes one synchronisation
or guarantee from a copy of aclnn/op_kernel/, builds the emulated kernel from the copy, runs the tests
that exercise the code, and expects them to fail, with the emulation rule's words where a rule
catches it. A mutation that passes the tests means the rule, or the test, guards nothing there.

    .venv/bin/python tests/scripts/ascend_mutations.py            # every mutation (6-8 minutes)
    .venv/bin/python tests/scripts/ascend_mutations.py -k barrier  # the ones whose name matches

Prints one line per mutation (CAUGHT / MISSED, with the failing message) and exits non-zero if any
was missed. Not part of `make test` (a build per mutation); its last run is quoted in docs/testing.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ACLNN = ROOT / "ms_rope_attention" / "aclnn"
GRAD = "rotary_flash_attention_grad.h"


@dataclass
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: str      # pytest -k expression over tests/test_ascend_grad.py
    expect: str     # words the failure must contain ("" for a wrong value caught by the reference)


MUTATIONS = [
    Mutation("barrier before IterateAll", GRAD,
             "    AscendC::PipeBarrier<PIPE_ALL>();\n    mm.IterateAll(c);", "    mm.IterateAll(c);",
             "layouts_modes and BNSD", "the cube reads GM this core's MTE3 wrote"),
    Mutation("barrier after IterateAll", GRAD,
             "    mm.End();\n    AscendC::PipeBarrier<PIPE_ALL>();", "    mm.End();",
             "layouts_modes and BNSD", "that Matmul::IterateAll (C into the UB) on pipe MTE2"),
    Mutation("End() between Matmul objects", GRAD, "    mm.End();\n", "",
             "layouts_modes and BNSD", "has not called End()"),
    Mutation("V_MTE3 before the P/dS tiles go out", GRAD,
             "    Sync<AscendC::HardEvent::V_MTE3>();  // the tiles", "    // removed: the tiles",
             "layouts_modes and BNSD", "read after write: DataCopy UB->GM on pipe MTE3"),
    Mutation("V_S before the scalar masks", GRAD,
             "    Sync<AscendC::HardEvent::V_S>();\n    const int64_t q_pos", "    const int64_t q_pos",
             "layouts_modes and BNSD and True", "LocalTensor::SetValue on pipe S"),
    Mutation("S_V after the scalar masks", GRAD,
             "    Sync<AscendC::HardEvent::S_V>();\n    for (int64_t r = 0; r < nq; ++r) {\n      if (with_p)",
             "    for (int64_t r = 0; r < nq; ++r) {\n      if (with_p)",
             "layouts_modes and BNSD and True", "that LocalTensor::SetValue on pipe S (scalar) wrote"),
    Mutation("V_S before the key probes are read", GRAD,
             "      Sync<AscendC::HardEvent::V_S>();\n      for (int64_t r = 0; r < n; ++r) {\n        if (probes",
             "      for (int64_t r = 0; r < n; ++r) {\n        if (probes",
             "layouts_modes and BNSD", "read after write: LocalTensor::GetValue"),
    Mutation("V_S before the Delta slots are read", GRAD,
             "      Sync<AscendC::HardEvent::V_S>();\n      b = chunk_b;", "      b = chunk_b;",
             "layouts_modes and BNSD", "read after write: LocalTensor::GetValue"),
    Mutation("S_MTE3 before the lse/Delta stages go out", GRAD,
             "      Sync<AscendC::HardEvent::S_MTE3>();\n", "",
             "layouts_modes and BNSD", "read after write: DataCopyPad UB->GM"),
    Mutation("MTE3_S before the stages are rewritten", GRAD,
             "      Sync<AscendC::HardEvent::MTE3_S>();", "",
             "bit_identical", "write after read"),
    Mutation("barrier before SyncAll", GRAD,
             "    AscendC::PipeBarrier<PIPE_ALL>();  // this core's workspace rows", "    // removed",
             "layouts_modes and BNSD", "SyncAll with this core's MTE3 GM writes"),
    Mutation("idle cores skip SyncAll", GRAD,
             "    const int64_t me = AscendC::GetBlockIdx(), cores = g_.core_num;\n",
             "    const int64_t me = AscendC::GetBlockIdx(), cores = g_.core_num;\n    if (me >= cores) return;\n",
             "bit_identical", "returned without reaching it"),
    Mutation("lse by scalar GM writes", GRAD,
             "      AscendC::DataCopyPad(ws_lse_[c0], lse_stage, copy);",
             "      for (int64_t r = 0; r < n; ++r) ws_lse_.SetValue(c0 + r, lse_stage.GetValue(r));",
             "layouts_modes and BNSD", "64-byte line"),
    Mutation("P/dS cast with CAST_NONE", GRAD,
             "      AscendC::Cast(dst, src, AscendC::RoundMode::CAST_RINT, count);",
             "      AscendC::Cast(dst, src, AscendC::RoundMode::CAST_NONE, count);",
             "low_precision and bfloat16", "does not support CAST_NONE"),
    Mutation("no-key rows keep lse -inf", GRAD,
             "lse == -__builtin_inff() ? kNoKeyLse : lse", "lse", "minus_infinity", ""),
    Mutation("dQ rotated instead of un-rotated", GRAD,
             "      rows_.Unrotate(dq[i * t_.head_pad], y, t_.scale);", "      rows_.Rotate(dq[i * t_.head_pad], y, t_.scale);",
             "layouts_modes and BNSD", "d_query: max error"),
    Mutation("d_rotated_key after the un-rotation", GRAD,
             "        rows_.Unrotate(dk_row, y, 1.0f);\n",
             "        rows_.Unrotate(dk_row, y, 1.0f);\n        if (g_.has_drk) AscendC::Add(y, y, x, static_cast<int32_t>(d));\n",
             "layouts_modes and BNSD", "d_key: max error"),
    Mutation("non-finite key rows reach the cube", GRAD,
             "        if (probes.GetValue(r * kSlot) == 0.0f) continue;", "        continue;",
             "cannot_see", "Arrays are not equal"),
    Mutation("non-finite query rows reach the cube", GRAD,
             "          rows_.ZeroRow(ws_qs_[(c0 + r) * d]);\n          rows_.ZeroRow(ws_do_[(c0 + r) * d]);\n", "",
             "poisoned_queries", "Arrays are not equal"),
    Mutation("dS left unmasked where P is", GRAD, "        dp[r * nb].SetValue(c, 0.0f);\n", "",
             "poisoned_queries", "Arrays are not equal"),
    Mutation("causal mask off by one", GRAD,
             "const int64_t seen = q_pos + r - j0 + 1;", "const int64_t seen = q_pos + r - j0 + 2;",
             "layouts_modes and BNSD and True", "max error"),
]


def build(kernel_dir: Path, out_dir: Path) -> None:
    """The emulated kernel library from `kernel_dir` (a mutated copy of op_kernel/), beside links to
    the installed CPU kernels (the tests' forward runs on them)."""
    cmd = ["g++", "-std=c++17", "-O2", "-pthread", "-fPIC", "-shared", "-fvisibility=hidden",
           "-D_GLIBCXX_USE_CXX11_ABI=0", f"-I{ACLNN / 'emulator'}", f"-I{kernel_dir}", f"-I{ACLNN / 'op_host'}",
           f"-I{ROOT / 'ms_rope_attention' / 'csrc'}", str(ACLNN / "emulator" / "rfa_ascend_emulated.cc"),
           "-o", str(out_dir / "_rfa_ascend_emulated.so")]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    for lib in (ROOT / "ms_rope_attention").glob("_rfa_cpu_*.so"):
        (out_dir / lib.name).symlink_to(lib)


def run(mutation: Mutation) -> tuple[bool, str]:
    """(caught, what the failing tests printed) for one mutation."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        kernel_dir, out_dir = tmp / "op_kernel", tmp / "lib"
        shutil.copytree(ACLNN / "op_kernel", kernel_dir)
        out_dir.mkdir()
        source = kernel_dir / mutation.file
        text = source.read_text()
        if text.count(mutation.old) != 1:
            raise SystemExit(f"{mutation.name}: the pattern to mutate occurs {text.count(mutation.old)} times")
        source.write_text(text.replace(mutation.old, mutation.new))
        build(kernel_dir, out_dir)
        env = dict(os.environ, RFA_CPU_KERNEL_DIR=str(out_dir))
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                 str(ROOT / "tests" / "test_ascend_grad.py"), "-k", mutation.tests],
                                cwd=ROOT, env=env, capture_output=True, text=True)
        output = result.stdout + result.stderr
        if "no tests ran" in output or " deselected" in output and " passed" not in output and " failed" not in output:
            raise SystemExit(f"{mutation.name}: -k {mutation.tests!r} selects no test")
        caught = result.returncode != 0 and mutation.expect in output
        lines = [line for line in output.splitlines() if line.startswith("E ") or "Error" in line]
        return caught, (lines[0].strip() if lines else output.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this")
    args = parser.parse_args()
    missed = 0
    for mutation in MUTATIONS:
        if args.k not in mutation.name:
            continue
        caught, message = run(mutation)
        missed += not caught
        print(f"{'CAUGHT' if caught else 'MISSED'}  {mutation.name}: {message[:200]}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
