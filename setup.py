"""Build of the one C extension, colibri.engine._core: Cython binding over csrc/*.c.

Per-ISA kernel files (csrc/*_avx2.c, csrc/*_avx512.c) get their own target flags so one
build runs on any x86-64; the kernel to use is picked at run time from CPUID.
"""

import glob
import os
import platform

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
ISA_FLAGS = {
    "_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"],
}
C_FLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-pthread", "-fno-math-errno"]
# COLIBRI_SANITIZE=1: AddressSanitizer + UBSan; COLIBRI_SANITIZE=thread: ThreadSanitizer
SANITIZE = os.environ.get("COLIBRI_SANITIZE", "")
SAN_FLAGS = (["-fsanitize=thread"] if SANITIZE == "thread"
             else ["-fsanitize=address,undefined"] if SANITIZE else [])
if SAN_FLAGS:
    C_FLAGS += [*SAN_FLAGS, "-fno-omit-frame-pointer", "-O1", "-g"]


def c_sources() -> list[str]:
    sources = sorted(glob.glob("csrc/*.c"))
    if not IS_X86:
        sources = [s for s in sources if not any(s.endswith(k) for k in ISA_FLAGS)]
    return sources


class BuildExt(build_ext):
    """Adds C11/warning flags to csrc files only, and ISA flags to the per-ISA files."""

    def build_extensions(self) -> None:
        original = self.compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):  # type: ignore[no-untyped-def]
            extra = list(extra_postargs)
            if "csrc" in src.replace("\\", "/"):
                extra += C_FLAGS
                for suffix, flags in ISA_FLAGS.items():
                    if src.endswith(suffix):
                        extra += flags
            else:
                extra += ["-O2", "-pthread"]
            return original(obj, src, ext, cc_args, extra, pp_opts)

        self.compiler._compile = _compile
        super().build_extensions()


link_args = ["-pthread", "-lm"]
link_args += SAN_FLAGS

ext = Extension(
    "colibri.engine._core",
    sources=["engine/_core.pyx", *c_sources()],
    include_dirs=["csrc"],
    # a header change rebuilds the extension (sources alone would leave it as it was)
    depends=sorted(glob.glob("csrc/*.h")),
    define_macros=[("CLB_HAVE_X86", "1")] if IS_X86 else [],
    extra_link_args=link_args,
)

# The repository's app/ and engine/ install as colibri.app and colibri.engine.
TOPS = ("app", "engine")
PACKAGES = ["colibri." + p
            for p in find_packages(include=[name for t in TOPS for name in (t, f"{t}.*")])]
PACKAGE_DIR = {f"colibri.{t}": t for t in TOPS}

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    ext_modules=cythonize([ext], language_level=3, compiler_directives={"boundscheck": False}),
    cmdclass={"build_ext": BuildExt},
)
