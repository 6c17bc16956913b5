"""The paper's metric in Python (`bleu.paper_bleu`: sacremoses + `multi_bleu`) equals the original
Moses perl pipeline (tokenizer.perl, the ##AT## split of get_ende_bleu.sh, multi-bleu.perl) on
real hypothesis files. The perl scripts live in ../shared/reference/moses, never in the package.
"""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from transformer.bleu import (
    moses_tokenize,
    paper_bleu,
    score_files,
    split_compounds,
    tokenized_bleu_lc,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def moses(shared_data: Path) -> Path:
    scripts = shared_data.parent / "reference" / "moses" / "scripts"
    if not scripts.is_dir() or shutil.which("perl") is None:
        pytest.skip("the Moses perl scripts (../shared/reference/moses) or perl are missing")
    return scripts


def _perturb(lines: list[str]) -> list[str]:
    """A deterministic stand-in for a system's output: line i loses its word i mod n and, every
    third line, swaps two words, so BLEU lands well between 0 and 100 on real text."""
    out = []
    for i, line in enumerate(lines):
        words = line.split()
        if len(words) > 3:
            del words[i % len(words)]
            if i % 3 == 0:
                j = (i // 3) % (len(words) - 1)
                words[j], words[j + 1] = words[j + 1], words[j]
        out.append(" ".join(words))
    return out


def _perl(moses: Path, args: list[str], stdin: str) -> str:
    done = subprocess.run(
        ["perl", *args], input=stdin.encode(), capture_output=True, check=True, cwd=moses
    )
    return done.stdout.decode()


def _perl_paper_bleu(moses: Path, hyp: Path, ref: Path, lang: str, tmp: Path) -> tuple[str, ...]:
    """get_ende_bleu.sh with the original scripts: returns (hyp.tok, ref.tok, multi-bleu line)."""
    tokenizer = str(moses / "tokenizer" / "tokenizer.perl")
    toks = []
    for path in (hyp, ref):
        tok = _perl(moses, [tokenizer, "-l", lang, "-q"], path.read_text(encoding="utf-8"))
        if lang == "de":
            tok = _perl(moses, ["-ple", r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"], tok)
        toks.append(tok)
    (tmp / "ref.tok").write_text(toks[1], encoding="utf-8")
    bleu = _perl(moses, [str(moses / "generic" / "multi-bleu.perl"), str(tmp / "ref.tok")], toks[0])
    return toks[0], toks[1], bleu.strip()


def _real_files(shared_data: Path) -> dict[str, tuple[list[str], str]]:
    def read(path: Path) -> list[str]:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            return f.read().splitlines()

    return {
        # newstest2014 German (raw, full 3,003 lines): hyphenated compounds and „…“ / "…" quotes
        "newstest2014.de": (read(shared_data / "wmt14_en_de" / "newstest2014.de"), "de"),
        "multi30k.val.fr": (read(shared_data / "multi30k" / "val.fr"), "fr"),
        # Tatoeba French: elisions (l'homme, qu'il) that tokenizer.perl -l fr treats specially
        "tatoeba.valid.fr": (read(shared_data / "tatoeba_fra_eng" / "valid.fr.gz")[:2000], "fr"),
    }


@pytest.mark.parametrize("name", ["newstest2014.de", "multi30k.val.fr", "tatoeba.valid.fr"])
def test_paper_bleu_equals_the_moses_perl_scripts(shared_data, moses, tmp_path, name):
    refs, lang = _real_files(shared_data)[name]
    hyps = _perturb(refs)
    hyp_path, ref_path = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp_path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    ref_path.write_text("".join(r + "\n" for r in refs), encoding="utf-8")
    perl_hyp, perl_ref, perl_bleu = _perl_paper_bleu(moses, hyp_path, ref_path, lang, tmp_path)

    # The tokenized text is the same, line for line, as tokenizer.perl's (+ the ##AT## split).
    ours_hyp = moses_tokenize(hyps, lang)
    ours_ref = moses_tokenize(refs, lang)
    if lang == "de":
        ours_hyp = [split_compounds(x) for x in ours_hyp]
        ours_ref = [split_compounds(x) for x in ours_ref]
    assert ours_hyp == perl_hyp.splitlines()
    assert ours_ref == perl_ref.splitlines()

    # multi-bleu.perl: "BLEU = 41.53, 74.1/50.2/35.1/24.9 (BP=1.000, ratio=1.000, hyp_len=..."
    m = re.match(
        r"BLEU = ([\d.]+), ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) \(BP=([\d.]+), ratio=[\d.]+, "
        r"hyp_len=(\d+), ref_len=(\d+)\)",
        perl_bleu,
    )
    assert m is not None, perl_bleu
    ours = paper_bleu(hyps, refs, lang)
    assert f"{ours.score:.2f}" == m.group(1)
    assert [f"{p:.1f}" for p in ours.precisions] == list(m.group(2, 3, 4, 5))
    assert f"{ours.brevity_penalty:.3f}" == m.group(6)
    assert (ours.hyp_len, ours.ref_len) == (int(m.group(7)), int(m.group(8)))
    assert 10.0 < ours.score < 90.0  # a real comparison, not a trivial 0 or 100
    if lang == "de":
        assert "##AT##-##AT##" in perl_ref and "&quot;" in perl_ref  # compounds and quotes
        assert "split:##AT##" in ours.signature

    # `transformer score` reports the same paper metric from the files.
    report = score_files(hyp_path, ref_path, lang).as_dict()
    assert report["paper"]["score"] == ours.score
    assert report["lines"] == len(refs)


def test_tokenized_lowercased_bleu_equals_multi_bleu_perl_lc(shared_data, moses, tmp_path):
    """The Multi30k literature's metric (text lowercased by Moses' lowercase.perl, tokenized,
    multi-bleu.perl), on Multi30k's German test set with a perturbed, partly upper-cased
    hypothesis. (multi-bleu.perl's own -lc lowercases ASCII only: Ä, Ö, Ü would stay.)"""
    refs = (shared_data / "multi30k" / "test_2016_flickr.de").read_text("utf-8").splitlines()
    hyps = [h.upper() if i % 4 == 0 else h for i, h in enumerate(_perturb(refs))]
    tokenizer = str(moses / "tokenizer" / "tokenizer.perl")
    lowercase = ["-CSD", "-ne", "print lc"]  # the body of Moses' lowercase.perl

    def tok_lc(lines: list[str]) -> str:
        return _perl(moses, lowercase, _perl(moses, [tokenizer, "-l", "de", "-q"], "".join(
            x + "\n" for x in lines)))  # fmt: skip

    (tmp_path / "ref.tok").write_text(tok_lc(refs), encoding="utf-8")
    multi_bleu = str(moses / "generic" / "multi-bleu.perl")
    perl = _perl(moses, [multi_bleu, str(tmp_path / "ref.tok")], tok_lc(hyps))
    ours = tokenized_bleu_lc(hyps, refs, "de")
    assert f"BLEU = {ours.score:.2f}," in perl
    assert 10.0 < ours.score < 90.0
    assert "|lc|" in ours.signature
