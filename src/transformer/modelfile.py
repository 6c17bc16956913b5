"""A trained model as one self-contained file: safetensors weights plus, in its metadata, the
resolved config, the sentencepiece model and the language pair.

Optionally, int8 weights rounded by GPTQ for `translate --dtype int8` (`transformer quantize`,
gptq.py): for each grid (63 levels, for CPUs without VNNI, and 127), every nn.Linear's and the
projection's integers `int8.<levels>.<name>` (int8, the weight's shape) and row scales
`int8.<levels>.<name>.scale` (fp32), and the metadata `int8` (JSON: how they were calibrated).

Loading never runs code from the file: safetensors holds only tensors and strings.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from transformer.checkpoint import replace_atomic
from transformer.config import ModelConfig, RunConfig, from_dict, to_dict
from transformer.errors import UserError
from transformer.gradhelper import is_linear
from transformer.model import Transformer

PROJECTION = "projection"  # the tied pre-softmax projection's name among the int8 weights

logger = logging.getLogger(__name__)

FORMAT = "transformer-model/1"
CHECKSUM = "tensors_sha256"  # hex sha256 of the tensors (`tensors_sha256`); absent in old files
METADATA_KEYS = ("format", "config", "spm_model", "src_lang", "tgt_lang")
INT8_PREFIX = "int8."  # int8.<levels>.<module name or "projection">[.scale]
INT8_LEVELS = (63, 127)
INT8_META = "int8"
_MIN_COMPUTED_LIMIT = 1 << 28  # bytes of load-time buffers always allowed (256 MiB)


@dataclass
class LoadedModel:
    """What a model file holds: the model (eval mode), its config, the tokenizer's model bytes."""

    model: Transformer
    config: RunConfig
    spm_proto: bytes
    src_lang: str
    tgt_lang: str
    path: Path
    # GPTQ's int8 weights by grid (63 / 127 levels): {name: (integers, row scales)}; {} if none
    int8: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    int8_info: dict = field(default_factory=dict)  # how they were calibrated (the metadata)

    def tokenizer(self):
        """The sentencepiece tokenizer stored in the file (lowercasing its input when the model
        was trained on lowercased text)."""
        from transformer.tokenizer import Tokenizer

        return Tokenizer.from_proto(self.spm_proto, lowercase=self.config.model.lowercase)


def _unique_state(model: Transformer, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor stored once (safetensors refuses aliases).
    With keep_vars, aliases are found by identity (meta tensors have no storage to compare)."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=keep_vars).items():
        key = id(t) if keep_vars else t.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        out[name] = t if keep_vars else t.detach().contiguous().cpu()
    return out


def save_model(
    path: Path,
    model: Transformer,
    config: RunConfig,
    spm_proto: bytes,
    src_lang: str,
    tgt_lang: str,
    dtype: torch.dtype = torch.float32,
    int8: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None,
    int8_info: dict | None = None,
) -> Path:
    """Write `path` atomically (temporary file, then rename), with a checksum of the tensors.
    `int8` (`LoadedModel.int8`'s form) and `int8_info` add GPTQ's int8 weights."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from transformer.tokenizer import strip_build_paths

    path = Path(path)
    tensors = {
        k: v.to(dtype) if v.is_floating_point() else v for k, v in _unique_state(model).items()
    }
    for levels, weights in (int8 or {}).items():
        for name, (ints, scales) in weights.items():
            key = f"{INT8_PREFIX}{levels}.{name}"
            tensors[key] = ints.to(torch.int8).contiguous().cpu()
            tensors[f"{key}.scale"] = scales.float().contiguous().cpu()
    metadata = {
        "format": FORMAT,
        "config": json.dumps(to_dict(config)),
        "spm_model": base64.b64encode(strip_build_paths(spm_proto)).decode("ascii"),
        "src_lang": src_lang,
        "tgt_lang": tgt_lang,
        CHECKSUM: tensors_sha256(tensors),
    }
    if int8:
        metadata[INT8_META] = json.dumps(int8_info or {})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    except OSError as e:  # disk full, permission denied
        raise UserError(f"{path}: cannot write the model file: {e.strerror or e}") from e
    except SafetensorError as e:  # safetensors reports its own I/O errors (disk full, no dir)
        raise UserError(f"{path}: cannot write the model file: {e}") from e
    return path


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors in name order: each name, dtype, shape and raw bytes."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def load_model(path: Path, device: str | torch.device = "cpu", verify: bool = True) -> LoadedModel:
    """Read a model file written by `save_model`; errors name the file and the problem.

    The header (metadata and tensor shapes) is checked against the config before any tensor or
    model is allocated, so a forged header cannot ask for a huge allocation.

    Args:
        path: the model file.
        device: where to put the model.
        verify: check the tensors against the checksum stored at save (`--no-verify` skips it);
            a file written before checksums existed loads with a warning.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a model file")
    if not path.is_file():
        raise UserError(f"{path}: no such model file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable safetensors model file: {e}") from e
    config, spm = _check_header(path, meta, shapes, dtypes)
    try:
        # Read into memory of their own (pread), not views of a mapping of the file: the model
        # outlives the load, and a mapped file rewritten in place (`cp` over it) would change
        # its weights under it, or end the process (SIGBUS) where the file was cut short.
        tensors = load_file(str(path), device="cpu", backend="pread")
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable safetensors model file: {e}") from e
    if CHECKSUM not in meta:
        logger.warning("%s: no checksum (an older model file); its tensors are not verified", path)
    elif verify and tensors_sha256(tensors) != meta[CHECKSUM]:
        raise UserError(
            f"{path}: the tensor data does not match the file's checksum (the file is damaged); "
            "--no-verify loads it anyway"
        )
    int8, int8_info = _int8_weights(path, tensors, meta)
    model = model_of_tensors(path, config.model, tensors)
    model.to(device).eval()
    return LoadedModel(
        model, config, spm, meta["src_lang"], meta["tgt_lang"], path, int8, int8_info
    )


def model_of_tensors(path: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> Transformer:
    """`Transformer.from_tensors` (a model file's or a checkpoint's weights, no initial values
    drawn), where a weight missing or not the config's is an error naming `path`. Tied weights
    are stored once and fill every name they go by."""
    model, missing, unexpected = Transformer.from_tensors(cfg, tensors)
    if missing or unexpected:
        raise UserError(
            f"{path}: weights do not match the config (missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)})"
        )
    return model


def _int8_weights(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]):
    """Take the int8 tensors out of `tensors` (their names and shapes were checked with the
    header): ({levels: {name: (integers, scales)}}, the calibration's metadata); their values
    checked: integers within the grid, scales positive and finite."""
    int8: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for key in [k for k in tensors if k.startswith(INT8_PREFIX) and not k.endswith(".scale")]:
        levels, name = _int8_key(key)
        ints, scales = tensors.pop(key), tensors.pop(f"{key}.scale")
        outside = ints.to(torch.int16).abs().max() > levels  # int8's abs(-128) is -128
        if outside or not (torch.isfinite(scales).all() and (scales > 0).all()):
            raise UserError(f"{path}: int8 weights {key} are outside their {levels}-level grid")
        int8.setdefault(levels, {})[name] = (ints, scales)
    try:
        info = json.loads(meta.get(INT8_META, "{}"))
    except ValueError as e:
        raise UserError(f"{path}: the header's int8 metadata is not valid JSON: {e}") from e
    return int8, info if isinstance(info, dict) else {}


def _int8_key(key: str) -> tuple[int, str]:
    """int8.<levels>.<name>[.scale] -> (levels, name); ValueError if malformed."""
    levels, _, name = key.removeprefix(INT8_PREFIX).partition(".")
    name = name.removesuffix(".scale")
    if not levels.isdigit() or int(levels) not in INT8_LEVELS or not name:
        raise ValueError(key)
    return int(levels), name


def int8_targets(model: Transformer) -> dict[str, torch.Tensor]:
    """The weights that int8 decoding quantizes, by the names the int8 weights carry: every
    nn.Linear's (by module name) and the tied pre-softmax projection's (`PROJECTION`)."""
    weights = {n: m.weight for n, m in model.named_modules() if is_linear(m)}
    weights[PROJECTION] = model.output_weight()
    return weights


def _check_int8_header(path: Path, skeleton: Transformer, shapes, dtypes) -> None:
    """The int8 tensors' names, shapes and dtypes against the model: for each grid present,
    integers (int8, the weight's shape) and scales (fp32, one per row) for every nn.Linear
    and the projection, and nothing else."""
    weights = {n: tuple(w.shape) for n, w in int8_targets(skeleton).items()}
    found: dict[int, set[str]] = {}
    for key in [k for k in shapes if k.startswith(INT8_PREFIX)]:
        try:
            levels, name = _int8_key(key)
        except ValueError:
            raise UserError(f"{path}: {key} is not an int8 weight name") from None
        if name not in weights:
            raise UserError(f"{path}: int8 weights {key} for a layer the config does not have")
        scale = key.endswith(".scale")
        want = (weights[name][0],) if scale else weights[name]
        dtype = "F32" if scale else "I8"
        if shapes[key] != want or dtypes[key] != dtype:
            raise UserError(
                f"{path}: {key} is {dtypes[key]} {list(shapes[key])}, the config needs "
                f"{dtype} {list(want)}"
            )
        found.setdefault(levels, set()).add(key)
    for levels, keys in found.items():
        need = {f"{INT8_PREFIX}{levels}.{n}{s}" for n in weights for s in ("", ".scale")}
        if keys != need:
            raise UserError(
                f"{path}: the {levels}-level int8 weights are incomplete (missing "
                f"{', '.join(sorted(need - keys)[:3])})"
            )


def _check_header(
    path: Path,
    meta: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, str],
) -> tuple[RunConfig, bytes]:
    """The config and tokenizer of a model file's header, checked against its tensor shapes
    without allocating anything: the model is built on the meta device."""
    if meta.get("format") != FORMAT:
        raise UserError(f"{path}: not a transformer model file (format {meta.get('format')!r})")
    missing = [k for k in METADATA_KEYS if k not in meta]
    if missing:
        raise UserError(f"{path}: the header lacks metadata {', '.join(missing)}")
    try:
        raw = json.loads(meta["config"])
    except ValueError as e:
        raise UserError(f"{path}: the header's config is not valid JSON: {e}") from e
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise UserError(f"{path}: the header's config is not a mapping of sections")
    config = from_dict(raw, source=f"{path} (header config)")
    try:
        spm = base64.b64decode(meta["spm_model"], validate=True)
    except (binascii.Error, ValueError) as e:
        raise UserError(f"{path}: the header's spm_model is not valid base64: {e}") from e
    # The layer count is checked first: it is the one number that makes the skeleton itself
    # large (a forged n_layers of 10^9 would build 10^9 modules, even on the meta device).
    for stack in ("encoder_layers", "decoder_layers"):
        found = {int(m.group(1)) for k in shapes if (m := re.match(rf"{stack}\.(\d+)\.", k))}
        if len(found) != config.model.n_layers or found != set(range(len(found))):
            raise UserError(
                f"{path}: the header's config has model.n_layers={config.model.n_layers}, the "
                f"tensors hold {len(found)} {stack}"
            )
    with torch.device("meta"):
        skeleton = Transformer(config.model)
    expected = {name: tuple(t.shape) for name, t in _unique_state(skeleton, keep_vars=True).items()}
    _check_int8_header(path, skeleton, shapes, dtypes)
    shapes = {k: v for k, v in shapes.items() if not k.startswith(INT8_PREFIX)}
    unexpected = sorted(set(shapes) - set(skeleton.state_dict(keep_vars=True)))
    if unexpected:
        raise UserError(f"{path}: tensors the config does not have: {', '.join(unexpected[:5])}")
    for name in sorted(set(expected) & set(shapes)):
        if expected[name] != shapes[name]:
            raise UserError(
                f"{path}: tensor {name} has shape {list(shapes[name])}, the header's config "
                f"(d_model={config.model.d_model}, vocab_size={config.model.vocab_size}, "
                f"max_len={config.model.max_len}, ...) needs {list(expected[name])}"
            )
    # Buffers computed at load (the §3.5 sinusoid table) are not in the file: bound them by
    # the size of what is, so a forged max_len cannot ask for terabytes.
    state = skeleton.state_dict(keep_vars=True)
    stored_bytes = sum(
        t.numel() * t.element_size() for t in _unique_state(skeleton, keep_vars=True).values()
    )
    computed = sum(
        b.numel() * b.element_size() for n, b in skeleton.named_buffers() if n not in state
    )
    if computed > max(stored_bytes, _MIN_COMPUTED_LIMIT):
        raise UserError(
            f"{path}: model.max_len={config.model.max_len} needs {computed / 2**30:.1f} GiB of "
            "positional encodings, more than the whole model; refusing the header"
        )
    return config, spm
