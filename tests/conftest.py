from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fixtures import SHARED_DATA, make_model_file, run_cli


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
