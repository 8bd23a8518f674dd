"""How large an honest contribution is, relative to its fragment: the norm of H AdamW steps' change per step,
divided by the fragment's norm — the quantity the syncer's outlier ceiling (`norm_ceiling`) bounds.

    python -m benchmarks.quality.update_norms --json runs/update-norms.json

Early training moves weights most (Adam's first steps move every value by about the learning rate), so this
measures the first H steps from initialisation of a GPT-2-style model (transformers' GPT2LMHeadModel, built from a
config), for several learning rates, on random tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from diloco.algorithm.fragments import plan_fragments, tensor_specs
from benchmarks.provenance import stamped


def relative_step_norms(lr: float, steps: int, fragments: int, layers: int, width: int, vocab: int,
                        seq: int, batch: int) -> list[float]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=vocab,
                                       n_positions=seq))
    params = dict(model.named_parameters())
    layout = [f for f in plan_fragments(tensor_specs(model), fragments) if f.role == "params"]

    def flat(fragment) -> torch.Tensor:
        return torch.cat([params[s.name].detach().flatten() for s in fragment.specs if s.name in params])

    before = [flat(f).clone() for f in layout]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=data)
        loss = model(x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [((flat(f) - b).norm() / steps / b.norm()).item() for f, b in zip(layout, before)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", default="6e-4,3e-3,1e-2", help="comma-separated AdamW learning rates")
    p.add_argument("--steps", "-H", type=int, default=30, help="inner steps per contribution")
    p.add_argument("--fragments", "-P", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=5000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    results = []
    for lr in (float(x) for x in args.lrs.split(",")):
        norms = relative_step_norms(lr, args.steps, args.fragments, args.layers, args.width, args.vocab, args.seq,
                                    args.batch)
        results.append({"lr": lr, "per_step_relative_norms": norms, "max": max(norms)})
        print(f"lr {lr:g}: ‖Δ‖ / H / ‖θ‖ per fragment " + " ".join(f"{n:.4f}" for n in norms)
              + f"  (max {max(norms):.4f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(stamped({"results": results}, args), indent=1))


if __name__ == "__main__":
    main()
