"""`gateway plugins`: the table, --json, and the --check preflight (rules 8, 9, 10)."""

from __future__ import annotations

import json

from gateway.plugins import (
    ENDPOINT_PLUGINS_GROUP,
    GENERAL_PLUGINS_GROUP,
    IO_PROCESSOR_PLUGINS_GROUP,
    LOGITS_PROCESSORS_GROUP,
    PLATFORM_PLUGINS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
)
from tests.conftest import run_gateway
from tests.plugin_dists import write_dist

MODULE = """
    import os
    from gateway.plugins import StatLoggerBase, LogitsProcessor
    if os.environ.get("MARKER"):
        with open(os.environ["MARKER"], "a") as f:
            f.write(__name__ + "\\n")
    def general():
        pass
    class GoodLogger(StatLoggerBase):
        def record(self, scheduler_stats, iteration_stats, engine_idx=0): pass
        def log_engine_initialized(self): pass
    class NotALogger:
        pass
    def io_factory():
        return "somewhere.Processor"
    class Endpoint:
        name, required_tasks = "ep", None
        def attach_router(self, app): pass
        async def init_state(self, engine_client, state, args): pass
"""


def _good_dists(site):
    write_dist(site, "good-plugins", {
        GENERAL_PLUGINS_GROUP: {"gen": "good_mod:general"},
        STAT_LOGGER_PLUGINS_GROUP: {"stats": "good_mod:GoodLogger"},
        ENDPOINT_PLUGINS_GROUP: {"ep": "good_mod:Endpoint"},
    }, {"good_mod": MODULE})
    write_dist(site, "io-plugins", {IO_PROCESSOR_PLUGINS_GROUP: {"ranker": "io_mod:io_factory"}},
               {"io_mod": MODULE})


def _records(proc):
    assert proc.stdout, proc.stderr
    return {(r["group"], r["name"]): r for r in json.loads(proc.stdout)["records"]}


def test_table_lists_every_entry_point_with_its_outcome(site):
    _good_dists(site)
    proc = run_gateway("plugins", roots=(site,))
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()
    assert header.split()[:3] == ["GROUP", "NAME", "VALUE"]
    text = "\n".join(rows)
    assert "vllm.general_plugins" in text and "called" in text
    assert "vllm.endpoint_plugins" in text and "not-allowlisted" in text


def test_json_reports_each_group_as_a_serving_process_would(site):
    _good_dists(site)
    records = _records(run_gateway("plugins", "--json", roots=(site,)))
    assert records[(GENERAL_PLUGINS_GROUP, "gen")]["outcome"] == "called"
    assert records[(STAT_LOGGER_PLUGINS_GROUP, "stats")]["outcome"] == "loaded"
    assert records[(ENDPOINT_PLUGINS_GROUP, "ep")]["outcome"] == "not-allowlisted"
    assert records[(ENDPOINT_PLUGINS_GROUP, "ep")]["allowlist"] == "excluded"
    assert records[(IO_PROCESSOR_PLUGINS_GROUP, "ranker")]["outcome"] == "not-requested"
    assert all(r["process_role"] == "cli" and r["pid"] > 0 for r in records.values())


def test_io_processor_group_is_not_loaded_when_none_is_named(site):
    _good_dists(site)
    marker = site / "imports.txt"
    proc = run_gateway("plugins", "--check", roots=(site,), MARKER=str(marker))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "io_mod" not in marker.read_text()


def test_check_passes_on_a_healthy_set(site):
    _good_dists(site)
    proc = run_gateway("plugins", "--check", roots=(site,), VLLM_PLUGINS="gen,stats,ep")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_fails_when_a_named_io_processor_is_missing_listing_those_available(site):
    _good_dists(site)
    proc = run_gateway("plugins", "--check", "--io-processor-plugin", "nope", roots=(site,))
    assert proc.returncode == 1
    assert "'nope'" in proc.stdout and "available: ranker" in proc.stdout


def test_check_fails_when_the_named_io_processor_is_not_allowed(site):
    _good_dists(site)
    proc = run_gateway("plugins", "--check", "--io-processor-plugin", "ranker", roots=(site,),
                       VLLM_PLUGINS="gen")
    assert proc.returncode == 1 and "available: none" in proc.stdout


def test_check_fails_on_a_stat_logger_that_is_not_a_stat_logger_base(site):
    write_dist(site, "bad-stats", {STAT_LOGGER_PLUGINS_GROUP: {"bad": "bad_stats:NotALogger"}},
               {"bad_stats": MODULE})
    proc = run_gateway("plugins", "--check", roots=(site,))
    assert proc.returncode == 1
    assert "'bad'" in proc.stdout and "StatLoggerBase" in proc.stdout


def test_check_fails_on_two_active_out_of_tree_platforms(site):
    write_dist(site, "plats", {PLATFORM_PLUGINS_GROUP: {"p1": "plat_mod:a", "p2": "plat_mod:b"}},
               {"plat_mod": "def a():\n    return 'x.A'\ndef b():\n    return 'y.B'\n"})
    proc = run_gateway("plugins", "--check", roots=(site,))
    assert proc.returncode == 1 and "p1" in proc.stdout and "p2" in proc.stdout


def test_logits_processors_ignore_the_allowlist_and_a_broken_one_fails_check(site):
    write_dist(site, "lps", {LOGITS_PROCESSORS_GROUP: {"ok": "lp_mod:general",
                                                      "broken": "lp_missing_mod:X"}},
               {"lp_mod": MODULE})
    proc = run_gateway("plugins", "--check", "--json", roots=(site,), VLLM_PLUGINS="")
    records = _records(proc)
    assert records[(LOGITS_PROCESSORS_GROUP, "ok")]["outcome"] == "loaded"
    assert records[(LOGITS_PROCESSORS_GROUP, "ok")]["allowlist"] == "ignored"
    assert records[(LOGITS_PROCESSORS_GROUP, "broken")]["outcome"] == "import-failed"
    assert proc.returncode == 1


def test_check_fails_when_a_general_plugin_raises_and_still_prints_the_table(site):
    write_dist(site, "bad-gen", {GENERAL_PLUGINS_GROUP: {"bad": "badgen:f"}},
               {"badgen": "def f():\n    raise RuntimeError('nope')\n"})
    proc = run_gateway("plugins", "--check", roots=(site,))
    assert proc.returncode == 1
    assert "call-failed" in proc.stdout and "'bad'" in proc.stdout and "cli" in proc.stdout


def test_warnings_do_not_fail_check(site):
    _good_dists(site)
    proc = run_gateway("plugins", "--check", roots=(site,), VLLM_PLUGINS="gen,typo")
    assert proc.returncode == 0, proc.stdout
    assert "'typo'" in proc.stdout and "matches no installed plugin" in proc.stdout
    assert "stats" in proc.stdout  # excluded by the set allowlist, listed


def test_a_raising_general_plugin_stops_other_commands(site):
    write_dist(site, "bad-gen", {GENERAL_PLUGINS_GROUP: {"bad": "badgen:f"}},
               {"badgen": "def f():\n    raise RuntimeError('nope')\n"})
    proc = run_gateway("serve", "--help", roots=(site,))
    assert proc.returncode == 1
    assert "'bad'" in proc.stderr and "api-server" in proc.stderr


def test_check_applies_the_route_conflict_rules(site):
    from tests.frontend.fake_endpoints import write_fake_endpoints
    write_fake_endpoints(site, ["twin_a", "twin_b", "replaces_models", "hello"])
    clash = run_gateway("plugins", "--check", roots=(site,), VLLM_PLUGINS="twin_a,twin_b")
    assert clash.returncode == 1
    assert "'twin_a'" in clash.stdout and "'twin_b'" in clash.stdout
    replace = run_gateway("plugins", "--check", "--json", roots=(site,),
                          VLLM_PLUGINS="replaces_models,hello")
    assert replace.returncode == 0, replace.stdout + replace.stderr
    records = _records(replace)
    assert "replaces core GET /v1/models" in records[(ENDPOINT_PLUGINS_GROUP,
                                                      "replaces_models")]["detail"]
    assert records[(ENDPOINT_PLUGINS_GROUP, "hello")]["outcome"] == "attached"


def test_check_refuses_a_plain_function_registered_as_a_logits_processor_as_serve_does(site):
    write_dist(site, "lp-func", {LOGITS_PROCESSORS_GROUP: {"func": "lp_mod:general"}},
               {"lp_mod": MODULE})
    proc = run_gateway("plugins", "--check", "--json", roots=(site,))
    assert proc.returncode == 1
    assert _records(proc)[(LOGITS_PROCESSORS_GROUP, "func")]["outcome"] == "invalid-plugin"
    assert any("'func'" in e and "LogitsProcessor" in e for e in json.loads(proc.stdout)["errors"])


def test_check_loads_the_logits_processors_named_on_the_command_line(site):
    proc = run_gateway("plugins", "--check", "--logits-processors", "no_such_mod:Proc",
                       roots=(site,))
    assert proc.returncode == 1 and "no_such_mod:Proc" in proc.stdout
