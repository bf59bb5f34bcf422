"""The example notebooks (examples/*.ipynb) run from top to bottom.

Each runs in a fresh kernel of this Python, with the test's temporary directory as
its working directory (what a notebook writes stays there). The notebooks start
local clusters, so they run where cluster tests run: inside a private network
namespace (scripts/test.sh), which the kernel inherits.
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # a cell that runs longer has hung: each notebook takes about a minute


def test_the_examples_are_stored_without_outputs():
    assert len(NOTEBOOKS) == 4
    for path in NOTEBOOKS:
        notebook = json.loads(path.read_text(encoding="utf-8"))
        for cell in notebook["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, (
                    f"{path.name}: strip the outputs before committing")


def _kernel_manager(kernels: pathlib.Path):
    """A kernel of this very Python (not whatever 'python3' kernel Jupyter finds)."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = kernels / "autodist-tests"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "autodist tests", "language": "python"}), encoding="utf-8")
    specs = KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)
    return KernelManager(kernel_name="autodist-tests", kernel_spec_manager=specs)


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_notebook_runs(path, tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="the test extra runs notebooks: "
                                                      "pip install -e '.[test]'")
    nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[test]'")
    pytest.importorskip("ipykernel", reason="pip install -e '.[test]'")

    notebook = nbformat.read(path, as_version=4)
    work = tmp_path / "work"
    work.mkdir()
    client = nbclient.NotebookClient(notebook, km=_kernel_manager(tmp_path / "kernels"),
                                     timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(work)}})
    start = time.monotonic()
    client.execute()  # a cell that raises fails the test (CellExecutionError), naming it
    print(f"{path.name}: ran in {time.monotonic() - start:.1f} s")
