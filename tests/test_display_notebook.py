"""examples/explore.ipynb runs headless (nbclient, CPU, embedded SmolLM2) and shows what it promises."""

import json
import os
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="needs the notebook extra: pip install -e '.[notebook]'")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "explore.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    # a kernel spec running *this* interpreter (the installed spec says "python", whatever is on PATH)
    spec_dir = tmp_path_factory.mktemp("jupyter") / "kernels" / "treegen-test"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "treegen test", "language": "python"}))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(spec_dir.parents[1]) + (os.pathsep + old if old else "")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        nb = nbformat.read(NOTEBOOK, as_version=4)
        client = nbclient.NotebookClient(nb, kernel_name="treegen-test", timeout=600,
                                         resources={"metadata": {"path": str(NOTEBOOK.parent)}})
        client.execute()
    finally:
        if old is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = old
    return {cell.id: cell for cell in nb.cells}


def html_of(cell) -> str:
    htmls = [o["data"]["text/html"] for o in cell.outputs if "data" in o and "text/html" in o["data"]]
    assert len(htmls) == 1, f"cell {cell.id}: expected one HTML output, got {len(htmls)}: {cell.outputs}"
    return htmls[0]


def test_notebook_runs_without_errors(executed):
    for cell in executed.values():
        if cell.cell_type == "code":
            assert not [o for o in cell.outputs if o["output_type"] == "error"], cell.id
            assert cell.execution_count is not None, f"cell {cell.id} did not run"


def test_program_tree_result_and_votes_are_shown(executed):
    program = html_of(executed["sc-program"])
    assert "self_consistency" in program and "question" in program and "source (" in program and "fork" in program

    tree = html_of(executed["sc-tree"])
    assert "<svg" in tree and "5 nodes" in tree and "4 branches" in tree and "saved" in tree
    assert "to gen" in tree  # the generation budget, before anything ran

    result = html_of(executed["sc-run"])
    assert "reasoning" in result and "list of 4" in result and "Executed sharing tree" in result
    assert "branch states (5)" in result  # the root and its 4 branches

    votes = html_of(executed["sc-votes"])
    assert "votes" in votes and "count" in votes

    two = html_of(executed["two-run"])
    assert "list of 2 × 2" in two
    two_votes = html_of(executed["two-votes"])
    assert "votes in #0" in two_votes or "no answer" in two_votes


def test_large_tree_view_stays_small(executed):
    big = html_of(executed["big-tree"])
    assert "5,051 nodes" in big and "5,000 branches" in big
    assert "more node" in big  # summarised
    assert len(big) < 100_000


def test_tg_cell_magic_runs_and_shows_the_vote(executed):
    result = html_of(executed["tg-run"])
    assert "solution" in result and "answer" in result and "vote" in result
    assert "parameters (3)" in result


def test_outputs_are_self_contained(executed):
    for cell in executed.values():
        for out in getattr(cell, "outputs", []):
            html = out.get("data", {}).get("text/html", "")
            assert "<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
            assert "https://" not in html
