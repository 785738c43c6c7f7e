"""Domus packaging.  ``supervisor/`` installs as ``domus.supervisor`` (a
top-level ``supervisor`` package would clash with the Supervisor process
manager).  C extensions from ``cext/`` are listed in EXTENSIONS."""

from setuptools import Extension, setup

EXTENSIONS: list[Extension] = []

setup(
    name="domus",
    version="0.1.0",
    description="Distributed hash tables for cluster jobs",
    python_requires=">=3.11",
    packages=["domus", "domus.service", "domus.storage", "domus.supervisor"],
    package_dir={"domus": "domus", "domus.supervisor": "supervisor"},
    ext_modules=EXTENSIONS,
    install_requires=[
        "twisted>=23.10",
        "msgpack>=1.0",
        "xxhash>=3.0",
        "psutil>=5.9",
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2", "hypothesis>=6", "redis>=5",
                 "hiredis>=2", "ruff>=0.4"],
    },
    entry_points={"console_scripts": ["domus = domus.cli:main"]},
)
