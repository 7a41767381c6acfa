"""The manylinux platform tag of goalloc's wheel, read off the files it ships.

PyPI takes Linux wheels only under a manylinux tag: manylinux_2_X_<arch>
promises that the wheel's native files need no more than glibc 2.X and
libraries every such system has. The tag therefore follows from the files
(what `auditwheel show` reports), not from the machine that built them:

  - every library a file names in DT_NEEDED must be one that manylinux
    allows (libc, libm, libstdc++, libgcc_s, ...); anything else would have
    to be bundled, and the wheel stays linux_<arch>;
  - each symbol version a file needs from them (GLIBC_2.34, GLIBCXX_3.4.21,
    ...) sets a floor on X: GLIBC_2.Y needs X >= Y, and the C++ runtime's
    versions need the glibc of the oldest manylinux base system whose
    compiler shipped them (POLICIES below).

Both native files are plain ELF read by ctypes and exec, not Python
extension modules, so this module reads them with the standard library.
setup.py calls manylinux_tag() on the wheel's files; tests/test_package.py
checks it on a real build.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterable, Optional

# The libraries a manylinux wheel may link without bundling them: the
# auditwheel policy's list (the same for every manylinux_2_X from 2_24 on)
# narrowed to those a CUDA allocator could plausibly need, plus the dynamic
# loader, which every dynamically linked file names.
ALLOWED_LIBRARIES = frozenset({
    "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
    "libgcc_s.so.1", "libstdc++.so.6", "libatomic.so.1", "libutil.so.1",
    "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1",
})

# The newest GLIBCXX, CXXABI and GCC (libgcc_s) symbol versions each
# manylinux_2_X allows on x86_64, from auditwheel's manylinux-policy.json.
# A file needing a newer one needs the next row's glibc.
POLICIES: list[tuple[int, dict[str, tuple[int, ...]]]] = [
    (17, {"GLIBCXX": (3, 4, 19), "CXXABI": (1, 3, 7), "GCC": (4, 8, 0)}),
    (24, {"GLIBCXX": (3, 4, 22), "CXXABI": (1, 3, 10), "GCC": (4, 8, 0)}),
    (27, {"GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11), "GCC": (7, 0, 0)}),
    (31, {"GLIBCXX": (3, 4, 28), "CXXABI": (1, 3, 12), "GCC": (7, 0, 0)}),
    (34, {"GLIBCXX": (3, 4, 29), "CXXABI": (1, 3, 13), "GCC": (7, 0, 0)}),
    (35, {"GLIBCXX": (3, 4, 30), "CXXABI": (1, 3, 13), "GCC": (12, 0, 0)}),
    (39, {"GLIBCXX": (3, 4, 33), "CXXABI": (1, 3, 15), "GCC": (14, 0, 0)}),
]

# Symbol versions that are not numbered but still say something about glibc.
SPECIAL_GLIBC = {"GLIBC_ABI_DT_RELR": 36}  # packed relocations, glibc 2.36

_SHT_DYNAMIC = 6
_SHT_GNU_VERNEED = 0x6FFFFFFE
_DT_NEEDED = 1
_MACHINES = {62: "x86_64", 183: "aarch64"}


class ELFInfo:
    """What the manylinux check needs from one ELF file."""

    def __init__(self, machine: str, needed: list[str], versions: dict[str, set[str]]):
        self.machine = machine
        self.needed = needed  # DT_NEEDED library names
        self.versions = versions  # library -> symbol versions needed from it


def is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def read_elf(path: Path) -> ELFInfo:
    """DT_NEEDED and the version references (.gnu.version_r) of a 64-bit
    little-endian ELF file, the only kind goalloc builds."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    (machine,) = struct.unpack_from("<H", data, 0x12)
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info
        sections.append(struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize))

    def string(table: int, offset: int) -> str:
        start = sections[table][4] + offset
        return data[start:data.index(b"\0", start)].decode()

    needed: list[str] = []
    versions: dict[str, set[str]] = {}
    for _, kind, _, _, offset, size, link, info in sections:
        if kind == _SHT_DYNAMIC:
            for pos in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", data, pos)
                if tag == _DT_NEEDED:
                    needed.append(string(link, value))
        elif kind == _SHT_GNU_VERNEED:
            pos = offset
            for _ in range(info):
                _, count, file, aux, nxt = struct.unpack_from("<HHIII", data, pos)
                names = versions.setdefault(string(link, file), set())
                apos = pos + aux
                for _ in range(count):
                    _, _, _, name, anext = struct.unpack_from("<IHHII", data, apos)
                    names.add(string(link, name))
                    apos += anext
                pos += nxt
    return ELFInfo(_MACHINES.get(machine, f"machine{machine}"), needed, versions)


def _version(text: str) -> Optional[tuple[int, ...]]:
    parts = text.split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def glibc_floor(info: ELFInfo) -> tuple[int, list[str]]:
    """The least glibc minor version (2.X) under which the file runs, and the
    reasons it cannot be manylinux at all (empty if it can)."""
    problems = [f"links {lib}, which manylinux does not allow"
                for lib in info.needed if lib not in ALLOWED_LIBRARIES]
    floor = POLICIES[0][0]
    for names in info.versions.values():
        for name in names:
            prefix, _, number = name.partition("_")
            if name in SPECIAL_GLIBC:
                floor = max(floor, SPECIAL_GLIBC[name])
                continue
            v = _version(number)
            if prefix == "GLIBC" and v is not None and v[0] == 2:
                floor = max(floor, v[1] if len(v) > 1 else 0)
            elif prefix in ("GLIBCXX", "CXXABI", "GCC") and v is not None:
                rows = [g for g, limits in POLICIES if v <= limits[prefix]]
                if rows:
                    floor = max(floor, rows[0])
                else:
                    problems.append(f"needs {name}, newer than any manylinux policy goalloc knows")
            elif prefix in ("GLIBCXX", "CXXABI") and number.startswith(("TM_", "FLOAT128")):
                continue  # allowed by every policy from 2_17 on
            else:
                problems.append(f"needs symbol version {name}, which manylinux does not list")
    return floor, problems


def manylinux_tag(files: Iterable[Path], linux_tag: str) -> tuple[str, list[str]]:
    """The platform tag for a wheel holding files (the ELF ones are read), and
    why it stayed linux_tag if it did. linux_tag is the generic tag
    (linux_x86_64) the build would otherwise use."""
    arch = linux_tag.removeprefix("linux_")
    if not linux_tag.startswith("linux_") or arch != "x86_64":
        return linux_tag, [f"no manylinux policy table here for {linux_tag}"]
    floor, problems = POLICIES[0][0], []
    found = False
    for path in files:
        if not is_elf(path):
            continue
        found = True
        info = read_elf(path)
        if info.machine != arch:
            problems.append(f"{path.name} is built for {info.machine}, not {arch}")
            continue
        f, p = glibc_floor(info)
        floor = max(floor, f)
        problems += [f"{path.name} {why}" for why in p]
    if not found:
        return linux_tag, ["the wheel holds no native file"]
    if problems:
        return linux_tag, problems
    return f"manylinux_2_{floor}_{arch}", []
