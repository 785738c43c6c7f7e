"""The ``domus`` command's help, its validation of values and the README's
command table, held to the parser itself so that they cannot drift apart."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from domus.ops import cli

README = Path(__file__).resolve().parents[2] / "README.md"
# Options every command that talks to a deployment takes: the paragraph
# above the README's table names them once.
COMMON = {"--supervisor", "--timeout", "--secret-file", "-h", "--help"}


def commands() -> dict[str, argparse.ArgumentParser]:
    """Every command the parser takes, by its words ("dht create"), the
    service admin actions included."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(words: str, parser: argparse.ArgumentParser) -> None:
        subparsers = [action for action in parser._actions
                      if isinstance(action, argparse._SubParsersAction)]
        if not subparsers:
            found[words] = parser
        for action in subparsers:
            for name, sub in action.choices.items():
                walk(f"{words} {name}".strip(), sub)

    walk("", cli.build_parser())
    del found["service"]
    for name, sub in _subcommands(cli._service_admin_parser()).items():
        found[f"service {name}"] = sub
    found["service"] = _subcommands(cli.build_parser())["service"]
    return found


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action, = (action for action in parser._actions
               if isinstance(action, argparse._SubParsersAction))
    return dict(action.choices)


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings
            if option.startswith("--")} - COMMON


def readme_rows() -> dict[str, list[str]]:
    """The README's command table: each command's words -> the text of
    every place the table shows it (a row may show several commands)."""
    rows: dict[str, list[str]] = {}
    for line in README.read_text().splitlines():
        if not line.startswith("| `domus"):
            continue
        first = line.split(" | ")[0]
        for shown in re.findall(r"`domus ([^`]*)`", first):
            words = " ".join(word for word in shown.split()
                             if re.fullmatch(r"[a-z][a-z-]*", word))
            rows.setdefault(words, []).append(shown)
    return rows


def row_of(command: str, rows: dict[str, list[str]]) -> list[str]:
    """The table's entries for ``command``: those whose leading words are
    the command's (an entry's other words are its arguments' values)."""
    return [text for words, texts in rows.items()
            if words == command or words.startswith(command + " ")
            and not any(other != command and words.startswith(other)
                        and len(other) > len(command) for other in commands())
            for text in texts]


def test_every_command_has_a_row_in_the_readme_and_every_flag_is_in_it():
    rows = readme_rows()
    for command, parser in commands().items():
        shown = row_of(command, rows)
        assert shown, f"the README's command table has no row for `domus {command}`"
        text = " ".join(shown)
        missing = {option for option in options(parser) if option not in text}
        assert not missing, f"`domus {command}`: the README's table omits {sorted(missing)}"


def test_every_flag_the_readme_shows_exists():
    every = commands() | {"": cli.build_parser()}       # ("domus --version")
    for words, texts in readme_rows().items():
        command = max((name for name in every if words == name or words.startswith(name + " ")),
                      key=len, default=None)
        assert command is not None, f"the README shows `domus {words}`, which does not exist"
        for text in texts:
            for flag in re.findall(r"--[a-z][a-z-]*", text):
                assert flag in options(every[command]) | COMMON, \
                    f"the README shows `domus {command} {flag}`, which the parser does not take"


@pytest.mark.parametrize("command", ["", "dht", "deployment", "balancer", "secret"])
def test_help_lists_every_action_with_a_line(command, capsys):
    parser = cli.build_parser()
    for word in command.split():
        parser = _subcommands(parser)[word]
    action, = (action for action in parser._actions
               if isinstance(action, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in action._choices_actions}
    for name in _subcommands(parser):
        assert helps.get(name), f"`domus {command} {name}` has no line in --help"
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    shown = capsys.readouterr().out
    for name in _subcommands(parser):
        assert re.search(rf"^\s+{re.escape(name)}\b", shown, re.M), (command, name)


def test_service_help_names_its_admin_actions(capsys):
    with pytest.raises(SystemExit):
        cli.main(["service", "--help"])
    shown = capsys.readouterr().out
    for action in cli.SERVICE_ADMIN:
        assert f"domus service {action}" in shown


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 3)", "(default: 7700)", "(default: 127.0.0.1)",
                    "(default: domus-data)"):
        assert default in shown


@pytest.mark.parametrize("typo, meant", [(["stauts"], "status"), (["dht", "craete"], "create"),
                                         (["deployment", "shutdwon"], "shutdown")])
def test_a_mistyped_command_gets_a_suggestion(typo, meant, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(typo)
    assert exited.value.code == 2
    assert f"did you mean {meant!r}?" in capsys.readouterr().err


def test_a_mistyped_service_action_gets_a_suggestion_not_a_missing_flag(capsys):
    assert cli.main(["service", "lst"]) == 2
    err = capsys.readouterr().err
    assert "unknown action 'lst'; did you mean 'list'?" in err
    assert "--listen" not in err.split("(")[0]


def numeric_options() -> list[tuple[str, str, str]]:
    """(command, option, a valid value) of every option whose value is a
    number, with the arguments the command needs besides."""
    found = []
    for command, parser in commands().items():
        for action in parser._actions:
            if action.option_strings and action.type is not None and action.type not in (
                    str, cli._cpu_list):
                found.append((command, action.option_strings[0]))
    return found


def required_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """Values for a command's positionals and required options, so that
    only the option under test can be wrong."""
    argv = []
    for action in parser._actions:
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            argv.append("1" if action.type is not None else "x")
        elif action.required and isinstance(action, argparse._StoreAction):
            argv += [action.option_strings[0], "127.0.0.1:1" if "listen" in action.dest
                     else "1" if action.type is not None else "x"]
    return argv


@pytest.mark.parametrize("command, option", numeric_options())
def test_bad_numbers_are_refused_naming_the_option_and_the_value(command, option, capsys):
    parser = commands()[command]
    for bad in ("-1", "nan", "inf", "abc", "1e400", ""):
        argv = [*command.split(), *required_arguments(parser), option, bad]
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2, argv
        err = capsys.readouterr().err
        assert f"argument {option}" in err, (argv, err)
        assert "Traceback" not in err


def test_a_port_range_that_does_not_fit_is_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["up", "--port", "70000"])
    assert exited.value.code == 2
    assert "70000 is out of range: ports go from 1 to 65535" in capsys.readouterr().err


def test_connect_refuses_a_timeout_that_is_not_positive():
    from domus.client.blocking import connect

    for timeout in (0, -1, float("nan"), "5", True):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            connect("127.0.0.1:1", timeout=timeout)


def test_the_quick_start_names_every_package_make_installs():
    makefile = (README.parent / "Makefile").read_text()
    packages = set(re.search(r"^APT_PACKAGES := (.*)$", makefile, re.M).group(1).split())
    said = re.search(r"install missing system packages with `apt-get` \((.*?)\)",
                     " ".join(README.read_text().split()))
    assert said, "the README's quick start no longer lists the packages make installs"
    assert set(re.findall(r"`([^`]+)`", said.group(1))) == packages


def test_every_benchmark_flag_is_in_the_benchmarks_readme():
    """benchmarks/README.md's table names each benchmark's every option."""
    folder = README.parent / "benchmarks"
    rows = {match.group(1): match.group(2) for match in re.finditer(
        r"^\| `python -m benchmarks\.(\w+)([^`]*)`", (folder / "README.md").read_text(), re.M)}
    for module in sorted(folder.glob("*.py")):
        flags = set(re.findall(r'add_argument\(\s*"(--[a-z-]+)"', module.read_text()))
        if not flags:
            continue
        assert module.stem in rows, f"benchmarks/README.md has no row for {module.stem}"
        missing = sorted(flag for flag in flags if flag not in rows[module.stem])
        assert not missing, f"benchmarks/README.md's {module.stem} row omits {missing}"
