#!/usr/bin/env python3
"""Python SentencePiece (Debian's python3-sentencepiece) encodes a text as titan3d did.

usage: sentencepiece_check.py TOKENIZER.model TEXT TOKENS.bin

Applies titan3d's documented encoding contract (runtime/data/text_tokenizer.h): the text cut at
'\\n', each line through sp.encode, each '\\n' the byte piece <0x0A>; then compares with the llm.c
token file titan3d wrote (version 1: uint16, version 2: uint32). Exit 0 when equal, 1 otherwise.
"""
import struct
import sys

import sentencepiece as spm


def read_tokens(path):
    with open(path, "rb") as f:
        raw = f.read()
    magic, version, count = struct.unpack_from("<3i", raw, 0)
    assert magic == 20240520, f"{path}: not an llm.c token file"
    width = {1: "H", 2: "I"}[version]
    return list(struct.unpack_from(f"<{count}{width}", raw, 1024))


def main():
    model, text_path, tokens_path = sys.argv[1:4]
    sp = spm.SentencePieceProcessor(model_file=model)
    with open(text_path, encoding="utf-8", newline="") as f:
        text = f.read()
    newline = sp.piece_to_id("<0x0A>")
    ids = []
    lines = text.split("\n")
    for i, line in enumerate(lines):
        ids += sp.encode(line)
        if i + 1 < len(lines):
            ids.append(newline)
    ours = read_tokens(tokens_path)
    if ids != ours:
        first = next((i for i, (a, b) in enumerate(zip(ids, ours)) if a != b), min(len(ids), len(ours)))
        print(f"differ: python {len(ids)} ids, titan3d {len(ours)}; first difference at {first}")
        return 1
    if sp.decode(ids) != text:
        print("python's decode does not give the text back")
        return 1
    print(f"same {len(ids)} ids; decode gives the text back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
