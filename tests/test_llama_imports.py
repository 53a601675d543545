"""The Llama package's import circle (model.py <-> parallel.py) stays broken: model.py imports the
tensor-parallel split, the losses and the weights import the model, and nothing imports back.

The checks that import models.llama run each in a child forked from one interpreter that has imported
MindSpore and nothing of this checkout (tests/forked_imports.py): each child imports models.llama
afresh, and MindSpore's import (~4 s) is paid once, not once per check."""
import ast
from pathlib import Path

import pytest

from forked_imports import run_forked

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "models" / "llama"
pytestmark = pytest.mark.xdist_group("llama_imports")  # one worker runs the forked checks, once


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


IMPORTED_ALONE = ["model", "tensor_parallel", "losses", "weights", "parallel"]


@pytest.fixture(scope="module")
def succeeds():
    """Asserts that a check of this module succeeded in its forked child; all of them run at the first use."""
    checks = [f"import models.llama.{module}" for module in IMPORTED_ALONE] + [OLD_PARALLEL_PATHS]
    checks += [old_engine_path_check(old) for old in sorted(OLD_ENGINE_PATHS)]
    results = dict(zip(checks, run_forked(checks, ["mindspore"], cwd=ROOT)))

    def succeeded(check: str):
        status, output = results[check]
        assert status == 0, output[-3000:]
    return succeeded


@pytest.mark.parametrize("module", IMPORTED_ALONE)
def test_imports_alone(module, succeeds):
    """Each module imports first, before any other of models.llama (a circle shows up as an ImportError there)."""
    succeeds(f"import models.llama.{module}")


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


OLD_PARALLEL_PATHS = (
    "from models.llama import losses, parallel, tensor_parallel, weights\n"
    "moved = {'TensorParallel': tensor_parallel, 'IGNORE_INDEX': losses, 'ContextParallelTraining': losses,\n"
    "         'shifted_targets': losses, 'context_parallel_batch': losses, 'gathered_state': weights,\n"
    "         'scatter_state': weights}\n"
    "assert all(getattr(parallel, name) is getattr(home, name) for name, home in moved.items())\n")


def test_the_old_parallel_paths_still_work(succeeds):
    succeeds(OLD_PARALLEL_PATHS)


OLD_ENGINE_PATHS = {  # old module -> a name it held and the module that holds it now
    "generate": [("Generator", "contiguous"), ("Sequence", "contiguous"), ("sample", "common"), ("Token", "common"),
                 ("PagedGenerator", "paged")],
    "serving": [("PagedGenerator", "paged")],
    "decoding": [("sample", "common"), ("SamplingError", "common"), ("CacheGraph", "common")],
    "block_pool": [("BlockPool", "block_pool"), ("blocks_for", "block_pool")],
    "kv_cache": [("KVCache", "kv_cache"), ("bucket_capacity", "kv_cache")],
}


def old_engine_path_check(old: str) -> str:
    """The code that imports models.llama.``old`` and checks each of its moved names."""
    code = (f"import importlib, warnings\n"
            f"old = importlib.import_module('models.llama.{old}')\n"
            f"for name, home in {OLD_ENGINE_PATHS[old]!r}:\n"
            f"    with warnings.catch_warnings(record=True) as caught:\n"
            f"        warnings.simplefilter('always')\n"
            f"        value = getattr(old, name)\n"
            f"    assert value is getattr(importlib.import_module('models.llama.engine.' + home), name), name\n"
            f"    assert [w.category for w in caught] == [DeprecationWarning], (name, caught)\n"
            f"    assert f'models.llama.{old}.{{name}} moved to' in str(caught[0].message), caught[0].message\n"
            f"try:\n"
            f"    old.no_such_name\n"
            f"except AttributeError:\n"
            f"    pass\n"
            f"else:\n"
            f"    raise AssertionError('no AttributeError')\n")
    if old == "generate":  # the CLI's entry point, as models.llama.train.main: no warning
        code += ("with warnings.catch_warnings():\n"
                 "    warnings.simplefilter('error')\n"
                 "    from models.llama.generate import main\n"
                 "from models.llama.engine.cli import main as cli_main\n"
                 "assert main is cli_main\n")
    return code


@pytest.mark.parametrize("old", sorted(OLD_ENGINE_PATHS))
def test_the_old_engine_paths_still_work_and_warn(old, succeeds):
    """models.llama.{generate, serving, decoding, block_pool, kv_cache}'s names, moved to
    models.llama.engine, stay importable for one release with a DeprecationWarning."""
    succeeds(old_engine_path_check(old))


def test_nothing_in_the_library_imports_an_old_engine_path():
    """models/ uses models.llama.engine; the old modules only point there."""
    importers = [str(path.relative_to(ROOT)) for folder in ("models", "ms_rope_attention")
                 for path in (ROOT / folder).rglob("*.py")
                 if not (path.parent == LLAMA and path.stem in OLD_ENGINE_PATHS)
                 and _imports_any(path, list(OLD_ENGINE_PATHS))]
    assert not importers, importers
