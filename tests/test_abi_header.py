"""The Python package against goalloc.h, the C ABI's one declaration.

ctypes trusts what it is told: a function declared with the wrong types,
or not declared at all (ctypes then takes an int result), passes a wrong
value or truncates a pointer without a word. So every ctypes declaration of
_lib.py must agree with the header, every function the package calls through
ctypes must be declared there, and every function whose address the package
hands to torch must be one the header declares. The statistics the package
reads and shows are the header's table.
"""

from __future__ import annotations

import ast
import ctypes
from pathlib import Path
from typing import Any

import goalloc
from goalloc import _abi, _lib, _summary, _torch, _warnings

PACKAGE = Path(_lib.__file__).resolve().parent

# The C types of goalloc.h's declarations, as _abi writes them, and the
# ctypes types that pass such a value unchanged. A C type this table does not
# name fails the test: add it here with the ctypes types that fit it.
_SCALARS: dict[str, tuple[Any, ...]] = {
    "int": (ctypes.c_int,),
    "double": (ctypes.c_double,),
    "ssize_t": (ctypes.c_ssize_t,),
    "size_t": (ctypes.c_size_t,),
    "int64_t": (ctypes.c_int64,),
    "long long": (ctypes.c_longlong,),
    "unsigned long long": (ctypes.c_ulonglong,),
    "char": (ctypes.c_char,),
}


def _fits(c_type: str, ct: Any, result: bool) -> bool:
    """Whether the ctypes type ct carries a value of c_type, as an argument
    or (result) as what the function returns."""
    if c_type == "void":
        return result and ct is None
    if c_type == "goalloc_notify_fn":  # void (*)(void)
        return (isinstance(ct, type) and issubclass(ct, ctypes._CFuncPtr)  # type: ignore[attr-defined]
                and ct._restype_ is None and not ct._argtypes_)
    if c_type.endswith("*"):
        pointee = c_type[:-1].removeprefix("const ")
        if result:
            # A string the library hands out is freed with
            # goalloc_string_free: it must arrive as the address, not as a
            # copy ctypes made (c_char_p), which would leave it to leak.
            return ct is ctypes.c_void_p
        if ct is ctypes.c_void_p:
            return True
        if pointee == "char" and ct is ctypes.c_char_p:
            return True
        return any(ct is ctypes.POINTER(p) for p in _SCALARS.get(pointee, ()))
    if c_type not in _SCALARS:
        raise AssertionError(f"goalloc.h uses the C type {c_type!r}, which this test does not know: add it to _SCALARS")
    return ct in _SCALARS[c_type]


def test_every_ctypes_declaration_is_the_headers():
    declared = _abi.functions()
    wrong = []
    for name, (restype, argtypes) in _lib.SIGNATURES.items():
        if name not in declared:
            wrong.append(f"{name}: not declared in goalloc.h")
            continue
        ret, params = declared[name]
        if not _fits(ret, restype, result=True):
            wrong.append(f"{name}: returns {ret}, declared to ctypes as {restype}")
        if argtypes is None:
            # ctypes then passes a Python int as a C int, and nothing else.
            if any(p != "int" for p in params):
                wrong.append(f"{name}({', '.join(params)}): only a function of ints may go without argtypes")
            continue
        if len(argtypes) != len(params):
            wrong.append(f"{name}: takes {len(params)} arguments ({', '.join(params)}), declared with {len(argtypes)}")
            continue
        for i, (p, ct) in enumerate(zip(params, argtypes)):
            if not _fits(p, ct, result=False):
                wrong.append(f"{name}: argument {i} is {p}, declared to ctypes as {ct}")
    assert not wrong, "ctypes declarations that differ from goalloc.h:\n" + "\n".join(wrong)


def _package_trees() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))}


def _library_name(name: str) -> bool:
    return name.startswith(("goalloc_", "my_"))


def test_the_package_calls_only_declared_functions():
    """Every function of the library the package calls through ctypes
    (lib().goalloc_x, _lib.goalloc_x, ...) has its declaration in
    SIGNATURES."""
    used = {(f, node.attr) for f, tree in _package_trees().items() for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _library_name(node.attr)}
    assert used, "the package calls no function of the library? the test lost its way"
    undeclared = sorted(f"{f}: {name}" for f, name in used if name not in _lib.SIGNATURES)
    assert not undeclared, "called through ctypes without a declaration in _lib.SIGNATURES: " + ", ".join(undeclared)


def test_the_functions_handed_to_torch_are_the_headers():
    """The names whose addresses go to torch (address(), has_function(),
    CUDAPluggableAllocator's malloc and free) are functions goalloc.h declares."""
    handed = set(name for _, name in _torch.GRAPH_HOOKS)
    for tree in _package_trees().values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if fn in ("address", "has_function", "CUDAPluggableAllocator"):
                handed |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                           and _library_name(a.value)}
    assert {"my_malloc", "my_free", "goalloc_init", "goalloc_record_stream"} <= handed, handed
    missing = sorted(handed - set(_abi.functions()))
    assert not missing, f"handed to torch but not declared in goalloc.h: {missing}"


def test_the_notifier_type_is_goalloc_notify_fn():
    assert _fits("goalloc_notify_fn", _warnings.NOTIFY, result=False)


def test_a_wrong_declaration_is_caught():
    """The check itself: a pointer result taken as an int, a 64-bit argument
    as an int, a returned string as a copy, an argument too many."""
    assert not _fits("void*", ctypes.c_int, result=True)
    assert not _fits("long long", ctypes.c_int, result=False)
    assert not _fits("char*", ctypes.c_char_p, result=True)
    assert not _fits("int64_t*", ctypes.POINTER(ctypes.c_int32), result=False)
    assert _fits("const char*", ctypes.c_char_p, result=False)
    assert _fits("int64_t*", ctypes.POINTER(ctypes.c_int64), result=False)


def test_the_summary_rows_are_the_stat_table():
    arrays = _abi.table("GOALLOC_STAT_ARRAYS")
    assert all(len(e) == 3 for e in arrays), "X(name, summary row, summary label)"
    assert sorted(int(e[1]) for e in arrays) == list(range(1, len(arrays) + 1)), "each row once"
    assert [r[0] for r in _summary.rows()] == [e[0] for e in sorted(arrays, key=lambda e: int(e[1]))]
    assert [r[0] for r in _summary.rows()][:3] == ["allocated_bytes", "active_bytes", "requested_bytes"], "torch's order"
    assert {p for p, _ in _summary._POOLS} == set(_abi.names("GOALLOC_STAT_POOLS"))
    assert set(_summary._FIGURES) == set(_abi.names("GOALLOC_STAT_VALUES"))


def test_memory_stats_has_every_figure_of_the_table(device):
    stats = goalloc.memory_stats(device)
    keys = [f"{a}.{p}.{v}" for a in _abi.names("GOALLOC_STAT_ARRAYS") for p in _abi.names("GOALLOC_STAT_POOLS")
            for v in _abi.names("GOALLOC_STAT_VALUES")] + list(_abi.names("GOALLOC_STAT_COUNTERS"))
    assert [k for k in keys if k not in stats] == []
