"""The Llama package's import circle (model.py <-> parallel.py) stays broken: model.py imports the
tensor-parallel split, the losses and the weights import the model, and nothing imports back."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "models" / "llama"


def _imported_modules(path: Path) -> set[str]:
    """The full names of the modules (or module members) ``path`` imports, at the top or inside a
    function; relative imports resolved in models/llama, other packages' relative imports left out."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level and path.parent != LLAMA:
                continue
            module = ".".join(filter(None, ["models.llama" if node.level else "", node.module]))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _imports_any(path: Path, modules: list[str]) -> set[str]:
    """Which of the models/llama ``modules`` ``path`` imports."""
    imported = _imported_modules(path)
    return {module for module in modules if f"models.llama.{module}" in imported}


@pytest.mark.parametrize("module", ["model", "tensor_parallel", "losses", "weights", "parallel"])
def test_imports_alone(module):
    """Each module imports first in a fresh interpreter (a circle shows up as an ImportError there)."""
    subprocess.run([sys.executable, "-c", f"import models.llama.{module}"], cwd=ROOT, check=True, timeout=300)


def test_model_imports_none_of_its_importers():
    assert not _imports_any(LLAMA / "model.py", ["losses", "parallel", "weights"])


def test_tensor_parallel_imports_neither_model_nor_losses():
    assert not _imports_any(LLAMA / "tensor_parallel.py", ["model", "losses", "parallel", "weights"])


def test_nothing_imports_the_deprecated_parallel_module():
    """models/llama/parallel.py is a re-export for old import paths only."""
    importers = [str(path.relative_to(ROOT)) for folder in ("models", "benchmarks", "tests", "ms_rope_attention")
                 for path in (ROOT / folder).rglob("*.py")
                 if path != LLAMA / "parallel.py" and _imports_any(path, ["parallel"])]
    assert not importers, importers


def test_the_old_parallel_paths_still_work():
    code = ("from models.llama import losses, parallel, tensor_parallel, weights\n"
            "moved = {'TensorParallel': tensor_parallel, 'IGNORE_INDEX': losses, 'ContextParallelTraining': losses,\n"
            "         'shifted_targets': losses, 'context_parallel_batch': losses, 'gathered_state': weights,\n"
            "         'scatter_state': weights}\n"
            "assert all(getattr(parallel, name) is getattr(home, name) for name, home in moved.items())\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)
