"""Render bench/multigpu.sh's results (JSON lines) as the markdown tables in
BENCHMARKS.md (bench/render.py's multigpu_tables says what they hold).

    python3 bench/multigpu_render.py OUT/multigpu.jsonl
    python3 bench/multigpu_render.py bench/results/multigpu.json   # the kept results: {"records": [...]}
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from render import multigpu_tables  # noqa: E402


def records(path):
    """The runs of a JSON lines file, or of a JSON document's "records"."""
    text = open(path).read()
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("records"), list):
        return doc["records"]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


if __name__ == "__main__":
    print("\n".join(multigpu_tables(records(sys.argv[1]))))
