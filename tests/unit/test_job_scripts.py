"""The job scripts (clients/slurm, clients/pbs) make each node's data dir
private: their own data-dir lines, run by a real bash, make a directory of
mode 0700, owned by this user, with a name nobody could take beforehand,
under DOMUS_DATA (or $TMPDIR, or /tmp); and they name no predictable path in
a world-writable directory."""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {"slurm": ROOT / "clients" / "slurm" / "domus-job.sbatch",
           "pbs": ROOT / "clients" / "pbs" / "domus-job.pbs"}


def data_dir_lines(script: Path) -> str:
    """The lines of ``script`` that say how a node's data dir is made."""
    text = script.read_text()
    lines = [line for line in text.splitlines()
             if re.match(r"^(export DOMUS_DATA_PARENT|PARENT|NEW_DATA_DIR)=", line)]
    assert any(line.startswith("NEW_DATA_DIR=") for line in lines), script
    return "\n".join(lines)


def make_on_a_node(kind: str, env: dict[str, str]) -> Path:
    """What a node's command makes of NEW_DATA_DIR, as the script hands it
    to srun or pbsdsh (a bash -c string)."""
    program = data_dir_lines(SCRIPTS[kind]) + '\nbash -c "d=$NEW_DATA_DIR && echo \\"\\$d\\""\n'
    result = subprocess.run(["bash", "-c", program], capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], **env}, timeout=30)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip())


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_each_node_gets_a_private_unguessable_data_dir(kind, tmp_path):
    parent = tmp_path / "scratch with space"
    parent.mkdir()
    made = {make_on_a_node(kind, {"DOMUS_DATA": str(parent)}) for _ in range(2)}
    assert len(made) == 2                            # (a fresh name each time)
    for path in made:
        assert path.parent == parent and path.name.startswith("domus-job")
        info = path.stat()
        assert info.st_mode & 0o777 == 0o700 and info.st_uid == os.getuid()
    elsewhere = make_on_a_node(kind, {"TMPDIR": str(tmp_path)})
    assert elsewhere.parent == tmp_path and elsewhere.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_no_script_uses_a_predictable_path_in_a_world_writable_directory(kind):
    text = SCRIPTS[kind].read_text()
    assert not re.search(r"/tmp/domus-\$", text)
    assert "umask 077" in text                       # the secret's directory too
