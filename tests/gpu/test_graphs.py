"""CUDA graphs with goalloc (issue: CUDA graphs); skipped without CUDA."""
import pytest
from rawlib import run_check

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def result():
    return run_check("graphs_check.py", "graphs", timeout=400)


def test_replays_match_eager(result):
    for name in ("mlp", "transformer_block", "shared_pool"):
        assert result[name]["replays"] == 100
        assert result[name]["max_abs_diff"] < 1e-4, name


def test_pool_ids_cross_the_abi(result):
    a = result["after_capture"]
    assert a["graph_pools"] == 1
    assert a["graph_bytes"] > 0
    assert [list(x) for x in a["pool_ids_seen_by_goalloc"]] == [a["pool_id_torch"]]


def test_shared_pool_and_release(result):
    # Three captures into two pools; torch releases a pool once per graph.
    assert result["three_graphs"]["graph_pools"] == 2
    shared = result["after_release_shared"]
    assert shared["hooks"] == [3, 3, 2]
    assert shared["graph_bytes"] < result["three_graphs"]["graph_bytes"]
    # The released shared pool keeps only memory still live: torch keeps the
    # cuBLAS workspace it allocated during the first capture.
    assert shared["free_in_pools"].get("(1, 0)", 0) == 0
    done = result["after_release_all"]
    assert done["hooks"] == [3, 3, 3]
    assert all(v == 0 for v in done["free_in_pools"].values()), done
    assert done["graph_bytes"] <= 64 << 20  # the workspace, not the graphs' memory
    assert done["bad_input"] == {}


def test_make_graphed_callables_trains(result):
    m = result["make_graphed_callables"]
    assert m["last"] < m["first"]


def test_release_during_capture(result):
    """A graph destroyed inside a capture into its pool: torch's release
    arrives in the window; the capture goes on and replays right."""
    r = result["release_during_capture"]
    assert "error" not in r, r
    assert r["max_abs_diff"] < 1e-4
    assert r["hooks_during"] == [2, 2, 1]  # two captures; ga's release, applied when gb's window ended
    assert r["hooks_after"] == [2, 2, 2]
    assert r["invalid_pool"] == 0
