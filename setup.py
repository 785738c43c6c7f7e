"""Domus packaging.  ``supervisor/`` installs as ``domus.supervisor`` (a
top-level ``supervisor`` package would clash with the Supervisor process
manager).  C extensions are built from ``cext/``.

DOMUS_SANITIZE=1 builds them with AddressSanitizer and UndefinedBehavior-
Sanitizer (``make check-c``)."""

import os

from setuptools import Extension, find_packages, setup

SANITIZE = os.environ.get("DOMUS_SANITIZE") == "1"
COMPILE_ARGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                "-Wno-missing-field-initializers"]
LINK_ARGS: list[str] = []
if SANITIZE:
    COMPILE_ARGS += ["-O1", "-g", "-fno-omit-frame-pointer",
                     "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    LINK_ARGS += ["-fsanitize=address,undefined"]

# module name -> (sources, libraries); a module is built once its sources exist.
MODULES = {
    "domus._rbtree": (["cext/rbtree.c"], []),
    "domus._hotpath": (["cext/hotpath.c"], []),
    "domus._codec": (["cext/codec.c"], []),
}
EXTENSIONS = [
    Extension(name, sources, libraries=libraries, extra_compile_args=COMPILE_ARGS,
              extra_link_args=LINK_ARGS)
    for name, (sources, libraries) in MODULES.items()
    if all(os.path.exists(source) for source in sources)
]

setup(
    name="domus",
    version="0.1.0",
    description="Distributed hash tables for cluster jobs",
    python_requires=">=3.11",
    packages=find_packages(include=["domus", "domus.*"]) + ["domus.supervisor"],
    package_dir={"domus": "domus", "domus.supervisor": "supervisor"},
    ext_modules=EXTENSIONS,
    install_requires=[
        "twisted>=23.10",
        "msgpack>=1.0",
        "xxhash>=3.0",
        "psutil>=5.9",
        "berkeleydb>=18.1",   # needs libdb-dev (make installs it)
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3.5", "hypothesis>=6",
                 "redis>=5", "hiredis>=2", "ruff>=0.4", "sortedcontainers>=2.4",
                 "matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["domus = domus.ops.cli:main"]},
)
