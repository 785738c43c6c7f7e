"""Domus installed the ways users install it, never from the source tree:
the wheel and the sdist that ``make wheelhouse`` built (``make test`` builds
it first), each in a fresh virtualenv outside the source tree, offline
(``pip install --no-index --find-links wheelhouse``), then used for real by
``install_smoke.py`` (a supervisor, services, a DHT on every platform the
install has, ``domus status``).

- the wheel with ``[bdb]``, as root;
- the sdist with no C compiler and no Berkeley DB: the pure-Python paths,
  and a service of it joins the first install's deployment;
- the wheel with ``[bdb]`` as an unprivileged user, with the system's own
  Python, with libdb taken from the virtualenv (checked with ldd).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

import domus

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(os.environ.get("DOMUS_WHEELHOUSE", ROOT / "wheelhouse"))
SMOKE = Path(__file__).with_name("install_smoke.py")
PIP_TIMEOUT = 300

pytestmark = pytest.mark.skipif(
    not (WHEELHOUSE / ".built").exists(),
    reason=f"no wheelhouse at {WHEELHOUSE}: run `make wheelhouse` (make test does)")


def the_one(pattern: str) -> Path:
    found = sorted(WHEELHOUSE.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {WHEELHOUSE}, found {found}"
    return found[0]


def run(command: list, **options: object) -> subprocess.CompletedProcess:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True,
                            timeout=PIP_TIMEOUT, **options)
    assert result.returncode == 0, (f"{' '.join(map(str, command))} exited "
                                    f"{result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: nothing that points into this
    checkout or this test run's virtualenv."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTHON", "VIRTUAL_ENV", "DOMUS_", "PYTEST", "COV_"))}
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env.update(extra)
    return env


def as_user(user: str | None) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment to run something as ``user``
    (None: as this process)."""
    if user is None:
        return [], clean_env()
    return [shutil.which("runuser"), "-u", user, "--"], clean_env(HOME=pwd.getpwnam(user).pw_dir,
                                                    USER=user, LOGNAME=user)


def make_venv(python: str, where: Path, *, user: str | None = None) -> Path:
    prefix, env = as_user(user)
    run([*prefix, python, "-m", "venv", where], env=env, cwd=where.parent)
    return where / "bin" / "python"


def pip_install(python: Path, wheelhouse: Path, *requirements: str | Path,
                user: str | None = None, **extra_env: str) -> None:
    prefix, env = as_user(user)
    run([*prefix, python, "-m", "pip", "install", "--no-index", "--find-links", wheelhouse,
         "--no-cache-dir", *requirements], env=env | extra_env, cwd=python.parents[2])


def smoke(python: Path, script: Path, data_dir: Path, *args: str | Path,
          user: str | None = None) -> dict:
    """Run install_smoke.py (a copy outside the source tree) with ``python``."""
    prefix, env = as_user(user)
    result = run([*prefix, python, script, data_dir, *args], env=env, cwd=script.parent)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_wheel_holds_every_module_of_the_source_tree():
    wheel = the_one("domus-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"domus/{path.relative_to(ROOT / 'domus')}"
                for path in (ROOT / "domus").rglob("*.py")}
    expected |= {f"domus/supervisor/{path.relative_to(ROOT / 'supervisor')}"
                 for path in (ROOT / "supervisor").rglob("*.py")}
    assert expected - shipped == set(), "left out of the wheel"
    assert {"_codec", "_hotpath", "_rbtree", "_recordtree"} <= {
        Path(name).name.split(".")[0] for name in shipped if name.endswith(".so")}
    assert re.search(rf"domus-{re.escape(domus.__version__)}-", wheel.name)
    # the sdist carries what it needs to build the wheel, and the tests
    names = set(subprocess.run(["tar", "tzf", the_one("domus-*.tar.gz")], capture_output=True,
                               text=True, check=True).stdout.split())
    prefix = f"domus-{domus.__version__}/"
    for needed in ("cext/codec.c", "cext/hashes.h", "cext/rbtree_api.h", "setup.py",
                   "pyproject.toml", "tests/integration/install_smoke.py",
                   "supervisor/server.py", "fuzz/harness.py",
                   "fuzz/regressions/control_reply/control-error-body-is-an-int"):
        assert prefix + needed in names, f"{needed} is not in the sdist"


@pytest.fixture(scope="module")
def installs(tmp_path_factory) -> dict[str, Path]:
    """Two installs outside the source tree: the wheel with Berkeley DB, and
    the sdist built with no C compiler (CC=false) and without Berkeley DB."""
    base = tmp_path_factory.mktemp("installs")
    full = make_venv(sys.executable, base / "full")
    pip_install(full, WHEELHOUSE, f"{the_one('domus-*.whl')}[bdb]")
    bare = make_venv(sys.executable, base / "bare")
    pip_install(bare, WHEELHOUSE, the_one("domus-*.tar.gz"), CC="false", CXX="false")
    script = shutil.copy(SMOKE, base / SMOKE.name)
    return {"full": full, "bare": bare, "base": base, "script": Path(script)}


def test_the_wheel_with_berkeley_db_runs_every_platform(installs):
    python = installs["full"]
    found = smoke(python, installs["script"], installs["base"] / "full-data",
                  "--extra-service", installs["bare"])
    site = str(installs["full"].parents[1])
    assert found["domus"].startswith(site), found["domus"]      # not the source tree
    assert found["version_line"].startswith(f"domus {domus.__version__} (")
    assert "C extensions built" in found["version_line"]
    assert found["hot_path"] == "c"
    assert set(found["stored"]) == {"python-dict-ram", "domus-rbt-ram",
                                    "domus-bsddb-btree-ram", "domus-bsddb-btree-disk",
                                    "domus-bsddb-hash-ram", "domus-bsddb-hash-disk"}
    # the service of the bare install joined, and stores only what it can
    assert found["services"]["extra"] == {"platforms": ["python-dict", "domus-rbt"],
                                          "hot_path": "python"}
    for technology, holders in found["stored"].items():
        assert sum(holders.values()) == 300, technology
        if "bsddb" in technology:
            assert "extra" not in holders, technology
    assert found["stored"]["python-dict-ram"].get("extra", 0) > 0
    status = found["status"]
    assert "HOT PATH" in status and "PLATFORMS" in status
    extra_line = next(line for line in status.splitlines() if line.startswith("extra "))
    assert "python (slow)" in extra_line and extra_line.rstrip().endswith("dict,rbt")


def test_the_sdist_without_a_compiler_or_berkeley_db_runs_on_the_python_paths(installs):
    python = installs["bare"]
    found = smoke(python, installs["script"], installs["base"] / "bare-data")
    assert found["domus"].startswith(str(installs["bare"].parents[1]))
    assert "not built: pure-Python paths" in found["version_line"]
    assert found["hot_path"] == "python"
    assert found["platforms"] == ["python-dict", "domus-rbt"]
    assert set(found["stored"]) == {"python-dict-ram", "domus-rbt-ram"}
    assert "domus[bdb]" in found["refused"] and "libdb" in found["refused"]
    assert subprocess.run([python, "-c", "import berkeleydb"]).returncode != 0


@pytest.fixture
def unprivileged_user():
    if os.geteuid() != 0:
        pytest.skip("creating a user for the unprivileged install needs root")
    if shutil.which("runuser") is None or shutil.which("useradd") is None:
        pytest.skip("runuser and useradd are needed for the unprivileged install")
    name = f"domustest{os.getpid() % 100000}"
    subprocess.run(["userdel", "-r", name], capture_output=True)
    run(["useradd", "--create-home", "--shell", "/bin/sh", name])
    try:
        yield name
    finally:
        # stop anything the user left running, by PID, then remove the user
        uid = pwd.getpwnam(name).pw_uid
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    if os.stat(f"/proc/{pid}").st_uid == uid:
                        os.kill(int(pid), 9)
                except (FileNotFoundError, ProcessLookupError):
                    pass
        subprocess.run(["userdel", "-r", name], capture_output=True)


def test_an_unprivileged_user_installs_offline_from_the_wheelhouse(unprivileged_user):
    system_python = shutil.which("python3", path="/usr/bin")
    if system_python is None:
        pytest.skip("no /usr/bin/python3 (Debian's python3) for the unprivileged user")
    user = unprivileged_user
    home = Path(pwd.getpwnam(user).pw_dir)
    # what the user was handed: a copy of the wheelhouse and the smoke script
    work = Path(tempfile.mkdtemp(prefix="domus-user-", dir=home))
    shutil.copytree(WHEELHOUSE, work / "wheelhouse")
    script = Path(shutil.copy(SMOKE, work / SMOKE.name))
    run(["chown", "-R", f"{user}:{user}", work])
    venv = work / "venv"
    python = make_venv(system_python, venv, user=user)
    pip_install(python, work / "wheelhouse", "domus[bdb]", user=user)
    # libdb comes from the virtualenv, not from /usr/lib
    extension = next(venv.glob("lib/python3*/site-packages/berkeleydb/_berkeleydb*.so"))
    linked = run(["ldd", extension]).stdout
    libdb = next(line for line in linked.splitlines() if "libdb" in line)
    assert str(venv) in libdb and "/usr/lib" not in libdb, linked
    found = smoke(python, script, work / "data", user=user)
    assert found["domus"].startswith(str(venv))
    assert found["hot_path"] == "c"
    assert {"domus-bsddb-btree-disk", "domus-bsddb-hash-disk"} <= set(found["stored"])
    assert all(sum(holders.values()) == 300 for holders in found["stored"].values())
    assert list((work / "data").glob("s*/dhts/*/bucket-*.db")), "no disk DHT file was written"
