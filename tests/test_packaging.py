"""Packaging: every third-party module the package imports at run time (outside a
``try: ... except ImportError`` for an optional feature) comes from a distribution that the
installed package's metadata requires. Read from the sources themselves, so it cannot drift."""
import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ms_rope_attention", "models")


def _optional_nodes(tree):
    """Import nodes inside a ``try`` whose handlers catch ImportError: optional features."""
    optional = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers):
            for child in node.body:
                optional.update(id(n) for n in ast.walk(child))
    return optional


def runtime_imports():
    """{top-level module: first file importing it} over the package sources."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            optional = _optional_nodes(tree)
            for node in ast.walk(tree):
                if id(node) in optional:
                    continue
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], path.relative_to(ROOT))
    return found


def test_install_requires_covers_every_runtime_import():
    required = set()
    for requirement in metadata.requires("ms_rope_attention") or []:
        if "extra ==" not in requirement:
            required.add(re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-"))
    providers = metadata.packages_distributions()
    missing = []
    for module, path in sorted(runtime_imports().items()):
        if module in sys.stdlib_module_names or module in PACKAGES or module == "__future__":
            continue
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [module])}
        if not dists & required:
            missing.append(f"{module} (imported by {path}; distribution {sorted(dists)})")
    assert not missing, f"install_requires lacks: {missing}"
