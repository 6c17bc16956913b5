"""Rehearsal of recipes/wmt14_ende.sh and wmt14_enfr.sh on real files served from 127.0.0.1.

A miniature of statmt.org is built with the real archive names and inner paths (Europarl v7,
Common Crawl, News Commentary v9, UN, Giga-FrEn, dev.tgz, test-full.tgz) and served by an
http.server thread. En-De: the real newstest2014 SGML (test-full, 3,003 segments) and the real
newstest2013 (the Stanford copy, Moses-detokenized: no raw copy is here); training lines from
Tatoeba and Multi30k stand in for the 4.5M pairs. En-Fr: no French newstest is here, so its
dev/test are Multi30k lines written in the real SGML layout. The recipe script itself runs:
download with checksums -> prepare -> train a few steps -> average -> evaluate.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from transformer.data import DataError
from transformer.download import DownloadError
from transformer.prepare import prepare_corpus

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _lines(path: Path, start: int = 0, stop: int | None = None) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()[start:stop]


def _text(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode("utf-8")


def _archive(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz" if path.suffix == ".tgz" else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))


def _sgm(lines: list[str], lang: str, kind: str, setid: str = "newstest2014") -> bytes:
    """WMT's SGML layout (one document here): <seg id=N>text</seg> per line."""
    segs = "".join(f'<seg id="{i}">{line}</seg>\n' for i, line in enumerate(lines, 1))
    return (
        f'<{kind} setid="{setid}" srclang="any" trglang="{lang}">\n'
        f'<doc sysid="ref" docid="mini" genre="news" origlang="en">\n{segs}</doc>\n</{kind}>\n'
    ).encode()


def _mini_statmt(root: Path, shared: Path, other: str) -> None:
    """The statmt.org paths and archive layouts the recipes download, from real lines."""
    from transformer.bleu import moses_detokenize

    td = shared / ("tatoeba_deu_eng" if other == "de" else "tatoeba_fra_eng")
    m30k = shared / "multi30k"
    tat = {lang: _lines(td / f"train.{lang}.gz", 0, 3000) for lang in ("en", other)}
    pair = f"{other}-en"
    train = {
        "europarl": {lang: tat[lang][:1500] for lang in tat},
        "commoncrawl": {lang: _lines(m30k / f"train.{lang}", 0, 1500) for lang in ("en", other)},
        "nc": {lang: tat[lang][1500:2500] for lang in tat},
    }
    _archive(root / "wmt13/training-parallel-europarl-v7.tgz", {
        f"training/europarl-v7.{pair}.{lang}": _text(v) for lang, v in train["europarl"].items()
    })  # fmt: skip
    _archive(root / "wmt13/training-parallel-commoncrawl.tgz", {
        f"commoncrawl.{pair}.{lang}": _text(v) for lang, v in train["commoncrawl"].items()
    })  # fmt: skip
    _archive(root / "wmt14/training-parallel-nc-v9.tgz", {
        f"training/news-commentary-v9.{pair}.{lang}": _text(v) for lang, v in train["nc"].items()
    })  # fmt: skip
    if other == "de":
        wmt = shared / "wmt14_en_de"
        dev = {
            lang: moses_detokenize(_lines(wmt / f"newstest2013.{lang}.gz", 0, 200), lang)
            for lang in ("en", "de")
        }
        test = {
            "test-full/newstest2014-deen-src.en.sgm": (wmt / "sgm/newstest2014-deen-src.en.sgm"),
            "test-full/newstest2014-deen-ref.de.sgm": (wmt / "sgm/newstest2014-deen-ref.de.sgm"),
        }
        test_members = {name: path.read_bytes() for name, path in test.items()}
    else:
        dev = {lang: _lines(m30k / f"val.{lang}", 0, 200) for lang in ("en", "fr")}
        flickr = {lang: _lines(m30k / f"test_2016_flickr.{lang}") for lang in ("en", "fr")}
        test_members = {
            "test-full/newstest2014-fren-src.en.sgm": _sgm(flickr["en"], "en", "srcset"),
            "test-full/newstest2014-fren-ref.fr.sgm": _sgm(flickr["fr"], "fr", "refset"),
        }
        _archive(root / "wmt13/training-parallel-un.tgz", {
            f"un/undoc.2000.fr-en.{lang}": _text(tat[lang][2500:]) for lang in ("en", "fr")
        })  # fmt: skip
        giga = _lines(m30k / "train.en", 1500, 2500), _lines(m30k / "train.fr", 1500, 2500)
        _archive(root / "wmt10/training-giga-fren.tar", {
            f"giga-fren.release2.fixed.{lang}.gz": gzip.compress(_text(v), mtime=0)
            for lang, v in zip(("en", "fr"), giga, strict=True)
        })  # fmt: skip
    _archive(root / "wmt14/dev.tgz", {f"dev/newstest2013.{k}": _text(v) for k, v in dev.items()})
    _archive(root / "wmt14/test-full.tgz", test_members)


@pytest.fixture
def statmt(tmp_path, shared_data):
    """Serve a miniature statmt.org from 127.0.0.1; yields (root dir, base URL)."""

    def serve(other: str) -> tuple[Path, str]:
        root = tmp_path / f"www-{other}"
        _mini_statmt(root, shared_data, other)
        handler = functools.partial(QuietHandler, directory=str(root))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return root, f"http://127.0.0.1:{server.server_address[1]}"

    servers: list[http.server.ThreadingHTTPServer] = []
    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _checksums(root: Path, path: Path) -> Path:
    """The miniature's own checksums (its archives are not statmt.org's bytes): sha256, and
    md5 for test-full.tgz as sacreBLEU publishes it for the real file."""
    lines = []
    for archive in sorted(root.rglob("*.t*")):
        algorithm = "md5" if archive.name == "test-full.tgz" else "sha256"
        lines.append(f"{hashlib.new(algorithm, archive.read_bytes()).hexdigest()}  {archive.name}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _run_recipe(script: str, data: Path, run: Path, env: dict) -> subprocess.CompletedProcess:
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"], "OMP_NUM_THREADS": "1",
           "PRESET": "tiny", "LAST": "2", "THREADS": "1", "BEAM": "1",
           "TRAIN_ARGS": "--max-steps 5 --device cpu train.dtype=fp32 train.max_tokens=600 "
                         "train.warmup_steps=10 "
                         "train.save_every_steps=2 train.save_every_minutes=1000 "
                         "train.valid_every_steps=1000 train.log_every_steps=5 "
                         "decode.max_len_b=3",
           **env}  # fmt: skip
    return subprocess.run(
        ["bash", str(REPO / "recipes" / script), str(data), str(run)],
        env=env, capture_output=True, timeout=900,
    )  # fmt: skip


def test_wmt14_ende_recipe_end_to_end_on_a_loopback_statmt(statmt, tmp_path):
    pytest.importorskip("sacremoses")
    root, url = statmt("de")
    data, run = tmp_path / "wmt14_en_de", tmp_path / "run"
    env = {
        "MIRROR": url,
        "CHECKSUMS": str(_checksums(root, tmp_path / "mini.sums")),
        "VOCAB": "2000",
    }
    res = _run_recipe("wmt14_ende.sh", data, run, env)
    assert res.returncode == 0, res.stderr.decode()[-3000:]

    downloads = tmp_path / "wmt14_en_de.downloads"
    names = {p.name for p in downloads.iterdir()}
    assert names >= {
        "training-parallel-europarl-v7.tgz",
        "training-parallel-commoncrawl.tgz",
        "training-parallel-nc-v9.tgz",
        "dev.tgz",
        "test-full.tgz",
        "SHA256SUMS",
    }
    recorded = (downloads / "SHA256SUMS").read_text().splitlines()
    assert len(recorded) == 5 and all(len(line.split()[0]) == 64 for line in recorded)

    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["splits"]["test"]["input_pairs"] == 3003  # the full newstest2014
    # newstest2014 as read from the real SGML equals the official full test set, byte for byte.
    assert manifest["inputs"]["test.de"]["verified"] is True
    assert manifest["inputs"]["test.en"]["verified"] is True

    report = json.loads((run / "newstest2014.json").read_text())
    assert report["sentences"] == 3003
    assert "tok:13a" in report["bleu_signature"] and "nrefs:1" in report["bleu_signature"]
    assert "split:##AT##" in report["paper_bleu_signature"] and "detokenized" not in report
    hyps = (run / "newstest2014.hyp.de").read_text(encoding="utf-8").split("\n")
    assert len(hyps) == 3004 and hyps[-1] == ""
    # Averaged: the two cadence checkpoints (steps 2 and 4), not the end of the run (step 5).
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("ckpt_*"))
    assert ckpts == ["ckpt_2.pt", "ckpt_4.pt", "ckpt_5_end.pt"]

    # A later run verifies what is already downloaded: dev.tgz (no built-in checksum) against
    # the sha256 its first download recorded in SHA256SUMS.
    sums = tmp_path / "mini.sums"
    sums.write_text("".join(x for x in sums.read_text().splitlines(True) if "dev.tgz" not in x))
    again = tmp_path / "again"
    prepare_corpus("wmt14", "en", "de", again, download_dir=downloads, vocab_size=2000,
                   mirror=url, checksums=sums)  # fmt: skip
    with open(downloads / "dev.tgz", "ab") as f:
        f.write(b"corrupted")
    with pytest.raises(DownloadError, match=r"dev\.tgz: exists but its sha256 is not"):
        prepare_corpus("wmt14", "en", "de", again, download_dir=downloads, vocab_size=2000,
                       mirror=url, checksums=sums)  # fmt: skip


def test_wmt14_download_refuses_a_file_that_does_not_match_its_checksum(statmt, tmp_path):
    root, url = statmt("de")
    sums = _checksums(root, tmp_path / "mini.sums")
    text = sums.read_text().replace(
        hashlib.md5((root / "wmt14/test-full.tgz").read_bytes()).hexdigest(), "0" * 32
    )
    sums.write_text(text)
    with pytest.raises(DownloadError, match=r"test-full\.tgz: md5 mismatch: expected 0{32}"):
        prepare_corpus("wmt14", "en", "de", tmp_path / "d", vocab_size=2000, mirror=url,
                       checksums=sums, download_dir=tmp_path / "dl")  # fmt: skip
    # Without --checksums the built-in pins apply: the miniature is not statmt.org's Europarl.
    with pytest.raises(DownloadError, match=r"europarl-v7\.tgz: sha256 mismatch: expected 0224c7"):
        prepare_corpus("wmt14", "en", "de", tmp_path / "d", vocab_size=2000, mirror=url,
                       download_dir=tmp_path / "dl2")  # fmt: skip


def test_wmt14_enfr_recipe_end_to_end_on_a_loopback_statmt(statmt, tmp_path):
    pytest.importorskip("sacremoses")
    root, url = statmt("fr")
    data, run = tmp_path / "wmt14_en_fr", tmp_path / "run"
    env = {
        "MIRROR": url,
        "CHECKSUMS": str(_checksums(root, tmp_path / "mini.sums")),
        "VOCAB": "2000",
    }
    res = _run_recipe("wmt14_enfr.sh", data, run, env)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    manifest = json.loads((data / "manifest.json").read_text())
    # Five training corpora, Giga-FrEn's gzipped members included: 1500 + 1500 + 500 + 1000 +
    # 1000 lines (before the length filter).
    assert manifest["splits"]["train"]["input_pairs"] == 5500
    assert manifest["splits"]["test"]["input_pairs"] == 1000
    report = json.loads((run / "newstest2014.json").read_text())
    assert report["sentences"] == 1000
    assert "moses-fr" in report["paper_bleu_signature"]
    assert "split" not in report["paper_bleu_signature"]


def test_wmt14_stanford_release_stays_an_option():
    from transformer import corpora

    recipe = corpora.resolve("wmt14-stanford", "en", "de")
    assert recipe.downloads[0].url.startswith("https://nlp.stanford.edu/")
    with pytest.raises(DataError, match="en-fr is not available"):
        corpora.resolve("wmt14-stanford", "en", "fr")
