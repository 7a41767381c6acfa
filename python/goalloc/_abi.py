"""goalloc.h, the C ABI of libgoalloc.so, as Python reads it.

The header (csrc/goalloc.h, shipped with the package beside the C++ class)
is the one declaration of the library's functions and of its statistics
table. memory_summary() takes its rows from the table (_summary.py);
tests/test_abi_header.py checks the ctypes declarations of _lib.py against
the functions.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

HEADER = Path(__file__).resolve().parent / "csrc" / "goalloc.h"

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_DIRECTIVE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)


@functools.lru_cache(maxsize=None)
def _text() -> str:
    return HEADER.read_text()


def table(name: str) -> tuple[tuple[str, ...], ...]:
    """The entries of the X-macro table name (GOALLOC_STAT_ARRAYS, ...):
    the arguments of each X(...), in order; a string argument unquoted."""
    m = re.search(r"^#define " + re.escape(name) + r"\(X\)((?:[^\n]*\\\n)*[^\n]*)", _text(), re.M)
    if m is None:
        raise LookupError(f"goalloc: {HEADER} defines no table {name}(X)")
    entries = []
    for args in re.findall(r"X\(([^)]*)\)", m.group(1)):
        entries.append(tuple(ast.literal_eval(a) if a.startswith('"') else a
                             for a in (a.strip() for a in args.split(","))))
    return tuple(entries)


def names(name: str) -> tuple[str, ...]:
    """The first argument of each entry of the table name: its names."""
    return tuple(e[0] for e in table(name))


def _c_type(text: str) -> str:
    """A C type as this module writes it: one space between words, none
    before a *, e.g. "const char*"."""
    return re.sub(r"\s*\*", "*", " ".join(text.split()))


def functions() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every function the header declares: name -> (return type, parameter
    types), the types as _c_type writes them (the parameter names dropped)."""
    text = _DIRECTIVE.sub(" ", _COMMENT.sub(" ", _text()))
    text = text.replace('extern "C" {', " ").replace("}", " ")
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for decl in text.split(";"):
        decl = " ".join(decl.split())
        if not decl or decl.startswith(("typedef ", "enum ")):
            continue
        m = re.fullmatch(r"(.+?)\b(\w+)\s*\(([^()]*)\)", decl)
        if m is None:
            raise ValueError(f"goalloc: {HEADER}: {decl!r} is not a function declaration this reader takes")
        ret, name, params = m.groups()
        types = []
        if params.strip() != "void":
            for p in params.split(","):
                pm = re.fullmatch(r"(.*?)\s*\b\w+", p.strip())
                if pm is None or not pm.group(1):
                    raise ValueError(f"goalloc: {HEADER}: {name}: parameter {p!r} has no name")
                types.append(_c_type(pm.group(1)))
        out[name] = (_c_type(ret), tuple(types))
    return out
