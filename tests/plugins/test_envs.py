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
