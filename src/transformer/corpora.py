"""Registry of named corpora: official URLs, file layouts, language pairs and checksums.

`resolve(name, src, tgt)` gives a `CorpusRecipe`: the split files prepare reads (as found under
`--from DIR`, plain or `.gz`), the files to download when there is no `--from`, and how to turn
the downloads into split files. A checksum is written here only where it is known (from the
upstream release or the shared copies' READMEs); unknown ones are None and nothing is verified
(see docs/data.md).
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import re
import shutil
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from transformer.data import DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteFile:
    """One file to download: its URL, local name and sha256 (or only md5) of its bytes (None if
    unknown: then the sha256 of the first download is recorded and checked on later runs)."""

    url: str
    name: str
    sha256: str | None = None
    md5: str | None = None


@dataclass(frozen=True)
class CorpusRecipe:
    """A named corpus for one language pair.

    Attributes:
        splits: our split name ("train", "valid", "test") -> file stem; the file of a split and
            language is `{stem}.{lang}` or `{stem}.{lang}.gz`. "test" is optional on disk.
        text_sha256: `{stem}.{lang}` -> sha256 of its (decompressed) text, where known.
        downloads: files fetched when no `--from` directory is given.
        assemble: turns the download directory into split files (None: they already are).
    """

    name: str
    src_lang: str
    tgt_lang: str
    splits: dict[str, str]
    vocab_size: int
    spm_type: str
    downloads: tuple[RemoteFile, ...] = ()
    text_sha256: dict[str, str] = field(default_factory=dict)
    assemble: Callable[[Path], None] | None = None

    def find(self, directory: Path, split: str, lang: str) -> Path | None:
        """The file of `split` and `lang` under `directory` (plain preferred over `.gz`)."""
        stem = self.splits[split]
        for candidate in (directory / f"{stem}.{lang}", directory / f"{stem}.{lang}.gz"):
            if candidate.is_file():
                return candidate
        return None


# --- Multi30k Task 1 (raw) -------------------------------------------------------------------
_MULTI30K_COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"
_MULTI30K_URL = (
    f"https://raw.githubusercontent.com/multi30k/dataset/{_MULTI30K_COMMIT}/data/task1/raw/"
)
# sha256 of the gunzipped upstream files (shared/data/multi30k/README.md).
_MULTI30K_SHA256 = {
    "test_2016_flickr.cs": "45adb85f688de8407fddcbe1b36dca15d12aab868149b337e2576f2d6d2ff8d8",
    "test_2016_flickr.de": "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16",
    "test_2016_flickr.en": "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182",
    "test_2016_flickr.fr": "cb3160d69b002bb638e66cc7612fcd56cb0af82eadc9c142dedc438afb885ef6",
    "train.cs": "2be68b38c8d586ff4f54eb13cc6e1baaaa053695b3f070d3038303a47f2268da",
    "train.de": "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72",
    "train.en": "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6",
    "train.fr": "5925a3c18f1587b6b54b87743106e6e8ab93618edb6f65d19eac0621f853a10d",
    "val.cs": "d53827e469b0a1ca8d57e9e26b2b64c4bc4b33f5479c7b03ae87ae5c882c3e33",
    "val.de": "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660",
    "val.en": "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227",
    "val.fr": "5304e444d842e962b2dda4d816b70b22a1765b15401642b7ca37a67477e708dc",
}


def _multi30k(src: str, tgt: str) -> CorpusRecipe:
    _check_pair("multi30k", src, tgt, allowed={"en", "de", "fr", "cs"})
    splits = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
    downloads = tuple(
        RemoteFile(f"{_MULTI30K_URL}{stem}.{lang}.gz", f"{stem}.{lang}.gz", None)
        for stem in splits.values()
        for lang in (src, tgt)
    )
    return CorpusRecipe("multi30k", src, tgt, splits, 8000, "bpe", downloads, _MULTI30K_SHA256)


# --- Tatoeba (manythings.org Anki exports), split by English sentence ----------------------
_TATOEBA = {
    "de": RemoteFile(
        "https://raw.githubusercontent.com/rioyshky/translation/"
        "de48b7027f7318d77010a6e08ed928c10748c23d/deu-eng.zip",
        "deu-eng.zip",
        "b7688f84f99fa33c17397c14d8bd9cef1fdeb2ee0bf50074767023aee8926e28",
    ),
    "fr": RemoteFile(
        "https://raw.githubusercontent.com/modelexlab/data/"
        "adddaf33ac35572bcfeb421efec29435e7ea9332/fra-eng.zip",
        "fra-eng.zip",
        "161c93f18da3a7e6df611ed961426613260de8af06ccf8c79c977afe5135ac44",
    ),
}
_TATOEBA_MEMBER = {"de": "deu.txt", "fr": "fra-eng/fra.txt"}
# sha256 of the unpacked split files (shared/data/tatoeba_*/README.md).
_TATOEBA_SHA256 = {
    "de": {
        "train.en": "9cc1ba271a060513cb63a40755980d3375eee75cfe44c91e8df723629986ef74",
        "train.de": "81249140e32fd472d967371f125c720155951f5971f812db8bb0342e8b9635ab",
        "valid.en": "c77dba5be3a1361aae1c453920e18461b36dd0ea19d66811caf75938108ffaa5",
        "valid.de": "6a01c47c8871d0f190d012b17fcf91b6e7a14d28e92033f529d08412a62c71ec",
    },
    "fr": {
        "train.en": "7e7401262980ac77a1bb58c44ad63f93f6206f9debd0f82c38cf8c72ecc229f4",
        "train.fr": "f698a469b52bc856eab72859c208afec3ffc8dae878a2023dce7786d25febf3c",
        "valid.en": "0a890b02c8e71bd689fff08b6fd5162f23903fb0950b3d9028b69a82c1df024b",
        "valid.fr": "02579eb38f9c0fe9059ca05d33ad50f72679f5a29c9d6e8a15f3307e352adca4",
    },
}


def tatoeba_bucket(english: str) -> int:
    """The split bucket of a pair: 0 = test, 1 = valid, other = train (shared/data README)."""
    return int(hashlib.sha1(english.strip().encode("utf-8")).hexdigest(), 16) % 100


def split_tatoeba(tsv_lines: list[str] | object, directory: Path, other: str) -> dict[str, int]:
    """Write `{train,valid,test}.{en,other}` from `English<TAB>Other` lines; returns counts."""
    names = {0: "test", 1: "valid"}
    files = {
        (split, lang): open(directory / f"{split}.{lang}", "w", encoding="utf-8", newline="")
        for split in ("train", "valid", "test")
        for lang in ("en", other)
    }
    counts = {"train": 0, "valid": 0, "test": 0}
    try:
        for number, line in enumerate(tsv_lines, start=1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 2:
                raise DataError(directory, f"tatoeba line {number} has no tab: {line[:60]!r}")
            split = names.get(tatoeba_bucket(fields[0]), "train")
            files[split, "en"].write(fields[0] + "\n")
            files[split, other].write(fields[1] + "\n")
            counts[split] += 1
    finally:
        for f in files.values():
            f.close()
    return counts


def _tatoeba(src: str, tgt: str) -> CorpusRecipe:
    _check_pair("tatoeba", src, tgt, pairs={("en", "de"), ("en", "fr")})
    other = tgt if src == "en" else src
    remote = _TATOEBA[other]

    def assemble(directory: Path) -> None:
        with zipfile.ZipFile(directory / remote.name) as z, z.open(_TATOEBA_MEMBER[other]) as f:
            lines = (raw.decode("utf-8") for raw in f)
            logger.info("tatoeba split: %s", split_tatoeba(lines, directory, other))

    splits = {"train": "train", "valid": "valid", "test": "test"}
    return CorpusRecipe(
        "tatoeba", src, tgt, splits, 16000, "bpe", (remote,), _TATOEBA_SHA256[other], assemble
    )


# --- IWSLT'14 De-En, fairseq prepare-iwslt14.sh output before BPE ---------------------------
_IWSLT_URL = (
    "https://raw.githubusercontent.com/vkhangpham/fairseq/811b9704a489cd76ac79fa0d87c249cd3f895d5a"
    "/examples/translation/iwslt14.tokenized.de-en/tmp/"
)
_IWSLT_SHA256 = {
    "valid.de": "3f051579c9d8c7281a6ea8c72ad4ae09dbaa9bb24dfd41166f2c3a3df7cd940a",
    "valid.en": "e6d7317a9772cd1ed970910c611e9e7dada1f34439269b44a9d801334bff948d",
}


def _iwslt14(src: str, tgt: str) -> CorpusRecipe:
    _check_pair("iwslt14", src, tgt, pairs={("de", "en")})
    splits = {"train": "train", "valid": "valid", "test": "test"}
    downloads = tuple(
        RemoteFile(
            f"{_IWSLT_URL}{stem}.{lang}", f"{stem}.{lang}", _IWSLT_SHA256.get(f"{stem}.{lang}")
        )
        for stem in splits.values()
        for lang in (src, tgt)
    )
    return CorpusRecipe("iwslt14", src, tgt, splits, 10000, "bpe", downloads, dict(_IWSLT_SHA256))


# --- WMT14, the raw statmt.org releases (the paper's tensor2tensor setup, §5.1) ---------------
_STATMT = "https://www.statmt.org/"
# Checksums: statmt.org publishes none. Pinned here only where a second party published one:
# sha256 of Europarl v7 and Common Crawl as pinned by stagedml/stagedml (stages/fetchwmt.py;
# Europarl's also by an independent download script), the md5 of test-full.tgz from sacreBLEU
# 2.6.0 (DATASETS["wmt14/full"]). None of them could be checked here (no internet). Every other
# archive is verified on later runs against the sha256 recorded at its first download
# (prepare's `SHA256SUMS` in the download directory), and newstest2014's text against the
# sha256 of the 3,003 segments of test-full (shared/data/wmt14_en_de/README.md).
_WMT14_FILES = {
    "europarl": RemoteFile(
        _STATMT + "wmt13/training-parallel-europarl-v7.tgz",
        "training-parallel-europarl-v7.tgz",
        "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7",
    ),
    "commoncrawl": RemoteFile(
        _STATMT + "wmt13/training-parallel-commoncrawl.tgz",
        "training-parallel-commoncrawl.tgz",
        "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5",
    ),
    "nc": RemoteFile(_STATMT + "wmt14/training-parallel-nc-v9.tgz", "training-parallel-nc-v9.tgz"),
    "un": RemoteFile(_STATMT + "wmt13/training-parallel-un.tgz", "training-parallel-un.tgz"),
    "giga": RemoteFile(_STATMT + "wmt10/training-giga-fren.tar", "training-giga-fren.tar"),
    "dev": RemoteFile(_STATMT + "wmt14/dev.tgz", "dev.tgz"),
    "test": RemoteFile(
        _STATMT + "wmt14/test-full.tgz", "test-full.tgz", md5="a8cd784e006feb32ac6f3d9ec7eb389a"
    ),
}
# (archive, member without its language suffix) of each training corpus, in the order of
# fairseq's prepare-wmt14en2{de,fr}.sh; a member may be gzipped (Giga-FrEn's are).
_WMT14_TRAIN = {
    "de": (
        ("europarl", "training/europarl-v7.de-en"),
        ("commoncrawl", "commoncrawl.de-en"),
        ("nc", "training/news-commentary-v9.de-en"),
    ),
    "fr": (
        ("europarl", "training/europarl-v7.fr-en"),
        ("commoncrawl", "commoncrawl.fr-en"),
        ("un", "un/undoc.2000.fr-en"),
        ("nc", "training/news-commentary-v9.fr-en"),
        ("giga", "giga-fren.release2.fixed"),
    ),
}
# sha256 of the full newstest2014 text (the <seg>s of test-full's en→de SGML, stripped).
_NEWSTEST2014_SHA256 = {
    "newstest2014.en": "1e10b7cb106e08ab9b3a4ed85f5c866bd9391d2659626e68a6e0904d5b1aebcf",
    "newstest2014.de": "ae5d110486bc33d7175e9e28c7d0051eb3e5fcd2166dd93371089852c091a20e",
}
_SEG = re.compile(r"<seg[^>]*>(.*)</seg>")


def sgm_lines(text: str) -> list[str]:
    """The segments of a WMT `.sgm` file, in order (the text between `<seg ...>` tags, with
    surrounding whitespace stripped, as sacreBLEU reads them)."""
    return [m.group(1).strip() for m in _SEG.finditer(text)]


def _member(tar: tarfile.TarFile, wanted: str) -> tarfile.TarInfo:
    for info in tar.getmembers():
        if info.name.endswith(wanted) or info.name.endswith(wanted + ".gz"):
            return info
    raise DataError(tar.name or "archive", f"no member named like {wanted!r}")


def _append_member(tar: tarfile.TarFile, wanted: str, out) -> None:
    info = _member(tar, wanted)
    with tar.extractfile(info) as f:  # type: ignore[union-attr]
        source = gzip.open(f) if info.name.endswith(".gz") else f
        shutil.copyfileobj(source, out, 1 << 20)


def assemble_wmt14(directory: Path, other: str) -> None:
    """From the statmt.org archives in `directory`, write `train.{en,OTHER}` (the training
    corpora concatenated), `newstest2013.*` (dev.tgz's raw text) and `newstest2014.*` (the full
    3,003-segment test set, read from test-full.tgz's en→OTHER SGML)."""
    files = _WMT14_FILES
    for lang in ("en", other):
        with open(directory / f"train.{lang}", "wb") as out:
            for key, stem in _WMT14_TRAIN[other]:
                with tarfile.open(directory / files[key].name) as tar:
                    _append_member(tar, f"{stem}.{lang}", out)
        with (
            tarfile.open(directory / files["dev"].name) as tar,
            open(directory / f"newstest2013.{lang}", "wb") as out,
        ):
            _append_member(tar, f"dev/newstest2013.{lang}", out)
        side = "src.en" if lang == "en" else f"ref.{other}"
        with tarfile.open(directory / files["test"].name) as tar:
            f = tar.extractfile(_member(tar, f"test-full/newstest2014-{other}en-{side}.sgm"))
            text = f.read().decode("utf-8")  # type: ignore[union-attr]
        lines = sgm_lines(text)
        (directory / f"newstest2014.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _wmt14(src: str, tgt: str) -> CorpusRecipe:
    _check_pair("wmt14", src, tgt, pairs={("en", "de"), ("en", "fr")})
    other = tgt if src == "en" else src
    splits = {"train": "train", "valid": "newstest2013", "test": "newstest2014"}
    keys = [key for key, _ in _WMT14_TRAIN[other]] + ["dev", "test"]
    downloads = tuple(_WMT14_FILES[k] for k in keys)
    # §5.1: En-De ~37,000 joint BPE; En-Fr 32,000 word-pieces (sentencepiece unigram).
    vocab, spm_type = (37000, "bpe") if other == "de" else (32000, "unigram")
    text_sha = {k: v for k, v in _NEWSTEST2014_SHA256.items() if k.endswith(("en", other))}
    return CorpusRecipe(
        "wmt14", src, tgt, splits, vocab, spm_type, downloads, text_sha,
        lambda directory: assemble_wmt14(directory, other),
    )  # fmt: skip


# The Stanford NLP release of WMT14 En-De (Luong et al. 2015): Moses-tokenized with
# ##AT##-##AT## hyphens, and its newstest2014 is the filtered 2,737-line set. Kept as an option:
# `evaluate` scores it only after Moses-detokenizing output and references (bleu.py).
_WMT14_STANFORD_URL = "https://nlp.stanford.edu/projects/nmt/data/wmt14.en-de/"


def _wmt14_stanford(src: str, tgt: str) -> CorpusRecipe:
    _check_pair("wmt14-stanford", src, tgt, pairs={("en", "de")})
    splits = {"train": "train", "valid": "newstest2013", "test": "newstest2014"}
    downloads = tuple(
        RemoteFile(f"{_WMT14_STANFORD_URL}{stem}.{lang}", f"{stem}.{lang}")
        for stem in splits.values()
        for lang in (src, tgt)
    )
    return CorpusRecipe("wmt14-stanford", src, tgt, splits, 37000, "bpe", downloads)


def _check_pair(
    name: str,
    src: str,
    tgt: str,
    allowed: set[str] | None = None,
    pairs: set[tuple[str, str]] | None = None,
) -> None:
    ok = src != tgt and (
        (allowed is not None and {src, tgt} <= allowed)
        or (pairs is not None and tuple(sorted((src, tgt))) in {tuple(sorted(p)) for p in pairs})
    )
    if not ok:
        have = sorted(allowed) if allowed else sorted("-".join(p) for p in pairs or ())
        raise DataError(name, f"language pair {src}-{tgt} is not available; available: {have}")


REGISTRY: dict[str, Callable[[str, str], CorpusRecipe]] = {
    "multi30k": _multi30k,
    "tatoeba": _tatoeba,
    "iwslt14": _iwslt14,
    "wmt14": _wmt14,
    "wmt14-stanford": _wmt14_stanford,
}


def resolve(name: str, src_lang: str, tgt_lang: str) -> CorpusRecipe:
    """The recipe of corpus `name` for the pair src_lang -> tgt_lang (either direction)."""
    if name not in REGISTRY:
        raise DataError(name, f"unknown corpus; named corpora: {sorted(REGISTRY)} (or 'custom')")
    return REGISTRY[name](src_lang, tgt_lang)
