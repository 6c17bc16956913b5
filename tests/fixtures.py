"""The test suite's helpers, one copy each: the shared-data path, Multi30k lines, a sentencepiece
model, a tiny random model file, the CLI as a subprocess, a running server.

Random weights decode deterministically, so a model file built here is enough to test serving and
export on real Multi30k sentences without training. conftest.py wraps them as fixtures; import
them with `from fixtures import ...` (pytest puts tests/ on sys.path: conftest.py lives there).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import sentencepiece as spm
import torch

import preloaded
from transformer.config import DecodeConfig, ModelConfig, RunConfig
from transformer.model import Transformer
from transformer.modelfile import save_model
from transformer.tokenizer import Tokenizer

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"  # ../shared/data
MULTI30K = SHARED_DATA / "multi30k"

# A few sentences to train the subword model on when Multi30k is absent (CI without data).
_FALLBACK = [
    "Two young, White males are outside near many bushes.",
    "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
    "A little girl climbing into a wooden playhouse.",
    "Ein kleines Mädchen klettert in ein Spielhaus aus Holz.",
] * 50


# /proc/cpuinfo of the CPUs the dtype choices tell apart (fake_cpuinfo): an AMX Xeon (whose
# other cores list fewer flags: the first processor's count), a Zen 4 (AVX-512 with bf16 and
# VNNI), an AVX2 CPU with AVX-VNNI, an AVX-512 CPU without bf16, and a Zen 3 (AVX2 only).
CPUINFO_AMX = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu sse2
"""
CPUINFO_ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
CPUINFO_AVX_VNNI = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx_vnni\n"
CPUINFO_SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
CPUINFO_ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


def fake_cpuinfo(monkeypatch, tmp_path: Path, text: str) -> None:
    """Make this test's /proc/cpuinfo `text` (`transformer.cpuinfo` reads it at each call): the
    dtype choices and the int8 input range follow the CPU's flags."""
    import transformer.cpuinfo

    info = tmp_path / "cpuinfo"
    info.write_text(text, encoding="utf-8")
    monkeypatch.setattr(transformer.cpuinfo, "CPUINFO", str(info))


def multi30k_lines(split: str, lang: str, n: int) -> list[str]:
    """The first n lines of a Multi30k file, or fallback sentences when the data is absent."""
    path = MULTI30K / f"{split}.{lang}"
    if not path.is_file():
        return _FALLBACK[:n]
    with path.open(encoding="utf-8") as f:
        return [next(f).strip() for _ in range(n)]


def train_spm(tmp_dir: Path, vocab_size: int = 400, n_lines: int = 300) -> bytes:
    """Train a joint en+de sentencepiece model with the project's special ids; its bytes."""
    text = tmp_dir / "spm_train.txt"
    lines = multi30k_lines("train", "en", n_lines) + multi30k_lines("train", "de", n_lines)
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prefix = tmp_dir / "spm"
    Tokenizer.train([text], prefix, vocab_size, model_type="bpe", num_threads=1)
    return prefix.with_suffix(".model").read_bytes()


def make_model_file(
    tmp_dir: Path,
    seed: int = 0,
    decode: DecodeConfig | None = None,
    **model_overrides,
) -> Path:
    """Save a tiny random Transformer (d_model=32, 2 layers) with a real spm model; its path."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    proto = train_spm(tmp_dir)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    fields = dict(
        vocab_size=sp.get_piece_size(),
        n_layers=2,
        d_model=32,
        d_ff=64,
        n_heads=4,
        d_k=8,
        d_v=8,
        p_drop=0.0,
        max_len=256,
    )
    fields.update(model_overrides)
    config = RunConfig(model=ModelConfig(**fields), decode=decode or DecodeConfig(max_len_b=10))
    torch.manual_seed(seed)
    model = Transformer(config.model).eval()
    return save_model(tmp_dir / "model.safetensors", model, config, proto, "en", "de")


def run_cli(
    *args: str, stdin: bytes = b"", env: dict | None = None, timeout: float = 600,
    own_process: bool = False,
):  # fmt: skip
    """`transformer ARGS` in a process (one torch thread): the CompletedProcess, output captured
    as bytes. Forked from the worker's preloaded server (tests/preloaded.py: no ~2 s of torch's
    imports) where the run starts as the server did, else, or with `own_process`, a process
    started afresh (`python -m transformer`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if not own_process and preloaded.same_start(env):
        return preloaded.run_module("transformer", *args, stdin=stdin, env=env, timeout=timeout)
    cmd = [sys.executable, "-m", "transformer", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, env=env, timeout=timeout)


def dead_pid() -> int:
    """The process id of a process that has ended (a killed writer's, for its leftovers)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(done.stdout)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model: Path, *flags: str, timeout_s: float = 90.0, log_path: Path | None = None):
    """`transformer serve MODEL` as a subprocess on 127.0.0.1 and a free port; yields its URL.

    Waits until GET /health answers; stops the server (SIGTERM, then SIGKILL) on exit. Its
    output goes to `log_path` when given.
    """
    import httpx2 as httpx

    port = free_port()
    cmd = [sys.executable, "-m", "transformer", "serve", str(model), "--port", str(port)]
    log = tempfile.TemporaryFile() if log_path is None else open(log_path, "w+b")
    proc = subprocess.Popen([*cmd, "--threads", "1", *flags], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited {proc.returncode}: {log.read().decode()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start within {timeout_s} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """A directory that `build(directory)` fills once per test run, shared by every pytest-xdist
    worker of the run (the first to ask builds it under a lock, the others wait and reuse it);
    for inputs that several tests read and none changes: a prepared corpus, a baseline run.

    A build that fails leaves nothing behind: the next test to ask builds it again.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    out = root / f"built-once-{name}"
    with open(root / f"built-once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".built").is_file():
            shutil.rmtree(out, ignore_errors=True)
            build(out)
            (out / ".built").touch()
    return out


def prepare_slice(
    out: Path,
    multi30k: Path,
    n_train: int = 200,
    n_valid: int = 20,
    vocab_size: int = 400,
    lowercase: bool = False,
) -> Path:
    """A prepared-data directory from the first lines of Multi30k en-de; its path."""
    from transformer.prepare import prepare_corpus

    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[Path]] = {}
    for split, name, n in (("train", "train", n_train), ("valid", "val", n_valid)):
        for lang in ("en", "de"):
            lines = (multi30k / f"{name}.{lang}").read_text(encoding="utf-8").splitlines()[:n]
            path = raw / f"{split}.{lang}"
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            files.setdefault(split, []).append(path)
    prepare_corpus(
        "custom", "en", "de", out / "prepared", vocab_size=vocab_size,
        train_files=files["train"], valid_files=files["valid"], num_threads=1,
        lowercase=lowercase,
    )  # fmt: skip
    return out / "prepared"
