"""End to end: a plugin package pip-installed as a user would, found through its entry points."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import run_gateway


def test_a_pip_installed_plugin_package_is_discovered_and_loaded(tmp_path):
    project = tmp_path / "acme-gateway-plugin"
    (project / "acme_plugin").mkdir(parents=True)
    (project / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "acme-gateway-plugin"
        version = "1.0.0"
        [project.entry-points."vllm.general_plugins"]
        acme_general = "acme_plugin:register"
        [project.entry-points."vllm.endpoint_plugins"]
        acme_routes = "acme_plugin:make_endpoint"
    """))
    (project / "acme_plugin" / "__init__.py").write_text(textwrap.dedent("""
        import os
        def register():
            with open(os.environ["ACME_MARKER"], "a") as f:
                f.write("called\\n")
        class Routes:
            name, required_tasks = "acme", ("generate",)
            def attach_router(self, app): pass
            async def init_state(self, engine_client, state, args): pass
        def make_endpoint():
            return Routes()
    """))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", "--target", str(target), str(project)],
                   check=True, capture_output=True, timeout=300)
    marker = tmp_path / "marker"
    proc = run_gateway("plugins", "--json", "--check", roots=(target,),
                       ACME_MARKER=str(marker), VLLM_PLUGINS="acme_general,acme_routes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {r["name"]: r for r in json.loads(proc.stdout)["records"]}
    assert records["acme_general"]["outcome"] == "called"
    assert records["acme_general"]["distribution"] == "acme-gateway-plugin"
    assert records["acme_routes"]["outcome"] == "attached"
    assert marker.read_text() == "called\n"
