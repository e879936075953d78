"""Unit tests of tfos.cluster_template and tfos._node.launch (pure: no Spark, no TensorFlow)."""

from __future__ import annotations

import json

import pytest

from tfos._node.launch import ClusterConfig
from tfos.cluster_template import (
    InputMode,
    NodeInfo,
    NodeRole,
    build_cluster_spec,
    build_template,
    build_tf_config,
    count_workers,
    format_template,
    roles_from_template,
    tf_config_json,
)
from tfos.errors import ConfigurationError, ControlProtocolError

KEY = bytes(range(32))


def _node(eid: int, job: str, idx: int, port: int, host: str = "10.0.0.1") -> NodeInfo:
    return NodeInfo(eid, job, idx, host, port)


# --------------------------------------------------------------------------- template
def test_tfos_order_ps_then_master_then_evaluator_then_workers():
    t = build_template(6, num_ps=2, master_node="chief", eval_node=True)
    assert t == {"ps": [0, 1], "chief": [2], "evaluator": [3], "worker": [4, 5]}
    assert list(t) == ["ps", "chief", "evaluator", "worker"]
    assert format_template(t) == "2 ps [0, 1], 1 chief [2], 1 evaluator [3], 2 worker [4, 5]"


def test_master_node_named_master():
    t = build_template(3, master_node="master")
    assert t == {"master": [0], "worker": [1, 2]}


def test_c18_one_ps_one_worker():
    t = build_template(2, num_ps=1)
    assert t == {"ps": [0], "worker": [1]}
    assert format_template(t) == "1 ps [0], 1 worker [1]"


def test_only_workers_and_only_chief():
    assert build_template(3) == {"worker": [0, 1, 2]}
    assert build_template(1, master_node="chief") == {"chief": [0]}
    assert format_template(build_template(1)) == "1 worker [0]"


def test_num_executors_too_small_for_ps():
    with pytest.raises(ConfigurationError) as ei:
        build_template(2, num_ps=2)
    msg = str(ei.value)
    assert "num_executors=2 is too small for num_ps=2" in msg
    assert "num_executors must be >= 3" in msg
    assert isinstance(ei.value, ValueError)


def test_num_executors_too_small_with_evaluator():
    with pytest.raises(ConfigurationError, match=r"num_ps=1 plus an evaluator.*>= 3"):
        build_template(2, num_ps=1, eval_node=True)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_num_executors_invalid(bad):
    with pytest.raises(ConfigurationError, match=r"num_executors must be an int >= 1"):
        build_template(bad)


@pytest.mark.parametrize("bad", [-1, False, 1.0])
def test_num_ps_invalid(bad):
    with pytest.raises(ConfigurationError, match=r"num_ps must be an int >= 0, got " + repr(bad).replace(".", r"\.")):
        build_template(3, num_ps=bad)


@pytest.mark.parametrize("bad", ["boss", "worker", "ps", ""])
def test_bad_master_node(bad):
    with pytest.raises(ConfigurationError) as ei:
        build_template(3, master_node=bad)
    assert "master_node must be None, 'chief' or 'master'" in str(ei.value)
    assert repr(bad) in str(ei.value)


def test_roles_from_template_sorted_and_validated():
    roles = roles_from_template(build_template(4, num_ps=1, master_node="chief"))
    assert roles == [
        NodeRole(0, "ps", 0),
        NodeRole(1, "chief", 0),
        NodeRole(2, "worker", 0),
        NodeRole(3, "worker", 1),
    ]
    assert [r.feedable for r in roles] == [False, True, True, True]
    assert roles[0].is_background
    with pytest.raises(ConfigurationError, match="not 0..n-1"):
        roles_from_template({"worker": [0, 2]})
    with pytest.raises(ConfigurationError, match="not 0..n-1"):
        roles_from_template({"ps": [0], "worker": [0, 1]})


def test_node_role_validation():
    with pytest.raises(ConfigurationError, match="negative executor id"):
        NodeRole(-1, "worker", 0)
    with pytest.raises(ConfigurationError, match="job_name must not be empty"):
        NodeRole(0, "", 0)
    assert NodeRole(2, "evaluator", 0).is_background


# --------------------------------------------------------------------------- NodeInfo
def test_node_info_roundtrip_and_names():
    n = NodeInfo(2, "worker", 1, "10.0.0.5", 2222, data_port=3333, pid=77, executor_key="10.0.0.5/99")
    assert NodeInfo.from_dict(json.loads(json.dumps(n.to_dict()))) == n
    assert n.address == "10.0.0.5:2222"
    assert n.name == "worker:1 (executor 2, host 10.0.0.5)"
    assert n.role == NodeRole(2, "worker", 1)


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(port=0), "invalid TF port 0 for executor 0"),
        (dict(port=70000), "invalid TF port 70000"),
        (dict(data_port=-1), "invalid data port -1"),
        (dict(host=""), "empty host for executor 0"),
    ],
)
def test_node_info_validation(kwargs, text):
    base = dict(executor_id=0, job_name="worker", task_index=0, host="h", port=1000)
    base.update(kwargs)
    with pytest.raises(ControlProtocolError) as ei:
        NodeInfo(**base)
    assert text in str(ei.value)


def test_node_info_from_dict_malformed():
    with pytest.raises(ControlProtocolError, match="malformed node record"):
        NodeInfo.from_dict({"executor_id": 0, "job_name": "worker", "task_index": 0, "host": "h"})
    with pytest.raises(ControlProtocolError, match="malformed node record"):
        NodeInfo.from_dict({"executor_id": "x", "job_name": "w", "task_index": 0, "host": "h", "port": 1})


# ----------------------------------------------------------------------- cluster spec
def test_cluster_spec_ordered_by_task_index_not_arrival():
    nodes = [
        _node(3, "worker", 2, 1003),
        _node(0, "ps", 0, 1000),
        _node(2, "worker", 1, 1002),
        _node(1, "worker", 0, 1001),
        _node(4, "evaluator", 0, 1004),
    ]
    spec = build_cluster_spec(nodes)
    assert spec == {
        "worker": ["10.0.0.1:1001", "10.0.0.1:1002", "10.0.0.1:1003"],
        "ps": ["10.0.0.1:1000"],
        "evaluator": ["10.0.0.1:1004"],
    }
    assert count_workers(spec) == 3


def test_cluster_spec_duplicate_task_rejected():
    with pytest.raises(ConfigurationError, match=r"two nodes claim worker:1"):
        build_cluster_spec([_node(0, "worker", 0, 1), _node(1, "worker", 1, 2), _node(2, "worker", 1, 3)])


def test_cluster_spec_gap_rejected():
    with pytest.raises(ConfigurationError, match=r"task indexes of job 'worker' are not contiguous: \[0, 2\]"):
        build_cluster_spec([_node(0, "worker", 0, 1), _node(1, "worker", 2, 2)])


def test_tf_config_without_chief_is_still_set():
    spec = {"worker": ["h:1", "h:2"]}
    cfg = build_tf_config(spec, "worker", 1)
    assert cfg == {"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 1}, "environment": "cloud"}
    assert json.loads(tf_config_json(spec, "worker", 0))["task"] == {"type": "worker", "index": 0}


def test_tf_config_excludes_evaluator_but_spec_keeps_it():
    spec = {"chief": ["h:1"], "worker": ["h:2"], "evaluator": ["h:3"], "ps": ["h:0"]}
    for job, idx in (("chief", 0), ("worker", 0), ("ps", 0), ("evaluator", 0)):
        cfg = build_tf_config(spec, job, idx)
        assert "evaluator" not in cfg["cluster"]
        assert cfg["cluster"] == {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:0"]}
        assert cfg["task"] == {"type": job, "index": idx}
    assert spec["evaluator"] == ["h:3"]  # not mutated
    assert count_workers(spec) == 2


def test_tf_config_unknown_task():
    with pytest.raises(ConfigurationError, match=r"worker:2 is not in the cluster spec"):
        build_tf_config({"worker": ["h:1", "h:2"]}, "worker", 2)
    with pytest.raises(ConfigurationError, match=r"chief:0 is not in the cluster spec"):
        build_tf_config({"worker": ["h:1"]}, "chief", 0)


def test_count_workers():
    assert count_workers({}) == 0
    assert count_workers({"ps": ["a", "b"], "evaluator": ["c"]}) == 0
    assert count_workers({"master": ["a"], "worker": ["b", "c"], "ps": ["d"]}) == 3


def test_input_mode_values_match_tfos():
    assert InputMode.TENSORFLOW == 0 and InputMode.SPARK == 1


# -------------------------------------------------------------------- ClusterConfig
def _config(**kw) -> ClusterConfig:
    base = dict(
        cluster_id="c1",
        key=KEY,
        driver_host="127.0.0.1",
        driver_port=5000,
        input_mode=InputMode.SPARK,
        roles=tuple(roles_from_template(build_template(3, num_ps=1))),
    )
    base.update(kw)
    return ClusterConfig(**base)


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(key=b"short"), "the cluster key must be 32 bytes"),
        (dict(driver_port=0), "invalid driver port 0"),
        (dict(heartbeat_interval_s=5.0, heartbeat_timeout_s=5.0), "heartbeat_timeout_s (5.0) must exceed"),
        (dict(reservation_timeout_s=0), "reservation_timeout must be > 0"),
        (dict(queue_chunks=0), "queue_chunks must be >= 1"),
        (dict(forward_logs="some"), "forward_logs must be 'chief', 'all' or 'none'"),
        (dict(roles=(NodeRole(1, "worker", 0),)), "roles must be ordered by executor id"),
    ],
)
def test_cluster_config_validation(kwargs, text):
    with pytest.raises(ConfigurationError) as ei:
        _config(**kwargs)
    assert text in str(ei.value)


def test_cluster_config_lead_and_logs():
    cfg = _config()  # ps:0, worker:0, worker:1
    ps, w0, w1 = cfg.roles
    assert cfg.num_nodes == 3
    assert [cfg.is_lead(r) for r in cfg.roles] == [False, True, False]
    assert all(cfg.forwards_logs_of(r) for r in cfg.roles)  # default 'all' (C26)
    assert [_config(forward_logs="chief").forwards_logs_of(r) for r in cfg.roles] == [False, True, False]
    assert not cfg.hosts_tensorboard(w0)
    assert _config(tensorboard=True).hosts_tensorboard(w0)
    assert all(_config(forward_logs="all").forwards_logs_of(r) for r in cfg.roles)
    assert not any(_config(forward_logs="none").forwards_logs_of(r) for r in cfg.roles)
    chief_cfg = _config(roles=tuple(roles_from_template(build_template(3, master_node="chief"))))
    assert [chief_cfg.is_lead(r) for r in chief_cfg.roles] == [True, False, False]
