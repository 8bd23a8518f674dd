import pytest
import torch
from torch import nn

from diloco.algorithm.fragments import (
    TensorSpec, clean_name, first_difference, fit_fragments, gather, max_fragments, plan_fragments, scatter, signature,
    tensor_specs,
)
from diloco.algorithm.schedule import due, offset


def specs(sizes, embedding=()):
    return [TensorSpec(f"t{i}", (n,), "float32", f"t{i}" in embedding) for i, n in enumerate(sizes)]


def test_layout_is_deterministic_and_covers_every_tensor_once():
    s = specs([50, 7, 33, 33, 8, 100, 1, 64, 2, 5], embedding={"t5"})
    a, b = plan_fragments(s, 4), plan_fragments(list(s), 4)
    assert a == b
    names = [x.name for f in a for x in f.specs]
    assert sorted(names) == sorted(x.name for x in s)


def test_embeddings_form_their_own_fragment():
    s = specs([50, 7, 33, 100, 5], embedding={"t3"})
    frags = plan_fragments(s, 3)
    assert frags[0].embedding and [x.name for x in frags[0].specs] == ["t3"]
    assert not any(x.embedding for f in frags[1:] for x in f.specs)


def test_balanced_within_greedy_bound():
    s = specs([97, 89, 83, 79, 73, 71, 67, 61, 59, 53, 47, 43, 41, 37, 31, 29, 23, 19])
    frags = plan_fragments(s, 4)
    loads = [f.numel for f in frags]
    # LPT guarantee: max load ≤ mean load + largest item; here it is much tighter
    assert max(loads) <= sum(loads) / 4 + max(x.numel for x in s)
    assert max(loads) - min(loads) <= 19 + 4


def test_tensor_order_inside_fragment_follows_model_order():
    s = specs([1, 100, 2, 99, 3])
    for f in plan_fragments(s, 2):
        idx = [int(x.name[1:]) for x in f.specs]
        assert idx == sorted(idx)


def test_impossible_fragment_count_is_refused():
    s = specs([4, 4, 4], embedding={"t0"})
    assert len(plan_fragments(s, 3)) == 3
    with pytest.raises(ValueError, match="between 1 and 3"):
        plan_fragments(s, 4)
    with pytest.raises(ValueError, match="between 1 and 3"):
        plan_fragments(s, 0)


def test_single_fragment_holds_everything():
    s = specs([4, 5, 6], embedding={"t1"})
    (f,) = plan_fragments(s, 1)
    assert [x.name for x in f.specs] == ["t0", "t1", "t2"]


class Tiny(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.emb = nn.Embedding(10, width)
        self.lin = nn.Linear(width, width)
        self.head = nn.Linear(width, 10, bias=False)
        self.head.weight = self.emb.weight


def test_tensor_specs_flags_tied_embedding_once_and_the_head_as_its_alias():
    s = tensor_specs(Tiny())
    assert [(x.name, x.embedding, x.kind) for x in s] == [
        ("emb.weight", True, "param"), ("lin.weight", False, "param"), ("lin.bias", False, "param"),
        ("head.weight", False, "alias")]
    assert s[-1].alias_of == "emb.weight"


class Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(3, 4)
        self.frozen.requires_grad_(False)
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)  # not in the state_dict: not ours


def test_every_state_dict_entry_has_a_kind_and_buffers_and_frozen_tensors_get_fragments_of_their_own():
    specs = tensor_specs(Stateful())
    kinds = {s.name: s.kind for s in specs}
    assert kinds == {"frozen.weight": "static", "frozen.bias": "static", "lin.weight": "param", "lin.bias": "param",
                     "bn.weight": "param", "bn.bias": "param", "bn.running_mean": "buffer",
                     "bn.running_var": "buffer", "bn.num_batches_tracked": "static"}
    layout = plan_fragments(specs, 2)
    assert [f.role for f in layout] == ["params", "params", "buffers", "static"]
    assert [s.name for s in layout[2].specs] == ["bn.running_mean", "bn.running_var"]
    assert {s.name for f in layout[:2] for s in f.specs} == {"lin.weight", "lin.bias", "bn.weight", "bn.bias"}
    assert max_fragments(specs) == 4  # only trained tensors count


def test_a_frozen_tensor_changes_the_signature():
    a, b = Stateful(), Stateful()
    b.lin.bias.requires_grad_(False)
    assert signature(tensor_specs(a)) != signature(tensor_specs(b))
    assert "(frozen)" in first_difference(tensor_specs(a), tensor_specs(b))


def test_wrapped_models_have_the_bare_models_signature():
    model = Stateful()
    compiled = torch.compile(model)  # wraps without compiling until called
    assert signature(tensor_specs(compiled)) == signature(tensor_specs(model))
    assert clean_name("blocks.0._checkpoint_wrapped_module.attn.weight") == "blocks.0.attn.weight"
    assert clean_name("_orig_mod.lin.weight") == "lin.weight"


def test_too_many_fragments_are_lowered_to_the_most_the_model_allows(caplog):
    specs = tensor_specs(Stateful())
    assert fit_fragments(specs, 24) == 4 and "--fragments 4" in caplog.text
    assert fit_fragments(specs, 3) == 3


def test_signature_and_first_difference_name_the_tensor():
    a, b = tensor_specs(Tiny(4)), tensor_specs(Tiny(5))
    assert signature(a) == signature(tensor_specs(Tiny(4)))
    assert signature(a) != signature(b)
    msg = first_difference(a, b)
    assert "emb.weight" in msg and "[10, 4]" in msg and "[10, 5]" in msg
    assert first_difference(a, a) is None
    assert "fewer tensors" in first_difference(a, a[:2])


def test_gather_scatter_round_trip():
    m = Tiny()
    params = dict(m.named_parameters())
    (f,) = plan_fragments(tensor_specs(m), 1)
    flat = gather(params, f)
    assert flat.numel() == sum(p.numel() for p in m.parameters())
    scatter(torch.zeros_like(flat), params, f)
    assert all(torch.all(p == 0) for p in m.parameters())
    scatter(flat, params, f)
    assert torch.equal(gather(params, f), flat)


def test_schedule_one_fragment_per_step_when_p_equals_h():
    H = P = 24
    assert [offset(p, H, P) for p in range(P)] == list(range(24))
    for t in range(1, 100):
        assert len(due(t, H, P)) == 1
    assert due(24, H, P) == [0] and due(1, H, P) == [1] and due(25, H, P) == [1]


def test_schedule_each_fragment_every_h_steps():
    H, P = 12, 4
    pushes = {p: [t for t in range(1, 49) if p in due(t, H, P)] for p in range(P)}
    assert pushes[0] == [12, 24, 36, 48]
    assert pushes[1] == [3, 15, 27, 39]
    assert all(b - a == H for ts in pushes.values() for a, b in zip(ts, ts[1:]))


def covered(layout):
    """{name: sorted [start, stop) ranges} of every trained value the layout's parameter fragments hold."""
    out = {}
    for f in layout:
        if f.role == "params":
            for s in f.specs:
                out.setdefault(s.name, []).append((s.start, s.start + s.numel))
    return {name: sorted(r) for name, r in out.items()}


def test_a_split_layout_keeps_fragments_near_a_pth_of_the_model_and_holds_every_value_once():
    s = specs([470, 60, 60, 200, 20, 90, 100], embedding={"t0"})
    total = sum(x.numel for x in s)
    whole = plan_fragments(s, 7)  # the most whole tensors allow
    assert whole[0].numel == 470  # the embedding alone: 47% of the model in one fragment
    layout = plan_fragments(s, 8, split=True)
    assert len(layout) == 8 and plan_fragments(list(s), 8, split=True) == layout
    assert max(f.numel for f in layout) <= 2 * total / 8 and min(f.numel for f in layout) >= 1
    for name, ranges in covered(layout).items():  # contiguous, no gap, no overlap, up to the tensor's end
        size = next(x.numel for x in s if x.name == name)
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    embedding = [f for f in layout if any(x.embedding for x in f.specs)]
    assert [f.index for f in embedding] == [0, 1, 2, 3] and all(f.embedding for f in embedding)  # round(8 × 0.47)
    for f in layout:  # the model's order inside a fragment, a tensor's pieces by their start
        keys = [(int(x.name[1:]), x.start) for x in f.specs]
        assert keys == sorted(keys)


def test_a_gpt2_sized_model_split_has_no_fragment_above_a_fifth_more_than_its_share():
    from diloco.train.model import ModelConfig, build_model

    with torch.device("meta"):
        model = build_model(ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12), 0)
    s = tensor_specs(model)
    total = sum(x.numel for x in s if x.kind == "param")
    whole = [f.numel for f in plan_fragments(s, 24) if f.role == "params"]
    split = [f.numel for f in plan_fragments(s, 24, split=True) if f.role == "params"]
    assert max(whole) > 0.3 * total  # the tied embedding and head, and the positions
    assert len(split) == 24 and max(split) <= 1.2 * total / 24


def test_split_with_one_fragment_or_small_tensors_changes_nothing_and_too_many_fragments_are_refused():
    s = specs([4, 5, 6], embedding={"t1"})
    assert plan_fragments(s, 1, split=True) == plan_fragments(s, 1)
    assert plan_fragments(s, 15, split=True)[-1].numel == 1  # one value each
    with pytest.raises(ValueError, match="it has 15 trained values; choose --fragments between 1 and 15"):
        plan_fragments(s, 16, split=True)
    assert fit_fragments(s, 16, split=True) == 15


def test_pieces_are_gathered_and_scattered_in_place_and_a_non_contiguous_tensor_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 6), nn.Linear(6, 40), nn.Linear(40, 3))
    s = tensor_specs(model)
    layout = plan_fragments(s, 5, split=True)
    assert any(not x.whole for f in layout for x in f.specs)
    state = dict(model.state_dict(keep_vars=True))
    before = {k: v.detach().clone() for k, v in state.items()}
    flats = [gather(state, f) for f in layout]
    assert sum(f.numel() for f in flats) == sum(v.numel() for v in before.values())
    for f, flat in zip(layout, flats):
        scatter(flat * 2, state, f)
    assert all(torch.equal(state[k].detach(), 2 * v) for k, v in before.items())
    piece = next(x for f in layout for x in f.specs if not x.whole)
    state[piece.name] = state[piece.name].detach().t()  # a transposed view: its flat values are not one span
    with pytest.raises(ValueError, match="not contiguous in memory.*without --split-tensors"):
        gather(state, next(f for f in layout if piece in f.specs))
