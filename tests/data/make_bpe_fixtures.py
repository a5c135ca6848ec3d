#!/usr/bin/env python3
"""Writes the byte-level BPE fixtures of tests/data/test_byte_bpe.cpp with Hugging Face `tokenizers`.

For each style (GPT-2, Llama 3, Qwen2: their pre-tokenizer split patterns, normalizers, added
tokens and merge options as their published tokenizer.json files have them) a small BPE is trained
on the corpus below and written as fixtures/bpe/<style>/tokenizer.json, with every corpus text and
the ids `tokenizers` encodes it to (no template: add_special_tokens=False) in
fixtures/bpe/<style>/cases.json. The C++ test must reproduce those ids exactly.

  python3 -m venv /tmp/hf && /tmp/hf/bin/pip install tokenizers
  /tmp/hf/bin/python tests/data/make_bpe_fixtures.py     # rewrites the fixtures
"""
import json
import os
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

GPT2 = None  # ByteLevel's own regex
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")

STYLES = {
    "gpt2": dict(pattern=GPT2, nfc=False, ignore_merges=False, special=["<|endoftext|>"]),
    "llama3": dict(pattern=LLAMA3, nfc=False, ignore_merges=True,
                   special=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]),
    "qwen2": dict(pattern=QWEN2, nfc=True, ignore_merges=False,
                  special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
}

TEXTS = [
    "Hello world! It's a test, isn't it? We'll see: they'd've DONE it.",
    "The quick brown fox jumps over the lazy dog 1234567 times; 3.14159 and 2,718.",
    "def add(a, b):\n    return a + b  # sum\n\n\nclass Foo(object):\n\tpass\r\n",
    "for (int i = 0; i < n; ++i) { x[i] += y[i] * 2; }  // C++\n",
    "机器学习是人工智能的一个分支。我们在北京和上海训练模型，共计 12345 个步骤。",
    "日本語のテキストと한국어 텍스트, und deutsche Umlaute: äöü ß; café naïve Ångström.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 — dashes – and “quotes” … ellipsis",
    "   leading spaces, trailing spaces   \n\n  \n tabs\t\tand\u00a0nbsp\u3000ideographic space",
    "Composed é vs decomposed e\u0301, Å vs A\u030a, ﬁ ligature, Ｆｕｌｌｗｉｄｔｈ.",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>",
    "<|begin_of_text|>Text<|eot_id|> and <|endoftext|> in the middle<|end_of_text|>",
    "",
    "a",
    "\n",
    "Numbers: 0 00 000 0000 12345678901234567890 ٣٤٥ ⅻ",
    "Ignore merges: PQRSTU stays whole where the vocabulary has it, PQRST does not.",
]
TRAIN = TEXTS * 20 + [
    "the of and to in is that for it with as was on be by this are or his from at which but "
    "have an they not you were her she he had all one their there been has will more if no "
] * 50


def build(style):
    spec = STYLES[style]
    tok = Tokenizer(models.BPE(ignore_merges=spec["ignore_merges"]))
    if spec["nfc"]:
        tok.normalizer = normalizers.NFC()
    if spec["pattern"] is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(spec["pattern"]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=spec["special"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TRAIN, trainer)
    if spec["ignore_merges"]:
        # A word in the vocabulary that no merge sequence builds: ignore_merges takes it whole.
        j = json.loads(tok.to_str())
        j["model"]["vocab"]["ĠPQRSTU"] = len(j["model"]["vocab"])
        tok = Tokenizer.from_str(json.dumps(j))
    return tok


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bpe")
    for style in STYLES:
        tok = build(style)
        out = os.path.join(root, style)
        os.makedirs(out, exist_ok=True)
        tok.save(os.path.join(out, "tokenizer.json"), pretty=True)
        cases = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in TEXTS]
        with open(os.path.join(out, "cases.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizers_version": __import__("tokenizers").__version__, "cases": cases},
                      f, ensure_ascii=False, indent=1)
        print(style, tok.get_vocab_size(), "ids")
    return 0


if __name__ == "__main__":
    sys.exit(main())
