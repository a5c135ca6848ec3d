#!/usr/bin/env python3
"""Recipe fuzzer: random mutations of the recipes in recipes/, each checked by
`titan3d train --dry-run` (a few by `titan3d plan`) under a time limit.

Usage: recipe_fuzz.py TITAN3D RECIPES_DIR [--cases N] [--seed S] [--limit-s T]

Every case must end with exit 0 or 2 within the time limit, never by a signal, an internal error
(exit 1) or C++ runtime noise; an exit 2 must print one `titan3d:` line. A literal too large for
64 bits placed on a recipe key must be refused (exit 2), never clamped into an accepted run.
Seeded and reproducible: the seed is printed, and a failing case is printed and kept in
$T3D_FUZZ_KEEP (default: a temporary directory that is left in place on failure).
"""
import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time

INTS = ["0", "-1", "1", "2", "3", "7", "1024", "2147483648", "4294967298", "1099511627776",
        "4611686018427387904", "4611686018427387905", "9223372036854775807",
        "-9223372036854775808", "0x7FFFFFFFFFFFFFFF", "1_000_000", "+5", "0o777", "0b101"]
OVERFLOWS = ["99999999999999999999", "-99999999999999999999", "9223372036854775808",
             "0xFFFFFFFFFFFFFFFFFF", "18_446_744_073_709_551_616"]
FLOATS = ["inf", "-inf", "nan", "+nan", "1e308", "1e999", "-1e999", "-0.0", "1e-320", "1e-9",
          "0.5", "3.0", "1e12", "2.5e-3"]
STRINGS = ['""', '"x"', '"' + "y" * 5000 + '"', '"every:99999999999999999999"', '"every:0"',
           '"every:-1"', '"every:"', '"every:3"', '"full"', '"none"', '"zb_v"', '"interleaved_1f1b"',
           '"gpipe"', '"bf16"', '"Haswell"', '"bogus"', '"latest"', '"/proc/self/mem"',
           '"../../../../etc/passwd"', "'literal'", '"""multi\nline"""', '"\\u00e9\\t"']
OTHERS = ["true", "false", "[]", "[1, 2, 3]", "[4611686018427387904]", "[-1]", '["a"]', "{}",
          "{ a = 1 }", "1979-05-27T07:32:00Z", "07:32:00", "[[1], [2]]"]
GARBAGE = [b"\x00", b"\xff\xfe", b"[[[[", b"]]]", b"{", b"=", b'"', b"'''", b"\n[model]\n",
           b"\n[[run]]\n", b"#", b"\\", b"\r", b"\x1b[31m", b"\xc3\x28"]


def pick_value(rng):
    kind = rng.random()
    if kind < 0.3:
        return rng.choice(INTS)
    if kind < 0.45:
        return rng.choice(FLOATS)
    if kind < 0.65:
        return rng.choice(STRINGS)
    if kind < 0.8:
        return rng.choice(OTHERS)
    depth = rng.choice([2, 5, 33, 200, 5000, 30000])
    opener, closer = rng.choice([("[", "]"), ("{a=", "}")])
    return opener * depth + ("1" if opener != "[" else "") + closer * depth


KEY_LINE = re.compile(r"^(\s*)([A-Za-z_][A-Za-z0-9_]*)(\s*=\s*)(.*)$")


def mutate(rng, text, keys):
    """One to three mutations of the recipe text; returns (text, sets, must_refuse, what)."""
    lines = text.split("\n")
    sets, what, must_refuse = [], [], False
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        key_lines = [i for i, l in enumerate(lines) if KEY_LINE.match(l)]
        op = rng.random()
        if op < 0.35 and key_lines:  # replace a value
            i = rng.choice(key_lines)
            m = KEY_LINE.match(lines[i])
            overflow = rng.random() < 0.15
            value = rng.choice(OVERFLOWS) if overflow else pick_value(rng)
            lines[i] = m.group(1) + m.group(2) + m.group(3) + value
            what.append(f"value of `{m.group(2)}` (line {i + 1}) -> {value[:40]}")
            if overflow:  # the last mutation, so that nothing else can hide or replace it
                # (data.path is replaced by the fuzzer's own --set)
                must_refuse = m.group(2) != "path"
                break
        elif op < 0.45 and key_lines:  # drop a key
            i = rng.choice(key_lines)
            what.append(f"dropped line {i + 1}: {lines[i][:40]}")
            del lines[i]
        elif op < 0.55 and key_lines:  # duplicate a key
            i = rng.choice(key_lines)
            lines.insert(rng.randrange(len(lines) + 1), lines[i])
            what.append(f"duplicated line {i + 1}: {lines[i][:40]}")
        elif op < 0.62:  # an unknown or misspelt key
            i = rng.randrange(len(lines) + 1)
            lines.insert(i, rng.choice(["dimm = 3", "tp.x = 1", "a.b.c = 2", "steps = 1",
                                        ".".join(["z"] * 200) + " = 1"]))
            what.append(f"inserted a stray key at line {i + 1}")
        elif op < 0.72:  # garbage bytes
            raw = "\n".join(lines).encode("utf-8", "surrogateescape")
            pos = rng.randrange(len(raw) + 1)
            junk = rng.choice(GARBAGE) if rng.random() < 0.7 else bytes(
                rng.randrange(256) for _ in range(rng.randrange(1, 16)))
            raw = raw[:pos] + junk + raw[pos:]
            lines = raw.decode("utf-8", "surrogateescape").split("\n")
            what.append(f"garbage {junk!r} at byte {pos}")
        elif op < 0.77:  # truncated file
            joined = "\n".join(lines)
            cut = rng.randrange(len(joined) + 1)
            lines = joined[:cut].split("\n")
            what.append(f"truncated at byte {cut}")
        elif op < 0.82:  # a section header damaged or repeated
            headers = [i for i, l in enumerate(lines) if l.startswith("[")]
            if headers:
                i = rng.choice(headers)
                lines[i] = rng.choice(["[model", "[[model]]", "[model.x]", "[modle]", lines[i] * 2,
                                       "[" + ".".join(["s"] * 100) + "]", "[]"])
                what.append(f"header line {i + 1} -> {lines[i][:40]}")
        else:  # a --set override
            key = rng.choice(keys)
            overflow = rng.random() < 0.1
            if overflow:
                value = rng.choice(OVERFLOWS)
            else:
                value = rng.choice([pick_value(rng), "a\nb", "1\n[model]\ndim = 2", "", "=", "x y"])
            sets.append(f"{key}={value}")
            what.append(f"--set {key}={value[:40]!r}")
            if overflow:
                must_refuse = key != "data.path"
                break
    return "\n".join(lines), sets, must_refuse, "; ".join(what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("titan3d")
    ap.add_argument("recipes")
    ap.add_argument("--cases", type=int, default=int(os.environ.get("T3D_FUZZ_CASES", 300)))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("T3D_FUZZ_SEED", 20240513)))
    ap.add_argument("--limit-s", type=float, default=10.0)
    args = ap.parse_args()
    print(f"recipe fuzz: seed {args.seed}, {args.cases} cases, {args.limit_s} s each "
          f"(rerun: T3D_FUZZ_SEED={args.seed})", flush=True)
    rng = random.Random(args.seed)
    keys = subprocess.run([args.titan3d, "keys"], capture_output=True, text=True, check=True).stdout
    keys = re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)`", keys, re.M)
    assert len(keys) > 40, keys
    sources = sorted(os.path.join(args.recipes, f) for f in os.listdir(args.recipes)
                     if f.endswith(".toml"))
    keep = os.environ.get("T3D_FUZZ_KEEP") or tempfile.mkdtemp(prefix="t3d_fuzz_")
    os.makedirs(keep, exist_ok=True)
    data = os.path.join(keep, "data.txt")
    with open(data, "w") as f:
        f.write("The quick brown fox jumps over the lazy dog.\n" * 200)
    failures, counts, start = 0, {0: 0, 2: 0}, time.time()
    for case in range(args.cases):
        src = rng.choice(sources)
        with open(src, encoding="utf-8") as f:
            text, sets, must_refuse, what = mutate(rng, f.read(), keys)
        path = os.path.join(keep, f"case{case}.toml")
        with open(path, "wb") as f:
            f.write(text.encode("utf-8", "surrogateescape"))
        # Most cases point the data at a file that exists, so validation goes past check_inputs.
        pre = ["--set", f"data.path={data}"] if rng.random() < 0.8 else []
        if rng.random() < 0.15:
            cmd = [args.titan3d, "plan", path] + pre
        else:
            cmd = [args.titan3d, "train", path, "--dry-run"] + pre
        for s in sets:
            cmd += ["--set", s]
        env = dict(os.environ, OMPI_COMM_WORLD_SIZE="", PMIX_RANK="")
        env.pop("OMPI_COMM_WORLD_SIZE"), env.pop("PMIX_RANK")
        problem = None
        try:
            p = subprocess.run(cmd, capture_output=True, timeout=args.limit_s, env=env)
            out = p.stderr.decode("utf-8", "replace") + p.stdout.decode("utf-8", "replace")
            if p.returncode < 0:
                problem = f"killed by signal {-p.returncode}"
            elif p.returncode not in (0, 2):
                problem = f"exit {p.returncode}"
            elif re.search(r"internal error|terminate called|Aborted|what\(\)", out):
                problem = "crash noise"
            elif p.returncode == 2 and out.count("titan3d:") + out.count("--") == 0:
                problem = "exit 2 without a message"
            elif must_refuse and p.returncode == 0 and cmd[1] == "train":
                problem = "a literal beyond 64 bits was accepted (clamped)"
            else:
                counts[p.returncode] += 1
        except subprocess.TimeoutExpired:
            problem, out = f"no answer within {args.limit_s} s (hang)", ""
        if problem:
            failures += 1
            print(f"FAIL case {case} (seed {args.seed}): {problem}\n  from {src}: {what}\n"
                  f"  command: {' '.join(cmd)[:400]}\n  kept: {path}\n  output: {out[-800:]}",
                  flush=True)
    print(f"recipe fuzz: {args.cases} cases in {time.time() - start:.1f} s: {counts[0]} accepted, "
          f"{counts[2]} refused with exit 2, {failures} failures", flush=True)
    if failures:
        print(f"failing cases kept in {keep}")
        return 1
    import shutil
    if not os.environ.get("T3D_FUZZ_KEEP"):
        shutil.rmtree(keep, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
