"""`transformer prepare`: parallel text in, a prepared-data directory out (§5.1).

Two streaming passes, so a WMT-sized corpus never has to fit in memory:

1. read each split in lockstep, validating UTF-8 and alignment; drop empty training pairs;
   write the surviving raw lines;
2. train the joint sentencepiece model on (a sample of) the training text, then encode every
   split in chunks, drop training pairs that are too long or have an extreme length ratio, and
   write the binarized ids next to the kept raw lines.

The directory is built under a temporary name and renamed when complete. Preparing again with
the same inputs (same sha256) and settings reuses it.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

from transformer import corpora
from transformer.atomic import remove_stale, write_atomic
from transformer.cpuinfo import usable_cores
from transformer.data import (
    FILTER_REASONS,
    FORMAT_VERSION,
    MANIFEST,
    DataError,
    TokenWriter,
    filter_reason,
    length_filter_reason,
    open_binary,
    read_lines,
    read_parallel,
)
from transformer.download import download, sha256_file
from transformer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CUSTOM = "custom"
DEFAULT_MAX_LEN = 256  # positions, EOS included; like tensor2tensor's max_length
DEFAULT_MAX_RATIO = 9.0  # Moses clean-corpus-n.perl default
DEFAULT_SPM_SAMPLE = 1_000_000  # sentences sampled for sentencepiece training
CUSTOM_VOCAB_SIZE = 8000
_CHUNK = 50_000  # pairs encoded at a time
SPM_PREFIX = "spm"


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What `manifest.json` holds (see docs/data.md)."""

    format_version: int
    corpus: str
    src_lang: str
    tgt_lang: str
    vocab_size: int
    spm_model: str
    spm_type: str
    token_dtype: str
    splits: dict
    filters: dict
    inputs: dict
    settings: dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def prepare_corpus(
    name: str,
    src_lang: str,
    tgt_lang: str,
    out_dir: Path,
    from_dir: Path | None = None,
    vocab_size: int | None = None,
    spm_type: str | None = None,
    max_len: int = DEFAULT_MAX_LEN,
    max_ratio: float = DEFAULT_MAX_RATIO,
    train_files: Sequence[Path] | None = None,
    valid_files: Sequence[Path] | None = None,
    test_files: Sequence[Path] | None = None,
    force: bool = False,
    download_dir: Path | None = None,
    spm_sample: int = DEFAULT_SPM_SAMPLE,
    num_threads: int | None = None,
    user_symbols: Sequence[str] = (),
    mirror: str | None = None,
    checksums: Path | None = None,
    lowercase: bool = False,
) -> Manifest:
    """Prepare a named corpus (or `name="custom"` with explicit files) into `out_dir`.

    Args:
        name: "multi30k", "tatoeba", "iwslt14", "wmt14", "wmt14-stanford" or "custom".
        src_lang, tgt_lang: language codes, e.g. "en", "de".
        out_dir: the prepared-data directory to write.
        from_dir: read the corpus's files from here instead of downloading.
        vocab_size, spm_type: joint sentencepiece size and type; default per corpus.
        max_len: longest training sequence kept, in subwords including EOS.
        max_ratio: largest training length ratio kept (longer side / shorter side).
        train_files, valid_files, test_files: (src, tgt) paths, plain or `.gz`, for "custom".
        force: rebuild even if `out_dir` holds a matching or different preparation.
        download_dir: where downloads go (default `{out_dir}.downloads`).
        spm_sample: sentences sampled for sentencepiece training.
        num_threads: threads for sentencepiece (default min(4, the usable cores)).
        user_symbols: tokens kept whole in the vocabulary (§6.3 tree symbols, `Tokenizer.train`).
        mirror: fetch every download from this base URL instead of its host, same path
            (a local copy of statmt.org, or the tests' loopback server).
        checksums: a file of "<sha256 or md5>  <file name>" lines that replace the built-in
            checksums of those downloads (a mirror that repacked its archives).
        lowercase: lowercase every split, both sides, before the subword model (the Multi30k
            literature's preprocessing, whose scores are on lowercased text). Not in the paper.
            The manifest records it, and models trained on the data lowercase their input.

    Returns:
        The manifest written to `out_dir/manifest.json`.

    Raises:
        DataError: missing or misaligned files, invalid UTF-8, unknown corpus or pair.
    """
    out_dir = Path(out_dir)
    _check_settings(max_len, max_ratio, vocab_size, spm_sample)
    threads = num_threads or min(4, usable_cores())
    if name == CUSTOM:
        inputs = _custom_inputs(train_files, valid_files, test_files)
        official: dict[str, str] = {}
        vocab_size = vocab_size or CUSTOM_VOCAB_SIZE
        spm_type = spm_type or "bpe"
    else:
        recipe = corpora.resolve(name, src_lang, tgt_lang)
        if from_dir is None:
            from_dir = _download(
                recipe,
                download_dir or out_dir.with_name(out_dir.name + ".downloads"),
                mirror,
                _read_sums(Path(checksums)) if checksums is not None else {},
            )
        inputs = _named_inputs(recipe, Path(from_dir))
        official = recipe.text_sha256
        vocab_size = vocab_size or recipe.vocab_size
        spm_type = spm_type or recipe.spm_type
    settings = {
        "vocab_size": vocab_size,
        "spm_type": spm_type,
        "max_len": max_len,
        "max_ratio": max_ratio,
        "spm_sample": spm_sample,
    }
    if user_symbols:  # only when set, so manifests written before this option stay reusable
        settings["user_symbols"] = list(user_symbols)
    if lowercase:  # the same: only when set
        settings["lowercase"] = True
    input_info = _hash_inputs(inputs, src_lang, tgt_lang, official)
    reused = _reusable(out_dir, name, src_lang, tgt_lang, settings, input_info, force)
    if reused is not None:
        return reused

    tmp = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    remove_stale(out_dir.parent, re.compile(rf"^\.{re.escape(out_dir.name)}\.partial-(\d+)$"))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        manifest = _build(tmp, name, src_lang, tgt_lang, inputs, settings, input_info, threads)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except OSError as e:  # disk full, permission denied: no partial output is left behind
        raise DataError(e.filename or tmp, f"cannot write the prepared data: {e.strerror}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("%s", summarize(manifest))
    return manifest


def _check_settings(max_len: int, max_ratio: float, vocab_size: int | None, sample: int) -> None:
    if max_len < 2:
        raise DataError("--max-len", f"must be at least 2 (one subword and EOS), got {max_len}")
    if not max_ratio >= 1:  # also refuses NaN
        raise DataError("--max-ratio", f"must be at least 1, got {max_ratio}")
    if vocab_size is not None and vocab_size < 1:
        raise DataError("--vocab-size", f"must be positive, got {vocab_size}")
    if sample < 0:
        raise DataError("--spm-sample", f"must be 0 (all) or positive, got {sample}")


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

# split -> (src path, tgt path, original split name)
Inputs = dict[str, tuple[Path, Path, str]]


def _custom_inputs(train, valid, test) -> Inputs:
    inputs: Inputs = {}
    for split, files in (("train", train), ("valid", valid), ("test", test)):
        if files is None:
            if split != "test":
                raise DataError(f"--{split}", f"custom corpora need {split} files (SRC TGT)")
            continue
        if len(files) != 2:
            raise DataError(f"--{split}", f"expected 2 files (SRC TGT), got {len(files)}")
        inputs[split] = (Path(files[0]), Path(files[1]), split)
    return inputs


def _named_inputs(recipe: corpora.CorpusRecipe, directory: Path) -> Inputs:
    inputs: Inputs = {}
    for split, stem in recipe.splits.items():
        src = recipe.find(directory, split, recipe.src_lang)
        tgt = recipe.find(directory, split, recipe.tgt_lang)
        if src is None or tgt is None:
            if split == "test" and src is None and tgt is None:
                logger.info("%s: no %s split (%s.*) found; skipping it", directory, split, stem)
                continue
            missing = [
                f"{stem}.{lang}[.gz]"
                for lang, p in ((recipe.src_lang, src), (recipe.tgt_lang, tgt))
                if p is None
            ]
            raise DataError(directory, f"{recipe.name} {split} split: missing {', '.join(missing)}")
        inputs[split] = (src, tgt, stem)
    return inputs


SHA256SUMS = "SHA256SUMS"  # in a download directory: "<sha256>  <name>" of each first download


def _download(
    recipe: corpora.CorpusRecipe,
    directory: Path,
    mirror: str | None = None,
    pins: dict[str, str] | None = None,
) -> Path:
    """Fetch the recipe's files into `directory`, verifying each against `pins` (by file name),
    else its built-in checksum, else the sha256 recorded in `directory/SHA256SUMS` by its first
    download (so a later run detects a changed or corrupted file)."""
    recorded = _read_sums(directory / SHA256SUMS)
    for remote in recipe.downloads:
        url = remote.url
        if mirror is not None:  # same path, another host: https://host/a/b -> MIRROR/a/b
            url = mirror.rstrip("/") + "/" + url.split("://", 1)[1].split("/", 1)[1]
        sha256, md5 = remote.sha256, remote.md5
        if pins and remote.name in pins:
            pin = pins[remote.name]
            sha256, md5 = (pin, None) if len(pin) == 64 else (None, pin)
        elif sha256 is None and md5 is None:
            sha256 = recorded.get(remote.name)
        try:
            download(url, directory / remote.name, sha256, md5=md5)
        except Exception as e:  # a missing optional test file should not stop the rest
            if remote.name.startswith(recipe.splits.get("test", "\0")):
                logger.warning("optional test file not downloaded: %s", e)
                continue
            raise
        if remote.name not in recorded:
            recorded[remote.name] = sha256_file(directory / remote.name)
            _write_sums(directory / SHA256SUMS, recorded)
    if recipe.assemble is not None and recipe.find(directory, "train", recipe.src_lang) is None:
        recipe.assemble(directory)
    return directory


def _read_sums(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    sums = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fields = line.split()
        if len(fields) != 2 or len(fields[0]) not in (32, 64):
            raise DataError(path, f"not a '<sha256 or md5>  <name>' line: {line[:60]!r}", number)
        sums[fields[1]] = fields[0]
    return sums


def _write_sums(path: Path, sums: dict[str, str]) -> None:
    text = "".join(f"{v}  {k}\n" for k, v in sorted(sums.items()))
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def _text_sha256(path: Path) -> str:
    if path.suffix != ".gz":
        return sha256_file(path)
    digest = hashlib.sha256()
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except (EOFError, OSError, zlib.error) as e:
        raise DataError(path, f"truncated or corrupt gzip file: {e}") from e
    return digest.hexdigest()


def _hash_inputs(inputs: Inputs, src_lang: str, tgt_lang: str, official: dict) -> dict:
    info = {}
    for split, (src, tgt, stem) in inputs.items():
        for lang, path in ((src_lang, src), (tgt_lang, tgt)):
            if path.exists() and not path.is_dir() and not path.is_file():  # before opening it
                raise DataError(path, "is a pipe or device, not a file: prepare reads each "
                                "input more than once, a pipe gives its lines once")  # fmt: skip
            open_binary(path).close()  # a missing, unreadable file or a directory: a DataError
            entry = {"path": str(path), "sha256": sha256_file(path)}
            expected = official.get(f"{stem}.{lang}")
            if expected is not None:
                text_sha = entry["sha256"] if path.suffix != ".gz" else _text_sha256(path)
                entry["official_text_sha256"] = expected
                entry["verified"] = text_sha == expected
                if text_sha != expected:
                    logger.warning("%s differs from the official file (sha256 %s)", path, text_sha)
            else:
                entry["verified"] = None
            info[f"{split}.{lang}"] = entry
    return info


def _reusable(out_dir, name, src_lang, tgt_lang, settings, input_info, force) -> Manifest | None:
    manifest_path = out_dir / MANIFEST
    if not out_dir.exists():
        return None
    if not out_dir.is_dir():
        raise DataError(out_dir, "exists and is not a directory")
    if not manifest_path.is_file():
        if any(out_dir.iterdir()):
            raise DataError(out_dir, "exists, is not empty and is not a prepared-data directory")
        return None
    old = _read_manifest(manifest_path)
    if force:
        _check_owned(out_dir, old)
        return None
    same = (
        old.get("format_version") == FORMAT_VERSION
        and (old.get("corpus"), old.get("src_lang"), old.get("tgt_lang"))
        == (name, src_lang, tgt_lang)
        and old.get("settings") == settings
        and {k: v["sha256"] for k, v in old.get("inputs", {}).items()}
        == {k: v["sha256"] for k, v in input_info.items()}
    )
    if same:
        logger.info("%s: already prepared from the same inputs and settings; reusing it", out_dir)
        return Manifest.from_dict(old)
    raise DataError(
        manifest_path,
        "was prepared from other inputs or settings; pass --force to overwrite it",
    )


# --------------------------------------------------------------------------------------------
# The two passes
# --------------------------------------------------------------------------------------------


def _read_manifest(path: Path) -> dict:
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(path, f"unreadable ({e}); remove the directory to prepare it again") from e
    if not isinstance(old, dict) or not isinstance(old.get("splits"), dict):
        raise DataError(path, "not a prepared-data manifest; choose another --out")
    return old


def _check_owned(out_dir: Path, manifest: dict) -> None:
    """--force replaces only what prepare wrote: refuse a directory holding anything else."""
    langs = (manifest.get("src_lang"), manifest.get("tgt_lang"))
    ours = {MANIFEST, f"{SPM_PREFIX}.model", f"{SPM_PREFIX}.vocab"}
    for split in manifest["splits"]:
        ours.add(f"{split}.trees")  # prepare ptb
        ours.update(f"{split}.{lang}.{ext}" for lang in langs for ext in ("txt", "bin", "idx.npy"))
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in ours)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise DataError(
            out_dir,
            f"holds {len(foreign)} files that prepare did not write ({shown}); --force only "
            "replaces a prepared-data directory: choose another --out",
        )


def _build(tmp, name, src_lang, tgt_lang, inputs, settings, input_info, threads) -> Manifest:
    splits: dict[str, dict] = {}
    filters: dict[str, dict] = {}
    for split, (src, tgt, stem) in inputs.items():
        stage = "stage1" if split == "train" else "txt"
        counts = _validate_split(
            src,
            tgt,
            tmp,
            split,
            stage,
            (src_lang, tgt_lang),
            split == "train",
            settings.get("lowercase", False),
        )
        splits[split] = {"source": stem, "input_pairs": counts.pop("input_pairs")}
        splits[split].update(counts)
        if split == "train" and counts["empty"] == splits[split]["input_pairs"]:
            raise DataError(src, f"all {counts['empty']} training pairs have an empty side")
    train_txt = [tmp / f"train.{lang}.stage1" for lang in (src_lang, tgt_lang)]
    tokenizer = _train_tokenizer(train_txt, tmp / SPM_PREFIX, settings, threads)
    for split in inputs:
        is_train = split == "train"
        stage = "stage1" if is_train else "txt"
        paths = [tmp / f"{split}.{lang}.{stage}" for lang in (src_lang, tgt_lang)]
        dropped, stats = _binarize_split(
            tokenizer, paths, tmp, split, (src_lang, tgt_lang), settings, is_train, threads
        )
        splits[split].update(stats)
        if is_train:
            filters[split] = {"empty": splits[split].pop("empty"), **dropped}
            for path in paths:
                path.unlink()
            if splits[split]["pairs"] == 0:
                counts = ", ".join(f"{k}={v}" for k, v in filters[split].items())
                raise DataError(
                    inputs[split][0],
                    f"no training pair is left after filtering {splits[split]['input_pairs']} "
                    f"(dropped: {counts}); raise --max-len ({settings['max_len']}) or "
                    f"--max-ratio ({settings['max_ratio']})",
                )
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        corpus=name,
        src_lang=src_lang,
        tgt_lang=tgt_lang,
        vocab_size=tokenizer.vocab_size,
        spm_model=f"{SPM_PREFIX}.model",
        spm_type=settings["spm_type"],
        token_dtype="int32",
        splits=splits,
        filters=filters,
        inputs=input_info,
        settings=settings,
    )
    text = json.dumps(manifest.to_dict(), indent=2, ensure_ascii=False) + "\n"
    (tmp / MANIFEST).write_text(text, encoding="utf-8")
    return manifest


def _validate_split(src, tgt, tmp, split, stage, langs, drop_empty, lowercase=False) -> dict:
    """Pass 1: validate and copy a split's raw lines (lowercased with `lowercase`); count (and
    for train, drop) empties."""
    n_in = n_empty = 0
    out = [
        open(tmp / f"{split}.{lang}.{stage}", "w", encoding="utf-8", newline="") for lang in langs
    ]
    try:
        for s, t in read_parallel(src, tgt):
            n_in += 1
            if filter_reason(s, t) == "empty":
                n_empty += 1
                if drop_empty:
                    continue
            if lowercase:
                s, t = s.lower(), t.lower()
            out[0].write(s + "\n")
            out[1].write(t + "\n")
    finally:
        for f in out:
            f.close()
    if n_in == 0:
        raise DataError(src, f"{split} split is empty")
    key = "empty" if drop_empty else "empty_kept"
    return {"input_pairs": n_in, key: n_empty}


def _train_tokenizer(
    train_txt: list[Path], prefix: Path, settings: dict, threads: int
) -> Tokenizer:
    try:
        return Tokenizer.train(
            train_txt,
            prefix,
            vocab_size=settings["vocab_size"],
            model_type=settings["spm_type"],
            input_sentence_size=settings["spm_sample"],
            num_threads=threads,
            user_symbols=settings.get("user_symbols", ()),
        )
    except RuntimeError as e:  # e.g. "Vocabulary size too high (8000). Please set it to ..."
        raise DataError(
            train_txt[0], f"sentencepiece training failed: {e}; adjust --vocab-size"
        ) from e


def _chunks(paths: Sequence[Path]) -> Iterable[tuple[list[str], list[str]]]:
    # Pass 1 wrote these files by the line model (data.decode_line: no "\r" is left), so
    # splitting on "\n" only reads back exactly the lines it wrote.
    files = [open(p, encoding="utf-8", newline="\n") for p in paths]
    try:
        lines = zip(*(_lines(f) for f in files), strict=True)
        while chunk := list(itertools.islice(lines, _CHUNK)):
            yield [c[0] for c in chunk], [c[1] for c in chunk]
    finally:
        for f in files:
            f.close()


def _lines(f) -> Iterable[str]:
    for line in f:
        yield line[:-1] if line.endswith("\n") else line


def _binarize_split(tokenizer, paths, tmp, split, langs, settings, is_train, threads):
    """Pass 2: encode in chunks, length-filter training pairs, write ids and kept raw lines."""
    writers = [TokenWriter(tmp / f"{split}.{lang}") for lang in langs]
    texts = (
        [open(tmp / f"{split}.{lang}.txt", "w", encoding="utf-8", newline="") for lang in langs]
        if is_train
        else None
    )
    dropped = dict.fromkeys(FILTER_REASONS[1:], 0)
    n_kept = 0
    try:
        for src_lines, tgt_lines in _chunks(paths):
            src_ids = tokenizer.encode_batch(src_lines, num_threads=threads)
            tgt_ids = tokenizer.encode_batch(tgt_lines, num_threads=threads)
            if is_train:
                keep = []
                for i, (s, t) in enumerate(zip(src_ids, tgt_ids, strict=True)):
                    reason = length_filter_reason(
                        len(s), len(t), settings["max_len"], settings["max_ratio"]
                    )
                    if reason is None:
                        keep.append(i)
                    else:
                        dropped[reason] += 1
                src_ids = [src_ids[i] for i in keep]
                tgt_ids = [tgt_ids[i] for i in keep]
                texts[0].writelines(src_lines[i] + "\n" for i in keep)
                texts[1].writelines(tgt_lines[i] + "\n" for i in keep)
            writers[0].add(src_ids)
            writers[1].add(tgt_ids)
            n_kept += len(src_ids)
    finally:
        for f in texts or ():
            f.close()
        counts = [w.close() for w in writers]
    assert counts[0] == counts[1] == n_kept, "binarized sides are misaligned"
    stats = {"pairs": n_kept, "src_tokens": writers[0].n_tokens, "tgt_tokens": writers[1].n_tokens}
    return dropped, stats


def summarize(manifest: Manifest) -> str:
    """A human-readable report: pairs per split and pairs dropped per filter."""
    pair = f"{manifest.src_lang}-{manifest.tgt_lang}"
    lines = [f"prepared {manifest.corpus} {pair}, V={manifest.vocab_size}"]
    for split, s in manifest.splits.items():
        lines.append(f"  {split} ({s['source']}): {s['pairs']} pairs of {s['input_pairs']}")
    for split, f in manifest.filters.items():
        lines.append(f"  {split} dropped: " + ", ".join(f"{k}={v}" for k, v in f.items()))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def read_symbols(path: Path) -> list[str]:
    """One token a line; blank lines are skipped, a line with inner spaces is an error."""
    lines = list(read_lines(path))
    for i, line in enumerate(lines, 1):
        if len(line.split()) > 1:
            raise DataError(path, f"a user symbol holds no spaces, got {line!r}", line=i)
    return [line.strip() for line in lines if line.strip()]
