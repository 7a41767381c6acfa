"""The user documentation says what the code does: its figures are checked
against the library, and it names nothing outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import goalloc

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
USER_DOCS = ["README.md", "TESTING.md", "BENCHMARKS.md", "bench/README.md", "traces/README.md"]


def test_readme_counts_the_statistics_keys_the_library_returns(device):
    m = re.search(r"That is (\d+) keys \((\d+) of torch's, (\d+) of goalloc's\)", README)
    assert m, "README.md no longer counts memory_stats' keys"
    total, torch_keys, own = map(int, m.groups())
    keys = [k for k in goalloc.memory_stats(device) if not k.startswith(("goalloc.bad_input.", "goalloc.driver."))]
    assert (len(keys), len([k for k in keys if not k.startswith("goalloc.")]),
            len([k for k in keys if k.startswith("goalloc.")])) == (total, torch_keys, own)
    for k in keys:
        if k.startswith("goalloc."):
            assert k.removeprefix("goalloc.").split(".")[-1] in README, f"README.md does not name {k}"


def test_readme_statistics_example_gives_the_librarys_figures(raw, device):
    """The README's worked example: its arithmetic, evaluated, equals what
    the library reports for the same sequence."""
    block = README[README.index("# three 1000-byte and two 3,000,000-byte allocations"):]
    block = block[:block.index("```")]
    claims = re.findall(r'^s\["([^"]+)"\]\s+#\s*([0-9_ *+]+(?:KiB|MiB)?[0-9_ *+]*)', block, re.M)
    assert len(claims) == 4, block
    small = [raw.must_malloc(1000, device) for _ in range(3)]
    large = [raw.must_malloc(3_000_000, device) for _ in range(2)]
    raw.free(large[0], 3_000_000, device)
    s = goalloc.memory_stats(device)
    for key, expr in claims:
        python = re.sub(r"(\d+) (KiB|MiB)", lambda m: f"({m[1]} * {1024 if m[2] == 'KiB' else 1 << 20})", expr)
        assert eval(python, {}) == s[key], f"README.md: {key} = {expr.strip()}, the library says {s[key]}"
    for p in small:
        raw.free(p, 1000, device)
    raw.free(large[1], 3_000_000, device)


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / f for f in out.splitlines() if (REPO / f).is_file()]


def test_nothing_refers_to_files_outside_the_repository():
    outside = ["shared" + "/", "PLATFORM" + ".md", "CUDA-DRIVER" + ".md"]
    found = []
    for path in _tracked_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if any(o in line for o in outside):
                found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("doc", USER_DOCS)
def test_user_docs_speak_to_users(doc):
    """Words about how the project was made (who asked, which machine was
    lent) mean nothing to a user."""
    text = (REPO / doc).read_text()
    words = [r"\bthe brief\b", r"\bbrief's\b", r"\bissue asked\b", r"\bwas lent\b", r"\bwere lent\b",
             r"\blent for\b", r"\bGPU lent\b", r"\bthe build machine\b", r"\bbuild-machine\b", r"\bsession\b",
             r"\bthe issue's\b", r"\bthe issue defines\b"]
    found = [f"{doc}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
             if any(re.search(w, line, re.I) for w in words)]
    assert not found, "\n".join(found)
