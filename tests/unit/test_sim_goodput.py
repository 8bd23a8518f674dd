"""Goodput simulator: closed forms, failure statistics, seeds, and the published cells."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from diloco.sim.world import FailureModel, TrainingModel, young_daly_interval
from diloco.sim.presets import LLAMA3_MTBI_SECONDS, PAPER_AGGRESSIVE, PRESETS, PUBLISHED_GOODPUT
from diloco.sim.strategies import simulate
from diloco.sim.sweep import Cell, cells_for, run_cell, run_sweep
from diloco.sim.unit import simulate_unit

NEVER = 1e30  # an MTBI no run lives to see
DAY = 86400.0


def _no_failures(**changes) -> FailureModel:
    return dataclasses.replace(PAPER_AGGRESSIVE.failures, mtbi_seconds=NEVER, **changes)


def test_no_failures_elastic_strategies_have_full_goodput_and_uptime():
    fm, tm = _no_failures(), TrainingModel()
    for strategy, learners in (("dp-elastic", 1), ("decoupled", 8)):
        sample = simulate(strategy, 150_000, learners, fm, tm, DAY, random.Random(0))
        assert sample.goodput == pytest.approx(1.0)
        assert sample.uptime == pytest.approx(1.0)
        assert sample.failures == 0


def test_no_failures_dp_pays_only_its_checkpoints():
    fm = _no_failures(checkpoint_interval_seconds=10.0, checkpoint_seconds=0.5)
    sample = simulate("dp", 150_000, 1, fm, TrainingModel(), DAY, random.Random(0))
    assert sample.goodput == pytest.approx(10.0 / 10.5, abs=1e-4)


def test_no_failures_diloco_pays_its_outer_step_and_the_slowest_learner():
    fm = _no_failures()
    tm = TrainingModel(step_time_cv=0.0, diloco_sync_seconds=1.0, sync_every=24, step_seconds=1.0)
    sample = simulate("diloco", 160_000, 8, fm, tm, DAY, random.Random(0))
    assert sample.goodput == pytest.approx(24 / 25, abs=1e-6)
    assert sample.uptime == pytest.approx(24 / 25, abs=1e-6)
    noisy = simulate("diloco", 160_000, 8, fm, dataclasses.replace(tm, step_time_cv=0.1), DAY, random.Random(0))
    assert noisy.goodput < sample.goodput - 0.01  # waiting for the slowest of 8 costs a few percent


def test_no_failures_decoupled_stalls_only_for_grace_beyond_the_overlap():
    fm = _no_failures()
    adaptive = TrainingModel(grace_seconds=None)
    fixed = TrainingModel(grace_seconds=2.5, overlap_steps=2, step_seconds=1.0, fragments=24, sync_every=24)
    assert simulate("decoupled", 80_000, 8, fm, adaptive, DAY, random.Random(0)).goodput == pytest.approx(1.0)
    stalled = simulate("decoupled", 80_000, 8, fm, fixed, DAY, random.Random(0)).goodput
    assert stalled == pytest.approx(1.0 / 1.5)


def test_single_non_elastic_job_matches_the_renewal_formula():
    # Slices are replaced at once (repair 0), so every failure costs a restart plus the unfinished segment:
    # goodput = T / ((exp(lambda (T + d)) - 1) (1 / lambda + C)).
    T, d, C = 20.0, 2.0, 30.0
    fm = FailureModel(mtbi_seconds=1e9, repair_seconds=0.0, checkpoint_interval_seconds=T,
                      checkpoint_seconds=d, restart_seconds=C)
    chips = 1e7
    lam = chips / fm.mtbi_seconds
    expected = T / (math.expm1(lam * (T + d)) * (1 / lam + C))
    run = simulate_unit(chips, fm, 1e6, random.Random(3), elastic=False)
    assert run.goodput == pytest.approx(expected, abs=0.005)


def test_single_elastic_job_matches_its_closed_form():
    # With repair 0 the slice is back before the shrink ends: goodput = 1 / (1 + lambda * shrink).
    fm = FailureModel(mtbi_seconds=1e9, repair_seconds=0.0, shrink_seconds=18.0)
    chips = 1e7
    run = simulate_unit(chips, fm, 1e6, random.Random(4), elastic=True)
    assert run.goodput == pytest.approx(1 / (1 + chips / fm.mtbi_seconds * 18.0), abs=0.003)


@pytest.mark.parametrize("in_pauses", [False, True])
def test_failure_counts_match_the_poisson_rate(in_pauses):
    fm = dataclasses.replace(PAPER_AGGRESSIVE.failures, failures_in_pauses=in_pauses)
    run = simulate_unit(1_200_000, fm, 2 * DAY, random.Random(5), elastic=True)
    expected = run.exposure / fm.mtbi_seconds
    assert run.failures > 1000
    assert abs(run.failures - expected) < 4 * math.sqrt(expected)


def test_failure_gaps_are_exponential():
    fm = FailureModel(mtbi_seconds=1e9, repair_seconds=0.0, shrink_seconds=0.0, grow_seconds=0.0)
    run = simulate_unit(1e7, fm, 1e6, random.Random(6), elastic=True, record=True)
    gaps = [e - s for s, e in zip(run.starts, run.ends)][:-1]  # the last interval is cut by the horizon
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert mean == pytest.approx(100.0, rel=0.05)  # 1e9 s / 1e7 chips
    assert cv == pytest.approx(1.0, abs=0.05)  # an exponential's coefficient of variation


def test_failures_in_pauses_only_lower_goodput():
    base = PAPER_AGGRESSIVE.failures
    cell = Cell("dp-elastic", 1_200_000, 1)
    off = run_cell(cell, base, TrainingModel(), DAY, 2, seed=1)
    on = run_cell(cell, dataclasses.replace(base, failures_in_pauses=True), TrainingModel(), DAY, 2, seed=1)
    assert on.goodput < off.goodput


def test_seeds_reproduce_and_differ():
    fm, tm = PAPER_AGGRESSIVE.failures, PAPER_AGGRESSIVE.training
    cells = cells_for(["dp", "diloco", "decoupled"], [300_000], [8])
    a = run_sweep(cells, fm, tm, DAY / 2, 2, seed=7)
    b = run_sweep(cells, fm, tm, DAY / 2, 2, seed=7, jobs=2)
    c = run_sweep(cells, fm, tm, DAY / 2, 2, seed=8)
    assert a == b
    assert [r.goodput for r in a] != [r.goodput for r in c]


def test_quorum_governs_uptime():
    fm, tm = PAPER_AGGRESSIVE.failures, PAPER_AGGRESSIVE.training
    any_one = simulate("decoupled", 2_400_000, 8, fm, tm, DAY / 2, random.Random(9))
    all_eight = simulate("decoupled", 2_400_000, 8, fm, dataclasses.replace(tm, quorum=8), DAY / 2,
                         random.Random(9))
    assert any_one.uptime == pytest.approx(1.0)
    assert all_eight.uptime < 0.5
    assert all_eight.goodput == pytest.approx(any_one.goodput)  # learners never wait for the quorum


def test_m_learners_behave_like_one_elastic_job_m_times_smaller():
    fm, tm = PAPER_AGGRESSIVE.failures, PAPER_AGGRESSIVE.training
    decoupled = run_cell(Cell("decoupled", 1_200_000, 8), fm, tm, 2 * DAY, 2, seed=0)
    elastic = run_cell(Cell("dp-elastic", 150_000, 1), fm, tm, 2 * DAY, 2, seed=0)
    assert decoupled.goodput == pytest.approx(elastic.goodput, abs=0.015)


def test_published_cells_within_three_points():
    preset = PRESETS["paper-aggressive"]
    for (strategy, chips, learners), published in PUBLISHED_GOODPUT.items():
        result = run_cell(Cell(strategy, chips, learners), preset.failures, preset.training, 3 * DAY, 3, seed=0)
        assert abs(result.goodput - published) <= 0.03, (strategy, chips, learners, result.goodput, published)
        if strategy == "decoupled":
            assert result.uptime > 0.999  # "about 100% for 4 or more learners"


def test_llama3_preset_rate():
    assert LLAMA3_MTBI_SECONDS / 16384 / 3600 == pytest.approx(54 * 24 / 419)  # one job failure per 3.1 h
    preset = PRESETS["llama3-observed"]
    result = run_cell(Cell("dp", 16_384, 1), preset.failures, preset.training, 30 * DAY, 3, seed=0)
    assert 0.95 < result.goodput < 1.0


def test_young_daly_interval():
    assert young_daly_interval(0.5, 200.0) == pytest.approx(math.sqrt(2 * 0.5 * 200), rel=0.03)
    assert young_daly_interval(0.0, 200.0) == math.inf
    assert young_daly_interval(500.0, 200.0) == 200.0


def test_unit_smaller_than_a_slice_is_refused():
    with pytest.raises(ValueError, match="smaller than one slice"):
        simulate("decoupled", 1000, 8, PAPER_AGGRESSIVE.failures, TrainingModel(), DAY, random.Random(0))


def test_docs_constants_table_is_generated_from_the_code():
    from pathlib import Path

    from diloco.sim.constants_doc import constants_table

    docs = Path(__file__).resolve().parents[2] / "docs" / "simulation.md"
    assert constants_table() in docs.read_text(), "regenerate with: python -m diloco.sim.constants_doc"
