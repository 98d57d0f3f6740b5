"""Clear a notebook's outputs, execution counts and widget state before committing it.

    python tools/clear_notebook.py examples/quickstart.ipynb

tests/test_notebook.py fails while examples/quickstart.ipynb carries outputs.
"""

import sys

import nbformat


def clear(path: str) -> None:
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
    notebook.metadata.pop("widgets", None)
    nbformat.write(notebook, path)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        clear(name)
