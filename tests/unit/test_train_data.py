import numpy as np
import pytest
import torch

from diloco.train.train_config import ModelConfig, TrainConfig
from diloco.train.data import (
    Corpus,
    ShardSampler,
    builtin_corpus_files,
    eval_batches,
    evaluate,
    load_text,
    sample_text,
    split_heldout,
)
from diloco.train.model import build_model
from diloco.train.tokenizer import ByteTokenizer


def test_byte_tokenizer_round_trips_non_ascii():
    tok = ByteTokenizer()
    text = "Ça va? Grüße, 東京 — ἀρετή 🙂\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.from_numpy(ids.astype(np.int64))) == text
    assert tok.decode(ids[:-3]).endswith("\ufffd")  # a cut multi-byte character is replaced, not an error


def test_builtin_corpus_is_the_sorted_plays():
    files = builtin_corpus_files()
    assert len(files) == 38 and all(f.suffix == ".md" for f in files)
    assert files == builtin_corpus_files()


def test_load_text_reads_files_and_directories(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("bee")
    (tmp_path / "d" / "sub" / "a.md").write_text("ay")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\xff")
    (tmp_path / "f.txt").write_text("eff")
    assert load_text([str(tmp_path / "f.txt"), str(tmp_path / "d")]) == "eff\nbee\nay"


def test_load_text_errors_name_the_path(tmp_path):
    missing = tmp_path / "no-such-file.txt"
    with pytest.raises(FileNotFoundError, match="no-such-file.txt"):
        load_text([str(missing)])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty.txt"):
        load_text([str(tmp_path / "empty.txt")])
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt.*not UTF-8"):
        load_text([str(tmp_path / "latin1.txt")])
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="nothing"):
        load_text([str(tmp_path / "nothing")])


def test_heldout_split_is_disjoint_spread_and_covers_everything():
    tokens = np.arange(1_000_000)  # unique values identify positions
    train, heldout = split_heldout(tokens, heldout_fraction=0.05)
    assert len(np.intersect1d(train, heldout)) == 0
    assert np.array_equal(np.sort(np.concatenate([train, heldout])), tokens)
    assert 0.04 < len(heldout) / len(tokens) < 0.06
    # held-out text comes from all over the corpus, in blocks
    assert heldout[0] == 0 and heldout[-1] > 0.9 * len(tokens)


def test_corpus_from_config_covers_builtin_text():
    corpus = Corpus.from_config(TrainConfig())
    n_tokens = len(ByteTokenizer().encode(load_text([])))
    assert len(corpus.train) + len(corpus.heldout) == n_tokens
    assert 0.04 < len(corpus.heldout) / n_tokens < 0.06
    assert corpus.fingerprint == Corpus.from_config(TrainConfig()).fingerprint and len(corpus.fingerprint) == 16


def test_shards_never_share_a_sequence_start_in_one_epoch():
    tokens = np.arange(10_000)
    seq_len, batch = 16, 8
    seen = []
    for shard in range(3):
        sampler = ShardSampler(tokens, shard, 3, seq_len, batch, seed=0)
        starts = []
        while sampler.epoch == 0 and sampler.position + batch <= len(sampler.starts):
            x, y = sampler.next_batch()
            assert x.shape == y.shape == (batch, seq_len) and x.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])
            starts += x[:, 0].tolist()
        assert len(set(starts)) == len(starts)
        seen.append(set(starts))
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert all(s % seq_len == 0 for s in set().union(*seen))


def test_sampler_starts_a_new_epoch_with_a_new_order():
    sampler = ShardSampler(np.arange(1000), 0, 1, seq_len=10, batch_size=len(range(0, 990, 10)), seed=3)
    first, second = sampler.next_batch()[0][:, 0], sampler.next_batch()[0][:, 0]
    assert sampler.epoch == 2
    assert sorted(first.tolist()) == sorted(second.tolist()) and not torch.equal(first, second)


def test_resume_at_position_gives_the_same_next_batch():
    tokens = np.arange(5000)
    a = ShardSampler(tokens, 1, 2, seq_len=32, batch_size=5, seed=9)
    for _ in range(17):  # crosses an epoch boundary (39 sequences per epoch)
        a.next_batch()
    b = ShardSampler(tokens, 1, 2, seq_len=32, batch_size=5, seed=9, position=a.position)
    for _ in range(3):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_eval_batches_are_fixed_and_evaluate_restores_mode():
    heldout = np.arange(3000) % 256
    batches = eval_batches(heldout, seq_len=16, n_batches=3, batch_size=4)
    again = eval_batches(heldout, seq_len=16, n_batches=3, batch_size=4)
    assert len(batches) == 3 and all(x.shape == (4, 16) for x, _ in batches)
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(batches, again))
    model = build_model(ModelConfig(seq_len=16), seed=0)
    model.train()
    loss = evaluate(model, batches)
    assert model.training and loss == evaluate(model, batches)


def test_sample_text_starts_with_prompt_and_is_reproducible():
    model = build_model(ModelConfig(), seed=0)
    text = sample_text(model, ByteTokenizer(), prompt="ROMEO:", max_new_tokens=20, seed=1)
    assert text.startswith("ROMEO:") and text == sample_text(model, ByteTokenizer(), "ROMEO:", 20, seed=1)
