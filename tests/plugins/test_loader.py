"""Conformance: the loading rules 1-6 of docs/plugins.md and the loader's "beyond the reference"."""

from __future__ import annotations

import logging

import pytest

from gateway.plugins import (
    ENDPOINT_PLUGINS_GROUP,
    GENERAL_PLUGINS_GROUP,
    LOGITS_PROCESSORS_GROUP,
    STAT_LOGGER_PLUGINS_GROUP,
    allowlist_warnings,
    discovery,
    load_endpoint_plugins,
    load_general_plugins,
    load_plugins_by_group,
    load_report,
)
from tests.conftest import run_python
from tests.plugin_dists import ENDPOINT_PLUGIN_CLASS, activate, forget_modules, write_dist

GENERAL = GENERAL_PLUGINS_GROUP
ENDPOINT = ENDPOINT_PLUGINS_GROUP

COUNTING_MODULE = """
    CALLS = []
    def register():
        CALLS.append(1)
"""

ENDPOINT_MODULE = ENDPOINT_PLUGIN_CLASS + """
    def any_task():
        return Plugin("any", None)
    def embed_only():
        return Plugin("embed", ("embed",))
    def generate_only():
        return Plugin("gen", ("generate",))
    def raising():
        raise RuntimeError("factory exploded")
    def not_a_plugin():
        return object()
    def bad_tasks():
        return Plugin("bad", "generate")
"""


@pytest.fixture
def general_dists(site, monkeypatch):
    write_dist(site, "alpha-dist", {GENERAL: {"alpha": "alpha_mod:register"}},
               {"alpha_mod": COUNTING_MODULE})
    write_dist(site, "beta-dist", {GENERAL: {"beta": "beta_mod:register"}},
               {"beta_mod": COUNTING_MODULE})
    activate(site, monkeypatch)
    yield site
    forget_modules("alpha_mod", "beta_mod")


@pytest.fixture
def endpoint_dists(site, monkeypatch):
    eps = {"any": "ep_mod:any_task", "embed": "ep_mod:embed_only", "gen": "ep_mod:generate_only",
           "raising": "ep_mod:raising", "notplugin": "ep_mod:not_a_plugin",
           "badtasks": "ep_mod:bad_tasks"}
    write_dist(site, "endpoints-dist", {ENDPOINT: eps}, {"ep_mod": ENDPOINT_MODULE})
    activate(site, monkeypatch)
    yield site
    forget_modules("ep_mod")


def outcome(group, name):
    rec = load_report().get(group, name)
    return rec.outcome if rec else None


# ---------------------------------------------------------------- rule 1: one loader
def test_loader_returns_objects_without_calling_them(general_dists):
    plugins = load_plugins_by_group(GENERAL)
    assert set(plugins) == {"alpha", "beta"}
    import alpha_mod
    assert plugins["alpha"] is alpha_mod.register
    assert alpha_mod.CALLS == []
    assert outcome(GENERAL, "alpha") == "loaded"


def test_loader_of_an_empty_group_returns_nothing(general_dists):
    assert load_plugins_by_group("vllm.no_such_group") == {}


# ---------------------------------------------------------------- rule 2: the allowlist
@pytest.mark.parametrize("allowlist, expected", [
    (None, {"alpha", "beta"}),
    ("alpha", {"alpha"}),
    (" beta , ", {"beta"}),
    ("alpha,beta", {"alpha", "beta"}),
    ("", set()),
    ("alpha-dist", set()),  # the distribution name is not the entry-point name
])
def test_allowlist_filters_by_entry_point_name(general_dists, monkeypatch, allowlist, expected):
    if allowlist is not None:
        monkeypatch.setenv("VLLM_PLUGINS", allowlist)
    assert set(load_plugins_by_group(GENERAL)) == expected
    for name in {"alpha", "beta"} - expected:
        assert outcome(GENERAL, name) == "not-allowlisted"


def test_empty_allowlist_allows_nothing_but_unset_allows_all(general_dists, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "")
    assert load_plugins_by_group(GENERAL) == {}
    monkeypatch.delenv("VLLM_PLUGINS")
    assert len(load_plugins_by_group(GENERAL)) == 2


# ---------------------------------------------------------------- rule 3: endpoint plugins
def test_endpoint_plugins_are_default_deny_with_a_warning(endpoint_dists, caplog):
    with caplog.at_level(logging.WARNING, logger="gateway"):
        assert load_endpoint_plugins(["generate"]) == []
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "VLLM_PLUGINS is unset" in warning
    for name in ("any", "embed", "gen"):
        assert name in warning
        assert outcome(ENDPOINT, name) == "not-allowlisted"
    import sys
    assert "ep_mod" not in sys.modules  # not even imported


def test_only_named_endpoint_plugins_load(endpoint_dists, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "any")
    assert [p.name for p in load_endpoint_plugins(["generate"])] == ["any"]
    assert outcome(ENDPOINT, "gen") == "not-allowlisted"


def test_endpoint_plugins_are_gated_by_tasks(endpoint_dists, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_PLUGINS", "any,embed,gen")
    with caplog.at_level(logging.INFO, logger="gateway"):
        plugins = load_endpoint_plugins(["generate"])
    assert sorted(p.name for p in plugins) == ["any", "gen"]
    assert outcome(ENDPOINT, "embed") == "skipped-tasks"
    line = next(r.getMessage() for r in caplog.records if "skipped" in r.getMessage())
    assert "['embed']" in line and "['generate']" in line
    loader_state_reset_and_embed = load_endpoint_plugins(["embed"])
    assert sorted(p.name for p in loader_state_reset_and_embed) == ["any", "embed"]


def test_endpoint_plugin_failures_are_isolated(endpoint_dists, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "any,raising,notplugin,badtasks")
    assert [p.name for p in load_endpoint_plugins(["generate"])] == ["any"]
    assert outcome(ENDPOINT, "raising") == "factory-failed"
    assert "factory exploded" in load_report().get(ENDPOINT, "raising").error
    assert outcome(ENDPOINT, "notplugin") == "invalid-plugin"
    assert outcome(ENDPOINT, "badtasks") == "invalid-plugin"


# ---------------------------------------------------------------- rule 4: once per process
def test_general_plugins_run_once_per_process(general_dists):
    load_general_plugins()
    load_general_plugins()
    import alpha_mod
    import beta_mod
    assert alpha_mod.CALLS == [1] and beta_mod.CALLS == [1]
    assert outcome(GENERAL, "alpha") == "called"


def test_flag_is_set_before_plugins_run_and_new_processes_load_again(site):
    reentrant = """
        import os
        from gateway.plugins import load_general_plugins
        def register():
            load_general_plugins()  # re-entry must return at once
            with open(os.environ["MARKER"], "a") as f:
                f.write(f"{os.getpid()}\\n")
    """
    write_dist(site, "re-dist", {GENERAL: {"re": "re_mod:register"}}, {"re_mod": reentrant})
    marker = site / "marker.txt"
    code = "from gateway.plugins import load_general_plugins as l; l(); l()"
    for _ in range(2):
        proc = run_python(code, site, MARKER=str(marker))
        assert proc.returncode == 0, proc.stderr
    pids = marker.read_text().split()
    assert len(pids) == 2 and pids[0] != pids[1]  # once in each process


# ---------------------------------------------------------------- rule 5: broken imports
BROKEN = {
    "raises": ("raise_mod:f", {"raise_mod": "raise RuntimeError('boom at import')"}),
    "exits": ("exit_mod:f", {"exit_mod": "raise SystemExit(3)"}),
    "noattr": ("noattr_mod:missing", {"noattr_mod": "x = 1"}),
    "nomodule": ("no_such_module_xyz:f", {}),
    "malformed": ("not a value!", {}),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_entry_point_is_skipped_and_the_rest_load(site, monkeypatch, name, caplog):
    value, modules = BROKEN[name]
    write_dist(site, "broken-dist", {GENERAL: {name: value}}, modules)
    write_dist(site, "good-dist", {GENERAL: {"good": "good_mod:register"}},
               {"good_mod": COUNTING_MODULE})
    activate(site, monkeypatch)
    try:
        with caplog.at_level(logging.ERROR, logger="gateway"):
            plugins = load_plugins_by_group(GENERAL)
        assert list(plugins) == ["good"]
        expected = "malformed" if name == "malformed" else "import-failed"
        assert outcome(GENERAL, name) == expected
        assert load_report().get(GENERAL, name).error
        assert name in caplog.text
        if expected == "import-failed":
            assert "Traceback" in caplog.text
    finally:
        forget_modules(*modules, "good_mod")


def test_broken_import_in_subprocess_does_not_end_the_process(site):
    write_dist(site, "exit-dist", {GENERAL: {"exits": "exit_mod2:f"}},
               {"exit_mod2": "raise SystemExit(3)"})
    proc = run_python("from gateway.plugins import load_plugins_by_group as l; "
                      "print(l('vllm.general_plugins')); print('alive')", site)
    assert proc.returncode == 0 and "alive" in proc.stdout


# ---------------------------------------------------------------- rule 6: raising general plugin
def test_a_raising_general_plugin_stops_start_up_naming_it(site):
    write_dist(site, "bad-general", {GENERAL: {"kaboom": "kaboom_mod:register"}},
               {"kaboom_mod": "def register():\n    raise ValueError('no way')\n"})
    code = ("from gateway.plugins import load_general_plugins, set_process_role\n"
            "set_process_role('engine-core'); load_general_plugins(); print('started')")
    proc = run_python(code, site)
    assert proc.returncode != 0
    assert "started" not in proc.stdout
    assert "'kaboom'" in proc.stderr and "engine-core" in proc.stderr
    assert "bad-general" in proc.stderr and "no way" in proc.stderr


# ---------------------------------------------------------------- names across groups
def test_same_name_in_two_groups_loads_in_each(site, monkeypatch):
    write_dist(site, "both-dist", {GENERAL: {"twin": "twin_mod:f"},
                                   LOGITS_PROCESSORS_GROUP: {"twin": "twin_mod:P"}},
               {"twin_mod": "def f(): pass\nclass P: pass\n"})
    activate(site, monkeypatch)
    monkeypatch.setenv("VLLM_PLUGINS", "twin")
    assert list(load_plugins_by_group(GENERAL)) == ["twin"]
    assert list(load_plugins_by_group(LOGITS_PROCESSORS_GROUP)) == ["twin"]
    forget_modules("twin_mod")


def test_same_name_twice_in_a_group_keeps_the_first_and_reports_both(site, monkeypatch, caplog):
    write_dist(site, "aaa-first", {GENERAL: {"dup": "dup_a:f"}}, {"dup_a": "def f(): return 'a'"})
    write_dist(site, "zzz-second", {GENERAL: {"dup": "dup_b:f"}}, {"dup_b": "def f(): return 'b'"})
    activate(site, monkeypatch)
    found = [p.distribution for p in discovery.discover(GENERAL)]
    plugins = load_plugins_by_group(GENERAL)
    assert plugins["dup"]() == ("a" if found[0] == "aaa-first" else "b")
    outcomes = sorted(r.outcome for r in load_report().records(GENERAL))
    assert outcomes == ["duplicate-name", "loaded"]
    assert "appears twice" in caplog.text
    forget_modules("dup_a", "dup_b")


# ---------------------------------------------------------------- one discovery scan per process
def test_discovery_scans_metadata_once_per_process(general_dists):
    scans = []

    def counting_scan():
        scans.append(1)
        return discovery.scan_installed()

    discovery.set_discovery(counting_scan)
    try:
        for _ in range(3):
            for group in (GENERAL, ENDPOINT, STAT_LOGGER_PLUGINS_GROUP, LOGITS_PROCESSORS_GROUP):
                load_plugins_by_group(group)
        load_endpoint_plugins(["generate"])
        allowlist_warnings()
    finally:
        discovery.set_discovery(None)
    assert scans == [1]


def test_a_distribution_installed_twice_counts_once(site, tmp_path, monkeypatch):
    second = tmp_path / "second"
    for root in (site, second):
        write_dist(root, "twice-dist", {GENERAL: {"once": "once_mod:f"}},
                   {"once_mod": "def f(): pass"})
    activate(second, monkeypatch)
    activate(site, monkeypatch)
    assert [p.name for p in discovery.discover(GENERAL)] == ["once"]
    forget_modules("once_mod")


# ---------------------------------------------------------------- allowlist hygiene
def test_allowlist_names_matching_nothing_are_warned(general_dists, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "alpha,alpah")
    warnings = allowlist_warnings()
    assert any("'alpah'" in w for w in warnings)
    assert not any("'alpha'" in w and "matches no" in w for w in warnings)


def test_set_allowlist_lists_the_plugins_of_other_groups_it_excludes(site, monkeypatch, caplog):
    write_dist(site, "mixed", {GENERAL: {"gen1": "m:f"}, STAT_LOGGER_PLUGINS_GROUP: {"st1": "m:S"},
                               ENDPOINT: {"ep1": "m:e"}, LOGITS_PROCESSORS_GROUP: {"lp1": "m:L"}},
               {"m": "def f(): pass"})
    activate(site, monkeypatch)
    monkeypatch.setenv("VLLM_PLUGINS", "ep1")
    with caplog.at_level(logging.WARNING, logger="gateway"):
        warnings = allowlist_warnings()
    excluded = [w for w in warnings if "not loaded" in w]
    assert len(excluded) == 1
    assert "gen1" in excluded[0] and "st1" in excluded[0]
    assert "lp1" not in excluded[0]  # logits processors ignore the allowlist
    assert "ep1" not in excluded[0]


def test_unset_allowlist_gives_no_hygiene_warnings(general_dists):
    assert allowlist_warnings() == []


# ---------------------------------------------------------------- the load report
def test_report_records_where_and_how_long(general_dists):
    from gateway.plugins import set_process_role
    set_process_role("worker-3")
    load_general_plugins()
    import os
    rec = load_report().get(GENERAL, "alpha")
    assert (rec.group, rec.name, rec.value, rec.distribution) == (
        GENERAL, "alpha", "alpha_mod:register", "alpha-dist")
    assert rec.process_role == "worker-3" and rec.pid == os.getpid()
    assert rec.outcome == "called" and rec.error is None and rec.load_time_s >= 0
    set_process_role("main")
