"""deploy/skypilot/island.yaml is a task SkyPilot's own parser accepts (offline: nothing is launched), with the
island's nodes, GPUs, recovery, environment and secret where the run script expects them.

SkyPilot is heavy (about 80 packages), so it is not in the test extra: `pip install skypilot` to run this test."""

from pathlib import Path

import pytest
import yaml

TASK = Path(__file__).resolve().parents[2] / "deploy" / "skypilot" / "island.yaml"


@pytest.fixture
def sky(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # SkyPilot keeps its state under ~/.sky: a fresh one, offline
    return pytest.importorskip("sky", reason="SkyPilot is not installed (heavy, not in the test extra): "
                                             "pip install skypilot to validate deploy/skypilot/island.yaml")


def test_skypilot_parses_the_island_task(sky):
    task = sky.Task.from_yaml(str(TASK))
    assert task.num_nodes == 2
    (resources,) = task.resources
    assert resources.accelerators == {"H100": 8} and resources.use_spot
    assert resources.job_recovery["max_restarts_on_errors"] >= 1
    assert {"DILOCO_ID", "DILOCO_SYNCER", "DILOCO_ARGS"} <= set(task.envs)
    for name in ("DILOCO_ID", "DILOCO_SYNCER", "DILOCO_TOKEN", "DILOCO_ARGS", "SKYPILOT_NODE_RANK",
                 "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_IPS", "DILOCO_EXIT_FILE"):
        assert f"${name}" in task.run or f"${{{name}}}" in task.run or f"{name}=" in task.run, name


def test_the_token_is_a_secret_given_at_launch(sky):
    config = yaml.safe_load(TASK.read_text())
    task = sky.Task.from_yaml_config(config, secrets_overrides=[("DILOCO_TOKEN", "s3cret")])
    assert set(task.secrets) == {"DILOCO_TOKEN"} and "DILOCO_TOKEN" not in task.envs


def test_skypilot_refuses_a_misspelt_field(sky):
    config = yaml.safe_load(TASK.read_text())
    config["num_node"] = config.pop("num_nodes")
    with pytest.raises(Exception, match="num_node"):
        sky.Task.from_yaml_config(config)
