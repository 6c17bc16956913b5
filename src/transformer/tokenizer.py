"""§5.1 subword model: train, load, encode, decode (sentencepiece)."""

from __future__ import annotations

# Special-token ids, defined here and nowhere else. sentencepiece is trained with these ids.
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
