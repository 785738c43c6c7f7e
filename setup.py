"""The parts of Domus's packaging that need code (the metadata is in
pyproject.toml):

- ``supervisor/`` installs as ``domus.supervisor`` (a top-level
  ``supervisor`` package would clash with the Supervisor process manager),
  beside every package found under ``domus/``;
- the C extensions, built from ``cext/``.  They are optional: where no C
  compiler (or no Python headers) is found the install goes on with the
  pure-Python paths, says so, and ``domus status`` shows the fast path off.
  ``DOMUS_REQUIRE_C=1`` makes a failed build an error (``make`` sets it).
  ``DOMUS_SANITIZE=1`` builds them with AddressSanitizer and
  UndefinedBehaviorSanitizer (``make check-c``); ``DOMUS_SANITIZE=fuzz``
  adds libFuzzer's coverage instrumentation (``make fuzz``; it needs clang:
  ``CC=clang LDSHARED="clang -shared"``).
- two C programs for the benchmarks, built with the extensions into
  ``build/bin/`` of the source tree (``make`` links them into the venv's
  ``bin/`` as well): ``domus-bench``, a load generator that speaks the
  Domus protocol, and ``domus-udp-echo``, the bare UDP loop that is a
  service's floor.  They are not part of an installed wheel.
"""

import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

SANITIZE = os.environ.get("DOMUS_SANITIZE") in ("1", "fuzz")
FUZZ = os.environ.get("DOMUS_SANITIZE") == "fuzz"
REQUIRE_C = os.environ.get("DOMUS_REQUIRE_C") == "1" or SANITIZE
COMPILE_ARGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                "-Wno-missing-field-initializers"]
LINK_ARGS: list[str] = []
if SANITIZE:
    SANITIZERS = "-fsanitize=address,undefined" + (",fuzzer-no-link" if FUZZ else "")
    COMPILE_ARGS += ["-O1", "-g", "-fno-omit-frame-pointer", SANITIZERS,
                     "-fno-sanitize-recover=undefined"]
    LINK_ARGS += [SANITIZERS]

# module name -> sources; nothing but the C library and Python's headers.
MODULES = {
    "domus._rbtree": ["cext/rbtree.c"],
    "domus._recordtree": ["cext/recordtree.c"],
    "domus._hotpath": ["cext/hotpath.c"],
    "domus._codec": ["cext/codec.c"],
}
# program name -> sources: C programs for the benchmarks (not installed).
PROGRAMS = {
    "domus-bench": ["cext/programs/bench.c"],
    "domus-udp-echo": ["cext/programs/udp_echo.c"],
}
PROGRAM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", "bin")
EXTENSIONS = [
    Extension(name, sources, depends=["cext/hashes.h", "cext/rbtree_api.h",
                                      "cext/recordtree_api.h", "cext/siphash.h",
                                      "cext/sha256.h"],
              extra_compile_args=COMPILE_ARGS, extra_link_args=LINK_ARGS)
    for name, sources in MODULES.items()
]


class OptionalBuildExt(build_ext):
    """Builds each extension if it can; one that cannot be built is left
    out with a warning (its pure-Python twin serves), unless REQUIRE_C."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # no compiler at all
            self._skip("the C extensions", error)
            return
        self._build_programs()

    def _build_programs(self) -> None:
        """domus-bench and domus-udp-echo into PROGRAM_DIR (they are the
        benchmarks' tools: a failure to build them only warns, unless
        REQUIRE_C)."""
        root = os.path.dirname(os.path.abspath(__file__))
        for name, sources in PROGRAMS.items():
            try:
                objects = self.compiler.compile(
                    [os.path.join(root, source) for source in sources],
                    output_dir=os.path.join(self.build_temp, "programs"),
                    extra_postargs=[*COMPILE_ARGS, "-pthread"],
                    depends=[os.path.join(root, "cext", header) for header in
                             ("hashes.h", "sha256.h", "siphash.h")])
                self.compiler.link_executable(objects, name, output_dir=PROGRAM_DIR,
                                              libraries=["m"],
                                              extra_postargs=["-pthread", *LINK_ARGS])
            except Exception as error:
                if REQUIRE_C:
                    raise
                print(f"WARNING: {name} could not be built ({error}); the benchmarks that "
                      "need it will say so.", file=sys.stderr)

    def build_extension(self, extension: Extension) -> None:
        try:
            super().build_extension(extension)
        except Exception as error:  # a compiler that failed on this one
            self._skip(extension.name, error)

    def _skip(self, what: str, error: Exception) -> None:
        if REQUIRE_C:
            raise error
        print(f"WARNING: {what} could not be built ({error}); Domus runs on its "
              "pure-Python paths, which are slower (domus status shows 'hot path: python'). "
              "Install a C compiler and the Python headers (Debian: build-essential "
              "python3-dev) and reinstall for the fast paths.", file=sys.stderr)


setup(
    packages=find_packages(include=["domus", "domus.*"]) + ["domus.supervisor"],
    package_dir={"domus": "domus", "domus.supervisor": "supervisor"},
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": OptionalBuildExt},
)
