"""Multi-node launches: the node layout in the config, hostfiles, the ssh check, commands."""

from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings
from pydantic import ValidationError

from artifacts.errors import ConfigError, InputNotFoundError
from tasks.train_nodes import check_dispatch, node_task
from training.config import TrainConfig
from training.runtime.hosts import check_ssh_hosts, node_hosts, read_hostfile, save_hostfile
from training.runtime.launcher import NodeLaunch, free_port, launcher_command
from training.runtime.memory import machine_memory_bytes
from training.stages import memory_budget, ssh_launch


def test_ranks_per_node_gives_the_world_size_and_where_fields_leave_the_cache_key() -> None:
    config = TrainConfig(nodes=2, ranks_per_node=3, launcher="per_node", batch_size=6)
    assert config.world_size == 6 and config.node_ranks() == 3
    one_node = TrainConfig(world_size=6, batch_size=6)
    assert config.fingerprinted() == one_node.fingerprinted()
    assert TrainConfig(nodes=2, launcher="per_node").node_ranks() == 1


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        ({"nodes": 2}, "train.nodes=2 needs train.launcher: ssh"),
        ({"nodes": 3, "launcher": "per_node"}, "train.nodes=3 does not divide train.world_size=2"),
        (
            {"nodes": 2, "ranks_per_node": 2, "world_size": 2, "launcher": "per_node"},
            "train.world_size=2 is not train.nodes=2 x train.ranks_per_node=2",
        ),
        ({"launcher": "ssh"}, "train.launcher=ssh needs train.hostfile"),
        (
            {"launcher": "ssh", "hostfile": "h", "nodes": 2},
            "set train.master_addr to node 0's address",
        ),
        ({"hostfile": "h"}, "train.hostfile='h' applies to launcher 'ssh' or 'per_node'"),
        ({"launcher": "per_node", "ssh_port": 22}, "train.ssh_port=22 applies to launcher 'ssh'"),
        (
            {"node_dispatch": "workers"},
            "train.node_dispatch=workers applies to launcher 'per_node'",
        ),
        (
            {"launcher": "per_node", "node_pickup_timeout_s": 5},
            "train.node_pickup_timeout_s=5.0 applies to node_dispatch 'workers' only",
        ),
        (
            {
                "model": "sasrec",
                "launcher": "ssh",
                "hostfile": "h",
                "master_addr": "10.0.0.1",
                "nodes": 2,
                "world_size": 6,
                "pipeline_stages": 3,
            },
            "train.nodes=2 x ranks_per_node=3 does not divide train.pipeline_stages=3",
        ),
    ],
)
def test_a_node_layout_that_cannot_run_is_refused_at_parse_time(fields: dict, refusal: str) -> None:
    with pytest.raises(ValidationError, match=refusal):
        TrainConfig(**fields)


def test_pipeline_stages_on_whole_nodes_are_accepted() -> None:
    ssh = {"launcher": "ssh", "hostfile": "h", "master_addr": "10.0.0.1", "model": "sasrec"}
    # 2 nodes x 2 ranks, 2 stages: a stage per node. 4 nodes x 1, 2 stages: 2 nodes a stage.
    assert TrainConfig(**ssh, nodes=2, world_size=4, pipeline_stages=2)
    assert TrainConfig(**ssh, nodes=4, world_size=4, pipeline_stages=2)
    assert TrainConfig(**ssh, nodes=2, world_size=4, pipeline_stages=4)


def test_a_hostfile_is_checked_against_the_layout(tmp_path: Path) -> None:
    hostfile = save_hostfile(tmp_path / "hosts", [("a", 2), ("b", 2), ("c", 1)])
    assert read_hostfile(hostfile, 2, 2) == [("a", 2), ("b", 2)]
    with pytest.raises(ConfigError, match="host c has slots=1 but every node runs"):
        read_hostfile(hostfile, 3, 2)
    with pytest.raises(ConfigError, match="train.nodes=4 but train.hostfile .* names 3 host"):
        read_hostfile(hostfile, 4, 1)
    (tmp_path / "bad").write_text("# nodes\na slots=2\nb 2\n")
    with pytest.raises(ConfigError, match="bad line 3: 'b 2' is not `host slots=N`"):
        read_hostfile(tmp_path / "bad", 2, 1)
    (tmp_path / "twice").write_text("a slots=1\na slots=1\n")
    with pytest.raises(ConfigError, match="line 2: host a repeats"):
        read_hostfile(tmp_path / "twice", 2, 1)
    with pytest.raises(InputNotFoundError, match="train.hostfile: .*missing does not exist"):
        read_hostfile(tmp_path / "missing", 1, 1)
    assert node_hosts(2, 3) == [("node-0", 3), ("node-1", 3)]


def test_a_host_that_does_not_answer_ssh_fails_the_stage_naming_it(tmp_path: Path) -> None:
    # Loopback only: nothing listens on a port that was free a moment ago.
    port = free_port()
    hostfile = save_hostfile(tmp_path / "hosts", [("127.0.0.1", 1), ("127.0.0.2", 1)])
    with pytest.raises(ConfigError, match=f"host 127.0.0.1 does not answer ssh port {port}"):
        check_ssh_hosts(["127.0.0.1", "127.0.0.2"], port, hostfile)
    config = TrainConfig(
        launcher="ssh", hostfile=str(hostfile), nodes=2, master_addr="127.0.0.2", ssh_port=port
    )
    with pytest.raises(ConfigError, match=rf"train.hostfile {hostfile}: host 127.0.0.1 does not"):
        ssh_launch(config)


def test_the_launcher_commands_are_deepspeeds_multi_node_ones(tmp_path: Path) -> None:
    spec = tmp_path / "launch.json"
    local = launcher_command("py", 2, 29500, "training.ctr.worker", spec)
    assert local == [
        "py", "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "29500",
        "--module", "training.ctr.worker", str(spec),
    ]  # fmt: skip
    per_node = launcher_command(
        "py", 4, 29500, "m", spec, NodeLaunch(tmp_path / "h", 2, 2, "10.0.0.1", node_rank=1)
    )
    assert per_node[3:] == [
        "--hostfile", str(tmp_path / "h"), "--num_nodes", "2", "--num_gpus", "2",
        "--master_addr", "10.0.0.1", "--no_ssh", "--node_rank", "1", "--master_port", "29500",
        "--module", "m", str(spec),
    ]  # fmt: skip
    ssh = launcher_command(
        "py", 4, 29500, "m", spec, NodeLaunch(tmp_path / "h", 2, 2, "10.0.0.1", ssh_port=2222)
    )
    assert ssh[11:15] == ["--launcher", "pdsh", "--ssh_port", "2222"]


def test_memory_is_planned_per_node() -> None:
    total = machine_memory_bytes()
    budget, source = memory_budget(TrainConfig(nodes=2, launcher="per_node"), "cpu")
    assert budget == int(total * 0.85) and "each node's" in source and "1 ranks per node" in source
    budget, source = memory_budget(TrainConfig(world_size=2), "cpu")
    assert budget == int(total * 0.85 / 2) and "2 ranks per node" in source


def test_node_workers_need_an_object_store_root_and_a_prefect_server() -> None:
    workers = TrainConfig(nodes=2, launcher="per_node", node_dispatch="workers")
    with pytest.raises(ConfigError, match="artifact root /tmp/r is a local path"):
        check_dispatch(workers, "/tmp/r")
    with temporary_settings({PREFECT_API_URL: None}):
        with pytest.raises(ConfigError, match="set PREFECT_API_URL"):
            check_dispatch(workers, "s3://bucket/x")
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        check_dispatch(workers, "s3://bucket/x")
    check_dispatch(TrainConfig(nodes=2, launcher="per_node"), "/tmp/r")  # threads here


def test_each_node_task_has_a_key_of_its_own_that_survives_the_worker_copy() -> None:
    """Prefect routes a run to the workers serving its task key; the worker copies the
    task (`with_options`), which derives the key again from the function."""
    keys = [node_task(index).task_key for index in range(3)]
    assert len(set(keys)) == 3
    assert [
        node_task(index).with_options(persist_result=True).task_key for index in range(3)
    ] == keys
