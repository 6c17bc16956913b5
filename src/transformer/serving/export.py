"""Export a model file to CTranslate2, a fast C++ inference engine (optional extra `export`).

The model is written through CTranslate2's Python spec API (`TransformerSpec`), weight by weight,
so nothing depends on another toolkit's checkpoint format. Three details must match exactly:

- positions: §3.5 interleaves sin and cos (even dims sin, odd dims cos), whereas CTranslate2 (like
  fairseq) generates [sin | cos] halves; the spec therefore gets our own table explicitly;
- LayerNorm epsilon: ours is PyTorch's 1e-5, CTranslate2's default is 1e-6; it is set in the config;
- §3.4 embedding scale sqrt(d_model): CTranslate2's `scale_embeddings` does the same.

See docs/serving.md for usage and the equality test.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import torch

from transformer.errors import UserError
from transformer.modelfile import load_model
from transformer.tokenizer import BOS_ID, EOS_ID, UNK_ID

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16", "float32")
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, used by every norm in model.py


class ExportError(UserError):
    """The model cannot be expressed in the target format; the message says why."""


def _check_exportable(cfg, path: Path) -> None:
    """Raise ExportError for architectures CTranslate2's TransformerSpec cannot express."""
    problems = []
    if cfg.d_k != cfg.d_v:
        problems.append(f"d_k={cfg.d_k} != d_v={cfg.d_v} (CTranslate2 has one head size)")
    if cfg.attn_window is not None:
        problems.append(f"attn_window={cfg.attn_window} (restricted self-attention, §4)")
    if not cfg.share_embeddings or cfg.tgt_vocab_size not in (None, cfg.vocab_size):
        problems.append("separate source and target vocabularies (the file has one spm model)")
    if problems:
        raise ExportError(f"{path}: cannot export to CTranslate2: {'; '.join(problems)}")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().contiguous().numpy()


def _set_linear(spec, linear: torch.nn.Linear) -> None:
    spec.weight = _np(linear.weight)
    if linear.bias is not None:
        spec.bias = _np(linear.bias)


def _set_norm(spec, norm: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _np(norm.weight), _np(norm.bias)


def _set_attention(spec, attn, self_attention: bool) -> None:
    """Our W^Q and fused W^{K,V} -> CT2's fused QKV (self) or Q + fused KV (cross)."""
    if self_attention:
        # CT2 expects one (3*H*K, D) matrix [Q; K; V]; ours already stores [K; V] fused.
        spec.linear[0].weight = np.concatenate([_np(attn.w_q.weight), _np(attn.w_kv.weight)])
        spec.linear[0].bias = np.concatenate([_np(attn.w_q.bias), _np(attn.w_kv.bias)])
    else:
        _set_linear(spec.linear[0], attn.w_q)
        _set_linear(spec.linear[1], attn.w_kv)
    _set_linear(spec.linear[-1], attn.w_o)


def _set_ffn(spec, ffn, norm: torch.nn.LayerNorm) -> None:
    _set_linear(spec.linear_0, ffn.w_1)
    _set_linear(spec.linear_1, ffn.w_2)
    _set_norm(spec.layer_norm, norm)


def _set_positions(stack_spec, pos_module) -> None:
    """§3.5 sinusoids (interleaved) or Table 3 row (E) learned positions, as an explicit table."""
    table = pos_module.learned.weight if pos_module.learned is not None else pos_module.table
    stack_spec.position_encodings.encodings = _np(table)  # (max_len, D)


def build_spec(model, pieces: list[str]):
    """A `ctranslate2.specs.TransformerSpec` holding `model`'s weights.

    Args:
        model: a `Transformer` (eval mode); its config must pass `_check_exportable`.
        pieces: the subword vocabulary, piece i for id i (V entries).

    Returns:
        The spec, not yet validated or saved.
    """
    from ctranslate2.specs import transformer_spec

    cfg = model.cfg
    head_dim = None if cfg.d_k * cfg.n_heads == cfg.d_model else cfg.d_k
    pre_norm = cfg.norm_first  # post-norm (§3.1) is pre_norm=False in CT2
    encoder = transformer_spec.TransformerEncoderSpec(
        cfg.n_layers, cfg.n_heads, pre_norm=pre_norm, head_dim=head_dim
    )
    decoder = transformer_spec.TransformerDecoderSpec(
        cfg.n_layers, cfg.n_heads, pre_norm=pre_norm, head_dim=head_dim
    )
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    spec.config.decoder_start_token = pieces[BOS_ID]

    encoder.embeddings[0].weight = _np(model.src_embed.weight)
    decoder.embeddings.weight = _np(model.tgt_embed.weight)
    decoder.projection.weight = _np(model.output_weight())  # §3.4: tied to the embedding
    _set_positions(encoder, model.src_pos)
    _set_positions(decoder, model.tgt_pos)
    if pre_norm:
        _set_norm(encoder.layer_norm, model.encoder_norm)
        _set_norm(decoder.layer_norm, model.decoder_norm)
    for layer_spec, layer in zip(encoder.layer, model.encoder_layers, strict=True):
        _set_attention(layer_spec.self_attention, layer.self_attn, self_attention=True)
        _set_norm(layer_spec.self_attention.layer_norm, layer.res_attn.norm)
        _set_ffn(layer_spec.ffn, layer.ffn, layer.res_ffn.norm)
    for layer_spec, layer in zip(decoder.layer, model.decoder_layers, strict=True):
        _set_attention(layer_spec.self_attention, layer.self_attn, self_attention=True)
        _set_norm(layer_spec.self_attention.layer_norm, layer.res_self.norm)
        _set_attention(layer_spec.attention, layer.cross_attn, self_attention=False)
        _set_norm(layer_spec.attention.layer_norm, layer.res_cross.norm)
        _set_ffn(layer_spec.ffn, layer.ffn, layer.res_ffn.norm)
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    return spec


def spm_pieces(spm_proto: bytes) -> list[str]:
    """Piece i of a sentencepiece model for every id i; checks the special ids' pieces."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=spm_proto)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    specials = {UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
    for i, piece in specials.items():
        if pieces[i] != piece:
            raise ExportError(f"sentencepiece id {i} is {pieces[i]!r}, CTranslate2 needs {piece!r}")
    return pieces


def export_ctranslate2(
    model_path: Path,
    out_dir: Path,
    quantization: str | None = None,
    force: bool = False,
    verify: bool = True,
) -> Path:
    """Write a CTranslate2 model directory (model.bin, config.json, shared_vocabulary.json).

    Args:
        model_path: a model file written by `modelfile.save_model`.
        out_dir: the directory to create.
        quantization: weight type stored on disk (`QUANTIZATIONS`), None = float32. CTranslate2
            can also quantize at load time (`compute_type`).
        force: replace `out_dir` if it exists.
        verify: check the model file's checksum (`modelfile.load_model`).

    Returns:
        out_dir.

    Raises:
        ExportError: the architecture has no CTranslate2 equivalent, or out_dir exists.
    """
    try:
        import ctranslate2  # noqa: F401
    except ImportError as e:
        raise UserError("export needs ctranslate2: pip install 'transformer[export]'") from e
    out_dir = Path(out_dir)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ExportError(f"quantization {quantization!r}: choose one of {QUANTIZATIONS}")
    loaded = load_model(Path(model_path), verify=verify)
    _check_exportable(loaded.model.cfg, loaded.path)
    if out_dir.exists() and not force:
        raise ExportError(f"{out_dir}: already exists (pass force=True / --force to replace)")
    spec = build_spec(loaded.model, spm_pieces(loaded.spm_proto))
    spec.validate()
    spec.optimize(quantization=quantization)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    spec.save(str(out_dir))
    (out_dir / "spm.model").write_bytes(loaded.spm_proto)  # to tokenize inputs for CT2
    logger.info("exported %s to CTranslate2 model %s (%s)", model_path, out_dir, quantization)
    if loaded.config.model.lowercase:  # our tokenizer lowercases; CTranslate2 + spm.model do not
        logger.warning(
            "%s was trained on lowercased text (prepare --lowercase): lowercase the inputs "
            "before tokenizing them with %s for CTranslate2",
            model_path, out_dir / "spm.model",
        )  # fmt: skip
    return out_dir
