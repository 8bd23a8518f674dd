"""benchmarks/quality/local_adam_noise.py is only worth its figures if its optimizer is AdamW and its oracle is exact:
its hand-written AdamW matches torch's, and learners that share v and average after every step are dp."""

from dataclasses import replace

import torch

from diloco.run.local import TINY
from diloco.train.train_config import TrainConfig, make_inner_optimizer
from diloco.train.model import build_model

from benchmarks.quality import local_adam_noise as bench


def test_the_hand_written_adamw_is_torchs():
    cfg = TrainConfig(model=TINY)
    ours, theirs = build_model(cfg.model, 0), build_model(cfg.model, 0)
    optimizer, reference = bench.ManualAdamW([ours], cfg), make_inner_optimizer(theirs, cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=g)
        grads = bench.clipped_grads(ours, x, x, 0.0)
        optimizer.step([grads], [grads], 1e-3)
        theirs.zero_grad(set_to_none=True)
        theirs(x, x)[1].backward()
        for group in reference.param_groups:
            group["lr"] = 1e-3
        reference.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-6)  # float rounding where v is near 0


def test_learners_sharing_v_and_averaging_every_step_are_data_parallel():
    cfg = replace(TrainConfig(model=TINY), grad_clip=0.0)  # dp clips the mean, learners their own: not compared
    tokens = 6 * 4 * cfg.tokens_per_step()  # six steps of four learners
    dp = bench.run("dp", cfg, 4, tokens, 24)
    assert abs(bench.run("local-shared-v", cfg, 4, tokens, 1) - dp) < 1e-4
    assert abs(bench.run("local", cfg, 4, tokens, 1) - dp) > 1e-3  # each learner's own v: not dp


def test_the_learner_knobs_change_the_learners_and_not_dp():
    cfg = replace(TrainConfig(model=TINY), grad_clip=0.0)
    tokens = 6 * 4 * cfg.tokens_per_step()
    scaled = replace(cfg, lr=2 * cfg.lr)  # lr × 2 by the knob is lr × 2 in the config
    assert abs(bench.run("local", cfg, 4, tokens, 1, lr_scale=2.0) - bench.run("local", scaled, 4, tokens, 1)) < 1e-5
    assert abs(bench.run("local", cfg, 4, tokens, 1, lr_scale=2.0) - bench.run("local", cfg, 4, tokens, 1)) > 1e-3
    other = replace(cfg, betas=(0.9, 0.99))
    assert bench.run("dp", cfg, 4, tokens, 24, other, 2.0) == bench.run("dp", cfg, 4, tokens, 24)
