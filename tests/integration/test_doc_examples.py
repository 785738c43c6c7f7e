"""Every example in README.md and docs/*.md, run as written against a real
deployment, with what its comments say it gives checked.

A ```python block runs in one namespace per document, in the order of the
document (as a reader would type them into one session), after
``import domus`` and with the deployment's address where an example says
``head:7700``.  A statement followed by a comment that starts with a Python
literal (``# [5, 9]``, ``# -> {1: "a"}``, ``# "x": the first str key``) must
give that value.  A ```sh block runs its ``domus`` lines (with
DOMUS_SUPERVISOR and DOMUS_SECRET_FILE set, as ``domus up`` prints), each of
which must succeed and print what its comment says when that is a literal.
Lines that start processes or act on a cluster this test cannot be (``domus
up``, ``domus supervisor``, ``domus service --listen``, ``make``, ``pip``,
paths on other hosts) are not run; a block that cannot run at all says so
with ``<!-- example: not run (why) -->`` on the line before it.  The test
prints how many blocks and lines it ran.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import start_deployment

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!-- example: not run \((.+)\) -->")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
# domus subcommands an example runs; the others start or stop processes
RUNS = ("dht", "put", "get", "del", "status", "balancer", "secret", "--version")
RUNS_SERVICE = ("list", "drain", "remove")


@dataclass
class Block:
    document: Path
    line: int              # of the opening fence, 1-based
    language: str
    text: str
    not_run: str | None     # the reason, when marked

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def blocks(document: Path) -> list[Block]:
    found = []
    lines = document.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, language = opening.groups()
        end = index + 1
        while end < len(lines) and not FENCE.match(lines[end]):
            end += 1
        marker = NOT_RUN.search(lines[index - 1]) if index else None
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line
                         for line in lines[index + 1:end])
        found.append(Block(document, index + 1, language, body,
                           marker.group(1) if marker else None))
        index = end + 1
    return found


def literal_in(comment: str) -> tuple[bool, Any]:
    """(True, value) when the comment starts with a Python literal (after an
    optional '->'), the longest one that parses; else (False, None)."""
    text = comment.strip()
    text = text[2:].strip() if text.startswith("->") else text
    if "..." in text:
        return False, None          # (a sketch of a value, not the value)
    for end in range(len(text), 0, -1):
        if end < len(text) and text[end] not in " :;,(" and text[end - 1] not in "]})\"'":
            continue
        try:
            value = ast.literal_eval(text[:end].strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if _sketch(value):
            return False, None      # ({"name", "address"}: the fields, not a value)
        return True, value
    return False, None


def _literal_text(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _literal_text  # (nothing a literal equals)


def _sketch(value: Any) -> bool:
    """Whether a literal names fields rather than shows a value: a set of
    strings anywhere in it (the docs' {"name", "from", ...})."""
    if isinstance(value, (set, frozenset)):
        return True
    if isinstance(value, (list, tuple)):
        return any(map(_sketch, value))
    if isinstance(value, dict):
        return any(map(_sketch, value.values()))
    return False


def comment_of(source_lines: list[str], node: ast.stmt) -> str | None:
    line = source_lines[node.end_lineno - 1]
    tail = line[node.end_col_offset:]
    return tail.split("#", 1)[1] if "#" in tail else None


def same(actual: Any, expected: Any) -> bool:
    """Equal as the docs mean it: a tuple shown where a list comes back
    (or the reverse) is the same, as msgpack makes them one."""
    if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(map(same, actual, expected))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(same(actual[k], expected[k])
                                                        for k in actual)
    return actual == expected


def run_python(block: Block, namespace: dict[str, Any], address: str) -> int:
    """Run a block statement by statement; returns how many results it
    checked."""
    source = block.text.replace("head:7700", address)
    tree = ast.parse(source, filename=block.where)
    lines = source.splitlines()
    checked = 0
    for node in tree.body:
        comment = comment_of(lines, node)
        is_literal, expected = literal_in(comment) if comment else (False, None)
        where = f"{block.where} (+{node.lineno}): {lines[node.lineno - 1].strip()}"
        with contextlib.redirect_stdout(io.StringIO()):
            if isinstance(node, ast.Expr):
                value = eval(compile(ast.Expression(node.value), where, "eval"), namespace)
            else:
                exec(compile(ast.Module([node], []), where, "exec"), namespace)
                continue
        if is_literal:
            checked += 1
            assert same(value, expected), f"{where}: gives {value!r}, the doc says {expected!r}"
    return checked


def shell_commands(block: Block) -> list[tuple[str, str | None]]:
    """The (command, comment) of each line of a sh block this test runs."""
    found = []
    for line in block.text.splitlines():
        command, _, comment = line.partition("  #")
        words = shlex.split(command, comments=True) if command.strip() else []
        if len(words) < 2 or words[0] != "domus":
            continue
        if words[1] in RUNS or (words[1] == "service" and words[2:3] and
                                words[2] in RUNS_SERVICE):
            found.append((command.strip(), comment or None))
    return found


def run_shell(block: Block, env: dict[str, str]) -> int:
    ran = 0
    for command, comment in shell_commands(block):
        result = subprocess.run([sys.executable, "-m", "domus", *shlex.split(command)[1:]],
                                capture_output=True, text=True, env=env, timeout=120,
                                stdin=subprocess.DEVNULL)
        assert result.returncode == 0, (f"{block.where}: `{command}` exited "
                                        f"{result.returncode}: {result.stderr}")
        # (a command's comment is its output only when it is nothing else:
        # "# 3", or "# -> ..." )
        is_literal, expected = literal_in(comment) if comment else (False, None)
        if is_literal and not comment.strip().startswith("->"):
            is_literal = comment.strip() in (repr(expected), str(expected)) or \
                _literal_text(comment.strip()) == expected
        if is_literal:
            printed = result.stdout.strip()
            assert printed == str(expected) or printed == repr(expected), \
                f"{block.where}: `{command}` printed {printed!r}, the doc says {expected!r}"
        ran += 1
    return ran


@pytest.mark.timeout(600)
@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_example_of_the_document_runs_as_written(document, tmp_path, capsys):
    examples = [block for block in blocks(document) if block.language in ("python", "sh")]
    for block in examples:
        assert block.not_run is None or block.not_run.strip(), block.where
    runnable = [block for block in examples if block.not_run is None]
    if not runnable:
        pytest.skip(f"{document.name} has no example this test runs")
    needs_deployment = any(block.language == "sh" or "cluster" in block.text
                           or "connect(" in block.text for block in runnable)
    deployment = start_deployment(tmp_path / "deployment") if needs_deployment else None
    try:
        env = dict(os.environ)
        if deployment is not None:
            env.update(deployment.environment())
            os.environ.update(deployment.environment())
        address = deployment.supervisor_address if deployment is not None else "head:7700"
        namespace: dict[str, Any] = {"__name__": "__doc_example__"}
        exec("import domus", namespace)
        checked = ran = 0
        with contextlib.chdir(tmp_path):
            for block in runnable:
                if block.language == "python":
                    checked += run_python(block, namespace, address)
                else:
                    ran += run_shell(block, env)
        cluster = namespace.get("cluster")
        if cluster is not None and hasattr(cluster, "close"):
            cluster.close()
    finally:
        if deployment is not None:
            deployment.stop_everything()
    with capsys.disabled():
        print(f"\n{document.name}: {len(runnable)} of {len(examples)} example blocks run "
              f"({checked} results checked, {ran} domus commands)")
