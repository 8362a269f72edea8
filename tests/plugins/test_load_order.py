"""Where and when the general plugins run (issue 13, item 2): the offline LLM's own process.
The worker's order (before torch.distributed) is tested with -tp 2 in test_examples.py."""

from __future__ import annotations

from gateway.plugins import DEFAULT_PLUGINS_GROUP
from tests.conftest import run_python
from tests.plugin_dists import write_dist

RECORDER = """
    import os
    def record():
        with open(os.environ["MARKER"], "a") as f:
            f.write(f"{os.getpid()}\\n")
"""


def test_the_offline_llm_loads_the_general_plugins_in_its_own_process(site):
    write_dist(site, "llm-recorder", {DEFAULT_PLUGINS_GROUP: {"rec": "llm_rec:record"}},
               {"llm_rec": RECORDER})
    marker = site / "calls"
    code = ("import os\n"
            "from gateway import LLM\n"
            "if __name__ == '__main__':\n"
            "    print(os.getpid())\n"
            "    try:\n"
            "        LLM('/no/such/model')\n"
            "    except Exception as exc:\n"
            "        print(type(exc).__name__)\n")
    proc = run_python(code, site, MARKER=str(marker))
    assert proc.returncode == 0, proc.stderr
    caller_pid = proc.stdout.split()[0]
    assert caller_pid in marker.read_text().split()


def test_a_raising_general_plugin_stops_the_offline_llm_naming_it(site):
    write_dist(site, "llm-bad", {DEFAULT_PLUGINS_GROUP: {"bad_gen": "llm_bad:f"}},
               {"llm_bad": "def f():\n    raise RuntimeError('no such device')\n"})
    code = ("from gateway import LLM\n"
            "from gateway.plugins import PluginError\n"
            "if __name__ == '__main__':\n"
            "    try:\n"
            "        LLM('/no/such/model')\n"
            "    except PluginError as exc:\n"
            "        print('PluginError', exc)\n")
    proc = run_python(code, site)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("PluginError") and "'bad_gen'" in proc.stdout
