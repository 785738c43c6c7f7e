"""The package layout as docs/architecture.md draws it, checked by walking
every import in the source (those inside functions and under TYPE_CHECKING
too): each side of the wire imports only the shared packages, imports run
downwards only, and no module imports itself back through others."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import domus
import domus.aio
from domus import txclient

ROOT = Path(__file__).resolve().parents[2]


def c_extensions() -> dict[str, set[str]]:
    """Each C extension built from cext/ (its ``m_name``) and the Domus
    modules its C code imports (PyImport_ImportModule, PyCapsule_Import)."""
    headers = "".join(header.read_text() for header in (ROOT / "cext").glob("*.h"))
    macros = dict(re.findall(r'#define (\w+) "([\w.]+)"', headers))
    extensions = {}
    for source in sorted((ROOT / "cext").glob("*.c")):
        text = source.read_text()
        name = re.search(r'\.m_name = "([\w.]+)"', text).group(1)
        imported = set(re.findall(r'PyImport_ImportModule\("(domus[\w.]*)"\)', text))
        imported |= {macros[macro].rpartition(".")[0]
                     for macro in re.findall(r"PyCapsule_Import\((\w+)", text)}
        extensions[name] = imported
    return extensions


C_EXTENSIONS = c_extensions()

# Layer of each package (the longest matching prefix wins) and the layers
# each may import.  ``shared`` is what both sides of the wire use.
LAYERS = {
    "domus.errors": "shared",
    "domus._version": "shared",
    "domus.wire": "shared",
    "domus.placement": "shared",
    "domus.routing": "shared",
    "domus.rbtree": "shared",
    "domus.client": "client",
    "domus.service": "service",
    "domus.storage": "storage",
    "domus.supervisor": "supervisor",
    "domus.ops": "ops",
    # the C accelerators (cext/), which every layer may use
    "domus._codec": "native",
    "domus._hotpath": "native",
    "domus._rbtree": "native",
    "domus._recordtree": "native",
    # the public names: thin re-exports and the command's entry point
    "domus": "public",
    "domus.txclient": "public",
    "domus.aio": "public",
    "domus.__main__": "public",
}
MAY_IMPORT = {
    "native": {"shared", "native"},
    "shared": {"shared", "native"},
    "client": {"shared", "native", "client"},
    "storage": {"shared", "native", "storage"},
    "service": {"shared", "native", "storage", "service"},
    "supervisor": {"shared", "native", "supervisor"},
    "ops": {"shared", "native", "client", "storage", "service", "supervisor", "ops"},
    "public": {"shared", "native", "client", "ops", "public"},
}


def source_modules() -> dict[str, Path]:
    """Every Python module that ships, by its installed name
    (``supervisor/`` installs as ``domus.supervisor``)."""
    modules = {}
    for top, package in (("domus", "domus"), ("supervisor", "domus.supervisor")):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = source_modules()


def layer_of(module: str) -> str:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + ".") and prefix != "domus":
            return LAYERS[prefix]
    raise AssertionError(f"{module} belongs to no layer: place it in a package of "
                         "docs/architecture.md and add it to LAYERS here")


def imports_of(module: str, path: Path) -> set[str]:
    """The Domus modules that ``module`` imports, anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from a import b`` imports the module a.b when there is one
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES
                     or f"{base}.{alias.name}" in C_EXTENSIONS else base
                     for alias in node.names]
        else:
            continue
        found.update(name for name in names if name == "domus" or name.startswith("domus."))
    return found


GRAPH = {module: imports_of(module, path) for module, path in MODULES.items()} | C_EXTENSIONS


def test_every_module_has_a_layer_and_top_level_stays_small():
    for module in MODULES:
        layer_of(module)
    top_level = sorted(path.name for path in (ROOT / "domus").glob("*.py"))
    assert top_level == ["__init__.py", "__main__.py", "_version.py", "aio.py", "errors.py",
                         "txclient.py"]


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_only_go_to_allowed_layers(module):
    mine = layer_of(module)
    for imported in sorted(GRAPH[module]):
        assert imported in GRAPH, f"{module} imports {imported}, which does not exist"
        theirs = layer_of(imported)
        assert theirs in MAY_IMPORT[mine], (
            f"{module} ({mine}) imports {imported} ({theirs}); {mine} may import only "
            f"{sorted(MAY_IMPORT[mine])}")


def reachable(module: str) -> set[str]:
    """Every Domus module that importing ``module`` may load."""
    seen, todo = set(), [module]
    while todo:
        for imported in GRAPH.get(todo.pop(), ()):
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return seen


@pytest.mark.parametrize("side, other", [("service", "client"), ("storage", "client"),
                                         ("client", "service"), ("client", "storage")])
def test_one_side_of_the_wire_never_loads_the_other(side, other):
    # transitively: a service process never loads client code, and a job
    # that imports the client never loads the service's
    for module in MODULES:
        if layer_of(module) == side:
            crossing = sorted(name for name in reachable(module) if layer_of(name) == other)
            assert not crossing, f"{module} ({side}) loads {other} modules: {crossing}"


def test_no_import_cycles():
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> None:
        path.append(module)
        on_path.add(module)
        for imported in sorted(GRAPH.get(module, ())):
            if imported in on_path:
                cycle = path[path.index(imported):] + [imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in done:
                visit(imported)
        on_path.discard(path.pop())
        done.add(module)

    for module in sorted(GRAPH):
        if module not in done:
            visit(module)


def test_the_walk_sees_imports_inside_functions():
    # the rule would be empty if the walk missed lazy imports: ops.launch
    # imports the blocking client inside its functions only
    assert "domus.client.blocking" in GRAPH["domus.ops.launch"]
    assert "domus.storage.pydict" in GRAPH["domus.service.hotpath"]
    # and those of the C code: the codec packs values with domus.wire.values
    assert "domus.wire.values" in GRAPH["domus._codec"]
    assert GRAPH["domus._hotpath"] == {"domus._recordtree"}
    assert GRAPH["domus._recordtree"] == {"domus.errors"}


def test_the_public_names_keep_working():
    assert callable(domus.connect)
    assert domus.Cluster.__module__ == "domus.client.blocking"
    assert issubclass(domus.errors.KeyTooLarge, domus.errors.DomusError)
    assert domus.__version__.count(".") == 2
    assert txclient.connect.__module__ == "domus.client.tx"
    assert {"connect", "TxCluster", "TxDht"} <= set(txclient.__all__)
    assert domus.aio.connect.__module__ == "domus.client.aio"
    assert {"connect", "AioCluster", "AioDht"} <= set(domus.aio.__all__)


def loaded_after(statements: str) -> set[str]:
    """The Domus modules a fresh interpreter holds after ``statements``."""
    probe = (statements + "\nimport sys\n"
             "print(' '.join(m for m in sys.modules if m.startswith('domus')))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return set(run.stdout.split())


def test_a_service_process_loads_no_client_code_and_a_job_no_service_code():
    # what the walk promises, seen in real processes: `python -m domus service`
    # and `python -m domus supervisor` import these, a job imports domus
    service = loaded_after("import domus.service.server, domus.supervisor.server, "
                           "domus.storage.bsddb")
    assert "domus.service.handler" in service
    assert not {m for m in service if m.startswith("domus.client")}
    job = loaded_after("import domus; domus.connect; from domus import txclient; "
                       "import domus.aio")
    assert "domus.client.blocking" in job and "domus.client.tx" in job
    assert "domus.client.aio" in job
    assert not {m for m in job if m.startswith(("domus.service", "domus.storage",
                                                "domus.supervisor", "domus.ops"))}
