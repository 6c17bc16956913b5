from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import preloaded
from fixtures import SHARED_DATA, make_model_file, run_cli

# Under pytest-xdist (scripts/test.sh runs one worker per core) each worker, and every process it
# starts, takes one torch thread unless OMP_NUM_THREADS says otherwise: two threads per worker
# beside another busy worker run several times slower than one (docs/performance.md, contention).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# The environment the preloaded server (tests/preloaded.py) starts in: the worker's, not that of
# whichever test first needs it.
preloaded.ENVIRONMENT = dict(os.environ)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and the test machine's cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real corpora not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_model_file(tmp_path_factory) -> Path:
    """A tiny random en->de model file with a real sentencepiece model (make_model_file)."""
    return make_model_file(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def allocation_failures() -> dict[str, BaseException]:
    """Real errors of an allocation that failed, torch's ("torch": a RuntimeError) and numpy's
    ("numpy": a MemoryError), made again from the messages a child process got. Never failed
    here: a malloc that fails moves glibc's calling thread to another arena for good, where a
    64 MiB block is mmapped whatever the threshold (test_allocator failed after it)."""
    import json
    import subprocess
    import sys

    code = (
        "import json, numpy, torch\n"
        "out = {}\n"
        "try: torch.empty(2**62, dtype=torch.uint8)\n"
        "except RuntimeError as e: out['torch'] = str(e)\n"
        "try: numpy.empty((10**7, 10**7))\n"
        "except MemoryError as e: out['numpy'] = str(e)\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)  # fmt: skip
    messages = json.loads(done.stdout)
    return {"torch": RuntimeError(messages["torch"]), "numpy": MemoryError(messages["numpy"])}


@pytest.fixture
def cli():
    """Runs `transformer ARGS` in a subprocess: cli("translate", model, stdin=b"...")."""
    return run_cli


def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Under CI=true a skip is a failure (only GPU tests may skip): a missing dependency such as the
# system chromium of the browser test must fail the run, not hide a part of the suite.
def _ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _fail_skip(report, what: str) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"{what} skipped under CI=true (only GPU tests may skip): {reason}"


def pytest_configure(config):
    if _ci():  # a module that cannot be collected fails, and the rest of the suite still runs
        config.option.continue_on_collection_errors = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ARG001
    report = yield
    if _ci() and report.skipped and "gpu" not in item.keywords and not hasattr(report, "wasxfail"):
        _fail_skip(report, item.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if _ci() and report.skipped:
        _fail_skip(report, collector.nodeid)
    return report
