"""`gateway serve` flags for ranks on several nodes (vLLM's names): what they fill in the
ParallelConfig, and the combinations refused before anything starts, naming the value."""

from __future__ import annotations

import pytest

from gateway.config import ParallelConfig
from gateway.frontend.cli.args import engine_config_from_args
from tests.frontend.conftest import serve_args


def test_node_flags_fill_the_parallel_config():
    parallel = engine_config_from_args(serve_args(
        "-tp", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.7",
        "--master-port", "29500", "--headless")).parallel
    assert parallel == ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1,
                                      master_addr="10.0.0.7", master_port=29500)
    assert parallel.ranks_per_node == 2 and parallel.uses_worker_processes


@pytest.mark.parametrize(("argv", "uses_worker_processes"), [
    ([], False), (["-tp", "2"], True), (["--distributed-executor-backend", "mp"], True)])
def test_worker_processes_serve_more_than_one_rank_or_when_asked(argv, uses_worker_processes):
    parallel = engine_config_from_args(serve_args(*argv)).parallel
    assert parallel.uses_worker_processes is uses_worker_processes


@pytest.mark.parametrize(("argv", "message"), [
    (["-tp", "3", "--nnodes", "2", "--master-port", "5"],
     "tensor_parallel_size 3 is not a multiple of nnodes 2"),
    (["-tp", "2", "--nnodes", "2"], "several nodes need --master-port"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "5"],
     "--node-rank 1 runs only worker ranks: add --headless"),
    (["-tp", "2", "--nnodes", "2", "--master-port", "5", "--headless"],
     "give it --node-rank 1 or more"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "5", "--headless"],
     r"node_rank 2 must be in 0..1"),
    (["-tp", "2", "--distributed-executor-backend", "uni"],
     "tensor_parallel_size 2 needs mp"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "5", "--headless",
      "--api-server-count", "2"], "--headless runs no API server"),
])
def test_impossible_node_layouts_are_refused_naming_the_value(argv, message):
    with pytest.raises(ValueError, match=message):
        engine_config_from_args(serve_args(*argv))


@pytest.mark.parametrize(("argv", "count"), [([], 1), (["--api-server-count", "3"], 3),
                                              (["-asc", "2"], 2)])
def test_api_server_count_is_vllms_flag_defaulting_to_one(argv, count):
    assert serve_args(*argv).api_server_count == count


def test_api_server_count_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        serve_args("--api-server-count", "0")
    assert "--api-server-count" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["-dp", "2"], ["-dp", "2", "--data-parallel-backend", "mp"],
                                  ["-dp", "2", "-dpb", "mp"]])
def test_the_data_parallel_backend_mp_is_the_default_and_accepted(argv):
    assert serve_args(*argv).data_parallel_backend == "mp"
    assert engine_config_from_args(serve_args(*argv)).parallel.data_parallel_size == 2


@pytest.mark.parametrize(("argv", "address"), [
    (["-dp", "2", "--data-parallel-backend", "ray"], None),
    (["-dp", "2", "-dpb", "ray", "-tp", "2", "--distributed-executor-backend", "ray"], None),
    (["-dp", "2", "-dpb", "ray", "--api-server-count", "2", "-dpa", "10.0.0.7"], "10.0.0.7"),
    (["-dp", "2", "-dpb", "ray", "--data-parallel-address", "127.0.0.1"], "127.0.0.1")])
def test_the_data_parallel_backend_ray_reaches_the_parallel_config(argv, address):
    parallel = engine_config_from_args(serve_args(*argv)).parallel
    assert parallel.data_parallel_backend == "ray" and parallel.data_parallel_size == 2
    assert parallel.data_parallel_address == address


def test_an_unknown_data_parallel_backend_is_refused_by_the_config():
    with pytest.raises(ValueError, match="data_parallel_backend 'dask' is not known"):
        ParallelConfig(data_parallel_size=2, data_parallel_backend="dask").validate()
