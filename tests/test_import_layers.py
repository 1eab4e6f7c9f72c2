"""The package map's arrows point one way (docs/architecture.md, "The house"): walks every module's imports
(AST, module level and inside functions alike) and fails on an arrow the map does not allow."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "cuda_ext", "draft_worker", "verify_worker", "gateway", "client", "training", "demo_build")
# package -> the project packages its modules may import (besides itself)
ALLOWED = {
    "shared": set(),
    "cuda_ext": {"shared"},
    "draft_worker": {"shared", "cuda_ext"},
    "verify_worker": {"shared", "cuda_ext", "draft_worker"},  # local placement hosts the drafter in-process
    "gateway": {"shared"},
    "client": {"shared"},
    "training": {"shared", "cuda_ext", "draft_worker", "verify_worker"},
    "demo_build": {"shared", "cuda_ext", "draft_worker", "verify_worker", "training"},
}
# inside verify_worker: the families know only each other, the TP layers and the family interface
FAMILY_ALLOWED = ("verify_worker.families", "verify_worker.parallel.group", "verify_worker.parallel.layers")
TORCH_FREE = ("gateway", "client", "shared.target_facts", "shared.config_json", "shared.draft_config",
              "shared.rope_settings", "shared.checkpoint_shapes", "shared.demo_models",
              "shared.config_values", "shared.sampling_params", "shared.settings")


def module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _nodes(tree: ast.AST, on_import: bool):
    """The tree's nodes; with on_import, not those inside functions (what importing the module runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if not (on_import and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
            todo.extend(ast.iter_child_nodes(node))


def imports_of(path: Path, module: str, on_import: bool = False) -> set[str]:
    """Every module path the file imports (relative imports resolved); with on_import, only those that
    importing the module runs."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _nodes(ast.parse(path.read_text(), str(path)), on_import):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_every_import_points_the_allowed_way():
    wrong = []
    for module, path in module_files().items():
        own = module.split(".")[0]
        for imported in imports_of(path, module):
            top = imported.split(".")[0]
            if top in PACKAGES and top != own and top not in ALLOWED[own]:
                wrong.append(f"{module} imports {imported}")
            if (module.startswith("verify_worker.families") and top == "verify_worker"
                    and not imported.startswith(FAMILY_ALLOWED)):
                wrong.append(f"{module} imports {imported} (a family must not know the engine)")
    assert not wrong, "imports against the package map:\n" + "\n".join(sorted(wrong))


def test_the_torch_free_modules_reach_no_torch():
    """Importing them imports no torch (the gateway and the client stay light; functions may import it late,
    like the worker set-up in shared.role)."""
    files = module_files()
    graph = {m: imports_of(p, m, on_import=True) for m, p in files.items()}
    offenders = []
    for start in (m for m in files if m.startswith(TORCH_FREE)):
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            for imported in graph.get(module, ()):
                if imported.split(".")[0] in ("torch", "safetensors", "numpy"):
                    offenders.append(f"{start} reaches {imported} through {module}")
                elif imported in files:
                    todo.append(imported)
    assert not offenders, "\n".join(sorted(set(offenders)))


@pytest.mark.parametrize("source, wrong", [
    ("from verify_worker.engine import SpeculativeEngine\n", "draft_worker.x imports verify_worker.engine"),
    ("def f():\n    import gateway.app\n", "draft_worker.x imports gateway.app"),
])
def test_the_walk_catches_a_wrong_arrow(tmp_path, source, wrong):
    path = tmp_path / "x.py"
    path.write_text(source)
    imported = imports_of(path, "draft_worker.x")
    assert any(f"draft_worker.x imports {i}" == wrong for i in imported
               if i.split(".")[0] not in ALLOWED["draft_worker"] | {"draft_worker"})


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a module graph (module -> the project modules it imports), each once, as found by a
    depth-first walk (Tarjan's strongly connected components of more than one module)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, edges = work[-1]
            for target in edges:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[module] = min(low[module], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_module_imports_itself_back():
    """No circle of imports at module level (type-only imports included): a module that binds something and
    also holds the helpers of the modules it binds splits in two (shared/cpu_kernels/arguments.py)."""
    files = module_files()
    graph = {m: {i for i in imports_of(p, m, on_import=True) if i in files} for m, p in files.items()}
    assert import_cycles(graph) == []


def test_the_circle_walk_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
