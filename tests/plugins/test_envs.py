import os

import pytest

from gateway import envs


@pytest.mark.parametrize("raw, expected", [
    ("a,b", ["a", "b"]),
    (" a , b ", ["a", "b"]),
    ("a,,b,", ["a", "b"]),
    ("", [""]),
    ("  ", [""]),
    (",", [""]),
])
def test_vllm_plugins_is_parsed_into_names(monkeypatch, raw, expected):
    monkeypatch.setenv("VLLM_PLUGINS", raw)
    assert envs.vllm_plugins() == expected


def test_unset_vllm_plugins_is_none_not_empty(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert envs.vllm_plugins() is None


@pytest.mark.parametrize(("operator", "expected"), [
    ({}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}),
    # the operator's spin count with our policy
    ({"GOMP_SPINCOUNT": "500"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "500"}),
    # the operator's policy alone: ACTIVE spins for good, as OpenMP defines it
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}),
])
def test_openmp_waits_passively_after_a_short_spin_unless_the_operator_chose(
        monkeypatch, operator, expected):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in operator.items():
        monkeypatch.setenv(name, value)
    envs.default_openmp_waiting()
    assert {name: os.environ.get(name) for name in expected} == expected
