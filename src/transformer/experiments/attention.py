"""Figures 3-5: pictures of a model's attention weights for one sentence.

Three kinds of picture (matplotlib, the optional `plot` extra, imported lazily):
- a grid of heatmaps, one per head, for encoder self-attention, decoder self-attention or
  encoder-decoder attention of one layer;
- Figure 3 style: one source word, lines to the words it attends to, one colour per head;
- Figure 4 style: one head, lines between all words, opacity = attention weight.
The paper draws encoder self-attention in layer 5 of 6; the default here is likewise the
last-but-one layer (0-based 4 for N = 6).
"""

from __future__ import annotations

import logging
import string
from pathlib import Path

import torch

from transformer.errors import UserError

log = logging.getLogger(__name__)

KINDS = ("encoder", "decoder", "cross")


def _import_pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise UserError("attention plots need matplotlib: pip install 'transformer[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_heads(weights: torch.Tensor, q_labels, k_labels, path: Path, title: str) -> Path:
    """A grid of heatmaps, one per head. weights: (H, Tq, Tk); rows are queries."""
    plt = _import_pyplot()
    H = weights.size(0)
    cols = min(H, 4)
    rows = -(-H // cols)
    cell = min(max(0.14 * len(k_labels), 2.5), 5.0)  # inches per head
    font = 6 if len(k_labels) <= 40 else 4
    fig, axes = plt.subplots(rows, cols, figsize=(cols * cell + 1, rows * cell + 1), squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.axis("off")
            continue
        # Each head on its own scale (0 to its largest weight), so diffuse heads stay visible.
        ax.imshow(weights[h].numpy(), cmap="viridis", vmin=0.0, vmax=float(weights[h].max()))
        ax.set_title(f"head {h} (max {float(weights[h].max()):.2f})", fontsize=8)
        ax.set_xticks(range(len(k_labels)), k_labels, rotation=90, fontsize=font)
        ax.set_yticks(range(len(q_labels)), q_labels, fontsize=font)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, path, plt)


def _draw_lines(ax, labels, weights, colors, heads) -> None:
    """Two columns of labels; a line from query i (left) to key j (right), opacity = weight
    relative to the largest one drawn."""
    n = len(labels)
    for i, label in enumerate(labels):
        ax.text(0.0, n - 1 - i, label, ha="right", va="center", fontsize=7)
        ax.text(1.0, n - 1 - i, label, ha="left", va="center", fontsize=7)
    heads = list(heads)
    top = float(weights[heads].max()) or 1.0  # the strongest line is opaque
    for h in heads:
        for i in range(weights.size(1)):
            for j in range(weights.size(2)):
                w = float(weights[h, i, j]) / top
                if w > 0.05:
                    ax.plot([0.02, 0.98], [n - 1 - i, n - 1 - j], color=colors[h], alpha=w, lw=2)
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylim(-1, n)
    ax.axis("off")


def plot_word(weights: torch.Tensor, labels, word: int, path: Path, title: str) -> Path:
    """Figure 3 style: one query word, its lines to every key, one colour per head.

    Args:
        weights: (H, T, T) self-attention of one layer.
        labels: T token labels.
        word: the query position.
    """
    plt = _import_pyplot()
    H = weights.size(0)
    colors = plt.get_cmap("tab10" if H <= 10 else "tab20")(range(H))
    only = torch.zeros_like(weights)
    only[:, word] = weights[:, word]  # (H, T, T): keep the one query's row
    fig, ax = plt.subplots(figsize=(4, 0.25 * len(labels) + 1))
    _draw_lines(ax, labels, only, colors, range(H))
    from matplotlib.lines import Line2D

    handles = [Line2D([0], [0], color=colors[h], lw=2, label=f"head {h}") for h in range(H)]
    ax.legend(handles=handles, fontsize=6, ncol=min(H, 4), loc="upper center",
              bbox_to_anchor=(0.5, 0.0), frameon=False)  # fmt: skip
    ax.set_title(f"{title}\nword {labels[word]!r}, one colour per head", fontsize=8)
    return _save(fig, path, plt)


def plot_all_words(weights: torch.Tensor, labels, heads, path: Path, title: str) -> Path:
    """Figure 4 style: for each given head, lines between all words, opacity = weight."""
    plt = _import_pyplot()
    heads = list(heads)
    fig, axes = plt.subplots(1, len(heads), figsize=(3 * len(heads), 0.25 * len(labels) + 1))
    for ax, h in zip(axes if len(heads) > 1 else [axes], heads, strict=True):
        colors = {h: "tab:blue"}
        _draw_lines(ax, labels, weights, colors, [h])
        ax.set_title(f"head {h}", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, path, plt)


def _save(fig, path: Path, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _pick_word(labels: list[str], word: str | None) -> int:
    """The position of `word`: a 0-based index, a subword label, or a whole word (its first
    subword). Default: the first piece of the longest word."""
    starts = [i for i, label in enumerate(labels) if i == 0 or label.startswith("▁")]
    words = {}
    for i, j in zip(starts, starts[1:] + [len(labels)], strict=True):
        text = "".join(labels[i:j]).lstrip("▁").removesuffix("</s>")
        words.setdefault(text, i)
        words.setdefault(text.strip(string.punctuation), i)  # "perfect," -> "perfect"
    if word is None:
        return words[max(words, key=len)]
    if word.isdigit() and int(word) < len(labels):
        return int(word)
    for i, label in enumerate(labels):
        if label.lstrip("▁") == word.lstrip("▁"):
            return i
    if word in words:
        return words[word]
    raise UserError(f"--word {word!r}: not a token of the sentence {labels}")


def plot_attention(
    model_path: Path,
    text: str,
    out_dir: Path,
    layer: int | None = None,
    head: int | None = None,
    kinds: tuple[str, ...] = KINDS,
    word: str | None = None,
    target: str | None = None,
) -> list[Path]:
    """`transformer attention`: write PNGs of one sentence's attention weights.

    Args:
        model_path: a model file (`modelfile.save_model`).
        text: the source sentence.
        out_dir: where the PNGs go.
        layer: 0-based layer; None = the last but one (Figures 3-5: layer 5 of 6, i.e. 4).
        head: one head for the Figure 4 picture; None draws every head.
        kinds: any of "encoder", "decoder", "cross" (heatmaps); encoder adds Figures 3 and 4.
        word: the Figure 3 query word (a subword or a 0-based position); None picks the longest.
        target: the target sentence; None uses the model's greedy translation.

    Returns:
        The paths written.
    """
    from transformer.translate import Translator

    translator = Translator.from_path(model_path)
    translator.decode = translator.options(beam_size=1)  # the greedy translation as the target
    cfg = translator.model.cfg
    n = cfg.n_layers
    if layer is None:
        layer = max(0, n - 2)
    if not -n <= layer < n:
        raise UserError(f"--layer {layer}: the model has {n} layers (0..{n - 1})")
    layer = layer % n
    if head is not None and not 0 <= head < cfg.n_heads:
        raise UserError(f"--head {head}: the model has {cfg.n_heads} heads")
    att = translator.attention_weights(text, target)
    if target is None:
        log.info("greedy translation: %s", att.translation)
    src, tgt = att.source_pieces, att.target_input_pieces
    labels = {"encoder": (src, src), "decoder": (tgt, tgt), "cross": (tgt, src)}
    out_dir = Path(out_dir)
    written = []
    for kind in kinds:
        w = att.weights[kind][layer]  # (H, Tq, Tk)
        q_labels, k_labels = labels[kind]
        title = f"{kind} attention, layer {layer + 1} of {n}"
        written.append(plot_heads(w, q_labels, k_labels, out_dir / f"{kind}_l{layer}.png", title))
    if "encoder" in kinds:
        w = att.weights["encoder"][layer]
        i = _pick_word(src, word)
        title = f"encoder self-attention, layer {layer + 1} of {n}"
        path = out_dir / f"encoder_l{layer}_word{i}.png"
        written.append(plot_word(w, src, i, path, title))
        heads = range(w.size(0)) if head is None else [head]
        path = out_dir / f"encoder_l{layer}_head{'all' if head is None else head}.png"
        written.append(plot_all_words(w, src, heads, path, title))
    return written
