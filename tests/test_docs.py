"""The user documentation says what the code does: its figures are checked
against the library, and it names nothing outside the repository."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

import goalloc
from goalloc_testing import load_bench

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


# --- the documents people read stay short, and quote the kept results ----------------

@pytest.mark.parametrize("doc,most", [("README.md", 300), ("BENCHMARKS.md", 400), ("TESTING.md", 250)])
def test_documents_stay_short(doc, most):
    n = len((REPO / doc).read_text().splitlines())
    assert n <= most, f"{doc} has {n} lines; at most {most} (history lives in git)"


def test_readme_names_no_commit():
    """goalloc's commits belong in git's history; the one revision the README
    names is PyTorch's, of the test file its test-suite figure comes from,
    and it is the one tests/gpu/results/torch-suite.json records."""
    hashes = re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", README)
    torch_revision = json.loads((REPO / "tests/gpu/results/torch-suite.json").read_text())["revision"]
    assert torch_revision in README, "the README names the PyTorch revision of its test-suite figure"
    assert [h for h in hashes if h != torch_revision] == [], f"README.md names commits: {hashes}"


RESULTS = ("bench/results", "tests/gpu/results")


def test_results_in_git_are_one_compact_json_per_suite():
    files = [p for p in _tracked_files() if str(p.relative_to(REPO)).startswith(RESULTS)]
    assert files
    assert sum(p.stat().st_size for p in files) <= 2 << 20, "the results kept in git exceed 2 MiB"
    for p in files:
        assert p.suffix == ".json", f"{p.relative_to(REPO)}: raw logs and archives stay out of git"
        doc = json.loads(p.read_text())
        if p.name != "torch-suite.json":  # torch_suite.py's own file: its runs say what ran
            assert "produced_by" in doc or "command" in json.dumps(doc), f"{p.relative_to(REPO)} names no command"


def _render_training() -> str:
    return load_bench("render").render(json.loads((REPO / "bench" / "results" / "training.json").read_text()))


def _rendered_rows(text: str) -> dict[tuple[str, str], list[str]]:
    """(workload, config) -> the cells of render.py's training tables."""
    rows, workload = {}, None
    for line in text.splitlines():
        m = re.match(r"#+ 3[abc]\. Training: (GPT-2|LLaMA|ResNet-50)", line)
        if m:
            workload = m[1]
        elif line.startswith("#"):
            workload = None
        elif workload and line.startswith("| ") and "GiB" in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.setdefault((workload, cells[0]), cells)
    return rows


def test_benchmarks_and_readme_quote_the_kept_training_results():
    text = _render_training()
    rows = _rendered_rows(text)
    assert len(rows) == 15, sorted(rows)
    bench = (REPO / "BENCHMARKS.md").read_text()
    seen = 0
    for line in bench.splitlines():
        m = re.match(r"\| (GPT-2|LLaMA|ResNet-50) \| ([a-z-]+) \| ([\d,]+) .*?\| ([\d.]+) \| ([\d.]+ GiB) \| ([\d.]+) \| "
                     r"([\d.]+ GiB) \| ([\d.]+ GiB) \|$", line)
        if not m:
            continue
        r = rows[(m[1], m[2])]
        assert [m[3], m[4] + "×", m[5], m[6] + "×", m[7], m[8]] == [r[1].split()[0], r[2], r[3], r[4], r[6], r[7]], line
        seen += 1
    assert seen == 15, "BENCHMARKS.md's training table lost rows"
    lockstep = re.search(r"\| goalloc-vmm against native \| ([\d.]+)×", text)[1]
    names = {"goalloc": "goalloc-vmm", "PyTorch default": "native", "`expandable_segments`": "expandable",
             "`cudaMallocAsync`": "async"}
    head = None
    for line in README.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "workload" and "goalloc" in cells:
            head = cells
            continue
        m = head and re.match(r"(GPT-2|LLaMA|ResNet-50)", cells[0])
        if not m:
            continue
        for name, cell in zip(head[1:], cells[1:]):
            config = names[name]
            memory, speed = [c.strip() for c in cell.split(",")]
            r = rows[(m[1], config)]
            assert memory == r[4].replace("×", "x"), (line, config)
            want = lockstep if (m[1], config) == ("ResNet-50", "goalloc-vmm") else r[2].replace("×", "")
            assert speed.rstrip("x") in (want, "1") and (speed != "1" or config == "native"), (line, config)
            seen += 1
    assert seen == 15 + 12, "README.md's results table lost cells"


def test_readme_quotes_the_test_suite_result():
    """The README's 'N of PyTorch's M passing CUDA allocator tests' is what
    tests/gpu/results/torch-suite.json says."""
    summary = json.loads((REPO / "tests/gpu/results/torch-suite.json").read_text())["summary"]
    m = re.search(r"(\d+) of PyTorch's (\d+) passing\s+CUDA allocator tests pass under goalloc", README)
    assert m, "the README quotes the test-suite result"
    assert (int(m.group(1)), int(m.group(2))) == (summary["goalloc_passed_of_those"], summary["native_passed"])


def test_go_files_and_functions_stay_readable():
    """No non-test Go file over 800 lines, no function over 120 except the
    invariant checkers (which list every invariant in one place)."""
    too_long = []
    for path in _tracked_files():
        if path.suffix != ".go" or path.name.endswith("_test.go"):
            continue
        lines = path.read_text().split("\n")
        if len(lines) > 800:
            too_long.append(f"{path.relative_to(REPO)}: {len(lines)} lines")
        for i, line in enumerate(lines):
            m = re.match(r"^func (\([^)]*\) )?(\w+)", line)
            if not m or not line.rstrip().endswith("{"):
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j] == "}")
            if end - i - 1 > 120 and "Invariants" not in m.group(2):
                too_long.append(f"{path.relative_to(REPO)}: func {m.group(2)} {end - i - 1} lines")
    assert too_long == []
