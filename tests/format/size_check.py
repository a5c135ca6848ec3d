#!/usr/bin/env python3
"""Sizes of the product (apps runtime parallel checkpoint kernels; .cpp .h .inc .cu .cuh): no file
over 600 lines and no function over 100, so that a file does one job and a function reads at once.
Prints each offender and fails; split by job (a helper, a file per concern), never by cramming.

A function is found by brace depth over the code with comments, string and character literals and
preprocessor lines blanked out: a '{' at namespace or class scope, outside parentheses, opens a
function body when the text since the previous declaration holds a ')' (a signature) and names no
namespace/class/struct/union/enum outside its template arguments and parentheses; a member's
brace initialiser in a constructor's list ('X() : v_{1}') is not a body. The function's lines run from the first line of its declaration to
its closing '}'; lambdas and local classes inside it count towards it. A ')' before an initialiser
at namespace scope that is not a signature would be misread; the tree has none (the check also
fails on unbalanced braces, so a misread shows).
"""
import os
import re
import sys

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100
FOLDERS = ("apps", "runtime", "parallel", "checkpoint", "kernels")
ENDINGS = (".cpp", ".h", ".inc", ".cu", ".cuh")
CONTAINER = re.compile(r"^extern\b|\b(namespace|class|struct|union|enum)\b")


def opens_container(header):
    """Whether a declaration opens a namespace, class, struct, union, enum or extern "C" block: one
    of those words outside its template arguments, parentheses (requires-clauses, parameters)."""
    outer, previous = header, None
    while outer != previous:  # innermost groups first: <...> without parentheses, then (...)
        previous = outer
        outer = re.sub(r"<[^<>()]*>", " ", outer)
        outer = re.sub(r"\([^()]*\)", " ", outer)
    return CONTAINER.search(outer) is not None


def blank_non_code(text):
    """The text with comments, literals and preprocessor lines replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if line_start and c == "#":  # a directive, with its continuation lines
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append("  \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        line_start = c == "\n"
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"' or (c == "'" and not (i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum())):
            j = i + 1  # a literal; a ' between digits is a digit separator
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(" " * (j - i))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def function_name(header):
    """A readable name for the function a header declares: the identifier before its '('."""
    header = re.sub(r"__\w+__\s*\([^)]*\)", "", header)  # __launch_bounds__(256) and the like
    before = re.sub(r"\[[^\]]*\]\s*$", "", header.split("(")[0].strip()).rstrip("= \t\n")
    names = re.findall(r"[A-Za-z_~][\w:~]*(?:operator\s*\S+)?", before)
    return names[-1] if names else header.strip().split("\n")[0][:40]


def long_functions(code):
    """(first line, lines, name) of each function of the blanked code."""
    found = []
    scopes = []  # per open brace: "container", "function", "other" or "member-init"
    header = []  # characters since the last declaration boundary at this scope
    header_start = None  # offset of the header's first non-space character
    function_open = None  # (offset of the header's start, header) of the outermost open function
    parens = 0
    line_of = lambda offset: code.count("\n", 0, offset) + 1
    for i, c in enumerate(code):
        in_function = any(s == "function" for s in scopes)
        if in_function:
            if c == "{":
                scopes.append("inner")
            elif c == "}":
                if scopes.pop() == "function":
                    start, text = function_open
                    first, last = line_of(start), line_of(i)
                    found.append((first, last - first + 1, function_name(text)))
                    header, header_start = [], None
            continue
        if c == "(":
            parens += 1
        elif c == ")":
            parens -= 1
        if c == "{" and parens == 0:
            text = "".join(header).strip()
            initialises_member = re.search(r"\)\s*:", text) and re.search(r"[\w>]\s*$", text)
            if opens_container(text):
                scopes.append("container")
                header, header_start = [], None
            elif ")" in text and not initialises_member:
                scopes.append("function")
                function_open = (header_start if header_start is not None else i, text)
            else:
                scopes.append("member-init" if initialises_member else "other")
                header.append(c)
            continue
        if c == "}" and parens == 0:
            if not scopes:
                raise ValueError(f"line {line_of(i)}: a '}}' closes nothing")
            kind = scopes.pop()
            if kind in ("member-init", "other"):
                header.append(c)
            else:
                header, header_start = [], None
            continue
        if c == ";" and parens == 0 and (not scopes or scopes[-1] == "container"):
            header, header_start = [], None
            continue
        if not scopes or scopes[-1] == "container":
            if header_start is None and not c.isspace():
                header_start = i
            if header_start is not None:
                header.append(c)
    if scopes or parens:
        raise ValueError(f"unbalanced: {len(scopes)} brace(s) and {parens} parenthesis(es) open at the end")
    return found


def main():
    repo = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    files = sorted(
        os.path.relpath(os.path.join(root, name), repo)
        for folder in FOLDERS
        for root, _, names in os.walk(os.path.join(repo, folder))
        for name in names
        if name.endswith(ENDINGS)
    )
    if len(files) < 150:
        print(f"FAIL: only {len(files)} product files found under {repo}")
        return 1
    problems = []
    functions = 0
    for path in files:
        with open(os.path.join(repo, path), encoding="utf-8", errors="replace") as f:
            text = f.read()
        lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if lines > MAX_FILE_LINES:
            problems.append(f"{path}: {lines} lines (at most {MAX_FILE_LINES} a file)")
        try:
            found = long_functions(blank_non_code(text))
        except ValueError as e:
            problems.append(f"{path}: cannot find its functions: {e}")
            continue
        functions += len(found)
        for first, count, name in found:
            if count > MAX_FUNCTION_LINES:
                problems.append(f"{path}:{first}: {name} is {count} lines (at most {MAX_FUNCTION_LINES} a function)")
    for p in problems:
        print("FAIL: " + p)
    if problems:
        print(f"FAIL: {len(problems)} size problem(s); split them by job (tests/format/size_check.py)")
        return 1
    print(f"{len(files)} product files, {functions} functions: none over {MAX_FILE_LINES} / {MAX_FUNCTION_LINES} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
