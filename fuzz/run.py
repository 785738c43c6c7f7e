"""Run fuzz targets under libFuzzer (atheris), coverage-guided.

    python -m fuzz.run [--seconds N] [TARGET ...]     every target, or those named
    python -m fuzz.run --list

``make fuzz SECONDS=N`` builds the C extensions with ASan, UBSan and
libFuzzer's coverage instrumentation (clang, ``-fsanitize=fuzzer-no-link``)
into build/fuzz, preloads atheris' ASan runtime with libFuzzer in it, and
runs this.  Each target runs in a process of its own for N seconds; at the
end a table gives, per target, the executions, the edges libFuzzer saw
covered (C and Python), and the share of the C code's edges reached in the
files the target drives.

Each target's corpus is build/fuzz/corpus/TARGET: its seeds (built by the
project's encoders each run) and the regression inputs of
fuzz/regressions/TARGET to start from, and what libFuzzer adds, so a longer
or later run goes on from there.  An input that shows a bug is written to
build/fuzz/crashes/TARGET-crash-...; keep it as a regression input by
copying it into fuzz/regressions/TARGET/ under a name that says what it
found (the suite replays it from then on).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("DOMUS_FUZZ_WORK", ROOT / "build" / "fuzz"))
# The C files whose functions count when a target's C coverage is summed.
FUNCTION_LINE = re.compile(r"^(COVERED|UNCOVERED)_FUNC: hits: (\d+) edges: (\d+)/(\d+) "
                           r"(\S+) (\S+?):\d+")
STATUS_LINE = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
DONE_LINE = re.compile(r"^Done (\d+) runs in (\d+) second")
STAT_LINE = re.compile(r"^stat::(\w+):\s+(\d+)")


@dataclass
class Report:
    """What one target's run printed."""

    name: str
    runs: int = 0
    seconds: float = 0.0            # the whole process, start-up included
    rate: int = 0                   # executions per second, as libFuzzer measured them
    peak_rss_mb: int = 0
    cov: int = 0
    features: int = 0
    corpus: int = 0
    # C file -> [edges covered, edges of the functions reached, functions
    # reached, edges in the file]
    c_edges: dict[str, list[int]] = field(default_factory=dict)
    outcome: str = "ok"
    artifacts: list[str] = field(default_factory=list)

    def c_coverage(self) -> str:
        """Per C file: edges covered of those in the functions the target
        reached (and of the whole file)."""
        parts = []
        for source, (covered, reached, functions, total) in sorted(self.c_edges.items()):
            share = 100.0 * covered / reached if reached else 0.0
            parts.append(f"{Path(source).name} {covered}/{reached} = {share:.0f}% in "
                         f"{functions} functions ({covered}/{total} of the file)")
        return "; ".join(parts) or "(Python only)"


# ------------------------------------------------------------ one target, in its own process

def child(name: str, seconds: int, runs: int | None, jobs_dir: Path) -> None:
    """Fuzz one target in this process (libFuzzer exits it at the end)."""
    import atheris

    with atheris.instrument_imports(include=["domus", "fuzz"]):
        from fuzz import harness

        targets = harness.load()
    target = targets[name]
    corpus = jobs_dir / "corpus" / name
    crashes = jobs_dir / "crashes"
    corpus.mkdir(parents=True, exist_ok=True)
    crashes.mkdir(parents=True, exist_ok=True)
    for data in target.seeds() + [data for _file, data in harness.regressions(name)]:
        (corpus / hashlib.sha1(data).hexdigest()).write_bytes(data)
    arguments = [sys.argv[0], str(corpus), f"-max_len={target.max_len}",
                 f"-artifact_prefix={crashes}/{name}-", "-print_final_stats=1",
                 "-print_coverage=1", "-timeout=60", "-rss_limit_mb=8192",
                 "-detect_leaks=0", "-print_pcs=0", "-reload=0"]
    arguments.append(f"-runs={runs}" if runs is not None else f"-max_total_time={seconds}")
    if target.dictionary:
        dictionary = jobs_dir / f"{name}.dict"
        dictionary.write_text("".join('"' + "".join(f"\\x{byte:02x}" for byte in entry)
                                      + '"\n' for entry in target.dictionary))
        arguments.append(f"-dict={dictionary}")
    print(f"fuzz: {name}: {len(list(corpus.iterdir()))} inputs to start from; "
          f"{harness.FENCE_ACTIVE and 'inputs fenced' or 'no fence (not under ASan)'}",
          file=sys.stderr, flush=True)
    atheris.Setup(arguments, target.run)
    atheris.Fuzz()


# ------------------------------------------------------------ the parent

def parse(name: str, output: str, c_sources: tuple[str, ...], code: int,
          crashes: Path, started: float) -> Report:
    report = Report(name, seconds=time.monotonic() - started)
    for line in output.splitlines():
        status = STATUS_LINE.match(line)
        if status:
            report.runs = int(status.group(1))
            report.cov, report.features, report.corpus = (int(status.group(2)),
                                                           int(status.group(3)),
                                                           int(status.group(4)))
        done = DONE_LINE.match(line)
        if done:
            report.runs = int(done.group(1))
        stat = STAT_LINE.match(line)
        if stat and stat.group(1) == "average_exec_per_sec":
            report.rate = int(stat.group(2))
        elif stat and stat.group(1) == "peak_rss_mb":
            report.peak_rss_mb = int(stat.group(2))
        function = FUNCTION_LINE.match(line)
        if function:
            source = function.group(6)
            if any(source.endswith(wanted) for wanted in c_sources):
                totals = report.c_edges.setdefault(source.split("/cext/")[-1], [0, 0, 0, 0])
                covered, edges = int(function.group(3)), int(function.group(4))
                if int(function.group(2)):
                    totals[0] += covered
                    totals[1] += edges
                    totals[2] += 1
                totals[3] += edges
    if code != 0:
        report.outcome = "FOUND A BUG" if "==ERROR" in output or "Uncaught" in output \
            or "Finding" in output or "deadly signal" in output else f"exit {code}"
        report.artifacts = sorted(str(path) for path in crashes.glob(f"{name}-*"))
    return report


def run_one(name: str, c_sources: tuple[str, ...], seconds: int, runs: int | None,
            log: Path) -> Report:
    crashes = WORK / "crashes"
    before = set(crashes.glob(f"{name}-*")) if crashes.is_dir() else set()
    command = [sys.executable, "-m", "fuzz.run", "--child", name, "--seconds", str(seconds)]
    if runs is not None:
        command += ["--runs", str(runs)]
    started = time.monotonic()
    with open(log, "w") as output:
        code = subprocess.call(command, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT)
    text = log.read_text(errors="replace")
    report = parse(name, text, c_sources, code, crashes, started)
    report.artifacts = [path for path in report.artifacts if Path(path) not in before]
    return report


def print_table(reports: list[Report]) -> None:
    header = f"{'target':<22} {'executions':>11} {'exec/s':>8} {'cov':>6} {'ft':>7} " \
             f"{'corpus':>6}  {'result':<12} C edges covered"
    print(header)
    print("-" * (len(header) + 40))
    for report in reports:
        print(f"{report.name:<22} {report.runs:>11,} {report.rate:>8,} {report.cov:>6} "
              f"{report.features:>7} {report.corpus:>6}  {report.outcome:<12} "
              f"{report.c_coverage()}")
        for artifact in report.artifacts:
            print(f"    input kept: {artifact}")
    print("cov: edges covered (C and Python) as libFuzzer counts them; ft: its features; "
          "C edges: of the functions each target reached in the C files it drives")
    total = sum(report.runs for report in reports)
    print(f"{'all':<22} {total:>11,}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.run", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", help="targets to run (default: all)")
    parser.add_argument("--seconds", type=int, default=60, help="per target (default 60)")
    parser.add_argument("--runs", type=int, default=None,
                        help="a number of executions per target instead of a time")
    parser.add_argument("--json", type=Path, default=WORK / "summary.json",
                        help="where to write the results, with date, commit and machine "
                             "(default: build/fuzz/summary.json)")
    parser.add_argument("--list", action="store_true", help="list the targets and stop")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        child(options.child, options.seconds, options.runs, WORK)
        return 0
    from fuzz import harness  # (not instrumented: the children import their own)

    targets = harness.load()
    if options.list:
        for name, target in targets.items():
            print(f"{name:<22} {target.doc.splitlines()[0] if target.doc else ''}")
        return 0
    unknown = [name for name in options.targets if name not in targets]
    if unknown:
        parser.error(f"no fuzz target {', '.join(unknown)}; --list shows them")
    chosen = options.targets or list(targets)
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    machine = f"{os.uname().nodename}, {os.cpu_count()} CPUs (shared with other work)"
    what = f"{options.runs} executions" if options.runs is not None \
        else f"{options.seconds} s"
    print(f"fuzz: {len(chosen)} targets, {what} each, on {machine}; logs in {WORK / 'logs'}",
          flush=True)
    reports = []
    for name in chosen:
        report = run_one(name, targets[name].c_sources, options.seconds, options.runs,
                         WORK / "logs" / f"{name}.log")
        print(f"fuzz: {name}: {report.runs:,} executions, cov {report.cov}, "
              f"C {report.c_coverage()}: {report.outcome}", flush=True)
        reports.append(report)
    print()
    print_table(reports)
    write_json(options.json, reports, options.seconds, options.runs)
    print(f"fuzz: results in {options.json}")
    return 0 if all(report.outcome == "ok" for report in reports) else 1


def write_json(path: Path, reports: list[Report], seconds: int, runs: int | None) -> None:
    """The run's results, with what is needed to reproduce them."""
    summary = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("DOMUS_FUZZ_COMMIT", "unknown"),
        "command": os.environ.get("DOMUS_FUZZ_COMMAND", " ".join(sys.argv)),
        "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                    "system": platform.platform(), "python": platform.python_version(),
                    "note": "shared with other work while this ran"},
        "per_target": {"seconds": seconds} if runs is None else {"executions": runs},
        "targets": [{"name": report.name, "executions": report.runs,
                     "process_seconds": round(report.seconds, 1),
                     "executions_per_second": report.rate,
                     "peak_rss_mb": report.peak_rss_mb,
                     "cov": report.cov, "features": report.features, "corpus": report.corpus,
                     "c_edges": {source: dict(zip(("covered", "in_functions_reached",
                                                   "functions_reached", "in_file"), counts))
                                 for source, counts in sorted(report.c_edges.items())},
                     "outcome": report.outcome, "inputs_kept": report.artifacts}
                    for report in reports],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
