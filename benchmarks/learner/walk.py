"""What finding a fragment's tensors costs the learner's training thread: walking the model's state_dict at every
use (as the learner did, twice a step) against the walk kept from join (learner/model_tensors.py).

    python -m benchmarks.learner.walk            # the 35M model of benchmarks/gpu/scale.py and GPT-2 small's shape, CPU
"""

from __future__ import annotations

import statistics
import time

import torch

from diloco.algorithm.fragments import plan_fragments, tensor_specs
from diloco.learner.model_tensors import ModelTensors, checked_state
from diloco.train.train_config import ModelConfig
from diloco.train.model import build_model

MODELS = {"35m": ModelConfig(vocab_size=32768, seq_len=512, d_model=512, n_layers=6, n_heads=8),
          "124m": ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12)}


def median_ms(fn, layout, uses: int = 400) -> float:
    times = []
    for i in range(uses):
        started = time.perf_counter()
        fn(layout[i % len(layout)])
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> int:
    torch.set_num_threads(1)
    for name, cfg in MODELS.items():
        model = build_model(cfg, 0)
        specs = tensor_specs(model)
        layout, kept = plan_fragments(specs, 24), ModelTensors(model, specs)

        def walked(fragment):
            state = checked_state(model, specs)
            return [state[s.name] for s in fragment.specs]

        every, once = median_ms(walked, layout), median_ms(lambda f: kept.tensors(f.specs), layout)
        print(f"{name}: a fragment's tensors, median per use: {every:.3f} ms walking every time, {once:.4f} ms "
              f"walked once (a step uses them twice)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
