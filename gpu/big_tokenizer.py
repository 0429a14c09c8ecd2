"""Write a byte-level BPE tokenizer with a Llama-3-sized vocabulary (128,256 ids) in which
every id decodes to visible text, for measuring the output poller's detokenizing cost.

    python3 gpu/big_tokenizer.py DIR [--vocab 128256]

The demo tokenizer has a few hundred entries and decodes the ids a dummy 8B model samples
beyond them to nothing, which makes detokenizing look free. Here the merges are made up
(deterministic, seeded): pairs of existing tokens joined into new ones of 2-12 characters
of lowercase letters, digits, punctuation and a leading space, so each sampled id costs
what a real vocabulary's id costs: a lookup, UTF-8 text, a stop-string scan.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

# GPT-2 byte-to-unicode map: the alphabet a byte-level BPE's vocabulary is written in
_BS = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))


def _byte_alphabet() -> dict[int, str]:
    bs, cs, n = _BS[:], _BS[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build(vocab_size: int = 128256, seed: int = 0) -> Tokenizer:
    b2u = _byte_alphabet()
    vocab = {b2u[b]: b for b in range(256)}
    text_bytes = b"abcdefghijklmnopqrstuvwxyz0123456789.,'-" + b" "
    pieces = [b2u[b] for b in text_bytes]          # what merged tokens are made of
    space = b2u[ord(" ")]
    rng = random.Random(seed)
    merges: list[tuple[str, str]] = []
    tokens = list(pieces)
    while len(vocab) < vocab_size - 2:
        a, b = rng.choice(tokens), rng.choice(tokens)
        if space in b or len(a) + len(b) > 12:     # spaces only lead a token, as in GPT-2
            continue
        t = a + b
        if t in vocab:
            continue
        vocab[t] = len(vocab)
        merges.append((a, b))
        tokens.append(t)
    for special in ("<|begin_of_text|>", "<|end_of_text|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    return tok


def write(d: Path, vocab_size: int = 128256) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json in d; returns the special ids."""
    d.mkdir(parents=True, exist_ok=True)
    tok = build(vocab_size)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}"}))
    return {"bos": tok.token_to_id("<|begin_of_text|>"), "eos": tok.token_to_id("<|end_of_text|>")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--vocab", type=int, default=128256)
    a = ap.parse_args()
    ids = write(Path(a.dir), a.vocab)
    print(f"wrote a {a.vocab}-entry byte-level BPE tokenizer to {a.dir} (bos {ids['bos']}, eos {ids['eos']})")


if __name__ == "__main__":
    main()
