"""Which RAY_ADDRESS values keep Ray on loopback (ray_cluster.py); the clusters themselves are
tested end to end in tests/executor."""

from __future__ import annotations

import pytest

from gateway.ray_cluster import has_ray_token, is_loopback_cluster


@pytest.mark.parametrize(("address", "on_loopback"), [
    (None, True), ("", True), ("local", True), ("127.0.0.1:6379", True),
    ("localhost:6379", True), ("127.0.1.1:6379", True), ("[::1]:6379", True),
    ("10.0.0.5:6379", False), ("head.example:6379", False), ("auto", False),
    ("ray://127.0.0.1:10001", False)])
def test_only_a_local_or_loopback_cluster_is_kept_on_loopback(address, on_loopback):
    assert is_loopback_cluster(address) == on_loopback


@pytest.mark.parametrize(("token", "token_file", "home_file", "expected"), [
    (None, False, False, False), ("abc", False, False, True),
    (None, True, False, True), (None, False, True, True)])
def test_a_token_is_at_hand_where_ray_looks_for_one(monkeypatch, tmp_path, token, token_file,
                                                    home_file, expected):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    if token:
        monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    if token_file:
        (tmp_path / "token").write_text("x")
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    if home_file:
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("x")
    assert has_ray_token() == expected
