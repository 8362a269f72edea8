"""The front-end process never imports torch, a worker, a model or the engine core: the
HTTP server stays light and starts fast, and the engine is reached through the engine
client alone (STYLE 5)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import gateway.frontend
from tests.conftest import run_python

FORBIDDEN = ("torch", "gateway.worker", "gateway.executor", "gateway.models.archs.decoder",
             "gateway.models.archs.bert", "gateway.engine.core", "gateway.engine.scheduler")
ENTRYPOINTS = Path(gateway.frontend.__file__).parent
# The offline `LLM` class runs the engine in the caller's process on purpose.
OFFLINE = {"llm.py"}


def _is_forbidden(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in FORBIDDEN)


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_no_front_end_module_imports_a_forbidden_module():
    found = {f"{path.relative_to(ENTRYPOINTS)}: {name}"
             for path in ENTRYPOINTS.rglob("*.py") if path.name not in OFFLINE
             for name in _imports(path) if _is_forbidden(name)}
    assert not found


def test_building_the_server_loads_no_forbidden_module():
    code = (
        "import json, sys\n"
        "from gateway.frontend.cli.main import build_parser\n"
        "import gateway.frontend.cli.serve, gateway.frontend.app\n"
        "build_parser()\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    loaded = [name for name in json.loads(proc.stdout) if _is_forbidden(name)]
    assert not loaded
