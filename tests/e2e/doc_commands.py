#!/usr/bin/env python3
"""The command lines of README.md and docs/*.md still parse.

Usage: doc_commands.py TITAN3D REPO

Every `titan3d <verb> ...` line in a code block (fenced, or indented by four spaces; a `$ `
prompt, an `mpirun ...` / `srun ...` prefix and `\\` continuations allowed; a synopsis with
`[--flag ARG]` brackets counts too) is checked against the binary, and no rank starts:

- the verb is one of `titan3d --help`'s;
- each of its options is one of `titan3d <verb> --help`'s, options that take a value have one,
  every REQUIRED option is given, and the positionals fit the verb's (as CLI11 would parse them);
- each `--set KEY=VALUE` names a key of `titan3d keys`;
- where the verb has `--dry-run` (train), the line runs with it in a scratch directory and must
  print `recipe ok` with exit 0. There `recipes/` is the repository's, `data/fortunes.txt` the ASCII
  of README.md and docs/*.md, a recipe the repository lacks (a placeholder such as `r.toml`) is
  `recipes/tiny.toml`, and a `data.tokenizer` the line sets is trained small first.

A failure names the file:line of the command. Exit 0: all parse; 1: one or more do not.
"""
import os
import re
import shlex
import subprocess
import sys
import tempfile

STOP = {"&&", "||", "|", ";", "&", ">", ">>", "<", "2>&1", "2>"}
LAUNCHERS = {"mpirun", "mpiexec", "srun", "exec"}


def is_titan3d(word):
    return word == "titan3d" or word.endswith("/titan3d")


def code_lines(path):
    """(line number, text) of the lines in code blocks, continuations joined."""
    lines = open(path, encoding="utf-8").read().split("\n")
    fence = None
    prev_blank, in_indented = True, False
    out = []
    for i, line in enumerate(lines, 1):
        stripped = line.lstrip()
        if fence is None and (stripped.startswith("```") or stripped.startswith("~~~")):
            fence = stripped[:3]
            continue
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            else:
                out.append((i, stripped))
            prev_blank = False
            continue
        indented = line.startswith("    ") and (prev_blank or in_indented)
        if indented:
            out.append((i, line[4:]))
        in_indented = indented
        prev_blank = not line.strip()
    joined, pending = [], None
    for i, text in out:
        if pending is not None:
            pending = (pending[0], pending[1] + " " + text.strip())
        else:
            pending = (i, text)
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1])
            continue
        joined.append(pending)
        pending = None
    if pending is not None:
        joined.append(pending)
    return joined


def command_of(text):
    """The titan3d argument list of a code line (verb first), or None if it runs no titan3d."""
    text = text.strip()
    if text.startswith("$ "):
        text = text[2:]
    if not text or text.startswith("#"):
        return None
    first = text.split()[0]
    if not (is_titan3d(first) or first in LAUNCHERS):
        return None
    try:
        words = shlex.split(text, comments=True)
    except ValueError as e:
        raise ValueError(f"cannot split the line into words ({e})")
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words.pop(0)  # VAR=value prefixes
    if not words:
        return None
    if words[0] in LAUNCHERS:
        at = next((k for k, w in enumerate(words) if is_titan3d(w)), None)
        if at is None:
            return None
        words = words[at:]
    if not is_titan3d(words[0]):
        return None
    args = []
    for w in words[1:]:
        if w in STOP or w.startswith(">"):
            break
        args.append(w)
    return args


class Verb:
    """A verb's options and positionals, read from `titan3d VERB --help` (CLI11's layout)."""

    def __init__(self, help_text):
        self.options = {}  # name -> (takes a value, repeatable)
        self.required = []  # required option names
        self.positionals = []  # (name, required)
        section = None
        for line in help_text.split("\n"):
            if re.match(r"^[A-Z][a-z]+:$", line):
                section = line[:-1]
                continue
            if section == "Options":
                m = re.match(r"^  (?:(-\w),)?(--[\w-]+)(?: ([A-Z][^ ]*)( \.\.\.)?)?(.*)$", line)
                if not m:
                    continue
                takes, repeatable = m.group(3) is not None, m.group(4) is not None
                for name in (m.group(1), m.group(2)):
                    if name:
                        self.options[name] = (takes, repeatable)
                if re.match(r"^\s*REQUIRED\b", m.group(5) or ""):
                    self.required.append(m.group(2))
            elif section == "Positionals":
                m = re.match(r"^  (\w+) [A-Z]\S*( REQUIRED)?", line)
                if m:
                    self.positionals.append((m.group(1), m.group(2) is not None))


def is_option(word):
    return word.startswith("-") and not re.match(r"^-\d", word)


def check_parse(verb_name, verb, args):
    """Problems with `args` (after the verb) as CLI11 would parse them, and the --set values."""
    problems, given, positionals, sets = [], set(), 0, []
    k = 0
    while k < len(args):
        word = args[k]
        k += 1
        if not is_option(word):
            positionals += 1
            continue
        name, eq, inline = word.partition("=")
        if name not in verb.options:
            problems.append(f"`{verb_name}` has no option `{name}` (titan3d {verb_name} --help)")
            continue
        given.add(name)
        takes, repeatable = verb.options[name]
        if not takes:
            if eq:
                problems.append(f"`{name}` is a flag and takes no value")
            continue
        values = [inline] if eq else []
        # One value, or (a repeatable option) every word up to the next option.
        while k < len(args) and not is_option(args[k]) and (repeatable or not values):
            values.append(args[k])
            k += 1
        if not values:
            problems.append(f"`{name}` needs a value")
        if name == "--set":
            sets += values
    if "-h" in given or "--help" in given:
        return problems, sets
    for name in verb.required:
        if name not in given:
            problems.append(f"the required option `{name}` is missing")
    needed = sum(1 for _, required in verb.positionals if required)
    if positionals < needed:
        problems.append(f"{needed} positional argument(s) needed, {positionals} given")
    if positionals > len(verb.positionals):
        problems.append(f"{positionals} positional arguments; `{verb_name}` takes "
                        f"{len(verb.positionals)}")
    return problems, sets


def run(cmd, cwd=None, timeout=30):
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def main():
    titan3d, repo = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    docs = [os.path.join(repo, "README.md")] + sorted(
        os.path.join(repo, "docs", f) for f in os.listdir(os.path.join(repo, "docs"))
        if f.endswith(".md"))

    rc, top_help, err = run([titan3d, "--help"])
    verbs = {}
    in_subcommands = False
    for line in top_help.split("\n"):
        if line.startswith("Subcommands:"):
            in_subcommands = True
        elif in_subcommands and re.match(r"^  [a-z]", line):
            verbs[line.split()[0]] = None
    if rc != 0 or not verbs:
        print(f"FAIL: `titan3d --help` (exit {rc}) lists no verbs: {top_help}{err}")
        return 1
    rc, keys_out, err = run([titan3d, "keys"])
    keys = set(re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \|", keys_out, re.M))
    if rc != 0 or len(keys) < 20:
        print(f"FAIL: `titan3d keys` (exit {rc}) lists {len(keys)} keys: {err}")
        return 1

    scratch = tempfile.mkdtemp(prefix="doc_commands.")
    os.symlink(os.path.join(repo, "recipes"), os.path.join(scratch, "recipes"))
    os.makedirs(os.path.join(scratch, "data"))
    with open(os.path.join(scratch, "data", "fortunes.txt"), "w", encoding="utf-8") as corpus:
        for path in docs:  # ASCII: a small tokenizer covers every character
            corpus.write(open(path, encoding="utf-8").read().encode("ascii", "ignore").decode())

    failures, checked, dry_runs = 0, 0, 0
    try:
        for path in docs:
            rel = os.path.relpath(path, repo)
            for lineno, text in code_lines(path):
                where = f"{rel}:{lineno}"
                try:
                    args = command_of(text)
                except ValueError as e:
                    print(f"FAIL {where}: {e}: {text}")
                    failures += 1
                    continue
                if args is None:
                    continue
                if not args or args[0] in ("--help", "-h"):
                    checked += 1
                    continue  # `titan3d --help`: read above
                verb_name = args[0]
                if not re.fullmatch(r"[a-z][a-z-]*", verb_name):
                    continue  # output such as `titan3d selfcheck: 8 ranks`, not a command
                checked += 1
                if verb_name not in verbs:
                    print(f"FAIL {where}: `{verb_name}` is not a titan3d verb "
                          f"({', '.join(verbs)}): {text}")
                    failures += 1
                    continue
                if verbs[verb_name] is None:
                    verbs[verb_name] = Verb(run([titan3d, verb_name, "--help"])[1])
                verb = verbs[verb_name]
                # A synopsis (`[--top N]`, `[--set k=v ...]`) is read without its brackets and
                # ellipses; its placeholders (`k=v`, `KEY=VALUE`) are not keys.
                synopsis = any(a.startswith("[") for a in args[1:])
                words = args[1:]
                if synopsis:
                    words = [w.strip("[]") for w in words]
                    words = [w for w in words if w not in ("", "...", "|")]
                problems, sets = check_parse(verb_name, verb, words)
                for s in sets:
                    key = s.partition("=")[0]
                    if synopsis and not re.fullmatch(r"[a-z_]+\.[a-z_0-9]+", key):
                        continue
                    if "=" not in s or key not in keys:
                        problems.append(f"`--set {s}`: `{key}` is not a recipe key (titan3d keys)")
                if not problems and not synopsis and "--dry-run" in verb.options:
                    problems += dry_run(titan3d, scratch, repo, args, sets)
                    dry_runs += 1
                if problems:
                    failures += 1
                    print(f"FAIL {where}: {text.strip()}")
                    for p in problems:
                        print(f"       {p}")
                else:
                    print(f"ok   {where}: titan3d {shlex.join(args)}")
    finally:
        subprocess.run(["rm", "-rf", scratch])

    if checked < 20:
        print(f"FAIL: only {checked} command lines found in README.md and docs/*.md")
        return 1
    print(f"{checked} command lines checked ({dry_runs} with --dry-run), {failures} failed")
    return 1 if failures else 0


def dry_run(titan3d, scratch, repo, args, sets):
    """Problems of `titan3d ARGS --dry-run` run in the scratch directory."""
    args = list(args)
    notes = []
    for k, a in enumerate(args):
        if a.endswith(".toml") and not os.path.exists(os.path.join(scratch, a)) and not (
                k > 0 and args[k - 1].startswith("-")):
            args[k] = "recipes/tiny.toml"
            notes.append(f"{a} -> recipes/tiny.toml")
    for s in sets:
        key, _, value = s.partition("=")
        value = value.strip().strip('"')
        if key == "data.tokenizer" and value != "bytes" and not os.path.exists(
                os.path.join(scratch, value)):
            os.makedirs(os.path.dirname(os.path.join(scratch, value)) or scratch, exist_ok=True)
            rc, out, err = run([titan3d, "tokenize", "data/fortunes.txt", "--vocab", "512",
                                "--tokenizer", value], cwd=scratch, timeout=60)
            if rc != 0:
                return [f"training the tokenizer {value} for the dry run failed: {out}{err}"]
    if "--dry-run" not in args:
        args.append("--dry-run")
    env = dict(os.environ)
    for name in list(env):  # a titan3d under a launcher would join its world
        if name.startswith(("OMPI_", "PMI", "PMIX_", "SLURM_")):
            del env[name]
    try:
        p = subprocess.run([titan3d] + args, cwd=scratch, capture_output=True, text=True,
                           timeout=30, env=env)
    except subprocess.TimeoutExpired:
        return ["`--dry-run` did not finish in 30 s"]
    if p.returncode != 0 or "recipe ok" not in p.stdout:
        note = f" (placeholders: {', '.join(notes)})" if notes else ""
        return [f"`titan3d {shlex.join(args)}` exited {p.returncode}{note}: "
                f"{(p.stdout + p.stderr).strip()}"]
    return []


if __name__ == "__main__":
    sys.exit(main())
