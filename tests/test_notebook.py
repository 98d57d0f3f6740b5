"""examples/quickstart.ipynb runs top to bottom in a Jupyter kernel (nbclient), on every test run.

The kernel is this interpreter (a kernelspec written for the test), its KIPP_HOME a store with
the tiny checkpoint's source but no artifact, so the first cell converts it and shows tqdm's
widget. The notebook is stored without outputs; a test keeps it that way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
TINY = "kipp-synthetic/qwen3-tiny"
WIDGET = "application/vnd.jupyter.widget-view+json"


def test_the_notebook_is_stored_without_outputs():
    stored = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    for cell in stored["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, (
                f"{cell['id']} has outputs: run `python tools/clear_notebook.py "
                f"examples/quickstart.ipynb` before committing")
    assert "widgets" not in stored["metadata"], "widget state is an output too"


@pytest.fixture
def kernel_env(tmp_path, monkeypatch, stock_store):
    """A kernelspec for this interpreter and a store that still has to convert the artifact."""
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(tmp_path / "jupyter" / "kernels" / "kipp-test")
    home = stock_store(tmp_path / "home", TINY, schemes=())
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("KIPP_HOME", str(home))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws PNGs
    return tmp_path


def outputs_of(notebook, cell_id: str) -> list[dict]:
    [cell] = [c for c in notebook.cells if c.get("id") == cell_id]
    return cell.outputs


def stdout_of(notebook, cell_id: str) -> str:
    return "".join(o.text for o in outputs_of(notebook, cell_id)
                   if o.output_type == "stream" and o.name == "stdout")


@pytest.mark.slow  # CI's longest default checks
def test_quickstart_notebook_runs(kernel_env):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    [parameters] = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    parameters.source = f'CHECKPOINT = "{TINY}"\nBACKEND = "reference"'  # fast and the same here
    client = nbclient.NotebookClient(notebook, kernel_name="kipp-test", timeout=900,
                                     resources={"metadata": {"path": str(kernel_env)}})
    try:
        client.execute()  # raises CellExecutionError on the first cell that fails
    finally:
        nbformat.write(notebook, kernel_env / "executed.ipynb")  # for a look when it fails

    [model] = [o for o in outputs_of(notebook, "cell-02") if o.output_type == "execute_result"]
    assert "kipp.Model" in model.data["text/html"] and TINY in model.data["text/plain"]
    assert any(WIDGET in o.get("data", {}) for o in outputs_of(notebook, "cell-02")), (
        "the conversion's progress bar should be a widget in Jupyter")
    pieces = [o for o in outputs_of(notebook, "cell-06") if o.output_type == "stream"]
    assert len(pieces) >= 4, "the stream should reach the notebook piece by piece, not at once"
    streamed = stdout_of(notebook, "cell-06")
    [shown] = [o for o in outputs_of(notebook, "cell-07") if o.output_type == "execute_result"]
    assert streamed and "finished (length)" in shown.data["text/plain"]
    assert repr(streamed)[1:-1][:20] in shown.data["text/plain"]  # the text it holds
    # "P prompt tokens, R reused" per turn: the second turn reuses the session's first turn
    # (the first may adopt a few tokens of earlier chats' cached blocks from the pool)
    turns = [[int(w) for w in line.split() if w.isdigit()]
             for line in stdout_of(notebook, "cell-13").splitlines()]
    assert len(turns) == 2 and turns[1][1] > max(turns[0][1], turns[0][0] // 2), turns
    pictures = [o for o in outputs_of(notebook, "cell-20") if "image/png" in o.get("data", {})]
    assert len(pictures) == 1
