"""Training throughput and MFU of the base and big presets on one CUDA GPU, bf16, with peers.

The paper's ~25k-token batches (§5.1: ~25,000 source + ~25,000 target tokens), synthetic
sentences of ~30 tokens, V = 32,000 tied; the full step is ours (bf16 parameters, fp32 master
Adam, chunked non-pad loss); attention on CUDA takes PyTorch's fused kernels (model.attention).
MFU = analytic model FLOPs (experiments.flops.training_flops) / step time / the measured bf16
matrix-product rate of the same GPU. Without CUDA it says so and exits 0.

--peers runs the same step shape (the same sentences, no padding, V = 32,000 shared and tied,
label smoothing 0.1, Adam(0.9, 0.98, 1e-9), bf16) through other toolkits in the same process,
timed interleaved with ours (warm-up, then rounds of a few steps each; medians):
  fairseq  0.12.2 `transformer_wmt_en_de` (base) / `transformer_vaswani_wmt_en_de_big` (big), its
           training step as its Trainer runs `--bf16`: bf16 model, fp32 master copies in
           `FP16Optimizer` (no loss scaling), its `adam` (FusedAdam only with apex), its
           `label_smoothed_cross_entropy` criterion (sum over tokens, grads / ntokens), the grad
           norm of `clip_grad_norm(0)`. fairseq is imported from its source tree (`--fairseq-src`
           or PYTHONPATH; its own dependencies hydra-core 1.0.7, omegaconf 2.0.6).
  hf       transformers MarianMTModel (post-norm, sinusoids, tied), the way its Trainer runs
           `bf16=True`: fp32 parameters under bf16 autocast, fused torch Adam, SDPA attention,
           F.cross_entropy(label_smoothing=0.1).
Peak memory is each implementation's own: its resident tensors (model, optimizer state) plus
the transient peak of its step. `--device cpu` rehearses every code path on a small batch.

    .venv/bin/python benchmarks/bench_gpu.py                       # base and big, ours alone
    .venv/bin/python benchmarks/bench_gpu.py --peers fairseq,hf    # ... and the peers
    .venv/bin/python benchmarks/bench_gpu.py --presets base --tokens 25000 --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from transformer.config import build_config
from transformer.experiments.flops import measure_matmul_tflops, training_flops
from transformer.loss import chunked_label_smoothed_loss
from transformer.optim import MixedPrecisionAdam
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.train import build_model

LR, BETAS, EPS, SMOOTHING = 1e-4, (0.9, 0.98), 1e-9, 0.1
# fairseq's and Marian's dictionaries: bos 0, pad 1, eos 2, unk 3; words 4.. as ours.
PEER_PAD, PEER_EOS = 1, 2
FAIRSEQ_ARCH = {"base": "transformer_wmt_en_de", "big": "transformer_vaswani_wmt_en_de_big"}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def ours(cfg, body: torch.Tensor, compiled: bool = False) -> Callable[[], None]:
    """Our full step: bf16 model, fp32 master Adam, chunked loss over the non-pad targets;
    `compiled`: the model's forward through `torch.compile`, as `train.compile=true` runs it."""
    model = build_model(cfg, body.device).train()
    forward = torch.compile(model) if compiled else model
    opt = MixedPrecisionAdam(model.parameters(), BETAS, EPS)
    n = body.size(0)
    src = torch.cat([body, body.new_full((n, 1), EOS_ID)], 1)  # (B, S)
    tgt_in = torch.cat([body.new_full((n, 1), BOS_ID), body], 1)  # (B, T)
    keep = src != PAD_ID
    ntok = int(keep.sum())

    def step() -> None:
        hidden = forward(src, keep, tgt_in)
        loss, _ = chunked_label_smoothed_loss(
            hidden[keep], model.output_weight(), src[keep], SMOOTHING
        )
        loss.backward()
        opt.collect_grads()
        opt.step(LR, 1.0 / ntok)

    return step


def import_fairseq(src: str | None):
    """fairseq 0.12.2 from a source tree. Its dataclass configs use dataclass instances as field
    defaults, which Python 3.11+ rejects as unhashable: during the import, dataclasses that
    lost their __hash__ get object's (fairseq's files stay unchanged)."""
    if src and src not in sys.path:
        sys.path.insert(0, src)
    orig = dataclasses.dataclass

    def hashable_dataclass(cls=None, /, **kw):
        def wrap(c):
            out = orig(c, **kw)
            if out.__hash__ is None:
                out.__hash__ = object.__hash__
            return out

        return wrap if cls is None else wrap(cls)

    logging.disable(logging.WARNING)
    dataclasses.dataclass = hashable_dataclass
    try:
        import fairseq
        import fairseq.models.transformer  # noqa: F401
    finally:
        dataclasses.dataclass = orig
        logging.disable(logging.NOTSET)
    return fairseq


def fairseq_peer(cfg, preset: str, body: torch.Tensor, src_tree: str | None):
    """fairseq's model, criterion and bf16 optimizer, stepped as fairseq's Trainer.train_step."""
    import_fairseq(src_tree)
    from argparse import Namespace

    from fairseq.criterions.label_smoothed_cross_entropy import (
        LabelSmoothedCrossEntropyCriterion,
    )
    from fairseq.data import Dictionary
    from fairseq.models import ARCH_CONFIG_REGISTRY
    from fairseq.models.transformer import TransformerModel
    from fairseq.optim.adam import FairseqAdam
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    vocab = cfg.model.vocab_size
    d = Dictionary()  # bos 0, pad 1, eos 2, unk 3
    for i in range(vocab - len(d)):
        d.add_symbol(f"w{i}")
    assert len(d) == vocab and d.pad() == PEER_PAD and d.eos() == PEER_EOS

    class Task:
        source_dictionary = target_dictionary = d

    args = Namespace(share_all_embeddings=True)
    ARCH_CONFIG_REGISTRY[FAIRSEQ_ARCH[preset]](args)  # the architecture's defaults
    assert (args.encoder_embed_dim, args.dropout) == (cfg.model.d_model, cfg.model.p_drop)
    model = TransformerModel.build_model(args, Task()).to(body.device).bfloat16().train()
    criterion = LabelSmoothedCrossEntropyCriterion(Task(), False, SMOOTHING)
    # Trainer._build_optimizer with --bf16 --optimizer adam: FP16Optimizer.build_optimizer
    # (bf16: per-parameter fp32 copies, no loss scaler) over fairseq's FairseqAdam.
    opt_cfg = Namespace(lr=[LR], adam_betas=str(BETAS), adam_eps=EPS, weight_decay=0.0,
                        use_old_adam=False, fp16_adam_stats=False, tpu=False)  # fmt: skip
    full_cfg = Namespace(
        optimizer=opt_cfg,
        common=Namespace(bf16=True, fp16_scale_window=None, model_parallel_size=1),
        optimization=Namespace(update_freq=[1]),
        distributed_training=Namespace(distributed_world_size=1),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    fp32_params = FP16Optimizer.build_fp32_params(opt_cfg, params, flatten=False)
    opt = FP16Optimizer(full_cfg, params, FairseqAdam(opt_cfg, fp32_params), fp32_params)
    n = body.size(0)
    eos = body.new_full((n, 1), PEER_EOS)
    tokens = torch.cat([body, eos], 1)
    sample = {
        "net_input": {
            "src_tokens": tokens,
            "src_lengths": torch.full((n,), tokens.size(1), device=body.device),
            "prev_output_tokens": torch.cat([eos, body], 1),
        },
        "target": tokens,
        "ntokens": tokens.numel(),
    }

    def step() -> None:
        loss, sample_size, _ = criterion(model, sample)
        opt.backward(loss)
        opt.multiply_grads(1.0 / sample_size)
        grad_norm = opt.clip_grad_norm(0.0)
        if not torch.isfinite(grad_norm).all():  # Trainer checks the norm each step
            raise FloatingPointError("fairseq: non-finite gradient norm")
        opt.step()
        opt.zero_grad()

    return step


def hf_peer(cfg, body: torch.Tensor):
    """transformers' MarianMTModel as its Trainer runs bf16: fp32 weights, bf16 autocast."""
    from transformers import MarianConfig, MarianMTModel

    m = cfg.model
    conf = MarianConfig(
        vocab_size=m.vocab_size, decoder_vocab_size=m.vocab_size, d_model=m.d_model,
        encoder_layers=m.n_layers, decoder_layers=m.n_layers,
        encoder_attention_heads=m.n_heads, decoder_attention_heads=m.n_heads,
        encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff, activation_function="relu",
        dropout=m.p_drop, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=256, scale_embedding=True,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        pad_token_id=PEER_PAD, eos_token_id=PEER_EOS, bos_token_id=0,
        decoder_start_token_id=PEER_EOS, forced_eos_token_id=None,
    )  # fmt: skip
    conf._attn_implementation = "sdpa"
    model = MarianMTModel(conf).to(body.device).train()
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, fused=True)
    n = body.size(0)
    eos = body.new_full((n, 1), PEER_EOS)
    tokens = torch.cat([body, eos], 1)
    dec_in = torch.cat([eos, body], 1)
    mask = torch.ones_like(tokens)

    def step() -> None:
        with torch.autocast(body.device.type, dtype=torch.bfloat16):
            logits = model(input_ids=tokens, attention_mask=mask, decoder_input_ids=dec_in,
                           decoder_attention_mask=mask, use_cache=False).logits  # fmt: skip
            loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), ignore_index=PEER_PAD,
                                   label_smoothing=SMOOTHING, reduction="sum")  # fmt: skip
        (loss / tokens.numel()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure(preset: str, peers: list[str], args, device: torch.device) -> list[dict]:
    """Build ours and each peer on the same sentences; warm each up, then time them in
    interleaved rounds. Returns one row per implementation."""
    cfg = build_config(preset, None, ["train.dtype=bf16"], vocab_size=args.vocab)
    n = args.tokens // args.length
    torch.manual_seed(0)
    body = torch.randint(4, args.vocab, (n, args.length - 1), device=device)
    builders = {
        "ours": lambda: ours(cfg, body),
        "fairseq": lambda: fairseq_peer(cfg, preset, body, args.fairseq_src),
        "hf": lambda: hf_peer(cfg, body),
    }
    rows = []
    for name in ["ours", *peers]:
        before = allocated(device)
        torch.manual_seed(1)
        step = builders[name]()
        for _ in range(args.warmup):
            step()
        sync(device)
        rows.append({"impl": name, "step": step, "resident": allocated(device) - before,
                     "times": [], "transient": 0})  # fmt: skip
    for _ in range(args.rounds):
        for r in rows:
            for _ in range(args.steps):
                sync(device)
                base = allocated(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                r["step"]()
                sync(device)
                r["times"].append(time.perf_counter() - start)
                if device.type == "cuda":
                    r["transient"] = max(r["transient"], torch.cuda.max_memory_allocated() - base)
    ntok = n * args.length
    flops = training_flops(cfg.model, ntok, ntok, args.length, args.length)
    out = []
    for r in rows:
        s = statistics.median(r["times"])
        out.append({"preset": preset, "impl": r["impl"], "tgt_tokens": ntok, "s_per_step": s,
                    "min_s": min(r["times"]), "max_s": max(r["times"]),
                    "tok_per_s": ntok / s, "tflops": flops / s / 1e12,
                    "peak_mem_GiB": (r["resident"] + r["transient"]) / 2**30})  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["base", "big"])
    p.add_argument("--peers", default="", help="comma-separated: fairseq, hf (default: none)")
    p.add_argument("--tokens", type=int, default=25000, help="target tokens per batch")
    p.add_argument("--length", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=2, help="timed steps per round and implementation")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--fairseq-src", default=None, help="fairseq source tree (else PYTHONPATH)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu to rehearse on a tiny batch")
    args = p.parse_args()
    peers = [x for x in args.peers.split(",") if x]
    unknown = set(peers) - {"fairseq", "hf"}
    if unknown:
        p.error(f"unknown peers: {sorted(unknown)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: GPU benchmark not run (not measured)")
        return
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    peak = measure_matmul_tflops("bf16", size=8192 if device.type == "cuda" else 512, seconds=2.0)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    for preset in args.presets:
        rows = measure(preset, peers, args, device)
        for r in rows:
            ratio = ""
            if r["impl"] != "ours":
                ratio = f"  ours/{r['impl']} {rows[0]['tok_per_s'] / r['tok_per_s']:.2f}x"
            print(f"{preset:>5} {r['impl']:>7}: {r['tok_per_s']:9.0f} tgt tok/s  "
                  f"{r['s_per_step']:.4f} s/step (min {r['min_s']:.4f} max {r['max_s']:.4f})  "
                  f"{r['tflops']:.0f} TFLOP/s model = MFU {r['tflops'] / peak:.1%}  "
                  f"peak mem {r['peak_mem_GiB']:.1f} GiB{ratio}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
