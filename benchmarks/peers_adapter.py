"""Our implementation as an adapter for the peers' harness in ../shared/peers.

The harness (bench_train.py, bench_infer.py, bench_memory.py there) runs every implementation
side by side in one process, interleaved; these adapters plug ours in without editing it:

    cd ../shared/peers && PYTHONPATH=/work/main/benchmarks ../../main/.venv/bin/python \
        bench_train.py --impl fairseq,hf,ext:peers_adapter:make_train --dtype bf16
    ... bench_infer.py --variants ct2:int8,ext:peers_adapter:Infer:bf16 --beams 4

(benchmarks/bench_peers.sh runs the full set.)

Training (`make_train`): the harness's Transformer-base (V = 32,000 tied, dropout 0.1, label
smoothing 0.1, Adam(0.9, 0.98, 1e-9), lr 1e-4 constant) on OUR fast path: parameters in the
step's dtype (bf16: bf16 parameters with fp32 master weights and fused Adam in
`optim.MixedPrecisionAdam`; no autocast), the chunked §5.4 loss over the non-pad target
positions only (`loss.chunked_label_smoothed_loss`).

Inference (`Infer`): the harness's shared random Marian weights (ctx["hf_dir"]) loaded into
OUR `Transformer`, so its output can be checked token for token against HF and CTranslate2.
Marian is the same post-norm §3 model with two conventions that differ from ours:
  * its sinusoid table is [sin | cos] concatenated, ours interleaves sin/cos (§3.5). We load
    Marian's table into learned position tables (`learned_pos=True`, ModelConfig), which is
    exact; the model code is unchanged.
  * vocabulary: </s> = 0, <unk> = 1, <pad> = 31,999 = the decoder's start token.
The search forces exactly `n_out` tokens like the peers' min = max length (EOS and <pad>
never chosen): greedy, or beam search with top-K over K x V per sentence (every hypothesis has
the same length, so a length penalty changes nothing). It drives our cached decoder through
`search.ModelStepper`.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

from transformer import gradhelper, kernels
from transformer.allocator import keep_large_blocks
from transformer.config import build_config
from transformer.loss import chunked_label_smoothed_loss
from transformer.model import DTYPES, Transformer
from transformer.optim import MixedPrecisionAdam
from transformer.search import ModelStepper, _top_candidates, row_argmax
from transformer.tokenizer import PAD_ID

# The harness's training batches (its common.py): BOS = 0, PAD = 1, EOS = 2, ids 4.. real.
PEER_BOS, PEER_PAD = 0, 1
# Its inference vocabulary (Marian): </s> = 0, <pad> = V - 1 = decoder start.
MARIAN_EOS = 0


@functools.cache
def has_packed_path(model_cls: type) -> bool:
    """Whether a Transformer class (this tree's, or an earlier revision's loaded by
    bench_before_after.py) takes the packed training path's tgt_mask."""
    return "tgt_mask" in inspect.signature(model_cls.forward).parameters


def train_step(model, opt: MixedPrecisionAdam, loss_fn, batch: dict, eps: float, lr: float):
    """One training step as `transformer train` takes it: the real tokens only when the model
    has the packed path (model.Packing), the chunked §5.4 loss, the fp32-master Adam step.

    batch: src, src_mask, tgt_in (B, T) and keep (B, T) bool, True at the real targets, whose
    ids are target (N,). Returns the summed loss (a scalar tensor).
    """
    if has_packed_path(type(model)):
        hidden = model(batch["src"], batch["src_mask"], batch["tgt_in"], batch["keep"])  # (N, D)
    else:  # an earlier revision's model
        hidden = model(batch["src"], batch["src_mask"], batch["tgt_in"])[batch["keep"]]
    loss, _ = loss_fn(hidden, model.output_weight(), batch["target"], eps)
    loss.backward()
    opt.collect_grads()
    opt.step(lr, grad_scale=1.0 / batch["target"].numel())
    return loss


def _to_our_ids(ids: torch.Tensor) -> torch.Tensor:
    """Swap the peers' BOS (0) and PAD (1) so that padding is our PAD_ID (0)."""
    out = ids.clone()
    out[ids == PEER_BOS] = 1
    out[ids == PEER_PAD] = PAD_ID
    return out


class OurTrain:
    """A TrainAdapter-like object: `.prepare(batch)`, `.step(prepared, amp)`, `.model`,
    `.n_params()`, `.notes`. One model + optimizer per dtype, built on first use (so the
    memory benchmark, one dtype per process, holds only one)."""

    def __init__(
        self,
        cfg: dict,
        model_cls: type = Transformer,
        loss_fn=None,
        row_major_grads=None,
        fused: bool = True,
        attention_bf16=None,
        reserve_state: bool = True,
    ) -> None:
        self.cfg, self.model_cls = cfg, model_cls
        self.reserve_state = reserve_state  # False: the Adam moments made at the first step
        self.row_major_grads = row_major_grads  # None: as the CPU decides (gradhelper)
        self.fused = fused  # False: kernels.FUSED off for this adapter's own steps
        # None: the training attention's products where the process has them (kernels)
        self.attention_bf16 = attention_bf16
        self.loss_fn = loss_fn or chunked_label_smoothed_loss
        keep_large_blocks()  # as `transformer train` sets up its process (train._setup_torch)
        self.runs: dict[str, tuple[Transformer, MixedPrecisionAdam]] = {}
        self.notes = (
            "transformer (ours): bf16 params + fp32 master Adam (fused), chunked non-pad "
            "loss; fp32 = plain fp32 params"
        )

    def _run(self, dtype: str) -> tuple[Transformer, MixedPrecisionAdam]:
        if dtype not in self.runs:
            c = self.cfg
            overrides = [
                f"model.d_model={c['d_model']}",
                f"model.d_ff={c['d_ff']}",
                f"model.n_heads={c['heads']}",
                f"model.d_k={c['d_model'] // c['heads']}",
                f"model.d_v={c['d_model'] // c['heads']}",
                f"model.n_layers={c['layers']}",
                f"model.p_drop={c['dropout']}",
                f"model.max_len={c['max_pos']}",
                f"train.dtype={dtype}",
            ]
            config = build_config("base", None, overrides, vocab_size=c["vocab"])
            torch.manual_seed(c["seed"])
            model = self.model_cls(config.model).train()
            for p in model.parameters():  # as train.build_model: parameters in the dtype
                p.data = p.data.to(DTYPES[dtype])
            opt = MixedPrecisionAdam(model.parameters(), tuple(c["betas"]), c["eps"])
            if self.reserve_state:  # as train._run, before the first batch
                opt.reserve_state()
            self.runs[dtype] = (model, opt)
        return self.runs[dtype]

    def prepare(self, batch: dict) -> dict:
        src, tgt_in, tgt_out = (_to_our_ids(batch[k]) for k in ("src", "tgt_in", "tgt_out"))
        keep = tgt_out != PAD_ID  # (B, T)
        return {
            "src": src,
            "src_mask": src != PAD_ID,
            "tgt_in": tgt_in,
            "target": tgt_out[keep],  # (N,)
            "keep": keep,
            "ntokens": int(keep.sum()),
        }

    def step(self, p: dict, amp: torch.dtype | None) -> float:
        model, opt = self._run("fp32" if amp is None else "bf16")
        model.train()
        eps, lr = self.cfg["label_smoothing"], self.cfg["lr"]
        # this adapter's choices for its own steps only
        saved = gradhelper.ROW_MAJOR_GRADS, kernels.FUSED
        if self.row_major_grads is not None:
            gradhelper.ROW_MAJOR_GRADS = self.row_major_grads
        kernels.FUSED = self.fused and saved[1]
        products = None  # untouched unless asked: an older tree's kernels lack the switch
        if self.attention_bf16 is not None:
            products = kernels.attention_products()
            kernels.attention_bf16(self.attention_bf16)
        try:
            loss = train_step(model, opt, self.loss_fn, p, eps, lr)
        finally:
            gradhelper.ROW_MAJOR_GRADS, kernels.FUSED = saved
            if products is not None:
                kernels.attention_products(products)
        return float(loss.detach()) / p["ntokens"]

    @property
    def model(self) -> Transformer:
        """The first model built (bf16 when none has been built yet)."""
        return next(iter(self.runs.values()))[0] if self.runs else self._run("bf16")[0]

    def n_params(self) -> int:
        return self.model.num_parameters()


def make_train(cfg: dict) -> OurTrain:
    """Factory for `bench_train.py --impl ext:peers_adapter:make_train`."""
    return OurTrain(cfg)


def make_train_torch_ops(cfg: dict) -> OurTrain:
    """`make_train` with torch's own ops where the fused kernels would run (kernels.FUSED off:
    residual LayerNorm, ReLU, the attention softmax): the before of round twenty-seven's
    same-run before/after, beside `make_train`."""
    return OurTrain(cfg, fused=False)


def make_train_torch_layouts(cfg: dict) -> OurTrain:
    """`make_train` with every weight gradient in torch's layouts (gradhelper.ROW_MAJOR_GRADS
    off): the before of a same-run before/after on an AMX CPU, beside `make_train`."""
    return OurTrain(cfg, row_major_grads=False)


def make_train_lanes_attention(cfg: dict) -> OurTrain:
    """`make_train` with the training attention's products on AVX-512's fp32 lanes
    (kernels.attention_bf16 off): the before of round sixty-five's same-run before/after on a
    CPU with AVX-512 BF16, beside `make_train`."""
    return OurTrain(cfg, attention_bf16=False)


def make_train_lazy_adam(cfg: dict) -> OurTrain:
    """`make_train` with the Adam moments made at the first step, not before the first batch
    (`MixedPrecisionAdam.reserve_state` not called): the before of round seventy-two's same-run
    before/after, beside `make_train`."""
    return OurTrain(cfg, reserve_state=False)


def marian_sinusoids(n_pos: int, d: int) -> torch.Tensor:
    """HF Marian's position table: sin of every frequency in the first half, cos in the second."""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    freq = torch.pow(10000.0, torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = pos / freq  # (n_pos, D/2)
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).float()


def load_marian(hf_dir: str, model_cls: type = Transformer) -> Transformer:
    """HF Marian weights (model.safetensors + config.json) in our Transformer (fp32, eval)."""
    import json

    from safetensors.torch import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        hc = json.load(f)
    d, h = hc["d_model"], hc["encoder_attention_heads"]
    overrides = [
        f"model.d_model={d}",
        f"model.d_ff={hc['encoder_ffn_dim']}",
        f"model.n_heads={h}",
        f"model.d_k={d // h}",
        f"model.d_v={d // h}",
        f"model.n_layers={hc['encoder_layers']}",
        f"model.max_len={hc['max_position_embeddings']}",
        "model.learned_pos=true",  # holds Marian's [sin | cos] table exactly
    ]
    config = build_config("base", None, overrides, vocab_size=hc["vocab_size"])
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    if float(sd["final_logits_bias"].abs().max()) != 0.0:
        raise ValueError("final_logits_bias is not zero: our tied projection has no bias")
    shared = sd["model.shared.weight"]  # (V, D): §3.4 one matrix for both embeddings + output
    ours: dict[str, torch.Tensor] = {"src_embed.weight": shared, "tgt_embed.weight": shared}
    table = marian_sinusoids(hc["max_position_embeddings"], d)
    ours["src_pos.learned.weight"] = ours["tgt_pos.learned.weight"] = table

    def attn(dst: str, src: str) -> None:
        for kind in ("weight", "bias"):
            ours[f"{dst}.w_q.{kind}"] = sd[f"{src}.q_proj.{kind}"]
            kv = [sd[f"{src}.k_proj.{kind}"], sd[f"{src}.v_proj.{kind}"]]
            ours[f"{dst}.w_kv.{kind}"] = torch.cat(kv, 0)
            ours[f"{dst}.w_o.{kind}"] = sd[f"{src}.out_proj.{kind}"]

    def copy(dst: str, src: str) -> None:
        for kind in ("weight", "bias"):
            ours[f"{dst}.{kind}"] = sd[f"{src}.{kind}"]

    for i in range(hc["encoder_layers"]):
        m, o = f"model.encoder.layers.{i}", f"encoder_layers.{i}"
        attn(f"{o}.self_attn", f"{m}.self_attn")
        copy(f"{o}.res_attn.norm", f"{m}.self_attn_layer_norm")
        copy(f"{o}.ffn.w_1", f"{m}.fc1")
        copy(f"{o}.ffn.w_2", f"{m}.fc2")
        copy(f"{o}.res_ffn.norm", f"{m}.final_layer_norm")
    for i in range(hc["decoder_layers"]):
        m, o = f"model.decoder.layers.{i}", f"decoder_layers.{i}"
        attn(f"{o}.self_attn", f"{m}.self_attn")
        copy(f"{o}.res_self.norm", f"{m}.self_attn_layer_norm")
        attn(f"{o}.cross_attn", f"{m}.encoder_attn")
        copy(f"{o}.res_cross.norm", f"{m}.encoder_attn_layer_norm")
        copy(f"{o}.ffn.w_1", f"{m}.fc1")
        copy(f"{o}.ffn.w_2", f"{m}.fc2")
        copy(f"{o}.res_ffn.norm", f"{m}.final_layer_norm")
    model = model_cls(config.model)
    model.load_state_dict(ours, strict=True)
    return model.eval()


@torch.inference_mode()
def forced_length_search(
    model: Transformer, src: torch.Tensor, src_mask: torch.Tensor, beam: int, n_out: int,
    start_id: int, banned: list[int],
) -> list[list[int]]:  # fmt: skip
    """Exactly `n_out` tokens per sentence, `banned` ids never chosen: greedy (beam 1) or beam
    search (all hypotheses have equal length, so ranking is by log-probability); (B, n_out)."""
    B = src.size(0)
    stepper = ModelStepper(model, src, src_mask, log_probs=beam > 1)  # greedy: argmax of logits
    last = torch.full((B,), start_id, dtype=torch.long)
    scores = torch.zeros(B, 1)  # (B, k) cumulative log-probs
    tokens = torch.empty(B, 0, dtype=torch.long)  # (B * k, t)
    for _ in range(n_out):
        lprobs = stepper.step(last)  # (B * k, V)
        lprobs[:, banned] = float("-inf")
        if beam == 1:
            last = row_argmax(lprobs)  # (B,): as `greedy_search`
            tokens = torch.cat([tokens, last[:, None]], 1)
            continue
        k = scores.size(1)
        # The candidates `beam_search` ranks (its blocked top-k over each beam's tokens, best
        # first; 3.5 against 11.3 ms for a top-k of all k * V sums at (64, 4, 32,000), Zen 3)
        cand, parent, token = _top_candidates(scores, lprobs, beam)
        scores, parent, last = cand[:, :beam], parent[:, :beam], token[:, :beam].reshape(-1)
        parents = (parent + torch.arange(B)[:, None] * k).reshape(-1)  # (B * K,) rows
        stepper.reorder(parents, same_sentences=k == beam)
        tokens = torch.cat([tokens.index_select(0, parents), last[:, None]], 1)  # (B * K, t + 1)
    if beam > 1:
        tokens = tokens.view(B, beam, n_out)[:, 0]  # topk sorts: beam 0 is the best
    return tokens.tolist()


class Infer:
    """`bench_infer.py --variants ext:peers_adapter:Infer:<fp32|bf16|int8|int8-bf16|auto>`.

    fp32: our model as loaded, its projection packed for oneDNN as `transformer translate`
    does (`translate.packed_projection`); fp32-unpacked: without that (F.linear, MKL); bf16:
    all weights bf16, every linear layer packed for oneDNN as `transformer translate` does
    (`translate.packed_bf16`); bf16-unpacked: the same through F.linear; int8:
    `translate.quantize_int8` (int8 weights in every nn.Linear and the tied projection, fp32
    activations); int8-bf16: the same with bf16 activations (embeddings, LayerNorm, attention,
    cache); auto: what `transformer translate` picks on this machine (`translate.auto_dtype`:
    bf16 with AMX, int8 with VNNI, else fp32).
    """

    def __init__(self, variant: str, ctx: dict, model_cls: type = Transformer) -> None:
        if variant == "auto":
            from transformer.translate import auto_dtype

            variant = auto_dtype("cpu")[0]
        model = load_marian(ctx["hf_dir"], model_cls)
        if variant == "bf16":
            from transformer.translate import packed_bf16

            model = packed_bf16(model)
        elif variant == "bf16-unpacked":
            model = model.to(torch.bfloat16)
        elif variant in ("int8", "int8-bf16"):
            from transformer.translate import quantize_int8

            activations = torch.bfloat16 if variant == "int8-bf16" else torch.float32
            model = quantize_int8(model, activations=activations)
        elif variant == "fp32":
            from transformer.translate import packed_projection

            model = packed_projection(model)
        elif variant != "fp32-unpacked":
            choices = "fp32, fp32-unpacked, bf16, bf16-unpacked, int8, int8-bf16 or auto"
            raise ValueError(f"variant must be {choices}, got {variant!r}")
        self.model, self.pad = model, model.cfg.vocab_size - 1
        self.note = f"transformer (ours) {variant}, forced-length search over ModelStepper"

    def prepare(self, src: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return src, src != self.pad

    def run(self, p: tuple[torch.Tensor, torch.Tensor], beam: int, n_out: int) -> int:
        self.last = forced_length_search(
            self.model, p[0], p[1], beam, n_out, self.pad, [self.pad, MARIAN_EOS]
        )
        return sum(len(x) for x in self.last)
