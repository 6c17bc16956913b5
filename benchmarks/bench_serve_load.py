#!/usr/bin/env python
"""Bounded load test of `transformer serve`: N concurrent clients for T seconds on loopback.

Starts the server as a subprocess on 127.0.0.1 (a free port), then runs `--clients` asyncio
clients, each posting one Multi30k test sentence at a time to /v1/translate for `--seconds`.
Prints throughput, latency percentiles, failed requests and the server's batching statistics.

    python benchmarks/bench_serve_load.py --model runs/x/model.safetensors
    python benchmarks/bench_serve_load.py --random-preset tiny          # no trained model needed
    python benchmarks/bench_serve_load.py --url http://127.0.0.1:8000   # an already running server

A random model never emits EOS, so each of its outputs runs to the maximum length a*|x|+b
(the model file's decode config; `--random-preset` writes max_len_b=--max-len-b): a worst case.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx2 as httpx

from bench_contention import busy_process  # this script's folder is on sys.path
from transformer.cli import thread_count

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k"


def random_model(preset: str, out_dir: Path, max_len_b: int) -> Path:
    """A random-weight model file of a preset with a sentencepiece model trained on Multi30k."""
    import sentencepiece as spm
    import torch

    from transformer.config import DecodeConfig, build_config
    from transformer.model import Transformer
    from transformer.modelfile import save_model
    from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

    text = out_dir / "train.txt"
    lines = []
    for lang in ("en", "de"):
        lines += (DATA / f"train.{lang}").read_text(encoding="utf-8").splitlines()[:5000]
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(out_dir / "spm"), vocab_size=4000, model_type="bpe",
        pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID, byte_fallback=True,
        character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    proto = (out_dir / "spm.model").read_bytes()
    cfg = build_config(
        preset, vocab_size=spm.SentencePieceProcessor(model_proto=proto).vocab_size()
    )
    cfg = replace(cfg, decode=DecodeConfig(max_len_b=max_len_b))
    torch.manual_seed(0)
    model = Transformer(cfg.model).eval()
    return save_model(out_dir / "model.safetensors", model, cfg, proto, "en", "de")


def start_server(model: Path, threads: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "transformer", "serve", str(model), "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--threads", str(threads), *extra])
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
    proc.kill()
    sys.exit("server did not start")


async def client(url: str, sentences: list[str], deadline: float, seed: int, out: dict) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as http:
        while time.perf_counter() < deadline:
            body = {"text": rng.choice(sentences)}
            if out["beam"] is not None:
                body["beam_size"] = out["beam"]
            t0 = time.perf_counter()
            try:
                response = await http.post(f"{url}/v1/translate", json=body)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            out["latencies" if ok else "failures"].append(time.perf_counter() - t0)


async def load(url: str, clients: int, seconds: float, beam: int | None) -> dict:
    sentences = (DATA / "test_2016_flickr.en").read_text(encoding="utf-8").splitlines()
    out: dict = {"latencies": [], "failures": [], "beam": beam}
    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()
    await asyncio.gather(*(client(url, sentences, deadline, i, out) for i in range(clients)))
    out["wall_s"] = time.perf_counter() - t0
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def report(url: str, args, out: dict, before: dict, after: dict) -> None:
    lat = out["latencies"]
    batches = after["batches"] - before["batches"]
    sentences = after["sentences"] - before["sentences"]
    info = httpx.get(f"{url}/v1/model", timeout=10).json()
    m = info["model"]
    print(f"\nserve load test: {args.clients} clients x {args.seconds:.0f} s on {url}")
    beam = args.beam or info["decode"]["beam_size"]
    busy = ", beside a busy process" if args.busy else ""
    print(f"model {info['name']}: N={m['n_layers']} d_model={m['d_model']} "
          f"{info['parameters'] / 1e6:.1f}M params, beam {beam}, {info['dtype']}, "
          f"server threads {args.threads}{busy}")  # fmt: skip
    print("| requests | failed | req/s | p50 ms | p90 ms | p99 ms | max ms | sent/batch |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    if not lat:
        print(f"| 0 | {len(out['failures'])} | 0 | - | - | - | - | - |")
        return
    ms = [1000 * x for x in lat]
    print(f"| {len(lat)} | {len(out['failures'])} | {len(lat) / out['wall_s']:.1f} "
          f"| {percentile(ms, 50):.0f} | {percentile(ms, 90):.0f} | {percentile(ms, 99):.0f} "
          f"| {max(ms):.0f} | {sentences / max(batches, 1):.1f} |")  # fmt: skip
    summary = {
        "requests": len(lat), "failed": len(out["failures"]),
        "throughput_rps": len(lat) / out["wall_s"], "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90), "p99_ms": percentile(ms, 99),
        "mean_ms": statistics.mean(ms), "batches": batches, "sentences": sentences,
    }  # fmt: skip
    print(json.dumps(summary))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a model file or run directory to serve")
    src.add_argument("--random-preset", help="serve a random model of this preset (e.g. tiny)")
    src.add_argument("--url", help="load an already running server")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--beam", type=int, help="beam size per request (default: the model's)")
    ap.add_argument(
        "--threads", type=thread_count, default="auto", help="server's --threads: N or auto"
    )
    ap.add_argument(
        "--busy", action="store_true",
        help="beside one busy process (`python -c 'while True: pass'`) for the timed part",
    )  # fmt: skip
    ap.add_argument("--max-len-b", type=int, default=10, help="random model's max_len_b")
    ap.add_argument("--batch-wait-ms", type=float, default=5.0)
    args = ap.parse_args()
    if args.clients < 1 or args.seconds <= 0 or (args.beam is not None and args.beam < 1):
        ap.error("--clients and --beam must be at least 1, --seconds above 0")
    proc = None
    url = args.url
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.random_preset:
            model = random_model(args.random_preset, Path(tmp), args.max_len_b)
        if url is None:
            proc, url = start_server(
                model, args.threads, ["--batch-wait-ms", str(args.batch_wait_ms)]
            )
        try:
            httpx.post(f"{url}/v1/translate", json={"text": "Warm-up."}, timeout=120)
            before = httpx.get(f"{url}/health", timeout=10).json()
            with busy_process() if args.busy else contextlib.nullcontext():
                out = asyncio.run(load(url, args.clients, args.seconds, args.beam))
            after = httpx.get(f"{url}/health", timeout=10).json()
            report(url, args, out, before, after)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)


if __name__ == "__main__":
    main()
