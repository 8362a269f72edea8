"""Which RAY_ADDRESS values keep Ray on loopback (ray_cluster.py); the clusters themselves are
tested end to end in tests/executor."""

from __future__ import annotations

import pytest

from gateway.ray_cluster import is_loopback_cluster


@pytest.mark.parametrize(("address", "on_loopback"), [
    (None, True), ("", True), ("local", True), ("127.0.0.1:6379", True),
    ("localhost:6379", True), ("127.0.1.1:6379", True), ("[::1]:6379", True),
    ("10.0.0.5:6379", False), ("head.example:6379", False), ("auto", False),
    ("ray://127.0.0.1:10001", False)])
def test_only_a_local_or_loopback_cluster_is_kept_on_loopback(address, on_loopback):
    assert is_loopback_cluster(address) == on_loopback
