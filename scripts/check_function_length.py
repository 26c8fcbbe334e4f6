#!/usr/bin/env python3
"""Lists C++ functions longer than a limit.

usage: scripts/check_function_length.py DIR_OR_FILE [...] LIMIT

Scans *.h, *.hpp, *.cc, *.cpp, *.cu and *.cuh files under each path and prints every function
(free function, member function defined in or out of its class, constructor) whose definition is
longer than LIMIT lines, counted from the line of its opening brace to the line of its closing
brace, both included. Lambdas and local classes count towards the function they are written in.
Exit status: 0 when there is none, 1 when there are offenders (listed as path:line: name: N lines),
2 on a usage error.

How it finds functions: comments, string and character literals (raw strings too) and preprocessor
lines are blanked out; the remaining text is walked brace by brace. At namespace, class or file
scope a '{' opens a function body when the declaration before it has a parameter list and is
neither an initializer ('= {') nor a class, struct, union, enum or namespace; member initializers
of a constructor ('a_{x}') are skipped. A heuristic, not a C++ parser: unbalanced braces between
#if branches would confuse it.
"""
import os
import re
import sys

EXTENSIONS = (".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh")
SCOPE_KEYWORDS = re.compile(r"\b(namespace|class|struct|union)\b")
ENUM_KEYWORD = re.compile(r"\benum\b")
ATTRIBUTES = {"__launch_bounds__", "__attribute__", "__declspec", "alignas", "__align__"}


def blank(text):
    """Text with comments, literals and preprocessor lines replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if line_start and c == "#":  # a preprocessor line, with its continuations
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        raw = re.match(r'(?:u8|u|U|L)?R"([^()\\ ]{0,16})\(', text[i:i + 24])
        if raw and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find(")" + raw.group(1) + '"', i + raw.end())
            j = n if end < 0 else end + len(raw.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum() and text[i - 1 : i + 1] != "L'":
                out.append(" ")  # a digit separator (1'000)
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else " " * (j - i))
            i = j
            continue
        out.append(c)
        if c == "\n":
            line_start = True
        i += 1
    return "".join(out)


def function_name(decl):
    """The name before the parameter list of a declaration ('Foo::bar', 'operator()')."""
    decl = re.sub(r"operator\s*\(\s*\)", "operator__call", decl)
    depth = 0
    for k, ch in enumerate(decl):
        if ch == "(":
            if depth == 0:
                head = decl[:k].rstrip()
                m = re.search(r"(operator\s*[^\s\w(]+|[~\w:]+)\s*$", head)
                if not m:
                    return "?"
                if m.group(1) not in ATTRIBUTES:
                    return m.group(1).replace("operator__call", "operator()")
            depth += 1
        elif ch == ")":
            depth -= 1
    return "?"


def has_ctor_initializers(decl):
    """True when the declaration's parameter list is followed by ': member(...)'."""
    close = decl.find(")")
    return close >= 0 and re.search(r"\)[^;{}]*?(?<!:):(?!:)", decl) is not None


def is_initializer(decl):
    """True when the '{' that follows `decl` starts an initializer, not a body."""
    stripped = re.sub(r"operator\s*[^\s(]*\s*\(", "operator(", decl)
    depth = 0
    for ch in stripped:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "=" and depth == 0:
            return True
    return False


def long_functions(path, limit):
    with open(path, encoding="utf-8", errors="replace") as f:
        text = blank(f.read())
    found = []
    # Each open brace: ("scope" | "function" | "other", start offset, function name).
    stack = []
    decl_start = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        in_function = any(kind == "function" for kind, _, _ in stack)
        if c in ";":
            if not in_function:
                decl_start = i + 1
        elif c == "{":
            if in_function:
                stack.append(("other", i, None))
            else:
                decl = " ".join(text[decl_start:i].split())
                before = text[:i].rstrip()
                if ENUM_KEYWORD.search(decl) or is_initializer(decl):
                    stack.append(("other", i, None))
                elif "(" in decl and has_ctor_initializers(decl) and before and (before[-1].isalnum() or before[-1] == "_"):
                    # 'member_{value}' in a constructor's initializer list: skip to its '}'.
                    depth, j = 0, i
                    while j < n:
                        depth += text[j] == "{"
                        depth -= text[j] == "}"
                        if depth == 0:
                            break
                        j += 1
                    i = j + 1
                    continue
                elif "(" in decl and not SCOPE_KEYWORDS.match(decl):
                    stack.append(("function", i, function_name(decl)))
                else:
                    stack.append(("scope", i, None))
                    decl_start = i + 1
        elif c == "}":
            if stack:
                kind, start, name = stack.pop()
                if kind == "function":
                    first = text.count("\n", 0, start) + 1
                    last = text.count("\n", 0, i) + 1
                    if last - first + 1 > limit:
                        found.append((first, name, last - first + 1))
            if not any(kind == "function" for kind, _, _ in stack):
                decl_start = i + 1
        elif c == ":" and not in_function:
            # 'public:' / 'private:' / 'protected:' end a declaration in a class.
            m = re.search(r"\b(public|private|protected)\s*$", text[decl_start:i])
            if m and text[i + 1 : i + 2] != ":":
                decl_start = i + 1
        i += 1
    return found


def source_files(root):
    if os.path.isfile(root):
        yield root
        return
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(EXTENSIONS):
                yield os.path.join(d, f)


def main(argv):
    if len(argv) < 3 or not argv[-1].isdigit():
        sys.stderr.write(__doc__.split("\n\n")[1] + "\n")
        return 2
    limit = int(argv[-1])
    offenders = []
    for root in argv[1:-1]:
        if not os.path.exists(root):
            sys.stderr.write(f"{root}: no such file or directory\n")
            return 2
        for path in source_files(root):
            offenders += [(path, line, name, length) for line, name, length in long_functions(path, limit)]
    for path, line, name, length in offenders:
        print(f"{path}:{line}: {name}: {length} lines (limit {limit})")
    if offenders:
        print(f"{len(offenders)} function(s) over {limit} lines")
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
