"""The C++ types of a generated kernel's visitor declarations, parsed (tests only): the
`using` declarations, template-ids and their top-level arguments that `visitors` reads."""

from __future__ import annotations

import re
from dataclasses import dataclass


class EpilogueSourceError(AssertionError):
    """The generated source holds an epilogue this interpreter does not model."""


@dataclass(frozen=True)
class CppType:
    """A C++ type or template argument: `name<args...>::member`."""

    name: str
    args: tuple[CppType, ...] = ()
    member: str = ""

    def __str__(self) -> str:
        args = f"<{', '.join(map(str, self.args))}>" if self.args else ""
        return f"{self.name}{args}{self.member}"


_TOKEN = re.compile(r"\s*(<|>|,|\*|typename\b|[A-Za-z0-9_:.]+)")


def parse_type(text: str) -> CppType:
    """Parse the template-id subset the visitor declarations use (names, numbers, `<...>`, `::member`,
    and a pointer's `*`, kept at the end of the member: a grouped kernel's per-group vectors)."""
    tokens, pos = [], 0
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        if not m:
            raise EpilogueSourceError(f"cannot parse {text[pos:pos + 40]!r} in {text!r}")
        tokens.append(m.group(1))
        pos = m.end()
    at = 0

    def term() -> CppType:
        nonlocal at
        if tokens[at] == "typename":
            at += 1
        name, args, member = tokens[at], [], ""
        at += 1
        if at < len(tokens) and tokens[at] == "<":
            at += 1
            while tokens[at] != ">":
                args.append(term())
                if tokens[at] == ",":
                    at += 1
            at += 1
        while at < len(tokens) and tokens[at].startswith("::"):
            member += tokens[at]
            at += 1
        while at < len(tokens) and tokens[at] == "*":
            member += "*"
            at += 1
        return CppType(name, tuple(args), member)

    out = term()
    if at != len(tokens):
        raise EpilogueSourceError(f"trailing {tokens[at:]} in {text!r}")
    return out


def split_arguments(text: str) -> list[str]:
    """The top-level template arguments of `name<...>`, as text (any C++ inside them)."""
    start = text.index("<") + 1
    args, depth, begin = [], 0, start
    for i in range(start, len(text)):
        c = text[i]
        if c in "<({":
            depth += 1
        elif c in ">)}":
            if depth == 0:
                args.append(text[begin:i].strip())
                return args
            depth -= 1
        elif c == "," and depth == 0:
            args.append(text[begin:i].strip())
            begin = i + 1
    raise EpilogueSourceError(f"unbalanced template arguments in {text[:80]!r}")


def declarations(source: str) -> dict[str, str]:
    """Every `using Name = ...;` of a generated kernel, by name."""
    return {m.group(1): " ".join(m.group(2).split())
            for m in re.finditer(r"^using (\w+) = (.*?);\s*$", source, re.M | re.S)}
