"""Conformance: rule 7, the lazily resolved platform. Process state: fresh subprocesses."""

from __future__ import annotations

import pytest

from gateway.plugins import PLATFORM_PLUGINS_GROUP
from tests.conftest import run_python
from tests.plugin_dists import write_dist

PLATFORM_MODULE = """
    import os
    with open(os.environ["MARKER"], "a") as f:
        f.write("imported\\n")
    from gateway.platforms.interface import Platform
    class ToyPlatform(Platform):
        device_type = "cpu"
        device_name = "toy"
    class OtherPlatform(Platform):
        device_type = "cpu"
        device_name = "other"
    def toy():
        return "toy_platform.ToyPlatform"
    def other():
        return "toy_platform.OtherPlatform"
    def inactive():
        return None
"""

READ = ("import gateway.platforms as p, sys\n"
        "assert 'toy_platform' not in sys.modules  # lazy: nothing loaded at import\n"
        "print(p.current_platform.device_name)\n"
        "from gateway.plugins import load_report\n"
        "print(sorted((r.name, r.outcome) for r in load_report().records()))\n")


def _dist(site, entry_points):
    eps = {name: f"toy_platform:{name}" for name in entry_points}
    write_dist(site, "toy-platform", {PLATFORM_PLUGINS_GROUP: eps},
               {"toy_platform": PLATFORM_MODULE})


def test_builtin_cpu_platform_without_plugins(site):
    proc = run_python(READ, site, MARKER=str(site / "m"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "cpu"


def test_one_activated_out_of_tree_platform_wins(site):
    _dist(site, ["toy", "inactive"])
    proc = run_python(READ, site, MARKER=str(site / "m"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "toy"
    assert "('inactive', 'inactive')" in lines[1] and "('toy', 'active')" in lines[1]


def test_two_activated_out_of_tree_platforms_are_an_error_naming_them(site):
    _dist(site, ["toy", "other"])
    proc = run_python(READ, site, MARKER=str(site / "m"))
    assert proc.returncode != 0
    assert "toy" in proc.stderr and "other" in proc.stderr and "Only one" in proc.stderr


def test_target_device_cpu_wins_before_the_group_is_loaded(site):
    _dist(site, ["toy", "other"])
    marker = site / "m"
    proc = run_python(READ, site, MARKER=str(marker), VLLM_TARGET_DEVICE="cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "cpu"
    assert not marker.exists()  # the platform plugin module was never imported


def test_allowlist_applies_to_platform_plugins(site):
    _dist(site, ["toy", "other"])
    proc = run_python(READ, site, MARKER=str(site / "m"), VLLM_PLUGINS="other")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "other"


@pytest.mark.parametrize("value", ["cuda", "tpu9000", ""])
def test_a_target_device_other_than_cpu_goes_through_detection(site, value):
    _dist(site, ["toy", "inactive"])
    proc = run_python(READ, site, MARKER=str(site / "m"), VLLM_TARGET_DEVICE=value)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "toy"


def test_current_platform_is_an_instance_of_the_plugin_class(site):
    _dist(site, ["toy"])
    code = ("from gateway.platforms import Platform, current_platform\n"
            "print(isinstance(current_platform, Platform), type(current_platform).__name__)\n")
    proc = run_python(code, site, MARKER=str(site / "m"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "ToyPlatform"]
