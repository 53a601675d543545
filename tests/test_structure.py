"""The package's shape, enforced: every module sits on a floor and imports only from its own floor or
below (any import, also one inside a function), with no circle anywhere; the model imports the
package by its face only; the op's attributes are one keyword-built value tied to the contract.
docs/design.md draws the same floors."""
import ast
from pathlib import Path

import pytest

from ms_rope_attention.attrs import OpAttrs, contract_attr_names
from ms_rope_attention.op_info import load_contract

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module (or a subpackage, all of its modules) may import from its floor and below.
FLOORS = [
    ("compatibility", ["_compat", "isas"]),
    ("contract", ["op_info", "attrs"]),
    ("checks and math", ["checks", "rope", "unfused", "gradients", "layouts"]),
    ("kernels", ["cpu_runtime", "compute", "cpu_kernel", "paged_kernel", "linear", "embedding", "norm", "flash_backward",
                 "ascend_kernel"]),
    ("dispatch", ["dispatch"]),
    ("functional", ["functional", "paged"]),
    ("cells", ["nn"]),
    # Above the op's own path, so nothing on it can import them; the last two are one-release shims.
    ("test instruments", ["testing", "cpu_direct", "ascend_emulated"]),
    ("above the op", ["fusion", "distributed"]),
    ("package", ["__init__"]),
]
FLOOR_OF = {room: level for level, (_, rooms) in enumerate(FLOORS) for room in rooms}


def _module_name(path: Path, package_root: Path) -> str:
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, is_package: bool) -> set:
    """Every module ``path`` imports (absolute names), wherever the import statement is."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if node.module:  # `from . import checks` imports the submodule, not the package's __init__
                found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _graph(package: str) -> dict:
    """module -> the package's modules it imports."""
    root = ROOT / package.replace(".", "/")
    modules = {_module_name(p, ROOT / package.split(".")[0]): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = _imports(path, name, path.name == "__init__.py")
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _cycle(graph):
    """One import circle of ``graph`` as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_module_has_a_floor():
    rooms = {_room(m) for m in _graph("ms_rope_attention")}
    assert rooms == set(FLOOR_OF), f"without a floor: {sorted(rooms - set(FLOOR_OF))}; " \
                                   f"listed but gone: {sorted(set(FLOOR_OF) - rooms)}"


def test_no_module_imports_from_a_higher_floor():
    graph = _graph("ms_rope_attention")
    upward = [f"{m} ({FLOORS[FLOOR_OF[_room(m)]][0]}) imports {t} ({FLOORS[FLOOR_OF[_room(t)]][0]})"
              for m, targets in graph.items() for t in targets if FLOOR_OF[_room(t)] > FLOOR_OF[_room(m)]]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("package", ["ms_rope_attention", "models.llama"])
def test_no_import_circle(package):
    cycle = _cycle(_graph(package))
    assert cycle is None, " -> ".join(cycle)


# What a user of the package imports: its face, and the subpackages with faces of their own.
FACES = {"ms_rope_attention", "ms_rope_attention.distributed", "ms_rope_attention.fusion"}


def _is_module(name: str) -> bool:
    return (ROOT / f"{name.replace('.', '/')}.py").exists() or (ROOT / name.replace(".", "/")).is_dir()


def _deep_imports(folder: str) -> list:
    """Every import in ``folder`` of a module of the package other than its faces, as 'file:line module'."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:  # `from pkg import module` imports it too
                names = [node.module] + [name for name in (f"{node.module}.{a.name}" for a in node.names)
                                         if _is_module(name)]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                      if name.startswith("ms_rope_attention.") and name not in FACES]
    return found


def test_the_model_imports_the_package_by_its_face():
    """models/ builds on ``ms_rope_attention``'s face (and ``distributed``'s), never on a module below it:
    the rooms behind the face can move without touching the model. benchmarks/ and tests/ are not held
    to it: they measure and check single kernels and ISA builds (``cpu_kernel``, ``testing``)."""
    deep = _deep_imports("models")
    assert not deep, "\n".join(deep)


def test_the_attributes_are_the_contracts():
    contract = load_contract()
    assert OpAttrs._fields[:len(contract.attrs)] == contract_attr_names()
    assert OpAttrs._fields[len(contract.attrs):] == ("backend", "strict")
    defaults = OpAttrs().kernel_attrs()
    assert defaults == {**contract.attr_defaults, "with_softmax_lse": True}  # the fused forward always emits it
    assert OpAttrs().with_softmax_lse is contract.attr_defaults["with_softmax_lse"]


def test_the_attributes_are_built_by_keyword_only():
    with pytest.raises(TypeError):
        OpAttrs(4, "BNSD")
    with pytest.raises(TypeError, match=r"OpAttrs: unknown attribute\(s\) \['heads'\]"):
        OpAttrs(heads=4)
    attrs = OpAttrs(head_num=4, strict=True)
    assert OpAttrs.of(tuple(attrs)) == attrs and type(OpAttrs.of(tuple(attrs))) is OpAttrs
