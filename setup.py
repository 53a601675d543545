"""The C++ kernels, built at install time (metadata and dependencies are in pyproject.toml).

The CPU kernel is built once per instruction set (picked at run time by ms_rope_attention/cpu_runtime.py);
each build is a plain shared library loaded by MindSpore's aot Custom op, not a Python module.
``RFA_SANITIZE=1`` builds them with AddressSanitizer + UBSan for the sanitizer test run.
"""
import os
import platform
import threading

import scipy_openblas32  # a build requirement (pyproject.toml)
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = "ms_rope_attention/csrc"
ACLNN = "ms_rope_attention/aclnn"
SOURCES = [f"{CSRC}/rfa_cpu_kernel.cc", f"{CSRC}/rfa_cpu_decode.cc", f"{CSRC}/rfa_cpu_backward.cc", f"{CSRC}/rfa_cpu_aot.cc",
           f"{CSRC}/rfa_cpu_paged.cc"]
COMMON = ["-std=c++17", "-O3", "-fopenmp", "-D_GLIBCXX_USE_CXX11_ABI=0", "-fvisibility=hidden", "-Wall", "-Wextra"]
ISA_FLAGS = {"generic": []}
if platform.machine() in ("x86_64", "AMD64"):
    ISA_FLAGS["avx2"] = ["-mavx2", "-mfma", "-mf16c"]
    ISA_FLAGS["avx512"] = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-DRFA_EXACT_SCRATCH"] if os.environ.get("RFA_SANITIZE") else []


class BuildKernels(build_ext):
    """build_ext with one object directory per extension (the ISA builds share source files), the
    extensions built in parallel over the machine's cores unless ``--parallel`` says otherwise."""

    _current = threading.local()

    @property
    def build_temp(self):
        return getattr(self._current, "build_temp", None) or self._build_temp

    @build_temp.setter
    def build_temp(self, value):
        self._build_temp = value

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = len(os.sched_getaffinity(0))

    def build_extension(self, ext):
        self._current.build_temp = os.path.join(self._build_temp, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self._current.build_temp = None

    def get_export_symbols(self, ext):
        return []  # not Python modules: no PyInit_ symbol to export


extensions = [
    Extension(f"ms_rope_attention._rfa_cpu_{isa}", sources=SOURCES, depends=[f"{CSRC}/{h}" for h in
              ("aot_abi.h", "aot_attrs.h", "last_error.h", "rfa_problem.h", "rfa_paged.h", "rfa_cpu_kernel.h", "rows.h",
               "simd.h")],
              extra_compile_args=COMMON + flags + SANITIZE, extra_link_args=["-fopenmp"] + SANITIZE[:1],
              language="c++")
    for isa, flags in ISA_FLAGS.items()
]

# The projections' GEMM (y = x W^T, on OpenBLAS and the library's own decode-sized product) and the
# half-table embedding lookup, once per instruction set like the attention kernel: its own products
# convert half weights in registers. OpenBLAS (the scipy-openblas32 wheel) picks its kernels for the
# running CPU itself. The wheel is a build requirement (headers, link) and an install requirement
# (the library at run time): the rpath finds it beside this package in site-packages, and
# ms_rope_attention/linear.py loads it by path before this library is opened, which covers an
# editable checkout too.
extensions += [
    Extension(f"ms_rope_attention._rfa_cpu_linear_{isa}",
              sources=[f"{CSRC}/rfa_cpu_linear.cc", f"{CSRC}/rfa_cpu_embedding.cc"],
              depends=[f"{CSRC}/{h}" for h in ("aot_abi.h", "last_error.h", "rfa_problem.h", "simd.h", "weight_rows.h")],
              include_dirs=[scipy_openblas32.get_include_dir()], library_dirs=[scipy_openblas32.get_lib_dir()],
              libraries=[scipy_openblas32.get_library()], runtime_library_dirs=["$ORIGIN/../scipy_openblas32/lib"],
              extra_compile_args=COMMON + flags + SANITIZE, extra_link_args=["-fopenmp"] + SANITIZE[:1],
              language="c++")
    for isa, flags in ISA_FLAGS.items()
]

# The Ascend C kernel (aclnn/op_kernel) compiled for the CPU against the AscendC emulation, for the
# tests only: the real kernel is built by CANN (ms_rope_attention/aclnn/build.sh).
extensions.append(Extension(
    "ms_rope_attention._rfa_ascend_emulated", sources=[f"{ACLNN}/emulator/rfa_ascend_emulated.cc"],
    include_dirs=[f"{ACLNN}/emulator", f"{ACLNN}/op_kernel", f"{ACLNN}/op_host", CSRC],
    depends=[f"{ACLNN}/emulator/kernel_operator.h", f"{ACLNN}/emulator/lib/matmul_intf.h",
             f"{ACLNN}/emulator/kernel_tiling/kernel_tiling.h", f"{ACLNN}/op_host/rotary_flash_attention_plan.h",
             f"{CSRC}/rfa_problem.h"] + [f"{ACLNN}/op_kernel/{name}" for name in (
                 "rfa_kernel_common.h", "rotary_flash_attention.h", "rotary_flash_attention.cpp",
                 "rotary_flash_attention_tiling.h", "rotary_flash_attention_grad.h", "rotary_flash_attention_grad.cpp",
                 "rotary_flash_attention_grad_tiling.h")],
    extra_compile_args=["-std=c++17", "-O2", "-pthread", "-fvisibility=hidden", "-Wall", "-Wextra",
                        "-D_GLIBCXX_USE_CXX11_ABI=0"] + SANITIZE,
    extra_link_args=["-pthread"] + SANITIZE[:1], language="c++"))

setup(ext_modules=extensions, cmdclass={"build_ext": BuildKernels})
