"""Bandwidth model: the published figures, consistency of the inverse, and projections of real runs."""

from __future__ import annotations

import json

import pytest

from diloco.sim.bandwidth import METHODS, Method, Workload, default_method, required_gbps, step_time, \
    utilisation
from diloco.sim.from_run import ReportError, load_run, project


def test_published_pair_198_vs_084_gbps():
    # 5B model, 1 s per step, 8 datacenters: bf16 ring all-reduce hidden in the backward pass vs one int4
    # fragment of 24 pushed per step to the syncer.
    work = Workload(parameters=5e9, step_seconds=1.0, datacenters=8)
    dp = required_gbps(default_method("dp"), work, 1.0)
    decoupled = required_gbps(default_method("decoupled"), work, 1.0)
    assert dp == pytest.approx(198, rel=0.10)
    assert decoupled == pytest.approx(0.84, rel=0.10)
    assert dp / decoupled == pytest.approx(236, rel=0.10)


@pytest.mark.parametrize("params, step_seconds, published", [(1e9, 0.21, 100), (1e10, 1.21, 200),
                                                             (1e11, 6.95, 300)])
def test_streaming_diloco_data_parallel_needs(params, step_seconds, published):
    # Two datacenters, 95% utilisation, step time growing as N^0.76 from 0.21 s at 1B (docs/simulation.md).
    work = Workload(parameters=params, step_seconds=step_seconds, datacenters=2)
    assert required_gbps(default_method("dp"), work, 0.95) == pytest.approx(published, rel=0.10)
    assert 0.5 < required_gbps(default_method("streaming"), work, 0.95) < 5  # "about 1-5 Gbps"


@pytest.mark.parametrize("kind", METHODS)
def test_required_bandwidth_is_the_smallest_that_reaches_the_target(kind):
    work, method = Workload(), default_method(kind)
    need = required_gbps(method, work, 0.9)
    assert utilisation(method, work, need) >= 0.9 - 1e-9
    assert utilisation(method, work, need * 0.99) < 0.9
    links = [0.01, 0.1, 1, 10, 100, 1000]
    values = [utilisation(method, work, g) for g in links]
    assert values == sorted(values) and values[-1] <= 1.0


def test_closed_forms():
    work = Workload(parameters=1e9, step_seconds=1.0, datacenters=2)
    # dp: 16 Gbit per step; at 8 Gbps the transfer takes 2 s, 2/3 s of it hidden.
    assert step_time(Method("dp", "bf16"), work, 8.0) == pytest.approx(1 + 2 - 2 / 3)
    # diloco: whole model (16 Gbit) every 4 steps, blocking: 4 s of compute + 2 s of transfer.
    assert utilisation(Method("diloco", "bf16", 1, 4, 0), work, 8.0) == pytest.approx(4 / 6)
    # decoupled: a quarter of the model in fp32 (8 Gbit) per step, one way, at 4 Gbps: the link sets the pace.
    assert utilisation(Method("decoupled", "fp32", 4, 4, 2), work, 4.0) == pytest.approx(0.5)
    # streaming with tau=2 hides a 2 s ring transfer of one fragment per step only if the link keeps pace.
    assert utilisation(Method("streaming", "fp32", 4, 4, 2), work, 8.0) == pytest.approx(1.0)
    # Blocking DiLoCo never reaches 100%, whatever the link.
    assert required_gbps(default_method("diloco"), work, 1.0) == float("inf")


def _write_report(directory, **changes) -> None:
    report = {
        "mode": "decoupled", "learners": 4, "wall_seconds": 120.0, "tokens_trained": 4_000_000,
        "wire_bytes": 2_000_000_000, "model_parameters": 10_000_000, "step_seconds_median": 0.25,
        "config": {"fragments": 4, "sync_every": 4, "overlap": 2, "codec": "int4"},
        "per_learner": [{"id": f"l{i}", "steps": 400, "tokens": 1_000_000} for i in range(4)],
    }
    report.update(changes)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps(report))


def test_from_run_projection(tmp_path):
    _write_report(tmp_path / "run")
    run = load_run(tmp_path / "run")
    assert run.steps == 1600
    assert run.bits_per_learner_step == pytest.approx(2e9 * 8 / 1600)
    # Modelled: a quarter of 10M values at 4.125 bits per step; the rest is framing and the way back.
    same = project(run)
    assert same.bits_per_step == pytest.approx(run.bits_per_learner_step)
    assert same.overhead == pytest.approx(1e7 / (2.5e6 * 4.125))
    big = project(run, parameters=5e9, learners=8, gbps=10.0)
    assert big.bits_per_step == pytest.approx(run.bits_per_learner_step * 500)
    assert big.workload.step_seconds == pytest.approx(0.25 * 500)
    assert big.utilisation == pytest.approx(1.0)
    assert big.required_gbps == pytest.approx(big.bits_per_step / big.workload.step_seconds / 1e9 * 0.95,
                                              rel=1e-6)


def test_from_run_errors(tmp_path):
    with pytest.raises(ReportError, match="not found"):
        load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="report.json not found"):
        load_run(tmp_path / "empty")
    _write_report(tmp_path / "nofield", config={"fragments": 4, "sync_every": 4, "codec": "int4"})
    with pytest.raises(ReportError, match="config.overlap"):
        load_run(tmp_path / "nofield")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "report.json").write_text("{not json")
    with pytest.raises(ReportError, match="cannot read"):
        load_run(tmp_path / "bad")
