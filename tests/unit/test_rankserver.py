"""rankserver.py: the server `train --procs N` forks its processes from, started by the CLI
before its own imports of torch."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import subprocess
import sys

from transformer import cli, distributed, rankserver

# A process that runs the CLI with rankserver.start replaced: it prints the module the server
# would preload and whether torch was imported by then, and ends there.
STARTS_FIRST = """
import sys
from transformer import cli, rankserver

def start(module):
    print(module, "torch" in sys.modules)
    raise SystemExit(0)

rankserver.start = start
sys.exit(cli.main(sys.argv[1:]))
"""


def test_train_procs_starts_the_server_before_importing_torch(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", STARTS_FIRST, "train", str(tmp_path), "--out", str(tmp_path / "r"),
         "--procs", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, "transformer.train False\n", "")


def test_one_process_starts_no_server(tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(rankserver, "start", started.append)
    for procs in (["--procs", "1"], []):
        code = cli.main(["train", str(tmp_path / "none"), "--out", str(tmp_path / "r"), *procs])
        assert code == 2 and "none" in capsys.readouterr().err  # no such data: one line
    assert started == []


def _parent() -> int:
    return os.getppid()


def test_a_job_forks_from_the_server_started_ahead():
    rankserver.start(__name__)  # or the one an earlier job of this process started: kept
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert server is not None and server != os.getpid()
    assert distributed.run_local(2, _parent) == server
