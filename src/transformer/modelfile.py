"""A trained model as one self-contained file: safetensors weights plus, in its metadata, the
resolved config, the sentencepiece model and the language pair.

Loading never runs code from the file: safetensors holds only tensors and strings.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer.config import RunConfig, from_dict, to_dict
from transformer.errors import UserError
from transformer.model import Transformer

FORMAT = "transformer-model/1"


@dataclass
class LoadedModel:
    """What a model file holds: the model (eval mode), its config, the tokenizer's model bytes."""

    model: Transformer
    config: RunConfig
    spm_proto: bytes
    src_lang: str
    tgt_lang: str
    path: Path

    def tokenizer(self):
        """The sentencepiece tokenizer stored in the file."""
        from transformer.tokenizer import Tokenizer

        return Tokenizer.from_proto(self.spm_proto)


def _unique_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor stored once (safetensors refuses aliases)."""
    seen: dict[int, str] = {}
    out = {}
    for name, t in model.state_dict().items():
        key = t.data_ptr()
        if key in seen:
            continue
        seen[key] = name
        out[name] = t.detach().contiguous().cpu()
    return out


def save_model(
    path: Path,
    model: Transformer,
    config: RunConfig,
    spm_proto: bytes,
    src_lang: str,
    tgt_lang: str,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write `path` atomically (temporary file, then rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.to(dtype) if v.is_floating_point() else v for k, v in _unique_state(model).items()
    }
    metadata = {
        "format": FORMAT,
        "config": json.dumps(to_dict(config)),
        "spm_model": base64.b64encode(spm_proto).decode("ascii"),
        "src_lang": src_lang,
        "tgt_lang": tgt_lang,
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


def load_model(path: Path, device: str | torch.device = "cpu") -> LoadedModel:
    """Read a model file written by `save_model`; errors name the file and the problem."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such model file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable safetensors model file: {e}") from e
    if meta.get("format") != FORMAT:
        raise UserError(f"{path}: not a transformer model file (format {meta.get('format')!r})")
    config = from_dict(json.loads(meta["config"]), source=str(path))
    model = Transformer(config.model)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # Tied weights are stored once; every missing key must be an alias of a stored tensor.
    stored = set(tensors)
    aliases = {n for n in missing if _alias_of(model, n) & stored}
    if set(missing) - aliases or unexpected:
        raise UserError(
            f"{path}: weights do not match the config (missing {sorted(set(missing) - aliases)}, "
            f"unexpected {sorted(unexpected)})"
        )
    model.to(device).eval()
    spm = base64.b64decode(meta["spm_model"])
    return LoadedModel(model, config, spm, meta["src_lang"], meta["tgt_lang"], path)


def _alias_of(model: Transformer, name: str) -> set[str]:
    """Names of the state-dict entries that share storage with `name`."""
    state = model.state_dict()
    ptr = state[name].data_ptr()
    return {k for k, v in state.items() if v.data_ptr() == ptr and k != name}
