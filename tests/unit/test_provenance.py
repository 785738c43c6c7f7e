"""A benchmark's raw output names the commit it ran: with ``-dirty`` when
the tracked files were not the commit's, so a figure from uncommitted code
is not passed off as the commit's."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from benchmarks.provenance import machine

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(*args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_the_commit_is_marked_dirty_while_tracked_files_differ_from_it(tmp_path,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    git("init", "-q")
    (tmp_path / "code.py").write_text("one\n")
    git("add", "code.py")
    git("commit", "-q", "-m", "first")
    head = git("rev-parse", "--short", "HEAD")
    assert machine()["commit"] == head
    (tmp_path / "notes.txt").write_text("untracked: not what ran\n")
    assert machine()["commit"] == head
    (tmp_path / "code.py").write_text("two\n")
    assert machine()["commit"] == f"{head}-dirty"
    git("commit", "-q", "-am", "second")
    assert machine()["commit"] == git("rev-parse", "--short", "HEAD")


def test_outside_a_repository_the_commit_is_unknown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert machine()["commit"] == "unknown"
