"""`python SCRIPT ARGS` and `python -m MODULE ARGS` for the tests: each run a process of its own,
as subprocess.run gives, but forked from a server that has already imported torch.

A script's own run is often ~0.1 s (a bad argument named in one line), and importing torch took
~2 s of each of the ~45 tests that do little else, on a Zen 3 (docs/performance.md, "Round
fifty-eight"); `fixtures.run_cli` runs `python -m transformer` the same way (round sixty-two).
The child is what `python SCRIPT` makes of the script (`python -m MODULE` of the module):
`__name__ == "__main__"`, sys.argv (sys.orig_argv for a module, which `train` runs again in
2 MB pages: allocator.huge_pages_exec), the script's folder (the working folder, for a module)
first on sys.path, the caller's environment and working folder, stdin at /dev/null or a file of
the given bytes, stdout and stderr captured, the exit status of SystemExit (its message to
stderr and 1 for a string, 1 and the traceback for any other exception), non-daemon threads
joined and atexit's functions run at the end. What torch, OpenMP and the preloaded modules read
from the environment at their import is the server's, the suite's (conftest.py:
OMP_NUM_THREADS=1), whatever `env` says: `same_start(env)` tells whether a run in `env` would
start as the server did (`run_cli` starts a process of its own where it would not), and a test
that changes those variables for a script must call subprocess.run itself (`run_script` does
not).

One server per pytest worker, started on first use and ended with it; a run at a time.
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path

# Imported once, in the server: what the benchmarks' scripts and the CLI's commands import first.
PRELOAD = ["torch", "numpy", "transformer.model", "transformer.translate", "transformer.trainer",
           "transformer.cli"]  # fmt: skip
_SERVER: subprocess.Popen | None = None
# The environment the server starts in: the worker's as conftest.py set it up, before any test
# changed it (None: os.environ at the first run).
ENVIRONMENT: dict[str, str] | None = None
_SERVER_ENV: dict[str, str] = {}  # the environment the server started in
# The variables read as a process starts or imports what the server preloads: by Python
# (PYTHON*), glibc (LD_*, MALLOC_*, GLIBC_TUNABLES, the locale's), OpenMP, MKL, oneDNN, OpenBLAS,
# torch, and this package (kernels.py reads TRANSFORMER_* switches at its import). KMP_* too
# where Intel's OpenMP is loaded (_intel_openmp).
START = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "LC_", "OMP_", "GOMP_", "MKL_", "DNNL_", "ONEDNN_",
         "OPENBLAS_", "TORCH_", "PYTORCH_", "CUDA_", "TRANSFORMER_")  # fmt: skip
START_NAMES = ("LANG", "LANGUAGE")


@functools.cache
def _intel_openmp(maps: str = "/proc/self/maps") -> bool:
    """Whether Intel's OpenMP runtime (libiomp5), the one reader of KMP_* variables, is loaded
    in this process (its `maps`), which has imported torch as the server has (torch's pip
    wheels load GNU's libgomp); True where they cannot be read. joblib sets KMP_INIT_AT_FORK in
    the worker's environment as sacremoses imports it: without libiomp it changes no process's
    start."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            return "libiomp" in f.read()
    except OSError:
        return True


def _child(
    script: str | None, module: str | None, args: list[str], env: dict[str, str], cwd: str,
    stdin: str, out: str, err: str,
):  # fmt: skip
    """In the forked child: the script as `python SCRIPT ARGS` runs it, or the module as
    `python -m MODULE ARGS` does; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, path, flags in ((0, stdin, os.O_RDONLY), (1, out, os.O_WRONLY),
                                (2, err, os.O_WRONLY)):  # fmt: skip
            file = os.open(path, flags)
            os.dup2(file, fd)
            os.close(file)
        # New streams on the new descriptors, as Python opens them (nothing of the server's
        # buffers: its requests, its replies), unbuffered where PYTHONUNBUFFERED says so.
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))

        def stream(fd: int, **how) -> io.TextIOWrapper:
            raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
            binary = raw if unbuffered and fd else io.BufferedReader(raw) if fd == 0 else (
                io.BufferedWriter(raw))  # fmt: skip
            return io.TextIOWrapper(binary, encoding="utf-8", write_through=unbuffered, **how)

        sys.stdin = sys.__stdin__ = stream(0)
        sys.stdout = sys.__stdout__ = stream(1)
        sys.stderr = sys.__stderr__ = stream(2, errors="backslashreplace", line_buffering=True)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        atexit._clear()  # the server's, not the script's
        try:
            if module is None:
                sys.argv = [script, *args]
                sys.path.insert(0, os.path.dirname(script))
                runpy.run_path(script, run_name="__main__")
            else:
                sys.argv = ["-m", *args]  # argv[0]: the module's file, as runpy sets it
                sys.orig_argv = [sys.executable, "-m", module, *args]
                sys.path.insert(0, cwd)
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - Python's own end of a script that raised
            traceback.print_exc()
        threading._shutdown()  # noqa: SLF001 - non-daemon threads, as at Python's exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _serve() -> None:
    """The server: imports PRELOAD, then forks a child per request line on stdin, replying
    on stdout with the child's pid, then its exit status (negative: the signal)."""
    for name in PRELOAD:
        __import__(name)
    requests, replies = sys.stdin.buffer, sys.stdout
    replies.write("ready\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(**request)
        replies.write(f"{pid}\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(f"{os.waitstatus_to_exitcode(status)}\n")
        replies.flush()


def _server() -> subprocess.Popen:
    global _SERVER, _SERVER_ENV
    if _SERVER is None or _SERVER.poll() is not None:
        code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        code += "import preloaded; preloaded._serve()"
        _SERVER_ENV = dict(os.environ if ENVIRONMENT is None else ENVIRONMENT)
        _SERVER = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, bufsize=0, env=_SERVER_ENV)  # fmt: skip
        if _reply(_SERVER, 300) != "ready":
            raise RuntimeError(f"preloaded: the server did not start ({_SERVER.wait()})")
    return _SERVER


def _reply(server: subprocess.Popen, timeout: float) -> str | None:
    """The server's next line, or None after `timeout` seconds without it (read a byte at a
    time, unbuffered: what select says is ready is all there is)."""
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        byte = server.stdout.read(1) if ready else None
        if not byte:
            return None if byte is None else line.decode()
        line += byte
    return line.decode().rstrip("\n")


def same_start(env: dict[str, str]) -> bool:
    """Whether a run in `env` starts as the server did: the same values of the variables that
    Python, glibc, OpenMP, MKL, torch and this package read as they start or import (START),
    which `env` may not change for a child of the server. Others (a test's own, torch's
    TORCHINDUCTOR_CACHE_DIR set in the worker by its first compilation) are read while the
    run runs, from the child's own environment. Before the server has started: whether they
    are those it will start with."""
    started = _SERVER_ENV if _SERVER is not None else ENVIRONMENT or os.environ

    prefixes = START + (("KMP_",) if _intel_openmp() else ())

    def start(environ: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in environ.items() if k.startswith(prefixes) or k in START_NAMES}

    return start(env) == start(started)


def run_script(
    script: str | Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
    timeout=timeout, env=env)'s result, from a child of the server."""
    script = os.path.abspath(script)
    return _run([sys.executable, script, *args], {"script": script, "module": None}, args, env,
                timeout, None, text=True)  # fmt: skip


def run_module(
    module: str, *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:  # fmt: skip
    """subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True,
    timeout=timeout, env=env)'s result (output as bytes), from a child of the server."""
    return _run([sys.executable, "-m", module, *args], {"script": None, "module": module}, args,
                env, timeout, stdin, text=False)  # fmt: skip


def _run(
    cmd: list[str], what: dict, args: tuple[str, ...], env: dict[str, str] | None,
    timeout: float, stdin: bytes | None, text: bool,
) -> subprocess.CompletedProcess:  # fmt: skip
    server = _server()
    with tempfile.TemporaryDirectory(prefix="preloaded-") as tmp:
        out, err, given = Path(tmp) / "stdout", Path(tmp) / "stderr", Path(tmp) / "stdin"
        out.touch()
        err.touch()
        given.write_bytes(stdin or b"")
        request = {**what, "args": list(args), "env": dict(os.environ if env is None else env),
                   "cwd": os.getcwd(), "stdin": os.devnull if stdin is None else str(given),
                   "out": str(out), "err": str(err)}  # fmt: skip
        server.stdin.write((json.dumps(request) + "\n").encode())
        pid = _reply(server, 60)
        if not pid:  # ended (its own error on the worker's stderr) or silent for a minute
            raise RuntimeError(f"preloaded: the server did not take the run ({server.poll()})")
        code = _reply(server, timeout)
        if code is None:
            os.kill(int(pid), signal.SIGKILL)
            _reply(server, 60)  # its status
            raise subprocess.TimeoutExpired(cmd, timeout)
        if not code:
            raise RuntimeError(f"preloaded: the server ended during the run ({server.poll()})")
        if not text:
            return subprocess.CompletedProcess(cmd, int(code), out.read_bytes(), err.read_bytes())
        read = {"encoding": "utf-8", "errors": "replace"}
        return subprocess.CompletedProcess(
            cmd, int(code), out.read_text(**read), err.read_text(**read)
        )
