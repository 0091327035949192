"""Progress of long runs on stderr: a bar on a terminal, lines elsewhere, nothing with --json."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import routing_bench
from kvrouter.progress import Progress

pytestmark = pytest.mark.timeout(180)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_and_a_line_per_tenth_elsewhere() -> None:
    tty = _Terminal()
    p = Progress(stream=tty)
    p.phase("phase one")
    assert list(p.iterate(range(500), "run", 500)) == list(range(500))
    p.phase("phase two")
    text = tty.getvalue()
    assert text.startswith("phase one\n") and text.endswith("500/500\x1b[K\nphase two\n")
    assert text.count("\r  run [") == 101 and "[########################] 100%" in text

    log = io.StringIO()
    p = Progress(stream=log)
    list(p.iterate(range(1000), "run", 1000))
    lines = log.getvalue().splitlines()
    assert [x.split()[1] for x in lines] == [f"{t}%" for t in range(0, 101, 10)]
    assert "\r" not in log.getvalue()

    lines_only = _Terminal()
    list(Progress(stream=lines_only, bar=False).iterate(range(10), "run", 10))
    assert "\r" not in lines_only.getvalue() and len(lines_only.getvalue().splitlines()) == 11

    quiet = _Terminal()
    p = Progress(quiet=True, stream=quiet)
    p.phase("x")
    list(p.iterate(range(10), "run", 10))
    assert quiet.getvalue() == ""


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvrouter.cli", "demo", "--workers", "2", "--duration", "1"]
    return subprocess.run(
        [*cmd, "--concurrency", "2", *args], capture_output=True, text=True, timeout=150
    )


def test_demo_reports_each_phase_and_is_quiet_with_json() -> None:
    loud = _demo()
    assert loud.returncode == 0, loud.stderr
    err = loud.stderr
    for phase in (
        "[1/2] kvrouter: starting",
        "[1/2] kvrouter: done: hit rate",
        "[2/2] round_robin",
    ):
        assert phase in err, err
    assert "  kvrouter 100%" in err and "  round_robin 100%" in err  # the last update
    quiet = _demo("--json")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    doc = json.loads(quiet.stdout.strip().splitlines()[-1])
    assert set(doc) == {"kvrouter", "round_robin"}


def test_routing_bench_is_quiet_with_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    argv = ["--workload", "chat", "--scale", "0.02", "--speed", "1.0", "--workers", "2"]
    argv += ["--policies", "round_robin,kvrouter", "--out", str(tmp_path / "c.png")]
    routing_bench.main(argv)
    loud = capsys.readouterr()
    assert "  kvrouter 100%" in loud.err and "  round_robin    hit" in loud.err
    routing_bench.main([*argv, "--json"])
    quiet = capsys.readouterr()
    assert quiet.err == "" and json.loads(quiet.out.splitlines()[-1])["policies"]
