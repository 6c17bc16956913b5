"""`transformer evaluate`: translate a prepared split and score it (sacreBLEU, chrF and, for
English→German and English→French, the paper's tokenized BLEU)."""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from transformer.bleu import (
    check_detokenized,
    corpus_bleu,
    corpus_chrf,
    moses_detokenize,
    paper_bleu,
    tokenized_bleu_lc,
)
from transformer.bleu import sentence_stats as per_sentence_stats
from transformer.errors import UserError
from transformer.translate import Translator

logger = logging.getLogger(__name__)

# The decode settings that decide the output, reported with the scores.
SEARCH_FIELDS = ("beam_size", "length_penalty", "max_len_a", "max_len_b", "stop")
PAPER_BLEU_HINT = "it needs sacremoses: pip install 'transformer[paper-bleu]'"


def evaluate(
    model_path: str | Path,
    data_dir: str | Path,
    split: str = "test",
    beam_size: int | None = None,
    length_penalty: float | None = None,
    dtype: torch.dtype | str = "fp32",
    output: str | Path | None = None,
    limit: int | None = None,
    stop: str | None = None,
    verify: bool = True,
    threads: int | str | None = None,
    sentence_stats: bool = False,
) -> dict:
    """Translate `split` of a prepared data directory and score it against its references.

    Args:
        model_path: a model file or a run directory (see `rundir.resolve_model`).
        data_dir: a directory written by `transformer prepare`.
        split: "test", "valid", ...
        beam_size, length_penalty: override the model's decode config (§6.1: 4 and 0.6).
        dtype: "fp32", "bf16", "int8" or "auto" (`translate.auto_dtype`: bf16 with CUDA or
            AMX, int8 with VNNI and no AMX, else fp32); the report says which ran.
        output: if given, the translations are written there, one per line.
        limit: translate only the first `limit` sentences (quick checks).
        stop: the beam search's stopping rule, "t2t" (§6.1) or "fairseq" (default: the model's).
        verify: check the model file's checksum (`modelfile.load_model`).
        threads: CPU threads: a number, "auto" (tuned, threads.py) or None (untouched).
        sentence_stats: add each sentence's sacreBLEU statistics ("sentence_stats",
            `bleu.sentence_stats`: paired bootstrap resampling, `valchoice.one_se_alpha`).

    Returns:
        {"split", "sentences", "search" (beam, α, max length, stop rule), "dtype", "bleu",
        "bleu_signature", "chrf", "chrf_signature", "bleu_lc" (sacreBLEU -lc),
        ["paper_bleu", "paper_bleu_signature"] (en→de, en→fr), ["tok_bleu_lc" (Moses-tokenized,
        lowercased; with sacremoses)], ["detokenized"], "lowercase" (the model writes lowercased
        text: `prepare --lowercase`), "seconds", "sentences_per_s",
        "target_tokens_per_s"}.

    Raises:
        UserError: the translations look Moses-tokenized and the references do not, or the
            reverse (a model trained on tokenized text scored against raw references).
    """
    reports = _evaluate(
        model_path, data_dir, split, beam_size,
        None if length_penalty is None else (length_penalty,),
        dtype, output, limit, stop, verify, threads, sentence_stats,
    )  # fmt: skip
    return reports[0]


def evaluate_alphas(
    model_path: str | Path,
    data_dir: str | Path,
    split: str,
    alphas: Sequence[float],
    beam_size: int | None = None,
    dtype: torch.dtype | str = "fp32",
    limit: int | None = None,
    stop: str | None = None,
    verify: bool = True,
    threads: int | str | None = None,
    sentence_stats: bool = False,
) -> list[dict]:
    """`evaluate`'s report for each length penalty α in `alphas`, in order, decoded by
    `Translator.translate_alphas` (one beam search for every α, in every precision): each equals
    `evaluate` with that α, but for "seconds" and the rates, which time the decoding of all of
    `alphas` (listed as "timed_with_alphas"). Choosing α on a dev set (§6.1) then costs about
    one decode instead of one per α."""
    if not alphas:
        raise ValueError("alphas: give at least one length penalty")
    return _evaluate(
        model_path, data_dir, split, beam_size, tuple(alphas), dtype, None, limit, stop, verify,
        threads, sentence_stats,
    )  # fmt: skip


def _evaluate(
    model_path: str | Path,
    data_dir: str | Path,
    split: str,
    beam_size: int | None,
    alphas: tuple[float, ...] | None,
    dtype: torch.dtype | str,
    output: str | Path | None,
    limit: int | None,
    stop: str | None,
    verify: bool,
    threads: int | str | None,
    with_stats: bool = False,
) -> list[dict]:
    """`evaluate` for each α of `alphas` (None: the model's own α), decoded in one call."""
    from transformer.data import load_prepared, write_output

    translator = Translator.from_path(model_path, dtype=dtype, verify=verify, threads=threads)
    first = None if alphas is None else alphas[0]
    translator.decode = translator.options(beam_size, first, stop=stop)  # ConfigError
    alphas = (translator.decode.length_penalty,) if alphas is None else alphas
    decodes = [translator.options(length_penalty=alpha) for alpha in alphas]  # ConfigError
    data = load_prepared(data_dir)
    if split not in data.split_names:
        raise UserError(f"{data_dir}: no split {split!r}; have {', '.join(data.split_names)}")
    pair = (translator.loaded.src_lang, translator.loaded.tgt_lang)
    if pair != (data.src_lang, data.tgt_lang):
        raise UserError(
            f"{model_path}: translates {pair[0]}→{pair[1]} but {data_dir} is "
            f"{data.src_lang}→{data.tgt_lang}"
        )
    model_lc = translator.loaded.config.model.lowercase
    if model_lc != data.lowercase:  # a mismatch scores, but the cased figures mean little
        logger.warning(
            "%s was trained on %s text but %s is %s: read the lowercased scores",
            model_path, "lowercased" if model_lc else "cased", data_dir,
            "lowercased" if data.lowercase else "cased",
        )  # fmt: skip
    parallel = data.split(split)
    sources, refs = parallel.text(data.src_lang), parallel.text(data.tgt_lang)
    if limit is not None:
        sources, refs = sources[:limit], refs[:limit]
    start = time.perf_counter()
    per_alpha = translator.translate_alphas(sources, alphas)
    seconds = time.perf_counter() - start
    reports = []
    for decode, results in zip(decodes, per_alpha, strict=True):
        hyps = [nbest[0].text for nbest in results]
        if output is not None:
            write_output(output, "".join(h + "\n" for h in hyps))
        n_tokens = sum(len(nbest[0].tokens) + 1 for nbest in results)  # + EOS
        about = {
            "search": {k: getattr(decode, k) for k in SEARCH_FIELDS},
            "dtype": translator.dtype_name,  # what ran: "auto" resolved to "fp32" or "bf16"
            "lowercase": model_lc,  # trained on lowercased text: its output is lowercased
        }
        rates = {
            "seconds": seconds,
            "sentences_per_s": len(hyps) / seconds if seconds > 0 else 0.0,
            "target_tokens_per_s": n_tokens / seconds if seconds > 0 else 0.0,
        }
        report = _score(hyps, refs, f"{model_path}: its {split} output",
                        f"{data_dir}: the {split} references", pair, about, rates,
                        with_stats)  # fmt: skip
        report = {"split": split, "sentences": len(hyps), **report}
        if len(alphas) > 1:
            report["timed_with_alphas"] = list(alphas)  # "seconds" covers all of them
        logger.info("%s: BLEU %.2f chrF %.2f", split, report["bleu"], report["chrf"])
        reports.append(report)
    return reports


def _score(
    hyps: list[str],
    refs: list[str],
    hyp_name: str,
    ref_name: str,
    pair: tuple[str, str],
    about: dict,
    rates: dict,
    with_stats: bool = False,
) -> dict:
    """The scores of `evaluate`'s report, `about` (the search) before them and `rates` after:
    sacreBLEU (cased and lowercased), chrF, the paper's tokenized BLEU and the Multi30k
    literature's tokenized lowercased BLEU (both with sacremoses)."""
    tgt_lang = pair[1]
    # The output is judged by Moses' marks only: a model trained on raw text emits none, but an
    # under-trained one may well put a space before a final period.
    detokenized = check_detokenized(hyps, refs, hyp_name, ref_name, hyp_punctuation=False)
    if detokenized:
        # Both sides tokenized (the Stanford release): sacreBLEU and the paper's metric tokenize
        # themselves, so both are scored after the Moses detokenizer, and the report says so.
        if importlib.util.find_spec("sacremoses") is None:
            raise UserError(f"{ref_name} are tokenized: detokenizing them {PAPER_BLEU_HINT}")
        hyps = moses_detokenize(hyps, tgt_lang)
        refs = moses_detokenize(refs, tgt_lang)
        logger.warning("%s are tokenized: both sides scored after Moses detokenization", ref_name)
    bleu, chrf = corpus_bleu(hyps, refs), corpus_chrf(hyps, refs)
    bleu_lc = corpus_bleu(hyps, refs, lowercase=True)
    report = {
        **about,
        "bleu": bleu.score,
        "bleu_signature": bleu.signature,
        "bleu_details": str(bleu),
        "chrf": chrf.score,
        "chrf_signature": chrf.signature,
        "bleu_lc": bleu_lc.score,  # case-insensitive, as much of the literature reports
        "bleu_lc_signature": bleu_lc.signature,
        **rates,
    }
    if detokenized:
        report["detokenized"] = "moses detokenizer (sacremoses) on hypotheses and references"
    if pair in (("en", "de"), ("en", "fr")):  # SPEC §6.1: the paper's metric, next to sacreBLEU
        if importlib.util.find_spec("sacremoses") is None:
            # An optional extra: its absence costs the paper's metric, not the evaluation.
            report["paper_bleu_missing"] = PAPER_BLEU_HINT
            logger.warning("the paper's tokenized BLEU is skipped: %s", PAPER_BLEU_HINT)
        else:
            paper = paper_bleu(hyps, refs, lang=tgt_lang)
            report["paper_bleu"] = paper.score
            report["paper_bleu_signature"] = paper.signature
    if importlib.util.find_spec("sacremoses") is not None:  # Multi30k papers: tokenized, lc
        tok_lc = tokenized_bleu_lc(hyps, refs, tgt_lang)
        report["tok_bleu_lc"] = tok_lc.score
        report["tok_bleu_lc_signature"] = tok_lc.signature
    if with_stats:  # as "bleu" scored them (after detokenization, if any)
        report["sentence_stats"] = per_sentence_stats(hyps, refs)
    return report
