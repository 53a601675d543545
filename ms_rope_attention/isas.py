"""The instruction sets the CPU kernels are built for, and which of them this CPU runs.

Standard library only: ``setup.py`` loads this file by path in pip's isolated build environment, where
neither this package nor MindSpore is importable (``RFA_ISAS=usable`` builds only what this CPU runs:
``make test``'s environment); ``cpu_runtime`` picks the build to load with the same table.
"""
from pathlib import Path

ISAS = ("avx512", "avx2", "generic")  # best first
REQUIRED_FLAGS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "generic": set(),
}
# What the compiler is given for each build (x86_64; elsewhere the portable build alone).
COMPILER_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}


def cpu_flags() -> set[str]:
    """The CPU feature flags of this machine (empty where /proc/cpuinfo is unavailable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def usable_isas() -> list[str]:
    """The instruction sets this CPU can run, best first (the portable build always)."""
    flags = cpu_flags()
    return [isa for isa in ISAS if REQUIRED_FLAGS[isa] <= flags]


if __name__ == "__main__":  # `python ms_rope_attention/isas.py`: the Makefile's sanitizer build, before .venv exists
    print(" ".join(usable_isas()))
