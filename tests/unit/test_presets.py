"""Presets and mode defaults: the paper preset turns every mechanism of ours off, the baselines average, and the
command line reaches every switch."""

import argparse

import pytest

from diloco.cli import SYNC_FLAGS, add_sync_options, sync_overrides
from diloco.config import PAPER, SyncConfig, for_mode
from diloco.config_doc import field_docs


def test_the_paper_preset_turns_off_every_mechanism_marked_ours():
    ours = {name for name, doc in field_docs(SyncConfig).items() if doc.startswith("Ours")}
    assert len(ours) >= 9 and ours <= set(PAPER)  # each of our mechanisms is set by the paper preset
    paper, default = for_mode("decoupled", 4, preset="paper"), for_mode("decoupled", 4)
    assert paper.preset == "paper" and default.preset == "default"
    assert not (paper.scale_partial_rounds or paper.clamp_long_contributions or paper.delayed_momentum
                or paper.keep_overlap or paper.align_pushes)
    assert paper.grace_expect_steps == 0 and paper.max_norm_ratio == 0 and paper.norm_ceiling == 0
    assert (paper.outer_lr, paper.outer_momentum, paper.down_codec) == (0.7, 0.9, "fp32")
    assert (paper.fragments, paper.quorum, paper.codec, paper.merge) == (24, 1, "int4", "rda")  # the mode's
    assert default.scale_partial_rounds and default.clamp_long_contributions
    # rounds wait a cycle for predicted peers, learners keeping their progress meanwhile (benchmarks/LOG.md, "What
    # costs tokens"); push alignment measured not to pay off: off, still a switch
    assert default.keep_overlap and default.grace_expect_steps == default.sync_every == 24
    assert for_mode("decoupled", 4, sync_every=12).grace_expect_steps == 12  # one cycle, whatever H
    assert for_mode("decoupled", 4, grace_expect_steps=0).grace_expect_steps == 0
    assert not default.align_pushes
    # one running sum per open round: half the merge memory, 1.5× the merge speed, and the fallback it drops never
    # ran in the measured runs (benchmarks/LOG.md, "Syncer memory")
    assert paper.rda_mean_fallback and not default.rda_mean_fallback
    assert default.bf16_residual and not paper.bf16_residual  # half a model less syncer memory, same loss
    assert not any(getattr(for_mode(m, 4), "keep_overlap") or for_mode(m, 4).grace_expect_steps
                   for m in ("diloco", "streaming"))  # the baselines stay the methods they reproduce


def test_flags_override_the_preset_and_unknown_presets_are_refused():
    assert for_mode("decoupled", 2, preset="paper", outer_lr=1.0).outer_lr == 1.0
    with pytest.raises(ValueError, match="unknown preset 'papr'"):
        for_mode("decoupled", 2, preset="papr")


@pytest.mark.parametrize("mode", ["diloco", "streaming"])
def test_the_baseline_modes_average_as_the_methods_they_reproduce(mode):
    assert for_mode(mode, 4).merge == "mean"
    assert for_mode("decoupled", 4).merge == "rda"


def test_every_switch_is_on_the_command_line():
    p = argparse.ArgumentParser()
    add_sync_options(p)
    args = p.parse_args(["--preset", "paper", "--no-scale-partial-rounds", "--no-clamp-long-contributions",
                         "--max-norm-ratio", "0", "--norm-ceiling", "0", "--no-keep-overlap", "--no-align-pushes",
                         "--grace-expect-steps", "0", "--no-delayed-momentum", "--clip-norm-ratio", "0",
                         "--max-counter-ratio", "0", "--max-round-ratio", "0"])
    cfg = for_mode("decoupled", 2, **sync_overrides(args))
    assert cfg == for_mode("decoupled", 2, preset="paper")
    switches = {"scale_partial_rounds", "clamp_long_contributions", "max_norm_ratio", "norm_ceiling", "keep_overlap",
                "align_pushes", "grace_expect_steps", "delayed_momentum", "preset", "clip_norm_ratio",
                "max_counter_ratio", "max_round_ratio"}
    assert switches <= set(SYNC_FLAGS)


def test_publishing_to_every_live_learner_needs_full_values_down():
    with pytest.raises(ValueError, match="--publish-to live needs --down-codec fp32"):
        for_mode("decoupled", 2, publish_to="live")
    assert for_mode("decoupled", 2, preset="paper").publish_to == "live"
    assert for_mode("decoupled", 2).publish_to == "contributors"
