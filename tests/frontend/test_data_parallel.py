"""Data parallelism without processes: the load balancer's choices (vLLM's score, ties by
KV usage then in turn), each engine's configuration, the flag, and the refusals; and the
Ray backends' flags, the settings they forward to their actors, and an engine address
that cannot be listened on."""

from __future__ import annotations

import argparse
import asyncio
import glob
import tempfile

import pytest

from gateway.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from gateway.frontend.cli.args import add_server_args, engine_config_from_args
from gateway.frontend.engine_client.balance import LoadBalancer
from gateway.frontend.engine_client.connection import EngineConnection
from gateway.frontend.engine_client.errors import EngineStartError
from gateway.frontend.engine_client.launch import engine_config_for_rank
from gateway.frontend.engine_client.ray_engines import (
    PlacedEngine,
    RayEngine,
    engine_config_on_ray,
    local_layout,
)
from gateway.messages import SchedulerStats


def _stats(running: int, waiting: int, kv_usage: float = 0.0) -> SchedulerStats:
    return SchedulerStats(running, waiting, kv_usage, 0, 64)


def test_an_idle_server_alternates_between_its_engines():
    balancer = LoadBalancer(3)
    assert [balancer.choose() for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert balancer.num_chosen == [2, 2, 2]


@pytest.mark.parametrize(("reports", "expected"), [
    # (running, waiting, kv usage) per engine -> the engine chosen
    ([(3, 0, 0.1), (1, 0, 0.1)], 1),  # fewer running
    ([(0, 1, 0.1), (3, 0, 0.1)], 1),  # one waiting outweighs three running (4 x waiting)
    ([(0, 1, 0.1), (5, 0, 0.1)], 0),
    ([(2, 0, 0.9), (2, 0, 0.2)], 1),  # a tie goes to the emptier KV cache
], ids=["running", "waiting-weighs-four", "running-past-four", "kv-usage-breaks-ties"])
def test_the_least_loaded_engine_by_its_report_is_chosen(reports, expected):
    balancer = LoadBalancer(len(reports))
    for index, report in enumerate(reports):
        balancer.report(index, _stats(*report))
    assert balancer.choose() == expected


def test_requests_sent_since_a_report_count_as_waiting_until_the_next():
    balancer = LoadBalancer(2)
    balancer.report(0, _stats(0, 0))
    balancer.report(1, _stats(6, 0))
    # Engine 1 runs 6: engine 0 takes requests until its unseen ones weigh more.
    assert [balancer.choose() for _ in range(3)] == [0, 0, 1]
    balancer.report(0, _stats(2, 0))  # it has them running now: 2 < 6 + 4 unseen
    assert balancer.choose() == 0


def test_each_engine_gets_its_rank_and_its_own_rendezvous_port():
    config = EngineConfig(parallel=ParallelConfig(data_parallel_size=2, master_port=29500))
    ranks = [engine_config_for_rank(config, rank).parallel for rank in (0, 1)]
    assert [(p.data_parallel_rank, p.master_port) for p in ranks] == [(0, 29500), (1, 29501)]
    free = engine_config_for_rank(EngineConfig(parallel=ParallelConfig(data_parallel_size=2)),
                                  1).parallel
    assert free.master_port is None and free.data_parallel_rank == 1


@pytest.mark.parametrize(("dp", "tp", "dp_rank", "roles", "num_workers", "indexes"), [
    (1, 2, 0, ("engine-core", "worker-0", "worker-1"), 2, [0, 1]),
    (2, 2, 1, ("engine-core-dp1", "worker-dp1-0", "worker-dp1-1"), 4, [2, 3]),
    (2, 1, 1, ("engine-core-dp1", "worker-dp1-0", "worker-dp1-1"), 2, [1]),
])
def test_engines_name_their_processes_and_split_the_machine(dp, tp, dp_rank, roles,
                                                            num_workers, indexes):
    parallel = ParallelConfig(data_parallel_size=dp, data_parallel_rank=dp_rank,
                              tensor_parallel_size=tp)
    assert (parallel.engine_role, parallel.worker_role(0), parallel.worker_role(1)) == roles
    assert parallel.num_local_workers == num_workers
    assert [parallel.local_worker_index(rank) for rank in range(tp)] == indexes


def _parse(*argv: str) -> argparse.Namespace:
    return add_server_args(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.mark.parametrize("flag", ["--data-parallel-size", "-dp"])
def test_the_flag_sets_the_number_of_engines(flag):
    assert engine_config_from_args(_parse(flag, "3")).parallel.data_parallel_size == 3


@pytest.mark.parametrize(("argv", "message"), [
    (("-dp", "2", "-tp", "2", "--nnodes", "2", "--master-port", "29500"),
     "data parallelism runs on one"),
], ids=["several-nodes"])
def test_data_parallel_refusals_name_the_values(argv, message):
    with pytest.raises(ValueError, match=message):
        engine_config_from_args(_parse(*argv))


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_data_parallel_size_below_one_is_refused_by_the_parser(value, capsys):
    with pytest.raises(SystemExit):
        _parse("--data-parallel-size", value)
    assert "--data-parallel-size" in capsys.readouterr().err


def test_the_ray_backend_parses_and_forwards_plugin_settings_to_the_actors(monkeypatch):
    from gateway.ray_cluster import forwarded_env

    config = engine_config_from_args(_parse("--distributed-executor-backend", "ray",
                                            "-tp", "2"))
    assert config.parallel.uses_worker_processes
    monkeypatch.setenv("VLLM_PLUGINS", "probe")
    monkeypatch.setenv("GATEWAY_PROCESS_ROLE", "engine-core")
    monkeypatch.setenv("UNRELATED_SETTING", "1")
    env = forwarded_env()
    assert env["VLLM_PLUGINS"] == "probe"
    assert "GATEWAY_PROCESS_ROLE" not in env and "UNRELATED_SETTING" not in env


def test_an_engine_address_that_is_not_this_machines_fails_start_up_naming_it(tiny_llama):
    # 203.0.113.0/24 is TEST-NET-3 (documentation only): no machine's own address.
    before = set(glob.glob(f"{tempfile.gettempdir()}/gateway-ipc-*"))
    launcher = RayEngine(None, PlacedEngine(0, None, 0, "here"),  # type: ignore[arg-type]
                         "203.0.113.254")  # no cluster: the bind fails before it is used
    config = EngineConfig(model=ModelConfig(model=str(tiny_llama)),
                          cache=CacheConfig(kv_cache_memory_gib=0.01))
    with pytest.raises(EngineStartError, match=r"cannot listen for the engine core at "
                       r"tcp://203\.0\.113\.254:\*"):
        asyncio.run(EngineConnection.start(config, launcher, startup_timeout_s=60))
    assert set(glob.glob(f"{tempfile.gettempdir()}/gateway-ipc-*")) <= before  # cleaned up


@pytest.mark.parametrize(("hosts", "layout"), [
    (["a", "a"], [(2, 0), (2, 1)]),
    (["a", "b", "a"], [(2, 0), (1, 0), (2, 1)]),
    (["b", "a", "a", "b"], [(2, 0), (2, 0), (2, 1), (2, 1)])])
def test_engines_placed_by_ray_count_only_the_engines_on_their_own_machine(hosts, layout):
    assert local_layout(hosts) == layout


def test_an_engine_placed_by_ray_takes_its_devices_and_cores_among_its_machines_engines():
    placed = [PlacedEngine(rank, None, 100 + rank, host)
              for rank, host in enumerate(["a", "b", "b"])]
    config = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, data_parallel_size=3,
                                                  data_parallel_backend="ray"))
    parallel = engine_config_on_ray(config, placed, 2).parallel
    assert (parallel.data_parallel_rank, parallel.engine_role) == (2, "engine-core-dp2")
    assert parallel.num_local_workers == 4  # the two engines on host b, two ranks each
    assert [parallel.local_worker_index(rank) for rank in range(2)] == [2, 3]
    alone = engine_config_on_ray(config, placed, 0).parallel
    assert alone.num_local_workers == 2
    assert [alone.local_worker_index(rank) for rank in range(2)] == [0, 1]
