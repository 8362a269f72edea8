"""Layering: the folder a module of gateway/ lies in says which process runs it, and no
module imports one that another process runs (the front end never imports torch; the
worker never imports the HTTP layer), but for the few crossings listed with their reasons.
And no import circle among gateway's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gateway

ROOT = Path(gateway.__file__).parent
FRONT_END, ENGINE_CORE, WORKER, SHARED = "front-end", "engine-core", "worker", "shared"

# The process of each folder (the longest matching prefix wins). A module directly in
# gateway/ is SHARED: imported by more than one process, torch only inside functions.
PROCESS_OF_FOLDER = {
    "gateway.frontend": FRONT_END,  # the API-server processes (and the offline LLM's)
    "gateway.metrics": FRONT_END,  # stat loggers and Prometheus, fed by the engine client
    "gateway.engine": ENGINE_CORE,  # the scheduler, the KV blocks, the core's sockets
    "gateway.executor": ENGINE_CORE,  # how the engine core reaches its workers
    "gateway.worker": WORKER,  # the model runner, the sampler, the logits processors
    "gateway.models": WORKER,  # layers, architectures, kernels, loading
    "gateway.models.info": SHARED,  # model files, configs and support checks: both sides
    "gateway.plugins": SHARED,  # every process loads plugins
    "gateway.platforms": SHARED,  # every process that reads current_platform
}
# Modules placed apart from their folder, with the reason.
PROCESS_OF_MODULE = {
    "gateway.models": SHARED,  # `ModelRegistry` for general plugins in any process
}


def process_of(module: str) -> str:
    if module in PROCESS_OF_MODULE:
        return PROCESS_OF_MODULE[module]
    folders = [folder for folder in PROCESS_OF_FOLDER
               if module == folder or module.startswith(folder + ".")]
    if folders:
        return PROCESS_OF_FOLDER[max(folders, key=len)]
    if module == "gateway" or module.count(".") == 1:
        return SHARED
    raise KeyError(f"{module} lies in a folder with no process: add it to PROCESS_OF_FOLDER")


MAY_IMPORT = {
    SHARED: {SHARED},
    FRONT_END: {FRONT_END, SHARED},
    # With one device (the `uni` executor) the worker runs inside the engine-core process.
    ENGINE_CORE: {ENGINE_CORE, WORKER, SHARED},
    WORKER: {WORKER, SHARED},
}
# Imports across processes on purpose, each with its reason.
CROSSINGS = {
    ("gateway.frontend.engine_client.connection", "gateway.engine.core_proc"):
        "names the engine core's spawn target (core_proc imports nothing heavy)",
    ("gateway.frontend.engine_client.ray_engines", "gateway.engine.core_proc"):
        "names the engine-core Ray actor's class (core_proc imports nothing heavy)",
    ("gateway.frontend.scaling.supervisor", "gateway.engine.core_proc"):
        "the supervisor of several API servers spawns the engine core itself",
    ("gateway.frontend.cli.serve", "gateway.engine.headless"):
        "`serve --headless` runs the worker-rank launcher instead of the server",
    ("gateway", "gateway.frontend.llm"): "`gateway.LLM`, imported on first use",
}
HTTP = ("fastapi", "starlette", "uvicorn")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in ROOT.rglob("*.py")}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) for every import outside `if TYPE_CHECKING:`."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child, top)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names
                    if f"{node.module}.{a.name}" in MODULES]
            found.extend((name, top) for name in subs or [node.module])
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text()), True)
    return found


def test_every_module_lies_in_a_folder_with_a_process():
    unplaced = []
    for module in MODULES:
        try:
            process_of(module)
        except KeyError as exc:
            unplaced.append(str(exc))
    assert unplaced == []


def test_no_folder_outside_the_front_end_holds_front_end_modules():
    front = {module for module in MODULES if process_of(module) == FRONT_END}
    assert all(module.startswith(("gateway.frontend", "gateway.metrics")) for module in front)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_modules_of_its_own_process(module):
    process = process_of(module)
    wrong = [f"{name} ({process_of(name)})" for name, _top in _imports(MODULES[module])
             if name in MODULES and process_of(name) not in MAY_IMPORT[process]
             and (module, name) not in CROSSINGS]
    assert wrong == [], f"{module} ({process}) imports {wrong}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES
                                          if process_of(m) in (FRONT_END, SHARED)))
def test_front_end_and_shared_modules_never_import_torch_at_import_time(module):
    front_end = process_of(module) == FRONT_END
    torch = [name for name, top in _imports(MODULES[module])
             if name.split(".")[0] == "torch" and (top or front_end)]
    assert torch == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if process_of(m) == WORKER))
def test_worker_modules_never_import_the_http_layer(module):
    http = [name for name, _top in _imports(MODULES[module])
            if name.split(".")[0] in HTTP or name.startswith("gateway.frontend")]
    assert http == []


def _import_graph() -> dict[str, set[str]]:
    """Each module's gateway imports, at module level or inside functions alike (a circle
    through an import deferred into a function is a circle all the same). Importing a.b.c
    from outside the package a.b also runs a/__init__ and a/b/__init__: those count too."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = set()
        for name, _top in _imports(path):
            if name not in MODULES or name == module:
                continue
            targets.add(name)
            parts = name.split(".")
            for cut in range(1, len(parts)):
                package = ".".join(parts[:cut])
                if package in MODULES and not module.startswith(package + "."):
                    targets.add(package)
        graph[module] = targets - {module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_check_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    assert _circles(_import_graph()) == []
