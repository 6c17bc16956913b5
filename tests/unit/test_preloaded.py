"""tests/preloaded.py: a script run from the preloaded server gives what `python SCRIPT` gives."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from preloaded import run_module, run_script, same_start

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


# A module run as `python -m pkg` sees: its name, argv[0] its own file, orig_argv, the working
# folder first on sys.path, the given stdin's bytes; then ends as ENDS says.
MODULE = """\
import os, sys
print(__name__, sys.argv[0] == __file__, sys.argv[1:], sys.orig_argv[1:],
      sys.path[0] == os.getcwd(), sys.stdin.buffer.read())
"""


@pytest.mark.parametrize("end", ["falls off the end", "sys.exit(3)", "a message", "an exception"])
def test_a_module_run_gives_what_python_dash_m_gives(tmp_path, monkeypatch, end):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(MODULE + ENDS[end], encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    stdin = "Zwei Hunde\r\n\ufeffim Schnee\n".encode() + b"\xff"
    want = subprocess.run([sys.executable, "-m", "pkg", "a b", "-x"], input=stdin,
                          capture_output=True)  # fmt: skip
    got = run_module("pkg", "a b", "-x", stdin=stdin)
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout)
    assert got.stdout.startswith(b"__main__ True ['a b', '-x'] ['-m', 'pkg', 'a b', '-x'] True")
    if end == "an exception":
        assert got.stderr.splitlines()[-1] == want.stderr.splitlines()[-1] == b"ValueError: boom"
    else:
        assert got.stderr == want.stderr


def test_a_run_starts_as_the_server_did_only_in_its_environment(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "3")  # not the server's, started or not
    assert run_module("json.tool", "--help").returncode == 0  # the server is up
    assert not same_start(dict(os.environ))
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    env = dict(os.environ)
    assert same_start(env)
    assert same_start({**env, "PYTEST_CURRENT_TEST": "another test", "PRELOADED_TEST": "1"})
    assert same_start({**env, "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"})  # read as it compiles
    assert not same_start({**env, "OMP_NUM_THREADS": "7"})  # torch read it at its import
    assert not same_start({**env, "TRANSFORMER_FUSED_KERNELS": "0"})  # kernels.py, the same
    assert not same_start({**env, "PYTHONPRELOADEDTEST": "1"})  # Python's own: PYTHON*
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    assert not same_start(dict(os.environ))  # the server started without it


def test_kmp_variables_count_only_where_intel_openmp_is_loaded(monkeypatch):
    import preloaded

    env = {k: v for k, v in os.environ.items() if not k.startswith("KMP_")}
    assert run_module("json.tool", "--help").returncode == 0  # the server is up
    # joblib's import (sacremoses') sets KMP_INIT_AT_FORK=FALSE in the worker: read by Intel's
    # OpenMP alone, so without it the suite's later `run_cli`s stay on the server.
    monkeypatch.setattr(preloaded, "_intel_openmp", lambda: False)
    assert same_start(env) and same_start({**env, "KMP_INIT_AT_FORK": "FALSE"})
    monkeypatch.setattr(preloaded, "_intel_openmp", lambda: True)
    assert not same_start({**env, "KMP_AFFINITY": "compact"})


def test_intel_openmp_is_read_from_the_process_maps(tmp_path):
    from preloaded import _intel_openmp

    maps = {"gomp": "7f00-7f01 r-xp 0 fd:01 1 /venv/torch/lib/libgomp.so.1\n",
            "iomp": "7f00-7f01 r-xp 0 fd:01 1 /opt/intel/lib/libiomp5.so\n"}  # fmt: skip
    for name, text in maps.items():
        (tmp_path / name).write_text(text)
    assert _intel_openmp(str(tmp_path / "gomp")) is False
    assert _intel_openmp(str(tmp_path / "iomp")) is True
    assert _intel_openmp(str(tmp_path / "none")) is True  # unreadable: counted
