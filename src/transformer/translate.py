"""Inference: text -> subword ids -> token-budget batches -> §6.1 search -> detokenized text.

`Translator` wraps a loaded model file (or a run directory's averaged / latest model) with its
tokenizer and decoding options. Lines are batched by source tokens, longest first, and the
outputs are returned in input order. Precision: fp32, bf16 (the model is cast to bfloat16),
int8 (`quantize_int8`: int8 weights in every `nn.Linear` and in the tied output projection,
each input row quantized on its own range; see docs/decoding.md), or auto (`auto_dtype`).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np
import torch
from torch import nn

from transformer import cpuinfo, kernels
from transformer.batching import batch_by_tokens
from transformer.config import INFERENCE_DTYPES, WINDOW_LINES, DecodeConfig
from transformer.cpuinfo import available_memory, cpu_flags, native_bf16
from transformer.data import read_lines, read_windows
from transformer.errors import UserError
from transformer.gptq import gptq_round, row_scales
from transformer.gradhelper import is_linear
from transformer.model import DTYPES as model_dtypes
from transformer.model import PositionwiseFeedForward, accelerator_dtype
from transformer.modelfile import PROJECTION, LoadedModel, int8_targets
from transformer.rundir import resolve_model
from transformer.search import Constrain, beam_search_alphas, greedy_search
from transformer.threads import (
    OtherLoad,
    ThreadTuner,
    omp_threads_fixed,
    room_left,
)
from transformer.threads import resolve as resolve_threads
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID

logger = logging.getLogger(__name__)

# Decoding streams (`Translator._decode_streams`): at most one per this many batches of a job (none
# below two streams' worth): with fewer, one long batch can leave the other streams idle.
MIN_BATCHES_PER_STREAM = 2
# Of the memory the process can still take (`cpuinfo.available_memory`), the share the decoding
# streams' batches may fill, each as much as the job's first batch took (`_streams_that_fit`).
STREAMS_MEMORY_SHARE = 0.8
# How often the first batch's resident memory is read while it decodes (seconds).
RSS_EVERY_S = 0.005
# A generous bound on one batch's decoding memory, in bytes per source token of the batch and
# beam and per decoder layer and model dimension: fp32 self-attention keys and values (2 x 4
# bytes) over about as many positions as source tokens, x3 for the doubling buffers' copies,
# the cross-attention keys and values and the rest. Measured: a base-shape int8 batch of 4,000
# tokens at beam 4 took 700-780 MiB, this bound 1,125 MiB (docs/performance.md, "Round
# forty-six"). Where the memory available holds twice the streams' bound, the first batch is
# not decoded alone to measure it: that costs 8-10% of a job's words/s.
BATCH_BYTES_BOUND = 2 * 4 * 3
# The first window of `Translator.load`, from the start of `from_path` (seconds; later ones 0.5)
FIRST_LOAD_WINDOW_S = 0.15
DTYPES = {**model_dtypes, "int8": "int8"}  # int8: `quantize_int8`'s int8 products
AUTO = "auto"
assert (AUTO, *DTYPES) == INFERENCE_DTYPES
PROGRESS_S = 30.0  # `translate_stream` logs its progress at most this often
TINY = torch.finfo(torch.float32).tiny  # `Int8Linear`'s least row scale (a row of zeros)
# `Int8Linear`'s input grids, by whether the inputs are never negative: (levels, zero point), an
# input row x / max|x| as u8 round(x * levels) + zero point: [-1, 1] in 254 steps around 128,
# or [0, 1] in 255 from 0.
INPUT_GRIDS = {False: (127.0, 128), True: (255.0, 0)}
# 8-bit dot products (u8 x s8 summed in int32): fbgemm's int8 kernels then take full 8-bit inputs.
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def auto_dtype(device: str | torch.device, gptq_levels: Sequence[int] = ()) -> tuple[str, str]:
    """`--dtype auto`: the precision to translate in on this device, and why.

    bf16 on CUDA (where supported) and on CPUs with AMX (`amx_bf16`: oneDNN multiplies bf16
    matrices on the tile unit, several times fp32's rate). int8 (`quantize_int8`) on CPUs
    without AMX that have 8-bit dot products (VNNI: `avx512_vnni` or `avx_vnni`), where it
    decodes faster than bf16 and fp32 (docs/performance.md, measured on AMD Zen 4), and on
    CPUs with neither where the library's exact AVX2 product runs (`int8_avx2`: the same
    8-bit weights and integer sums as with VNNI). Without it (no compiled kernels, or
    TRANSFORMER_INT8_PRODUCT=fbgemm), int8 on such a CPU only when the model file holds GPTQ's
    weights for fbgemm's 7-bit grid there (`gptq_levels`: the grids of `LoadedModel.int8`;
    `transformer quantize`): fp32's products run at ~0.6x int8's, and int8 rounded to the
    nearest of 63 levels cost 0.3 BLEU where GPTQ's cost < 0.1 (docs/decoding.md). fp32
    elsewhere. On the Multi30k quickstart model, bf16's and int8's sacreBLEU are within 0.1 of
    fp32 for beam 4 and greedy search (docs/decoding.md, "Precision"); the exact AVX2 product
    gives oneDNN's int8 bits (docs/performance.md, "Round sixty-eight").
    """
    device = torch.device(device)
    if device.type != "cpu":
        return accelerator_dtype(device)
    flags = cpu_flags()
    if "amx_bf16" in flags:
        if torch.backends.mkldnn.is_available():
            return "bf16", "the CPU has amx_bf16"
        return "fp32", "the CPU has AMX but this torch has no oneDNN"
    fbgemm = int8_kernels()
    vnni = sorted(VNNI_FLAGS & flags)
    if vnni and fbgemm:
        return "int8", f"the CPU has {vnni[0]} and no AMX"
    if fbgemm and int8_avx2():
        return "int8", "the CPU has neither AMX nor VNNI: 8-bit weights on the exact AVX2 product"
    if fbgemm and int8_levels() in gptq_levels:
        return "int8", "the CPU has neither AMX nor VNNI, and the model file has GPTQ int8 weights"
    return "fp32", "the CPU has neither AMX nor VNNI"


@dataclass
class Translation:
    """One output: detokenized text, its subword ids (no BOS/EOS) and its search score."""

    text: str
    tokens: list[int]
    score: float


@dataclass
class SentenceAttention:
    """One sentence pair's attention weights (Figures 3-5) with the token labels."""

    source_pieces: list[str]  # S: the subwords and </s>
    target_pieces: list[str]  # T: the output subwords and </s> (row i predicts piece i)
    target_input_pieces: list[str]  # T: <s> and the output subwords (the decoder's inputs)
    translation: str
    weights: dict[str, list[torch.Tensor]]  # encoder/decoder/cross -> N layers of (H, Tq, Tk)


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8, one scale per output row (symmetric), and each row of x
    quantized to 8 bits on its own range (oneDNN's int8 product where `int8_onednn()`: CPUs
    with VNNI; the library's exact AVX2 product where `int8_avx2()`: CPUs without; fbgemm's
    elsewhere).

    Each input row is divided by its largest |x| and rounded on one fixed grid: [-1, 1] in 254
    steps (u8 1..255, zero point 128), or [0, 1] in 255 where the inputs are never negative
    (`nonnegative_inputs`: ReLU's outputs, the FFN's second layer, `relu_input_layers`); the
    product's row is multiplied back by that |x| and the bias added after. So a row's outputs
    depend on that row alone, as a sentence's translation must not depend on its batch or
    search (attention: `model._attention_rowwise`; fbgemm's dynamic quantization, used before,
    took one range for the whole input, set by the batch's largest value), and int8's damage
    is halved (docs/decoding.md, "Per-row inputs"). Every step rounds each element once
    (scale, the kernel, scale back, add the bias: `addcmul`'s fused multiply-add rounds
    differently from a multiply and an add, and which path an element takes can depend on where
    its row sits), so no value depends on its row's place in the batch (tested bit for bit,
    output widths that are and are not a multiple of the vector width).

    narrow_weights: the weights take 7 bits (-63..63) instead of 8, which fbgemm's product needs
    on CPUs without VNNI: its kernel there (AVX2 `vpmaddubsw`) sums pairs of u8 x s8 products
    in int16 and saturates beyond 32,767; 2 x 255 x 63 stays below it while the inputs keep
    their 8 bits (`int8_narrow_weights`). x may be fp32 or bf16; the output has x's dtype, or
    `out_dtype`.
    hessian: X^T X of inputs like the layer's (`gptq.input_moments`): the weights are then
    rounded by GPTQ on the same grid (`gptq.gptq_round`) instead of to the nearest level.
    rounded: the weights already rounded on this grid (integers, row scales; a model file's
    GPTQ weights, `LoadedModel.int8`): `weight` then gives only the shape.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        narrow_weights: bool,
        out_dtype: torch.dtype | None = None,
        hessian: torch.Tensor | None = None,
        rounded: tuple[torch.Tensor, torch.Tensor] | None = None,
        nonnegative_inputs: bool = False,
    ):
        super().__init__()
        w = weight.detach().float()
        levels = 63.0 if narrow_weights else 127.0
        zeros = torch.zeros(w.size(0), dtype=torch.long)
        if rounded is not None:
            ints, scales = rounded[0].to(torch.int8), rounded[1].double()
        else:
            scales = row_scales(w, levels)
            ints = None
            if hessian is not None:
                ints = gptq_round(w, scales, levels, hessian).to(torch.int8)
        with warnings.catch_warnings():  # quantized tensors are deprecated (torch 2.13) but work
            warnings.simplefilter("ignore")
            if ints is None:
                qweight = torch.quantize_per_channel(w, scales, zeros, axis=0, dtype=torch.qint8)
            else:
                qweight = torch._make_per_channel_quantized_tensor(ints, scales, zeros, 0)
        # The bias is added after each row is scaled back, so the product gets none. oneDNN's
        # product (`int8_onednn`) keeps the integers beside its packed copy (`stacked` reads
        # them); fbgemm's packed weights and the AVX2 product's (`int8_avx2`) give them back.
        self.packed = self.ints = self.scales = self.dnn = self.avx2 = None
        if int8_onednn():
            self.ints, self.scales = qweight.int_repr(), scales.double()
            self.dnn = torch.ops.onednn.qlinear_prepack(self.ints, None)
            self.dnn_scales, self.dnn_zeros = self.scales.float(), zeros
        elif int8_avx2():  # its rows' scales in fp32, as oneDNN's product takes them
            self.scales = scales.double()
            self.avx2, self.avx2_scales = kernels.int8_pack(qweight.int_repr()), self.scales.float()
        else:
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        # A copy, not a view of the caller's tensor: its model's memory is not kept (nor, were
        # it read by mapping the file, `safetensors.safe_open`, the whole file's pages).
        self.bias = (
            None if bias is None else bias.detach().to(torch.float32, copy=True).contiguous()
        )
        self.in_features, self.out_features = w.size(1), w.size(0)
        self.narrow_weights, self.out_dtype = narrow_weights, out_dtype
        self.nonnegative_inputs = nonnegative_inputs
        # The inputs' grid (u8 = round(x / scale) + zero point, x in [-1, 1] or [0, 1]).
        levels, zero = INPUT_GRIDS[nonnegative_inputs]
        self.grid = (1 / levels, zero)

    @classmethod
    def stacked(cls, parts: Sequence[tuple[Int8Linear, float]]) -> Int8Linear:
        """One layer whose outputs are the parts' side by side, each times its factor: the
        same values as calling them one by one when the factors are powers of two and the
        parts take the same input (the same 8-bit inputs, the same integer weights, each row's
        scale and bias times its factor, exact). A decoder step's W^Q and W^KV run as one
        product (`cache.StepProjections`): one fbgemm call's fixed cost fewer per layer."""
        ints, scales, biases = [], [], []
        for part, factor in parts:
            part_ints, part_scales = part.integer_weights()
            ints.append(part_ints)
            scales.append(part_scales * factor)
            rows = part_ints.size(0)
            biases.append(torch.zeros(rows) if part.bias is None else part.bias * factor)
        first = parts[0][0]
        if len({part.nonnegative_inputs for part, _ in parts}) > 1:
            raise ValueError("Int8Linear.stacked: the parts must take the same inputs")
        shape = torch.zeros(()).expand(sum(i.size(0) for i in ints), first.in_features)
        return cls(shape, torch.cat(biases), first.narrow_weights, first.out_dtype,
                   rounded=(torch.cat(ints), torch.cat(scales)),
                   nonnegative_inputs=first.nonnegative_inputs)  # fmt: skip

    def integer_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights as the product takes them: integers (out, in) int8 and each row's scale
        (out,) fp64."""
        if self.avx2 is not None:
            return kernels.int8_unpack(self.avx2, self.out_features, self.in_features), self.scales
        if self.packed is None:
            return self.ints, self.scales
        qweight = torch.ops.quantized.linear_unpack(self.packed)[0]
        return qweight.int_repr(), qweight.q_per_channel_scales().double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach()  # inference only: the int8 products have no gradient
        fused = x.dtype == torch.float32 and x.is_contiguous() and int8_row_kernels()
        if self.dnn is not None or self.avx2 is not None:
            return self._forward_u8(x, fused)
        # Each row's largest |x| (at least TINY: a row of zeros stays 0, not 0/0), and the
        # row times its inverse (a multiply by a per-row value: cheaper than dividing).
        if fused:  # the same bits in one pass each (`kernels.int8_rows_in`, `int8_rows_out_`)
            xs, top = kernels.int8_rows_in(x, self.nonnegative_inputs, TINY)
        else:
            xs, top = _rows_in(x, self.nonnegative_inputs)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            xs, *self.grid, self.packed
        )
        if fused:
            return kernels.int8_rows_out_(y, top, self.bias).to(self.out_dtype or x.dtype)
        return _rows_out_(y, top, self.bias).to(self.out_dtype or x.dtype)

    def _forward_u8(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        """oneDNN's product (`int8_onednn`) or the library's AVX2 one (`int8_avx2`) of each
        row's 8-bit inputs: the rows quantized to u8 in the pass that finds their ranges
        (`kernels.int8_rows_u8`, or `_rows_u8`). The AVX2 product scales its sums as oneDNN's
        does, and by each row's top and adds the bias itself, in `int8_rows_out_`'s roundings:
        the same bits as oneDNN's path."""
        levels, zero = INPUT_GRIDS[self.nonnegative_inputs]
        rows = x.reshape(-1, self.in_features)
        if fused:
            q, top = kernels.int8_rows_u8(rows, self.nonnegative_inputs, TINY, levels, zero)
        else:
            q, top = _rows_u8(rows, self.nonnegative_inputs)
        if self.avx2 is not None:
            y = kernels.int8_product(q.contiguous(), zero, self.grid[0], self.avx2,
                                     self.out_features, self.avx2_scales, top.contiguous(),
                                     self.bias)  # fmt: skip
            return y.view(*x.shape[:-1], self.out_features).to(self.out_dtype or x.dtype)
        if q.size(0):
            y = torch.ops.onednn.qlinear_pointwise(
                q, self.grid[0], zero, self.dnn, self.dnn_scales, self.dnn_zeros, None, 1.0, 0,
                torch.float32, "none", [], "",
            )  # fmt: skip
        else:
            y = torch.empty(0, self.out_features)
        y = kernels.int8_rows_out_(y, top, self.bias) if fused else _rows_out_(y, top, self.bias)
        return y.view(*x.shape[:-1], self.out_features).to(self.out_dtype or x.dtype)

    def extra_repr(self) -> str:
        narrow = self.narrow_weights
        nonneg = self.nonnegative_inputs
        product = "fbgemm" if self.packed is not None else "avx2" if self.dnn is None else "onednn"
        return (f"in={self.in_features}, out={self.out_features}, narrow_weights={narrow}, "
                f"nonnegative_inputs={nonneg}, product={product}")  # fmt: skip


class PackedLinear(nn.Module):
    """y = x W^T (+ b) on CPU with W reordered once into oneDNN's blocked layout
    (`torch.ops.mkldnn._reorder_linear_weight`), for decoding, where the weights are constant;
    in fp32 or bf16 (`dtype`: the weight's and the output's; x is cast to it).

    A plain weight is reordered by oneDNN inside every call instead. fp32: the pre-softmax
    projection of a greedy decoder step, (64, 512) x (512, 32,000), ran at ~77 GFLOP/s through
    MKL and ~126 this way (AMD EPYC Zen 3, 2 threads); W2 in fp32, peers' harness: greedy +9%,
    beam 4 +13% (docs/performance.md); the values are fp32 products summed in another order:
    equal to F.linear's to ~1e-6 relative. bf16 (`packed_bf16`, every linear layer of a bf16
    decoder): a decoder step's products at 64 rows took 1.6-2.2x as long through F.linear on an
    Intel Xeon with AMX (docs/performance.md, "Round twenty-four"). A copy of W in the packed
    layout (V x D: 62.5 MiB at V = 32,000, D = 512 in fp32; half that in bf16); `weight` and
    `bias` are the plain ones (kept for `stacked`; for the fp32 projection, the embedding).
    rows: the batch rows oneDNN chooses its layout for.

    bf16 on an AMX Xeon: oneDNN sums a row's products in an order that depends on the call's
    row count (with d_model 512, a row alone and in a batch of 47 or more can round
    differently; above 64 rows, with d_ff 2048, also on the thread count), through F.linear
    as well as here: the same rows differ either way (docs/decoding.md, "bf16 on an AMX
    Xeon"). Calls of a fixed 64 rows would make every row's sums the same, but took beam 4 on
    W2 to 688 tokens/s, against F.linear's 789 in the same run (64-row calls run the AMX
    tiles at about half their rate at 256).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: int = 64,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.weight = weight.detach().to(dtype).contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows)
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.in_features, self.out_features = self.weight.size(1), self.weight.size(0)
        self.rows, self.dtype = rows, dtype

    @classmethod
    def stacked(cls, parts: Sequence[tuple[PackedLinear, float]]) -> PackedLinear:
        """One layer whose outputs are the parts' side by side, each times its factor (a power
        of two: exact), as `cache.StepProjections` stacks a decoder step's W^Q and W^KV."""
        first = parts[0][0]
        if any(part.bias is None for part, _ in parts):
            raise ValueError("PackedLinear.stacked: every part must have a bias")
        weight = torch.cat([part.weight * factor for part, factor in parts])
        bias = torch.cat([part.bias * factor for part, factor in parts])
        return cls(weight, bias, first.rows, first.dtype)

    def forward(self, x: torch.Tensor, post: str = "none") -> torch.Tensor:
        x2 = x.to(self.dtype).reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, post, [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def relu_forward(self, x: torch.Tensor) -> torch.Tensor:
        """max(0, forward(x)), the max oneDNN's post-op on the fp32 sums before they are rounded
        (max(0, .) and rounding commute: the same values; a NaN sum comes out 0, where F.relu
        keeps it), not a pass of its own over the output: a decoding FFN's first layer
        (`PositionwiseFeedForward`), W2 1.02x-1.03x (docs/performance.md, "Round
        fifty-three")."""
        return self(x, "relu")

    def extra_repr(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"in={self.in_features}, out={self.out_features}, {dtype}, oneDNN-packed"


class FP32Logits(nn.Module):
    """The pre-softmax projection of a bf16 decoder on a CPU with AMX (`packed_bf16`): fp32
    logits from `kernels.project`, each the fp32 sum of its bf16 products, not rounded to bf16
    (whose steps are 1/16 between 8 and 16, which beam search ranks), and the same for a
    sentence in any batch. Where the kernel does not run (TRANSFORMER_PROJECT_AMX=0,
    `kernels.project_amx(False)`), a bf16 `PackedLinear`'s bf16 logits, as before it. The
    weight is the bf16 model's own (the tied embedding, §3.4), not a copy."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight.detach().to(torch.bfloat16).contiguous()
        self.in_features, self.out_features = self.weight.size(1), self.weight.size(0)
        self._packed: PackedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = kernels.project(x.to(torch.bfloat16), self.weight)
        if y is not None:
            return y
        if self._packed is None:  # built once, where it is first needed
            self._packed = PackedLinear(self.weight, None, dtype=torch.bfloat16)
        return self._packed(x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bf16, fp32 logits on AMX"


def packed_projection(model: nn.Module) -> nn.Module:
    """`model` for fp32 decoding on CPU with its pre-softmax projection a `PackedLinear`
    (a copy of the tied embedding), where oneDNN is available; otherwise `model` itself. The
    returned module shares every parameter with `model`, which is left unchanged."""
    if not torch.backends.mkldnn.is_available() or model.projection is not None:
        return model
    packed = copy.copy(model)  # the same parameters; its own submodule table:
    packed._modules = dict(model._modules)  # setting `projection` leaves `model`'s alone
    packed.projection = PackedLinear(model.output_weight(), None)
    return packed


def bf16_packs() -> bool:
    """Whether bf16 decoding on this CPU takes `packed_bf16`'s layers: oneDNN is there, the
    CPU multiplies bf16 natively (AVX512-BF16 or AMX), and oneDNN's own check of the CPU
    passes (its bf16 layout needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and refuses to pack on a
    CPU without them, such as a Zen 3: `_reorder_linear_weight` raises there, so flags that
    claim more than the CPU has, as a container's or a test's can, must not decide alone);
    elsewhere bf16 runs in slow fallbacks that a packed layout would not help."""
    return torch.backends.mkldnn.is_available() and bool(native_bf16()) and onednn_bf16()


def onednn_bf16() -> bool:
    """Whether oneDNN multiplies and packs bf16 on this CPU (torch's check of the CPU itself,
    not of /proc/cpuinfo's flags)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without this op
        return False


def packed_bf16(model: nn.Module) -> nn.Module:
    """A bf16 copy of `model` for decoding on CPU with every nn.Linear and the pre-softmax
    projection (a copy of the tied embedding, §3.4) a bf16 `PackedLinear`, where `bf16_packs`;
    otherwise just the bf16 copy. The same products as `model.to(torch.bfloat16)`'s, their sums
    in oneDNN's order for the packed layout (bf16 rounds a few outputs differently). Where
    `kernels.project_amx`, the projection is an `FP32Logits` instead: the same products, their
    logits in fp32. `model` is left unchanged."""
    # Each parameter copied once, straight to bf16 (shared ones stay shared): no fp32 copy; a
    # bf16 model's parameters are shared, not copied (`Tensor.to` of the same dtype).
    memo = {id(p): nn.Parameter(p.detach().to(torch.bfloat16), p.requires_grad)
            for p in model.parameters()}  # fmt: skip
    model = copy.deepcopy(model, memo).to(torch.bfloat16)
    if not bf16_packs():
        return model
    for name, linear in [(n, m) for n, m in model.named_modules() if is_linear(m)]:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                PackedLinear(linear.weight, linear.bias, dtype=torch.bfloat16))  # fmt: skip
    if model.projection is None:
        weight = model.output_weight()
        model.projection = (FP32Logits(weight) if kernels.project_amx()
                            else PackedLinear(weight, None, dtype=torch.bfloat16))  # fmt: skip
    return model


def _rows_in(x: torch.Tensor, nonnegative: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`Int8Linear`'s input rows in torch's ops: (x * (1 / top), top), top (..., 1) fp32 each
    row's largest |x| (`nonnegative`: largest x), at least TINY."""
    top = (x if nonnegative else x.abs()).amax(-1, keepdim=True).float().clamp_min_(TINY)
    return x * top.reciprocal(), top


def _rows_u8(x: torch.Tensor, nonnegative: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`Int8Linear`'s 8-bit input rows in torch's ops (oneDNN's product): (q, top), q uint8 =
    round(x * (1 / top) * levels) + zero point, to nearest even, saturated to 0 .. 255 (a
    NaN: the zero point), on `Int8Linear.grid`'s levels: 255 from 0 (`nonnegative`), 127 either
    side of 128."""
    xs, top = _rows_in(x, nonnegative)
    levels, zero = INPUT_GRIDS[nonnegative]
    q = (xs.float() * levels).nan_to_num_(nan=0.0).round_().add_(zero).clamp_(0, 255)
    return q.to(torch.uint8), top


def _rows_out_(y: torch.Tensor, top: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`Int8Linear`'s output rows in torch's ops, in place: y * top, then + bias (a multiply,
    then an add: never a fused multiply-add)."""
    y.mul_(top)
    return y if bias is None else y.add_(bias)


@functools.cache
def int8_row_kernels() -> bool:
    """Whether `Int8Linear` scales its rows with `kernels.int8_rows_in` / `int8_rows_out_`
    (AVX-512 or AVX2, where the library builds): only once they have given the same bits as
    `_rows_in` / `_rows_out_` on rows of every kind (zeros, infinities, a NaN, widths that are
    and are not a multiple of 16, rows enough for the threads); torch's ops otherwise. A W2
    greedy search 2-7% faster, beam 4 1-3% (docs/performance.md, "Round thirty-seven").
    Decoding streams may ask at once: `kernels` makes them wait while it loads the library,
    so each gets the same answer."""
    if not kernels.rows_supported():
        return False
    g = torch.Generator().manual_seed(0)
    for rows, k, nonneg in ((5, 37, False), (5, 37, True), (70, 1024, False), (3, 16, True)):
        x = torch.randn(rows, k, generator=g) * 3
        x[0], x[1, :2], x[2, 5] = 0.0, float("inf"), -float("inf")
        x = x.relu() if nonneg else x
        bias = torch.randn(k + 3, generator=g)
        y = torch.randn(rows, k + 3, generator=g)
        xs, top = kernels.int8_rows_in(x, nonneg, TINY)
        ref_xs, ref_top = _rows_in(x, nonneg)
        same = [(xs, ref_xs), (top, ref_top)]
        for b in (bias, None):
            same.append((kernels.int8_rows_out_(y.clone(), top, b), _rows_out_(y.clone(), top, b)))
        if not all(torch.equal(a.view(torch.int32), r.view(torch.int32)) for a, r in same):
            logger.info("Int8Linear: torch's ops for the rows (the compiled kernels differ)")
            return False
    nan = torch.tensor([[1.0, float("nan"), 2.0]])
    return bool(kernels.int8_rows_in(nan, False, TINY)[1].isnan().all())


def int8_onednn() -> bool:
    """Whether `Int8Linear` multiplies through oneDNN (`onednn::qlinear_pointwise` on u8 rows)
    instead of fbgemm: on CPUs with VNNI (8-bit weights), where this torch has the op, and
    only once it has matched the exact product (integer sums, then (sum x input scale) x row
    scale, to 2e-7 of each row's largest) and given a row the same bits in any batch. At
    decoding's shapes on a Zen 5 it multiplies 20-35% faster than fbgemm, whose integer sums
    were off in 0.3% of the outputs at 256 rows with signed inputs (docs/performance.md,
    "Round forty-one"). On the AMX Xeon of round forty-eight oneDNN's sums are exact but a
    one-row batch's bits differ from the same row's in a batch of 40 (by 1 ulp), so there the
    check keeps fbgemm's (bf16 is `auto_dtype`'s choice on AMX).
    `TRANSFORMER_INT8_PRODUCT=fbgemm` keeps fbgemm's (`=avx2`: the library's, `int8_avx2`).
    Decoding streams may ask at once: each gets the same answer."""
    return _int8_onednn(_int8_product_asked(), cpuinfo.CPUINFO)


@functools.cache
def _int8_onednn(asked: str, cpuinfo_path: str) -> bool:
    """`int8_onednn` for TRANSFORMER_INT8_PRODUCT's value and the CPU (the file its flags are
    read from, which a test may replace): the check runs once for each."""
    if asked:  # fbgemm's or the library's, asked for
        return False
    if not _vnni() or not torch.backends.mkldnn.is_available():
        return False
    try:
        prepack, product = torch.ops.onednn.qlinear_prepack, torch.ops.onednn.qlinear_pointwise
        g = torch.Generator().manual_seed(0)
        for k, n, zero, scale in ((300, 70, 128, 1 / 127), (37, 19, 0, 1 / 255)):
            ints = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            scales = torch.rand(n, generator=g) * 0.01 + 1e-4
            q = torch.randint(0, 256, (40, k), generator=g, dtype=torch.uint8)
            packed, zeros = prepack(ints, None), torch.zeros(n, dtype=torch.long)

            def mul(rows, packed=packed, scale=scale, zero=zero, scales=scales, zeros=zeros):
                return product(rows, scale, zero, packed, scales, zeros, None, 1.0, 0,
                               torch.float32, "none", [], "")  # fmt: skip

            y = mul(q)
            exact = ((q.double() - zero) @ ints.double().t()) * scale * scales.double()
            close = (y.double() - exact).abs() <= 2e-7 * exact.abs().amax(1, keepdim=True)
            alone = all(torch.equal(mul(q[i : i + m].contiguous()).view(torch.int32),
                                    y[i : i + m].view(torch.int32))
                        for i, m in ((5, 1), (0, 17), (23, 17)))  # fmt: skip
            if not (bool(close.all()) and alone):
                logger.info("Int8Linear: fbgemm's product (oneDNN's differs from the exact one)")
                return False
    except (AttributeError, RuntimeError) as e:  # no such op, or it refused
        logger.info("Int8Linear: fbgemm's product (oneDNN's: %s)", e)
        return False
    return True


INT8_PRODUCT_CHOICES = ("fbgemm", "avx2")  # TRANSFORMER_INT8_PRODUCT's values


def _int8_product_asked() -> str:
    """TRANSFORMER_INT8_PRODUCT: the int8 product a user asked for ("fbgemm", "avx2"; "" for
    the CPU's own choice); UserError for any other value."""
    asked = os.environ.get("TRANSFORMER_INT8_PRODUCT", "").strip().lower()
    if asked and asked not in INT8_PRODUCT_CHOICES:
        choices = " or ".join(INT8_PRODUCT_CHOICES)
        raise UserError(f"TRANSFORMER_INT8_PRODUCT: {choices} (or unset for the CPU's own "
                        f"choice), not {asked!r}")  # fmt: skip
    return asked


def _vnni(flags: set[str] | None = None) -> bool:
    """Whether a CPU with these feature flags (default /proc/cpuinfo's) has 8-bit dot
    products (VNNI, or AMX's int8 tiles)."""
    return bool(VNNI_FLAGS & (cpu_flags() if flags is None else flags))


def int8_avx2() -> bool:
    """Whether `Int8Linear` multiplies through the library's exact 8-bit product on AVX2
    (`kernels.int8_product`) instead of fbgemm's: on CPUs without VNNI (a Zen 3), where
    fbgemm's AVX2 kernel (`vpmaddubsw`, pairs of u8 x s8 products summed in int16) saturates
    with 8-bit weights and so takes 7-bit ones (`int8_narrow_weights`); the library's sums two
    int16 products in int32 (`vpmaddwd`): the same 8-bit weights and integer sums as a VNNI
    CPU's; W2 as a Zen 3 runs it 0.97x (greedy) and 1.01x (beam 4) of fbgemm's 7-bit product
    (docs/performance.md, "Round sixty-eight"). Only where the library runs with AVX2, and once
    it has given the exact product bit for bit (the int32 sums, then x step, x scale, x top, +
    bias, each rounded: oneDNN's product's bits, then `int8_rows_out_`'s, so a CPU without VNNI
    translates as one with it does, word for word) on shapes with every edge and inputs that
    saturate `vpmaddubsw`. `TRANSFORMER_INT8_PRODUCT=avx2` takes it on any CPU with AVX2 (a
    VNNI CPU too: to compare), `=fbgemm` keeps fbgemm's. Decoding streams may ask at once:
    each gets the same answer."""
    return _int8_avx2(_int8_product_asked(), cpuinfo.CPUINFO)


@functools.cache
def _int8_avx2(asked: str, cpuinfo_path: str) -> bool:
    """`int8_avx2` for TRANSFORMER_INT8_PRODUCT's value and the CPU (the file its flags are
    read from, which a test may replace): the check runs once for each."""
    flags = cpu_flags()
    if asked == "fbgemm" or (asked != "avx2" and _vnni(flags)):
        return False
    if "avx2" not in flags or not kernels.int8_product_supported():
        logger.info("Int8Linear: fbgemm's product (the compiled kernels: %s)",
                    kernels.unavailable() or "no AVX2")  # fmt: skip
        return False
    g = torch.Generator().manual_seed(0)
    shapes = ((9, 37, 70, 128), (4, 300, 24, 0), (1, 2, 1, 128), (45, 512, 49, 0))
    for m, k, n, zero in shapes + ((70, 512, 130, 128),):  # the last on two threads
        ints = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        ints[0] = 127  # with inputs of 255, pairs that saturate int16 (2 x 255 x 127)
        q = torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
        q[0] = 255
        scales, step = torch.rand(n, generator=g) * 1e-3 + 1e-6, 1 / (255 - zero)
        top, bias = torch.rand(m, 1, generator=g) * 10, torch.randn(n, generator=g)
        top[-1] = float("nan")
        packed = kernels.int8_pack(ints)
        sums = _exact_sums(q, zero, ints)  # one reference's sums for both biases
        for b in (bias, None):
            want = _exact_out(sums, step, scales, top, b)
            got = kernels.int8_product(q, zero, step, packed, n, scales, top, b)
            alone = kernels.int8_product(q[m // 2 :].contiguous(), zero, step, packed, n,
                                         scales, top[m // 2 :].contiguous(), b)  # fmt: skip
            if not (_same_bits(got, want) and _same_bits(alone, got[m // 2 :])):
                logger.info("Int8Linear: fbgemm's product (the library's AVX2 one differs from "
                            "the exact product)")  # fmt: skip
                return False
    return True


def int8_product_exact(q, zero: int, step: float, ints, scales, top, bias) -> torch.Tensor:
    """`kernels.int8_product`'s definition in torch, the reference its check and tests hold it
    to: the int64 sums of (q - zero) x ints^T (exact), then each step rounded on its own in fp32
    (x step, x scales; `_rows_out_`: x top, then + bias). A sum of 0 is +0, as an integer's."""
    return _exact_out(_exact_sums(q, zero, ints), step, scales, top, bias)


def _exact_sums(q, zero: int, ints) -> torch.Tensor:
    """`int8_product_exact`'s integer sums, (q - zero) x ints^T in int64."""
    return (q.long() - zero) @ ints.long().t()


def _exact_out(sums, step: float, scales, top, bias) -> torch.Tensor:
    """`int8_product_exact`'s fp32 steps on its integer sums."""
    return _rows_out_(sums.float() * torch.tensor(step).float() * scales, top, bias)


def int8_product_said() -> str:
    """Which product `Int8Linear` multiplies with on this CPU, and its weights' bits, in words
    (`transformer kernels`)."""
    asked = _int8_product_asked()
    said = f" (TRANSFORMER_INT8_PRODUCT={asked})" if asked else ""
    if int8_onednn():
        return "oneDNN's (VNNI), 8-bit weights"
    if int8_avx2():
        return f"the library's exact AVX2 product, 8-bit weights{said}"
    return f"fbgemm's, {7 if int8_narrow_weights() else 8}-bit weights{said}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two fp32 tensors hold the same values bit for bit (a NaN matches any NaN)."""
    if a.shape != b.shape:
        return False
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def int8_kernels() -> bool:
    """Whether this torch multiplies `Int8Linear`'s products with fbgemm (x86; its quantized
    engine "fbgemm" or "x86"): the per-row product `Int8Linear` calls has no other kernel."""
    return torch.backends.quantized.engine in {"fbgemm", "x86"}


def int8_narrow_weights(flags: set[str] | None = None, avx2_product: bool | None = None) -> bool:
    """Whether `Int8Linear` must take 7-bit weights on a CPU: yes without VNNI where the
    product is fbgemm's, whose AVX2 path (vpmaddubsw) sums pairs of 8-bit products in int16
    and saturates; not where the library's exact AVX2 product runs (`int8_avx2`). Relative
    error of a random 512 -> 2048 layer on a Zen 3 (normal inputs / rows whose scales span
    100x), fbgemm: 8-bit weights and inputs 11.1% / 10.5% (saturated), 7-bit inputs 1.9% /
    4.3%, 7-bit weights 1.2% / 2.3%.

    Args:
        flags: the CPU's feature flags; default this one's (/proc/cpuinfo).
        avx2_product: whether the library's exact AVX2 product multiplies there; default
            `int8_avx2()`, this CPU's answer, so another CPU's `flags` must come with it.
    """
    if avx2_product is None:
        if flags is not None:
            raise TypeError("int8_narrow_weights: another CPU's flags need its avx2_product")
        avx2_product = int8_avx2()
    flags = cpu_flags() if flags is None else flags
    return not _vnni(flags) and not ("avx2" in flags and avx2_product)


def relu_input_layers(model: nn.Module) -> set[str]:
    """The names of `model`'s nn.Linear layers whose inputs are ReLU's outputs, so never
    negative: each FFN's second layer (§3.3 eq. 2). `Int8Linear` gives them [0, max] in 8 bits."""
    ffns = (n for n, m in model.named_modules() if isinstance(m, PositionwiseFeedForward))
    return {f"{name}.w_2" if name else "w_2" for name in ffns}


def quantize_int8(
    model: nn.Module,
    activations: torch.dtype = torch.float32,
    moments: dict[str, torch.Tensor] | None = None,
    rounded: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> nn.Module:
    """A copy of `model` with int8 weights in every nn.Linear (attention W^Q, W^KV, W^O and the
    FFN) and in the pre-softmax projection (an int8 copy of the tied embedding, §3.4), as
    `Int8Linear`; the rest (embeddings, LayerNorm, attention's products, the cache) in
    `activations` (fp32, or bf16 where the CPU multiplies it natively). The logits are fp32.
    The weights are rounded to the nearest level, or by GPTQ: with `moments`
    (`gptq.input_moments` of `model`: one per nn.Linear and the projection), or taken
    `rounded` already (a model file's GPTQ weights for this CPU's grid, `int8_levels()`).
    """
    # The copy shares the nn.Linear weights and biases it replaces below (nothing writes them
    # through it): a deep copy of them was a second fp32 model for the moment (big: 0.7 GB).
    replaced = [t for m in model.modules() if is_linear(m) for t in (m.weight, m.bias)]
    model = copy.deepcopy(model, {id(t): t for t in replaced if t is not None})
    narrow = int8_narrow_weights()
    linears = [(n, m) for n, m in model.named_modules() if is_linear(m)]
    targets = int8_targets(model)
    for what, given in (("input moments", moments), ("rounded weights", rounded)):
        missing = [n for n in targets if n not in (given or {})]
        if given is not None and missing:
            raise ValueError(f"quantize_int8: no {what} for {', '.join(missing[:3])}")
    h, r = moments or {}, rounded or {}
    relu_inputs = relu_input_layers(model)
    for name, linear in linears:
        parent, _, attr = name.rpartition(".")
        q = Int8Linear(linear.weight, linear.bias, narrow, hessian=h.get(name), rounded=r.get(name),
                       nonnegative_inputs=name in relu_inputs)  # fmt: skip
        setattr(model.get_submodule(parent) if parent else model, attr, q)
    model.projection = Int8Linear(
        model.output_weight(), None, narrow, torch.float32, h.get(PROJECTION), r.get(PROJECTION)
    )
    return model.to(activations)


def int8_levels() -> int:
    """The int8 weights' grid on this CPU: 63 levels where the weights are narrow
    (`int8_narrow_weights`: no VNNI, fbgemm's product), else 127."""
    return 63 if int8_narrow_weights() else 127


class Translator:
    """Translate text with a loaded model.

    Args:
        loaded: a model file's contents (`rundir.resolve_model`), kept as `self.loaded`; for
            int8 with the int8 model in place of the fp32 one (whose weights are not kept)
            and no GPTQ integers beside it (`num_parameters`: the model's count).
        decode: beam size, α, max-length rule, n-best and the token budget per batch.
        device: where to run.
        dtype: torch.float32, torch.bfloat16, or "fp32" / "bf16" / "int8" / "auto"
            (`auto_dtype`; the choice is logged and kept in `dtype_name`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        decode: DecodeConfig | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ):
        self.decode = decode if decode is not None else loaded.config.decode
        self.device = torch.device(device)
        self.tokenizer = loaded.tokenizer()
        if dtype == AUTO:
            dtype, why = auto_dtype(self.device, list(loaded.int8))
            logger.info("dtype auto: %s (%s)", dtype, why)
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                choices = ", ".join(INFERENCE_DTYPES)
                raise UserError(f"dtype must be one of {choices}, got {dtype!r}")
            dtype = DTYPES[dtype]
        names = {v: k for k, v in DTYPES.items()}
        self.dtype_name = names.get(dtype, str(dtype).removeprefix("torch."))  # "fp32", ...
        self.num_parameters = loaded.model.num_parameters()  # the model's, whatever the dtype
        model = loaded.model.to(self.device).eval()
        if dtype == "int8":
            if self.device.type != "cpu" or not int8_kernels():
                engine = torch.backends.quantized.engine
                raise UserError(f"dtype int8 runs on a CPU with fbgemm's kernels (x86); this is "
                                f"{self.device.type} with quantized engine {engine!r}: use fp32 "
                                "or bf16")  # fmt: skip
            _int8_product_asked()  # a TRANSFORMER_INT8_PRODUCT nobody has: a one-line error
            # GPTQ's weights for this CPU's grid when the file has them (`transformer quantize`)
            levels = int8_levels()
            rounded = loaded.int8.get(levels)
            if rounded is None:
                logger.info("int8: weights rounded to the nearest of %d levels (`transformer "
                            "quantize` stores GPTQ's, closer to fp32)", levels)  # fmt: skip
            model = quantize_int8(model, rounded=rounded)
            # `loaded.model` is the int8 copy, and the weights it took are not kept beside it:
            # neither the fp32 ones (a base model's 0.25 GB, big's 0.86 GB, in every int8
            # process: `translate`, `serve`) nor a GPTQ file's integers (`loaded.int8`), which
            # the copy holds already.
            loaded = replace(loaded, model=model, int8={})
        elif dtype == torch.bfloat16 and self.device.type == "cpu":
            # Cast in place first, as for any dtype: the packed copy then shares the bf16
            # parameters (no fp32 copy kept beside them) and adds the packed weights.
            model = packed_bf16(model.to(dtype))
        elif dtype != torch.float32:
            model = model.to(dtype)
        elif self.device.type == "cpu":
            model = packed_projection(model)
        self.loaded, self.model, self.dtype = loaded, model, dtype
        self.max_src_len = model.cfg.max_len
        self.constrain: Constrain | None = None  # a search constraint, e.g. parse's trees
        self.tuner: ThreadTuner | None = None  # chooses the CPU threads step by step
        self.streams = 1  # batches decoded at once on CPU (`translate`), each on its threads
        self.load: OtherLoad | None = None  # other processes' CPU use, for the streams
        self.cores = 1  # the cores the streams or one search use (auto: the usable cores)
        self.spare_cpus = 0  # CPUs of `load` beyond `cores` (`crowded`)
        # The most batches decoded at once that memory holds, found on the first job of
        # streams (`_streams_that_fit`); None until then, 0 where it cannot be known.
        self.batches_at_once: int | None = None

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        decode: DecodeConfig | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        verify: bool = True,
        threads: int | str | None = None,
    ) -> Translator:
        """A Translator for a model file or a run directory (see `resolve_model`).

        threads: a CPU thread count, "auto" (tuned batch by batch to the machine's load unless
        OMP_NUM_THREADS is set, threads.py), or None (torch's setting, untouched).
        """
        # Other processes' CPU use from here (the model's loading is this process's own time,
        # not counted): the first batch of a short job asks ~0.2 s in (`OtherLoad`).
        load = OtherLoad(first_window_s=FIRST_LOAD_WINDOW_S)
        before = torch.get_num_threads()
        alone = threads != AUTO or torch.device(device).type != "cpu" or omp_threads_fixed()
        if not alone and OtherLoad.crowded_since_start():
            # Others kept the CPUs busy while this command started (its imports): the loading's
            # small ops (checks of the int8 weights, their packing) on one thread. On two, each
            # op waits at a barrier for a thread that is not running: two `translate` started
            # together on 2 cores took 2.0-3.2 s each to load the quickstart model instead of
            # 0.5 (alone 0.16 on two threads, 0.18 on one; docs/performance.md, "Round
            # forty-seven").
            torch.set_num_threads(1)
        try:
            translator = cls(resolve_model(path, device, verify), decode, device, dtype)
        finally:
            torch.set_num_threads(before)
        if torch.device(device).type == "cpu":
            # One unit per thread count in a probe: a unit is already several decoder steps
            # (search.TUNER_STEPS), and a translation job is often short. The process's first
            # unit is not timed: it builds oneDNN's kernels for its shapes and faults in the
            # cache's pages (~0.3 s on the quickstart's test set), and timed, every core looked
            # slower than one thread, a choice kept for the next 30 s: `translate` of 200-400
            # lines ran its searches ~40% slower than with --threads 2 on an idle 2-core Zen 5
            # (docs/performance.md, "Round forty-three").
            translator.tuner = resolve_threads(threads, probe_units=1, warmup_units=1)
            if translator.tuner is not None and translator.tuner.candidates[0] >= 2:
                # One stream per core and one more: the extra one runs while another holds
                # the GIL between ops, or while a busy process holds a core (`_decode_streams`).
                translator.streams = translator.tuner.candidates[0] + 1
                translator.load = load
                # CPUs of the affinity beyond the usable cores (a CPU quota): others' load
                # there leaves this process's cores free (64 CPUs, a quota of 2: crowded
                # once others keep 62.25 busy, not 0.25).
                translator.cores = translator.tuner.candidates[0]
                translator.spare_cpus = load.spare_cpus(translator.cores)
                # A search on its own (a short job, `serve`) keeps to the threads that fit
                # beside others while they crowd the cores (on 2: one), as the streams keep
                # to one CPU each.
                translator.tuner.room = translator.room
                # Others' load is read, not inferred from a fall in the rate: a decoding unit's
                # rate falls ~3x within a batch as its hypotheses lengthen and finish (a base
                # model on newstest2013: 3,137 -> 1,169 rows/s on two threads), which read as a
                # drop, and the re-probe that timed the other count first on the falling rate
                # chose one thread for the rest of the job (31.6 s against 18.8;
                # docs/performance.md, "Round forty-six"). Scheduled probes remain.
                translator.tuner.drop = 0.0
        return translator

    def crowded(self) -> bool:
        """Whether other processes keep at least CROWDED_CORES of this one's cores busy, over
        the last whole window of `load` (False where that is not known): of its CPUs, those
        beyond the `spare_cpus` it may leave to others."""
        return self.room() is not None

    def room(self) -> float | None:
        """While others crowd this process's cores (`crowded`), the cores they leave it (at
        most 0.25 fewer than its own; 0 or less: none); else None."""
        others = self.load.cores() if self.load is not None else None
        return room_left(others, self.cores, self.spare_cpus)

    def encode(self, lines: Sequence[str], first_line: int = 1) -> list[list[int]]:
        """Subword ids + EOS per line; a line longer than the model's maximum is truncated to
        it with a warning naming the line (`first_line` is the number of the first). Empty
        lines give []."""
        out = []
        for number, (line, ids) in enumerate(
            zip(lines, self.tokenizer.encode_batch(list(lines)), strict=True), start=first_line
        ):
            if not line.strip():
                out.append([])
                continue
            if len(ids) + 1 > self.max_src_len:
                logger.warning(
                    "line %d: %d subword tokens exceed the model's maximum of %d; truncated",
                    number, len(ids) + 1, self.max_src_len,
                )  # fmt: skip
                ids = ids[: self.max_src_len - 1]
            out.append([*ids, EOS_ID])
        return out

    def batches(self, sources: Sequence[list[int]]) -> Iterator[list[int]]:
        """Indices of non-empty sources in batches of at most `decode.max_tokens` padded source
        tokens, longest first (stable), so that padding and search steps are few."""
        kept = np.array([i for i, s in enumerate(sources) if s], dtype=np.int64)
        lens = np.array([len(sources[i]) for i in kept], dtype=np.int64)
        for batch in batch_by_tokens(
            lens, lens, self.decode.max_tokens, longest_first=True, oversize_alone=True
        ):
            yield kept[batch].tolist()

    def _collate(self, sources: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        S = max(len(s) for s in sources)
        src = torch.full((len(sources), S), PAD_ID, dtype=torch.long)
        for row, ids in enumerate(sources):
            src[row, : len(ids)] = torch.tensor(ids)
        src = src.to(self.device)
        return src, src != PAD_ID  # (B, S), (B, S)

    @torch.inference_mode()
    def translate(
        self,
        lines: Sequence[str],
        beam_size: int | None = None,
        length_penalty: float | None = None,
        n_best: int | None = None,
        first_line: int = 1,
    ) -> list[list[Translation]]:
        """Translate lines; returns, per line in input order, its n-best translations.

        Beam size 1 runs greedy search (score 0). An empty line gives one empty translation.
        `first_line`: the number of the first line, in warnings (`encode`).
        """
        cfg = self.options(beam_size, length_penalty, n_best)
        return self.translate_alphas(
            lines, (cfg.length_penalty,), cfg.beam_size, cfg.n_best, first_line
        )[0]

    @torch.inference_mode()
    def translate_alphas(
        self,
        lines: Sequence[str],
        alphas: Sequence[float],
        beam_size: int | None = None,
        n_best: int | None = None,
        first_line: int = 1,
    ) -> list[list[list[Translation]]]:
        """`translate` under several length penalties α in one beam search
        (`search.beam_search_alphas`): for each α in order, what `translate` with that α gives.
        Greedy search (beam size 1) has no α: every α gets its output. The same in every
        precision: a row's values never depend on the other rows of its batch (in int8 too,
        `Int8Linear` quantizes each row on its own range), so the sentences one search keeps
        for a larger α change nothing in the others'.
        """
        alphas = tuple(alphas)
        cfgs = [self.options(beam_size, alpha, n_best) for alpha in alphas]  # ConfigError
        if not cfgs:
            raise ValueError("alphas: give at least one length penalty")
        sources = self.encode(lines, first_line)
        results = [[[Translation("", [], 0.0)] for _ in lines] for _ in alphas]
        batches = list(self.batches(sources))
        streams = min(self.streams, len(batches) // MIN_BATCHES_PER_STREAM)
        if streams > 1 and self.constrain is None:
            found = self._decode_streams(batches, sources, cfgs[0], alphas, streams)
        else:
            found = (self._decode(batch, sources, cfgs[0], self.tuner, alphas) for batch in batches)
        for batch, per_alpha in zip(batches, found, strict=True):
            for out, hyps in zip(results, per_alpha, strict=True):
                for i, nbest in zip(batch, hyps, strict=True):
                    out[i] = [Translation(self.tokenizer.decode(t), t, s) for t, s in nbest]
        return results

    def _decode(
        self,
        batch: list[int],
        sources: Sequence[list[int]],
        cfg: DecodeConfig,
        tuner: ThreadTuner | None,
        alphas: tuple[float, ...],
    ) -> list[list[list[tuple[list[int], float]]]]:
        """The §6.1 search over one batch: for each α, per sentence, its n-best (tokens, score)
        (`cfg.length_penalty` is not read)."""
        src, src_mask = self._collate([sources[i] for i in batch])
        if cfg.beam_size == 1:
            outs = greedy_search(
                self.model, src, src_mask, cfg.max_len_a, cfg.max_len_b, self.constrain, tuner
            )
            return [[[(tokens, 0.0)] for tokens in outs]] * len(alphas)
        found = beam_search_alphas(
            self.model, src, src_mask, alphas, cfg.beam_size,
            cfg.max_len_a, cfg.max_len_b, cfg.n_best, self.constrain, cfg.stop, tuner,
        )  # fmt: skip
        return [[[(h.tokens, h.score) for h in nbest] for nbest in per] for per in found]

    def _decode_streams(
        self,
        batches: list[list[int]],
        sources: Sequence[list[int]],
        cfg: DecodeConfig,
        alphas: tuple[float, ...],
        streams: int,
    ) -> list[list[list[list[tuple[list[int], float]]]]]:
        """`_decode` of every batch, `streams` batches at a time, each in its own Python thread
        with an equal share of torch's threads (one each on 2 cores).

        Not in the paper. Independent searches wait for nothing from each other, where one
        search on two threads meets at a barrier in every operation: beside another busy
        process (which holds a core), those barriers wait for a thread that is not running.
        On 2 Zen 4 cores, Multi30k val (1,014 lines, int8, beam 4): two streams of one thread
        decoded 216 lines/s alone against 188 for one search on two threads, and 146 beside
        a busy process (one thread: 128; two: 53). A third stream (the default on 2 cores,
        `from_path`) fills the gaps where a stream holds the GIL between ops and takes 3 of the
        4 runnable threads' shares beside a busy process: on 2 Zen 3 cores, val x2 in fp32,
        median of 8, words/s alone 1,176 (2 streams) / 1,188 (3) / 1,152 (4), beside a busy
        process 779 / 876 / 917. docs/performance.md, "Decoding streams".
        Torch ops release the GIL, so the streams run in parallel; each holds its own batch
        (`streams` times the decoding memory of one search): where memory is short (the
        bound BATCH_BYTES_BOUND), the first batch alone first tells how many fit
        (`_streams_that_fit`; `batches_at_once`, kept for the translator's later jobs).

        Beside other busy processes (`crowded`, from `self.load`: at least CROWDED_CORES of
        this process's cores kept busy by others over the last half second, checked before each
        batch) stream k keeps to CPU k mod cores and one more stream runs. A stream that waits
        for the GIL sleeps, and with no CPU idle Linux wakes it on the CPU of the stream that
        let the GIL go (gradhelper.py found the same for its helper): the streams pile up on
        one CPU while the busy process has the other to itself. On the 2-core Zen 5, val x 2,
        int8, beside `python -c 'while True: pass'`: 3 streams as before 2,884 words/s (1.33
        cores), pinned 3 + 1 3,064 (1.48 cores), medians of 4 rounds; alone, where nothing
        changes, 4,417 / 4,372 (6 rounds). docs/performance.md, "Round ten".
        """
        results: list = [None] * len(batches)
        taken = [0]  # batches handed out so far
        before = torch.get_num_threads()
        if self.batches_at_once is None:
            cfg_m = self.model.cfg
            bound = cfg.max_tokens * cfg.beam_size * cfg_m.n_layers * cfg_m.d_model
            available = available_memory()
            if available is None or available >= 2 * streams * BATCH_BYTES_BOUND * bound:
                self.batches_at_once = 0  # plenty, or not known: no bound
        if self.batches_at_once is None or self.batches_at_once == 1:
            try:
                if self.batches_at_once is None:
                    # The job's first batch, the longest (`batches`), decoded alone first: what
                    # it takes in memory bounds the streams (`_streams_that_fit`).
                    results[0] = self._streams_that_fit(batches[0], sources, cfg, alphas)
                    taken[0] = 1
                if self.batches_at_once == 1:  # one batch at a time, as without streams
                    for i in range(taken[0], len(batches)):
                        results[i] = self._decode(batches[i], sources, cfg, self.tuner, alphas)
                    return results
            finally:
                torch.set_num_threads(before)
        streams = min(streams, self.batches_at_once or streams)
        torch.set_num_threads(max(1, before // streams))  # new threads inherit this count
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
        watch = self.load is not None and len(cpus) >= 2  # pinning needs 2 CPUs or more
        # The extra stream only where memory holds one batch more.
        watch = watch and (not self.batches_at_once or streams < self.batches_at_once)
        lock, stop = threading.Lock(), threading.Event()
        errors: list[BaseException] = []
        pinned: dict[int, int] = {}  # stream -> its thread's id, while it keeps to one CPU

        def crowded() -> bool:
            return watch and self.crowded()

        def pin(k: int, now_crowded: bool) -> None:
            """Stream k to CPU k mod cores (crowded), or to all of them again."""
            with lock:
                try:
                    os.sched_setaffinity(0, {cpus[k % len(cpus)]} if now_crowded else cpus)
                except OSError:  # a CPU taken away since (cpuset): left as it is
                    return
                if now_crowded:
                    pinned[k] = threading.get_native_id()
                else:
                    pinned.pop(k, None)

        def unpin_the_rest(k: int) -> None:
            """No batch is left for stream k: the others, still decoding their last, may use
            every CPU. Kept to one each, two `translate` jobs side by side on 2 cores (each
            crowding the other) left one CPU idle for the last 1.5 s of their 4.8 s of decoding,
            while both jobs' last batches shared the other (docs/performance.md, "Round
            forty-seven")."""
            with lock:
                for other, tid in pinned.items():
                    try:
                        if other != k:  # stream k ends here
                            os.sched_setaffinity(tid, cpus)
                    except OSError:  # ended meanwhile, or a CPU taken away
                        pass
                pinned.clear()

        def work(k: int) -> None:
            try:
                with torch.inference_mode():  # thread-local: the caller's does not reach here
                    while not stop.is_set():
                        now_crowded = crowded()
                        if k >= streams and not now_crowded:  # the extra stream: crowded only
                            if taken[0] >= len(batches):
                                return
                            stop.wait(0.05)
                            continue
                        with lock:
                            i, taken[0] = taken[0], taken[0] + 1
                        if i >= len(batches):
                            unpin_the_rest(k)
                            return
                        if now_crowded != (k in pinned):
                            pin(k, now_crowded)
                        results[i] = self._decode(batches[i], sources, cfg, None, alphas)
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                errors.append(e)
                stop.set()

        workers = [
            threading.Thread(target=work, args=(k,), name=f"decode-{k}", daemon=True)
            for k in range(streams + watch)
        ]
        try:
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
        finally:  # on an error or Ctrl-C, the batches not yet started are dropped, not run
            stop.set()
            for worker in workers:
                if worker.ident is not None:
                    worker.join()
            torch.set_num_threads(before)
        if errors:
            raise errors[0]
        return results

    def _streams_that_fit(
        self,
        batch: list[int],
        sources: Sequence[list[int]],
        cfg: DecodeConfig,
        alphas: tuple[float, ...],
    ) -> list[list[list[tuple[list[int], float]]]]:
        """`_decode` of `batch` on the tuned threads, alone, while its resident memory is read
        every RSS_EVERY_S; sets `batches_at_once` to the batches of that size the memory still
        available holds (STREAMS_MEMORY_SHARE of it, at least one), 0 (no bound) where either
        cannot be read.

        Not in the paper. Each stream holds a batch of its own: under a memory limit of 2.5 GB
        (a cgroup's, as Docker's --memory) a base-shape model's three streams over newstest2013
        were killed by the kernel after 8-10 s, with nothing written, where one search on two
        threads peaks at 1.75-1.86 GB (docs/performance.md, "Round forty-six"). On a machine of
        many cores (one stream per core and one more) the same bound keeps the streams' batches
        within its memory.
        """
        peak = _PeakRSS()
        with peak:
            found = self._decode(batch, sources, cfg, self.tuner, alphas)
        available = available_memory()
        if peak.grown is None or available is None:
            self.batches_at_once = 0  # not known: no limit
            return found
        fit = max(1, int(STREAMS_MEMORY_SHARE * available / max(peak.grown, 1)))
        self.batches_at_once = fit
        if fit < self.streams:
            logger.info(
                "%d decoding stream%s instead of %d: a batch took %.0f MiB and %.0f MiB are "
                "available", fit, "s" if fit != 1 else "", self.streams, peak.grown / 2**20,
                available / 2**20,
            )  # fmt: skip
        return found

    def options(
        self,
        beam_size: int | None = None,
        length_penalty: float | None = None,
        n_best: int | None = None,
        max_tokens: int | None = None,
        stop: str | None = None,
    ) -> DecodeConfig:
        """This translator's DecodeConfig with the given (non-None) values changed; n_best is
        capped to a smaller beam. Invalid values raise ConfigError."""
        changes = {
            "beam_size": beam_size,
            "length_penalty": length_penalty,
            "n_best": n_best,
            "max_tokens": max_tokens,
            "stop": stop,
        }
        changes = {k: v for k, v in changes.items() if v is not None}
        if "beam_size" in changes and "n_best" not in changes:
            changes["n_best"] = min(self.decode.n_best, changes["beam_size"])
        return replace(self.decode, **changes)

    def translate_lines(self, lines: Sequence[str], first_line: int = 1) -> list[str]:
        """The best translation of each line, in input order (`first_line`: see `translate`)."""
        return [nbest[0].text for nbest in self.translate(lines, first_line=first_line)]

    @torch.inference_mode()
    def attention_weights(self, src_text: str, tgt_text: str | None = None) -> SentenceAttention:
        """Attention weights of one sentence pair (Figures 3-5); decodes tgt when not given
        (with this translator's search)."""
        if tgt_text is None:
            tgt_text = self.translate_lines([src_text])[0]
        src_ids = self.encode([src_text])[0] or [EOS_ID]
        tgt_ids = self.tokenizer.encode(tgt_text)
        if len(tgt_ids) + 1 > self.model.cfg.max_len:
            raise UserError(
                f"target: {len(tgt_ids) + 1} tokens exceed the model's max_len "
                f"{self.model.cfg.max_len}"
            )
        src, src_mask = self._collate([src_ids])
        tgt = torch.tensor([[BOS_ID, *tgt_ids]], device=self.device)  # (1, T)
        weights = self.model.attention_weights(src, src_mask, tgt)
        piece = self.tokenizer.id_to_piece
        return SentenceAttention(
            source_pieces=[piece(i) for i in src_ids],
            target_pieces=[piece(i) for i in [*tgt_ids, EOS_ID]],
            target_input_pieces=[piece(i) for i in [BOS_ID, *tgt_ids]],
            translation=tgt_text,
            weights={k: [w[0].float().cpu() for w in v] for k, v in weights.items()},
        )

    def attention(self, src_text: str, tgt_text: str | None = None) -> dict:
        """`attention_weights` as plain JSON values.

        Returns:
            {"source_pieces": S pieces (ending "</s>"), "target_pieces": T output pieces
            (ending "</s>"; row i of decoder/cross is where piece i is predicted),
            "target_input_pieces": T decoder inputs ("<s>" first), "translation": tgt text,
            "encoder": N x H x S x S, "decoder": N x H x T x T, "cross": N x H x T x S},
            weights as nested lists of floats.
        """
        a = self.attention_weights(src_text, tgt_text)
        return {
            "source_pieces": a.source_pieces,
            "target_pieces": a.target_pieces,
            "target_input_pieces": a.target_input_pieces,
            "translation": a.translation,
            **{k: [w.tolist() for w in v] for k, v in a.weights.items()},
        }


class _PeakRSS:
    """The most this process's resident memory grew over a `with` block, read from
    /proc/self/statm every RSS_EVERY_S by a thread of its own (`grown`: bytes; None where
    /proc/self/statm cannot be read)."""

    def __init__(self) -> None:
        self.grown: int | None = None
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _rss(self) -> int | None:
        try:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return None

    def _watch(self, start: int) -> None:
        top = start
        while not self._stop.wait(RSS_EVERY_S):
            now = self._rss()
            top = max(top, now or 0)
        self.grown = max(top, self._rss() or 0) - start

    def __enter__(self) -> _PeakRSS:
        start = self._rss()
        self._thread = None
        if start is not None:
            self._thread = threading.Thread(target=self._watch, args=(start,), daemon=True,
                                            name="peak-rss")  # fmt: skip
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def translate_stream(
    translator: Translator,
    stream: BinaryIO,
    name: str,
    out: TextIO,
    window: int = WINDOW_LINES,
) -> int:
    """`transformer translate`: the translations of the lines of `stream` (named `name` in
    errors), one a line in input order, written to `out`; the number of lines.

    Not in the paper. The input is read a window of at most `window` lines at a time: each is
    batched longest first, translated, written and flushed before the next is read, so memory
    is one window's whatever the input's size (the whole input at once took ~2.5 KB a line:
    290,000 lines, 1.16 GB), the first lines come out before the last are read, and what a
    stopped job had finished is in `out`. A line translates the same in any window (docs/
    decoding.md, "A sentence's translation does not depend on its batch"). From a pipe or a
    terminal a window also ends where the input pauses (`data.read_windows`): typed lines are
    answered as they come.

    A stream that can seek (a file, stdin redirected from one) is read once through first:
    invalid UTF-8 anywhere is then an error before any work, and the log counts down the
    lines. Elsewhere the lines before a bad one are translated and written first.
    """
    total = None
    if stream.seekable():
        at = stream.tell()  # stdin from a file may start past its beginning
        total = sum(1 for _ in read_lines(stream, name))  # DataError: file and line
        stream.seek(at)
        logger.info("translating %d lines from %s", total, name)
    else:
        logger.info("translating lines from %s as they come, up to %d at a time", name, window)
    done, start = 0, time.perf_counter()
    logged = start
    for first, lines in read_windows(stream, name, window):
        outputs = translator.translate_lines(lines, first_line=first)
        out.write("".join(line + "\n" for line in outputs))
        out.flush()
        done += len(lines)
        now = time.perf_counter()
        if now - logged >= PROGRESS_S and done != total:  # a long job: where it is
            of = "" if total is None else f" of {total:,}"
            logger.info("translated %s%s lines (%.1f lines/s)", f"{done:,}", of,
                        done / (now - start))  # fmt: skip
            logged = now
    return done
