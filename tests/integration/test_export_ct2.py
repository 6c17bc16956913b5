"""`transformer export MODEL --to ctranslate2 OUT` on a briefly trained model: CTranslate2's
greedy translations of real Multi30k test sentences equal ours token for token.

A random model repeats one token; 120 Adam steps on 300 Multi30k pairs make the outputs
varied (the test checks that), so equality exercises every position, layer and the vocabulary.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fixtures import make_model_file, multi30k_lines, run_cli
from transformer.modelfile import load_model, save_model
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.translate import Translator

ctranslate2 = pytest.importorskip("ctranslate2")
spm = pytest.importorskip("sentencepiece")

pytestmark = pytest.mark.integration


def _pad(seqs: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(seqs), max(map(len, seqs))), PAD_ID)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = torch.tensor(seq)
    return out


def _train_briefly(path, steps: int = 120) -> None:
    """A few Adam steps on 300 Multi30k en-de pairs, in place."""
    loaded = load_model(path)
    model, sp = loaded.model.train(), spm.SentencePieceProcessor(model_proto=loaded.spm_proto)
    src = [sp.encode(x) + [EOS_ID] for x in multi30k_lines("train", "en", 300)]
    tgt = [sp.encode(x) for x in multi30k_lines("train", "de", 300)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(src), (24,), generator=gen).tolist()
        s = _pad([src[i] for i in idx])
        tin, tout = _pad([[BOS_ID, *tgt[i]] for i in idx]), _pad([[*tgt[i], EOS_ID] for i in idx])
        logits = model.project(model(s, s != PAD_ID, tin))
        loss = F.cross_entropy(logits.flatten(0, 1), tout.flatten(), ignore_index=PAD_ID)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    save_model(path, model, loaded.config, loaded.spm_proto, loaded.src_lang, loaded.tgt_lang)


def test_cli_export_greedy_equals_ours_on_multi30k(tmp_path, shared_data):  # noqa: ARG001
    torch.set_num_threads(1)
    path = make_model_file(tmp_path / "model")
    _train_briefly(path)
    out = tmp_path / "ct2"
    done = run_cli("export", str(path), "--to", "ctranslate2", str(out))
    assert done.returncode == 0, done.stderr.decode()[-2000:]

    lines = multi30k_lines("test_2016_flickr", "en", 40)
    ours = [n[0].tokens for n in Translator.from_path(path).translate(lines, beam_size=1)]
    sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    cfg = load_model(path).config.decode
    theirs = []
    for line in lines:  # our maximum length is per sentence: a * (|x| + EOS) + b, EOS included
        pieces = sp.encode(line, out_type=str)
        max_len = int(cfg.max_len_a * (len(pieces) + 1)) + cfg.max_len_b - 1
        (result,) = translator.translate_batch(
            [pieces + ["</s>"]],
            beam_size=1,
            max_decoding_length=max_len,
            suppress_sequences=[["<pad>"], ["<s>"]],
        )
        theirs.append([sp.piece_to_id(p) for p in result.hypotheses[0]])
    assert len({t for seq in ours for t in seq}) > 10  # varied outputs, not one repeated token
    assert theirs == ours
