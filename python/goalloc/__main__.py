"""The `goalloc` command, and `python -m goalloc`: goalloc's command-line tool.

The tool (`goalloc replay TRACE --compare --html out.html`, `goalloc help`)
is a Go program; the wheel carries it as goalloc/bin/goalloc, built with the
library. This module replaces the Python process with it, so arguments,
standard streams, signals and the exit status are the tool's own.
`goalloc --version` is answered here, with the package's version (the tool
built with it says the same), so also where the tool is missing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

TOOL_ENV = "GOALLOC_TOOL"
TOOL_NAME = "goalloc"
VERSION_ARGS = ("--version", "-version", "version")  # the tool's own spellings


def tool_path() -> str:
    """Path of the goalloc tool: $GOALLOC_TOOL if set, else the copy in the
    package. Raises FileNotFoundError, saying how to get one, if there is none."""
    env = os.environ.get(TOOL_ENV)
    if env:
        p = Path(env).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise FileNotFoundError(
                f"goalloc: {TOOL_ENV}={env!r} is not an executable file; point it at a "
                f"goalloc tool built with `make tool`, or unset it to use the one in the package."
            )
        return str(p)
    p = Path(__file__).resolve().parent / "bin" / TOOL_NAME
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise FileNotFoundError(
            f"goalloc: the goalloc tool is not in this installation ({p} is missing): the "
            f"package was installed without Go and without {TOOL_ENV}. Reinstall it where Go "
            f"is (`pip install .` builds the tool), or build it elsewhere with `make tool` and "
            f"set {TOOL_ENV}=/path/to/goalloc."
        )
    return str(p)


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Run the tool with argv (default: this process's arguments)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] and args[0] in VERSION_ARGS:
        from goalloc import __version__

        print(f"{TOOL_NAME} {__version__}")
        sys.exit(0)
    try:
        path = tool_path()
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        sys.exit(127)  # the shell's "command not found"
    sys.stdout.flush()
    sys.stderr.flush()
    # argv[0] "goalloc": the tool names itself by it in its messages.
    os.execv(path, [TOOL_NAME, *args])


if __name__ == "__main__":
    main()
