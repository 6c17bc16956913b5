"""tests/preloaded.py: a script run from the preloaded server gives what `python SCRIPT` gives."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from preloaded import run_script

# Each script prints what a run can see, then ends one way. None imports torch, so the
# subprocess it is compared with starts in ~20 ms.
SEEN = """\
import atexit, os, sys, threading
print(__name__, sys.argv[1:], os.getcwd() == sys.argv[1], sys.path[0] == os.path.dirname(
      os.path.abspath(__file__)), os.environ.get("PRELOADED_TEST"), sys.stdin.read() == "")
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (__import__("time").sleep(0.2), print("thread ran"))).start()
print("to stderr", file=sys.stderr)
"""
ENDS = {
    "falls off the end": "",
    "sys.exit(0)": "sys.exit(0)\n",
    "sys.exit(3)": "sys.exit(3)\n",
    "a message": "sys.exit('bench.py: --reps: at least 1')\n",
    "argparse": "import argparse\nargparse.ArgumentParser(prog='b').parse_args(['--no'])\n",
    "an exception": "raise ValueError('boom')\n",
    "a signal": "os.kill(os.getpid(), 9)\n",
    "unicode": "print('Zwei Hunde spielen — im Schnee: ä ö ü ß')\n",
}


@pytest.mark.parametrize(
    ("end", "unbuffered"), [(end, "") for end in ENDS] + [("a signal", "1")]
)  # killed, a buffered stdout is lost; an unbuffered one (PYTHONUNBUFFERED) was written
def test_a_run_gives_what_a_process_of_its_own_gives(tmp_path, monkeypatch, end, unbuffered):
    script = tmp_path / "script.py"
    script.write_text(SEEN + ENDS[end], encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "PRELOADED_TEST": "yes", "PYTHONUNBUFFERED": unbuffered}
    want = subprocess.run([sys.executable, str(script), str(tmp_path), "a b"], env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)  # fmt: skip
    got = run_script(script, str(tmp_path), "a b", env=env)
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout)
    if end != "a signal" or unbuffered:
        assert got.stdout.startswith("__main__ [") and "True True yes True" in got.stdout
    if end in ("an exception",):  # both print the traceback, through other frames
        assert got.stderr.splitlines()[-1] == want.stderr.splitlines()[-1] == "ValueError: boom"
        assert got.stderr.startswith("to stderr\nTraceback (most recent call last):\n")
    else:
        assert got.stderr == want.stderr


def test_a_run_past_its_timeout_is_killed_and_the_next_one_runs(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys, time\nif sys.argv[1] == 'wait': time.sleep(60)\nprint('ok')\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_script(script, "wait", timeout=0.5)
    done = run_script(script, "go")
    assert (done.returncode, done.stdout) == (0, "ok\n")
