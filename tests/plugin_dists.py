"""Real installed plugin distributions, made cheaply: a module plus a NAME-0.0.0.dist-info
folder (METADATA, entry_points.txt) written into a folder that is put on sys.path (and on
PYTHONPATH, so spawned processes see it too). No patched importlib.metadata."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

#: Module source of a minimal endpoint plugin, `Plugin(name, required_tasks)`, for the
#: fake distributions of the loader tests: append the factories that make it.
ENDPOINT_PLUGIN_CLASS = """
    class Plugin:
        def __init__(self, name, tasks):
            self.name, self.required_tasks = name, tasks
        def attach_router(self, app):
            pass
        async def init_state(self, engine_client, state, args):
            pass
"""


def write_dist(root: Path, dist_name: str, entry_points: dict[str, dict[str, str]],
               modules: dict[str, str] | None = None) -> Path:
    """Write distribution `dist_name` into `root`.

    entry_points: {group: {name: "module:attr"}}; modules: {module_name: source}.
    Returns root.
    """
    root.mkdir(parents=True, exist_ok=True)
    for module_name, source in (modules or {}).items():
        path = root / (module_name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    info = root / f"{dist_name.replace('-', '_')}-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.0.0\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {value}" for name, value in eps.items())
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return root


def subprocess_env(*roots: Path, **extra: str) -> dict[str, str]:
    """An environment for a fresh interpreter that sees the distributions under `roots`."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS",)}
    paths = [str(r) for r in roots] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


def activate(root: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Put `root` on sys.path and PYTHONPATH for this test (monkeypatch undoes it)."""
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def forget_modules(*names: str) -> None:
    for name in list(sys.modules):
        if name in names or any(name.startswith(n + ".") for n in names):
            del sys.modules[name]
