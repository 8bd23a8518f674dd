"""Hugging Face causal LMs as learners (examples/hf_causal_lm.py): two learners train a tiny GPT-2 (tied head) or a
tiny Llama (untied) against a real syncer; the global model learns, its saved file loads strictly into a fresh
model, GPT-2's head stays tied, and frozen embeddings take the global value on join."""

import importlib.util
import pathlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from diloco import ServerOptions, SyncerThread, for_mode  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "hf_causal_lm.py"
TINY = dict(preset="tiny", seq_len=32, batch_size=4, lr=3e-3)


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("hf_causal_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_two(example, out: pathlib.Path, models, steps: int, **options):
    """Two learners in threads of this process against a syncer writing into `out`; returns their outcomes."""
    syncer = SyncerThread(for_mode("decoupled", 2, fragments=4, sync_every=8),
                          ServerOptions(listen="127.0.0.1:0", http=None, out=out))
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(example.main, syncer.address, name, model=model, shard=i, num_shards=2,
                                   steps=steps, **TINY, **options)
                       for i, (name, model) in enumerate(zip(("alice", "bob"), models))]
            outcomes = [f.result(timeout=120) for f in futures]  # re-raises a learner's exception here
    finally:
        syncer.stop()
    return outcomes


@pytest.fixture(scope="module")
def runs(example, tmp_path_factory):
    """runs(model_type): one two-learner run per architecture, made on first use and shared by the tests below."""
    done = {}

    def run(model_type: str) -> dict:
        if model_type not in done:
            out = tmp_path_factory.mktemp(model_type)
            # Built here, one after the other: torch.manual_seed is process-wide, so building in the learner
            # threads at once would interleave their random draws and give the two learners different models.
            models = [example.build_model(model_type, "tiny") for _ in range(2)]
            heldout = example.heldout_batches(TINY["seq_len"])
            initial = example.evaluate(example.build_model(model_type, "tiny"), heldout)
            outcomes = train_two(example, out, models, steps=48, model_type=model_type)
            done[model_type] = dict(saved=load_file(out / "model.safetensors"), initial=initial, outcomes=outcomes)
        return done[model_type]

    return run


def fresh(example, model_type: str):
    return example.build_model(model_type, "tiny", seed=1)  # different values from the trained run's start


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_global_model_learns(example, runs, model_type):
    run = runs(model_type)
    assert all(o.learner.pushes >= 2 and o.learner.applied >= 1 for o in run["outcomes"])
    model = fresh(example, model_type)
    # Only the loss matters here: test_saved_model_loads_strictly checks that every key is present.
    model.load_state_dict(run["saved"], strict=False)
    final = example.evaluate(model, example.heldout_batches(TINY["seq_len"]))
    assert final < run["initial"] - 0.5, (run["initial"], final)  # from ln(256) = 5.5 to about 3.3 in 48 steps


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_saved_model_loads_strictly(example, runs, model_type):
    run = runs(model_type)
    model = fresh(example, model_type)
    model.load_state_dict(run["saved"], strict=True)
    state = model.state_dict()
    for name, value in run["saved"].items():
        assert torch.equal(state[name], value), name


def test_gpt2_head_stays_tied_after_loading(example, runs):
    run = runs("gpt2")
    model = fresh(example, "gpt2")
    model.load_state_dict(run["saved"], strict=True)
    head, embedding = model.lm_head.weight, model.transformer.wte.weight
    assert head.data_ptr() == embedding.data_ptr()
    assert torch.equal(embedding, run["saved"]["transformer.wte.weight"])
    assert torch.equal(head, run["saved"]["lm_head.weight"])


def test_frozen_embeddings_take_the_global_value(example, tmp_path):
    models = [example.build_model("gpt2", "tiny", freeze_embeddings=True) for _ in range(2)]
    with torch.no_grad():  # bob's frozen embedding alone starts from other values: the join must replace them
        bob = models[1].transformer.wte.weight
        bob.copy_(torch.randn(bob.shape, generator=torch.Generator().manual_seed(7)) * 0.02)
    starts = [m.transformer.wte.weight.detach().clone() for m in models]
    assert not torch.equal(*starts)

    outcomes = train_two(example, tmp_path, models, steps=16, model_type="gpt2", freeze_embeddings=True)

    alice, bob = (o.learner.model.transformer.wte.weight for o in outcomes)
    assert not alice.requires_grad and not bob.requires_grad
    assert torch.equal(alice, bob)  # frozen, so equal now means equal since the join
    assert any(torch.equal(alice, start) for start in starts)  # the first learner's, uploaded as the initial model
    assert torch.equal(alice, load_file(tmp_path / "model.safetensors")["transformer.wte.weight"])
