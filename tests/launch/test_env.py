"""The launcher's environment is parsed in one place (hybrid.launch_env) and turned into the parallel
state by one constructor (ParallelState.from_launch_env), for the trainer and every tool."""

import ast
import re
from pathlib import Path

import pytest

from hybrid.launch_env import LaunchEnv, LaunchEnvError
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job7"}


def test_torchrun_variables_are_read_into_one_frozen_value():
    env = LaunchEnv.from_environ(TORCHRUN)
    assert env == LaunchEnv(rank=5, world_size=8, local_rank=1, local_world_size=4,
                            master_addr="node0", master_port=29500, restart_count=2,
                            agent_store=True, run_id="job7")
    assert env.distributed and env.under_torchrun
    with pytest.raises(AttributeError):
        env.rank = 0


def test_no_launcher_is_one_process():
    env = LaunchEnv.from_environ({})
    assert (env.rank, env.world_size, env.distributed, env.under_torchrun) == (0, 1, False, False)
    state = ParallelState.from_launch_env(env, tensor_parallel_size=1, device="cpu")
    assert (state.world_size, state.tp_size, state.dp_size, state.dp.shm) == (1, 1, 1, None)


@pytest.mark.parametrize("change, names", [
    ({"RANK": "one"}, "RANK='one' is not an integer"),
    ({"WORLD_SIZE": "4.0"}, "WORLD_SIZE='4.0' is not an integer"),
    ({"RANK": "8"}, "RANK=8 is outside the job's WORLD_SIZE=8"),
    ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4 is outside LOCAL_WORLD_SIZE=4"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 must be at least 1"),
])
def test_malformed_values_name_the_variable(change, names):
    with pytest.raises(LaunchEnvError, match=re.escape(names)):
        LaunchEnv.from_environ({**TORCHRUN, **change})


def test_ranks_with_nowhere_to_meet_are_refused_before_joining():
    env = LaunchEnv.from_environ({"RANK": "1", "WORLD_SIZE": "4"})
    with pytest.raises(LaunchEnvError, match="4 ranks without MASTER_ADDR and MASTER_PORT"):
        ParallelState.from_launch_env(env, tensor_parallel_size=2)


def _from_env(rank, world_size):
    state = ParallelState.from_launch_env(LaunchEnv.from_environ(), tensor_parallel_size=2,
                                          gpus_per_node=world_size, dp_transport="gloo")
    return state.tp.ranks, state.dp.ranks, state.topology == Topology(world_size, 2, world_size)


def test_groups_of_a_launched_job_are_the_topology_grid():
    got = run_on_ranks(_from_env, 4)
    assert got == [([0, 1], [0, 2], True), ([0, 1], [1, 3], True),
                   ([2, 3], [0, 2], True), ([2, 3], [1, 3], True)]


def test_only_the_launch_env_module_reads_the_launchers_variables():
    """No other module of the framework (or entry point) parses RANK, WORLD_SIZE, ... itself."""
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"}
    files = [*ROOT.glob("hybrid/**/*.py"), *ROOT.glob("models/**/*.py"), *ROOT.glob("tools/*.py"),
             ROOT / "launch" / "pretrain_gpt.py"]
    readers = sorted(str(f.relative_to(ROOT)) for f in files
                     if f.name != "launch_env.py" and names & {
                         node.value for node in ast.walk(ast.parse(f.read_text()))
                         if isinstance(node, ast.Constant) and isinstance(node.value, str)})
    assert readers == []
