"""§5.1 subword model: special ids, round trip, batch encode/decode."""

from __future__ import annotations

import random

import pytest
import sentencepiece as spm

from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, strip_build_paths

WORDS = (
    "the a man woman dog cat runs sits on in with red blue small big street park water ball "
    "der die das Mann Frau Hund Katze läuft sitzt auf im mit rot blau klein groß Straße Park"
).split()


def write_corpus(path, n=600, seed=0):
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "." for _ in range(n)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    write_corpus(d / "a.txt", seed=0)
    write_corpus(d / "b.txt", seed=1)
    return Tokenizer.train([d / "a.txt", d / "b.txt"], d / "spm", vocab_size=320, num_threads=1)


def test_special_ids_are_the_single_definition(tokenizer):
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer.model_path))
    assert (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()) == (0, 1, 2, 3)
    assert tokenizer.vocab_size == 320


@pytest.mark.parametrize(
    "text",
    [
        "the man runs in the park.",
        "Der Hund läuft auf der Straße.",
        "Va !\u00a0Quoi\u202f?",  # no-break spaces as in Tatoeba French: kept, not normalized
        "Ünïcödé 東京 — “quotes” ½ ﬁ",  # unseen characters: byte fallback, no NFKC
    ],
)
def test_decode_encode_round_trips_plain_sentences(tokenizer, text):
    ids = tokenizer.encode(text)
    assert UNK_ID not in ids
    assert tokenizer.decode(ids) == text


def test_encode_has_no_bos_eos_and_decode_drops_specials(tokenizer):
    ids = tokenizer.encode("the dog sits.")
    assert BOS_ID not in ids and EOS_ID not in ids
    assert tokenizer.decode([BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]) == "the dog sits."


def test_batch_matches_single(tokenizer):
    texts = ["the cat.", "ein Hund im Park.", ""]
    assert tokenizer.encode_batch(texts, num_threads=2) == [tokenizer.encode(t) for t in texts]
    assert tokenizer.decode_batch(tokenizer.encode_batch(texts)) == texts


def test_unigram_model_type(tmp_path):
    write_corpus(tmp_path / "a.txt")
    tok = Tokenizer.train([tmp_path / "a.txt"], tmp_path / "u", 300, model_type="unigram")
    assert tok.decode(tok.encode("a small red ball.")) == "a small red ball."


def test_bad_model_type_and_foreign_model_are_errors(tmp_path):
    write_corpus(tmp_path / "a.txt")
    with pytest.raises(ValueError, match="model_type"):
        Tokenizer.train([tmp_path / "a.txt"], tmp_path / "x", 300, model_type="char")
    # a model with sentencepiece's default ids (unk=0, bos=1, eos=2, no pad) is refused
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "a.txt"),
        model_prefix=str(tmp_path / "d"),
        vocab_size=60,
        minloglevel=2,
    )
    with pytest.raises(ValueError, match="special ids"):
        Tokenizer(tmp_path / "d.model")


def test_from_proto_equals_the_file_and_bad_models_are_user_errors(tmp_path) -> None:
    from transformer.errors import UserError

    lines = [f"a small sentence number {i} about cats and dogs" for i in range(300)]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(lines) + "\n")
    tok = Tokenizer.train([corpus], tmp_path / "spm", vocab_size=400)
    from_bytes = Tokenizer.from_proto((tmp_path / "spm.model").read_bytes())
    assert from_bytes.encode(lines[7]) == tok.encode(lines[7])
    assert from_bytes.decode(tok.encode(lines[7])) == lines[7]
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"junk")
    with pytest.raises(UserError, match="bad.model: not a readable sentencepiece model"):
        Tokenizer(bad)
    with pytest.raises(UserError, match="not a readable sentencepiece model"):
        Tokenizer.from_proto(b"junk")


SYMBOLS = ["(S", ")S", "(NP", ")NP", "(VP", ")VP", "XX"]


def test_user_symbols_are_one_piece_each_and_round_trip(tmp_path):
    """§6.3: every tree token must stay one symbol, and cost one piece (no separate "▁")."""
    lines = write_corpus(tmp_path / "a.txt", seed=2)
    tree = "(S (NP XX XX )NP (VP XX (NP XX )NP )VP XX )S"
    with open(tmp_path / "a.txt", "a", encoding="utf-8") as f:
        f.write((tree + "\n") * 50)
    tok = Tokenizer.train(
        [tmp_path / "a.txt"], tmp_path / "spm", vocab_size=320, num_threads=1, user_symbols=SYMBOLS
    )
    ids = tok.encode(tree)
    assert len(ids) == len(tree.split())
    assert [tok.id_to_piece(i) for i in ids] == ["\u2581" + t for t in tree.split()]
    assert tok.decode(ids) == tree
    assert tok.decode(tok.encode(lines[0])) == lines[0]  # ordinary text unaffected
    assert tok.vocab_size == 320  # the symbols count towards the vocabulary size


def test_user_symbols_with_spaces_are_rejected(tmp_path):
    write_corpus(tmp_path / "a.txt")
    with pytest.raises(ValueError, match="without spaces"):
        Tokenizer.train([tmp_path / "a.txt"], tmp_path / "spm", 320, user_symbols=["(N P"])


def test_the_model_keeps_no_path_of_the_machine_it_was_trained_on(tokenizer, tmp_path):
    # issue 18: model files carried prepare's temporary directory (`.OUT.partial-PID/...`)
    proto = tokenizer.model_path.read_bytes()
    directory = str(tokenizer.model_path.parent).encode()
    assert directory not in proto and b"a.txt" in proto and b"b.txt" in proto
    sp = spm.SentencePieceProcessor(model_proto=proto)
    assert sp.encode("the dog runs.") == tokenizer.encode("the dog runs.")
    # an older model that still has them loses them on the way into a model file
    write_corpus(tmp_path / "c.txt")
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "old"), vocab_size=60,
        minloglevel=2,
    )  # fmt: skip
    old = (tmp_path / "old.model").read_bytes()
    assert str(tmp_path).encode() in old
    stripped = strip_build_paths(old)
    assert str(tmp_path).encode() not in stripped and b"c.txt" in stripped
    assert spm.SentencePieceProcessor(model_proto=stripped).encode("a dog.") == (
        spm.SentencePieceProcessor(model_proto=old).encode("a dog.")
    )
    assert strip_build_paths(b"\x00not a model") == b"\x00not a model"


def test_lowercase_tokenizer_lowercases_every_input(tokenizer):
    """A model trained on lowercased text (`prepare --lowercase`) reads its input lowercased."""
    lc = Tokenizer(tokenizer.model_path, lowercase=True)
    text = "Der MANN läuft im Park. ÄÖÜ"
    assert tokenizer.encode(text) != tokenizer.encode(text.lower())  # the case is seen...
    assert lc.encode(text) == tokenizer.encode(text.lower())  # ...unless the model is lowercase
    assert lc.encode_batch([text, "A Dog."]) == tokenizer.encode_batch([text.lower(), "a dog."])
    proto = tokenizer.model_path.read_bytes()
    assert Tokenizer.from_proto(proto, lowercase=True).encode(text) == lc.encode(text)
    assert not Tokenizer.from_proto(proto).lowercase
