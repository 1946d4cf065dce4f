import json

import pytest
import torch

from datamodules.text import (
    EmbeddedCorpus,
    LocalCorpus,
    MarginalSampler,
    load_tokenizer,
    pack_blocks,
    pack_lines,
    token_counts,
    tokenize_splits,
)
from datamodules.text.pseudo import load_counts, save_counts
from datamodules.text_inversion import TextInversionDataModule
from datamodules.training_stream import SampledStream


def test_embedded_gpt2_tokenizer_is_gpt2():
    tok = load_tokenizer()
    assert len(tok) == 50257
    assert tok("Hello world")["input_ids"] == [15496, 995]  # GPT-2's ids
    assert tok.decode([15496, 995]) == "Hello world"


def test_embedded_corpus_splits_by_document_without_overlap():
    corpus = EmbeddedCorpus(sources=("lee",), eval_fraction=0.2)
    data = corpus.load()
    aux, ev = set(data["auxiliary"]["text"]), set(data["evaluation"]["text"])
    assert len(ev) > 0 and len(aux) > 3 * len(ev)
    assert not aux & ev
    with pytest.raises(ValueError, match="unknown embedded source"):
        EmbeddedCorpus(sources=("books",))


def test_local_corpus_files_and_errors(tmp_path, corpus_files):
    data = LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["evaluation"])]).load()
    assert len(data["auxiliary"]) == 41 and len(data["evaluation"]) == 12
    held = LocalCorpus([str(corpus_files["auxiliary"])], eval_fraction=0.25).load()
    assert not set(held["auxiliary"]["text"]) & set(held["evaluation"]["text"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LocalCorpus(["/no/such/file.txt"])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        LocalCorpus([str(empty)])
    tsv = tmp_path / "data.tsv"
    tsv.write_text("id\tsentence\n1\tfirst sentence here\n2\tsecond sentence there\n3\tthird one\n")
    data = LocalCorpus([str(tsv)], [str(tsv)], format="tsv", text_column="sentence").load()
    assert data["auxiliary"]["text"][0] == "first sentence here"
    with pytest.raises(ValueError, match="no column 'text'"):
        LocalCorpus([str(tsv)], [str(tsv)], format="tsv").load()


def test_packing_blocks_and_lines(corpus_files):
    tok = load_tokenizer()
    data = tokenize_splits(LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["evaluation"])]).load(), tok)
    blocks = pack_blocks(data["auxiliary"], 8)
    total = sum(len(r) for r in data["auxiliary"]["input_ids"])
    assert blocks.shape == (total // 8, 8)
    flat = [t for r in data["auxiliary"]["input_ids"] for t in r]
    assert blocks.reshape(-1).tolist() == flat[: blocks.numel()]
    ids, mask = pack_lines(data["evaluation"], 32, tok.pad_token_id)
    assert ids.shape == (12, 32) and mask[:, 0].all() and not mask[:, -1].any()
    assert tok.decode(ids[0][mask[0].bool()]).startswith("Held out line 0")
    with pytest.raises(ValueError, match=">= 2"):
        pack_blocks(data["auxiliary"], 1)


def test_marginal_counts_files_and_sampler(tmp_path):
    samples = torch.tensor([[1, 1, 2, 3], [1, 2, 2, 0]])
    counts = token_counts(samples, 5)
    assert counts.tolist() == [1, 3, 3, 1, 0]
    save_counts(counts, tmp_path / "c.npy")
    assert torch.equal(load_counts(tmp_path / "c.npy", 5), counts)
    (tmp_path / "c.json").write_text(json.dumps({"1": 3, "2": 1}))
    assert load_counts(tmp_path / "c.json", 5).tolist() == [0, 3, 1, 0, 0]
    with pytest.raises(ValueError, match="has 5 entries"):
        load_counts(tmp_path / "c.npy", 7)
    with pytest.raises(FileNotFoundError):
        load_counts(tmp_path / "missing.npy", 5)
    draws = MarginalSampler(counts).sample(4000, 5, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws.reshape(-1), minlength=5).double() / draws.numel()
    assert torch.allclose(freq, counts / counts.sum(), atol=0.01) and freq[4] == 0


def test_pseudo_batches_are_fresh_and_differ_between_ranks():
    sampler = MarginalSampler(torch.ones(50))

    def draw(generator):
        return {"input_ids": sampler.sample(4, 6, generator).view(4, 1, 6)}

    rank0 = list(SampledStream(draw, 3, seed=0, rank=0, world_size=2))
    rank1 = list(SampledStream(draw, 3, seed=0, rank=1, world_size=2))
    assert len(rank0) == 3 and rank0[0]["input_ids"].shape == (4, 1, 6)
    assert not torch.equal(rank0[0]["input_ids"], rank0[1]["input_ids"])  # a new draw every batch
    assert not torch.equal(rank0[0]["input_ids"], rank1[0]["input_ids"])
    again = list(SampledStream(draw, 3, seed=0, rank=0, world_size=2))
    assert torch.equal(rank0[2]["input_ids"], again[2]["input_ids"])  # reproducible


def _datamodule(corpus_files, **kwargs):
    from datamodules.targets import Transformer3

    target = Transformer3(hidden_size=16, num_heads=2, ffn_size=32, num_layers=1, max_positions=8)
    corpus = LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["evaluation"])])
    return TextInversionDataModule(target=target, corpus=corpus, seq_len=8, batch_size=4, **kwargs)


def test_datamodule_batches_carry_features_and_eval_updates(corpus_files):
    dm = _datamodule(corpus_files, eval_samples=6)
    dm.setup()
    spec = dm.inversion_spec
    assert spec.num_positions == 8 and spec.vocab_size == 50257
    assert spec.num_features == round(0.1 * dm.pipeline.observed_dim)
    batch = dm.on_after_batch_transfer(next(iter(dm.val_dataloader())), 0)
    assert batch["features"].shape == (4, spec.num_features)
    assert batch["update"].shape == (4, dm.pipeline.observed_dim)
    assert len(dm.val_dataloader().dataset) == 6
    assert dm.majority_tokens.shape == (8,)
    text = dm.decode(batch["input_ids"].view(4, -1))
    assert text[0].startswith("Held out line 0")


def test_auxiliary_inputs_are_the_servers_sequences(corpus_files):
    dm = _datamodule(corpus_files, eval_samples=6)
    with pytest.raises(RuntimeError, match="setup"):
        dm.auxiliary_inputs(3)
    dm.setup()
    aux = dm.auxiliary_inputs(3)
    assert aux.shape == (3, 8)
    assert torch.equal(aux, dm._splits["auxiliary"].fields["input_ids"].reshape(-1, 8)[:3])
    # Only auxiliary text: no held-out (evaluation) line among them.
    assert not any(text.startswith("Held out") for text in dm.decode(dm.auxiliary_inputs(10_000)))


def test_datamodule_rejects_bad_settings(corpus_files):
    with pytest.raises(ValueError, match="exceeds the target model's 8 positions"):
        _datamodule(corpus_files).__class__(target=_datamodule(corpus_files).target, seq_len=9)
    with pytest.raises(ValueError, match="training_data 'both' is not allowed"):
        _datamodule(corpus_files, training_data="both")
    from datamodules.targets import Transformer3

    small_vocab = Transformer3(vocab_size=1000, hidden_size=16, num_heads=2, ffn_size=16, num_layers=1, max_positions=8)
    with pytest.raises(ValueError, match="tokenizer 'embedded-gpt2' has 50257 tokens but the target model's vocabulary has 1000"):
        TextInversionDataModule(target=small_vocab, seq_len=8)


def test_client_updates_serve_one_row_of_every_field_and_reject_mismatched_fields():
    from datamodules.client_updates import ClientUpdates

    updates = ClientUpdates(inputs=torch.arange(12.0).view(3, 2, 2), labels=torch.tensor([[0, 1], [2, 3], [4, 5]]))
    item = updates[1]
    assert len(updates) == 3 and set(item) == {"inputs", "labels", "index"}
    assert torch.equal(item["inputs"], torch.tensor([[4.0, 5.0], [6.0, 7.0]])) and item["labels"].tolist() == [2, 3]
    assert int(item["index"]) == 1
    with pytest.raises(ValueError, match="share their first"):
        ClientUpdates(inputs=torch.zeros(3, 2), labels=torch.zeros(4))
    with pytest.raises(ValueError, match="share their first"):
        ClientUpdates()


def test_local_corpus_adds_the_auxiliary_split_of_further_corpora(corpus_files, tmp_path):
    extra = tmp_path / "extra.txt"
    extra.write_text("An extra auxiliary paragraph about hashed gradients.\n")
    base = LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["evaluation"])]).load()
    corpus = LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["evaluation"])],
                         auxiliary_corpora=[LocalCorpus([str(extra)], [str(extra)])])
    splits = corpus.load()
    assert list(splits["auxiliary"]["text"]) == list(base["auxiliary"]["text"]) + ["An extra auxiliary paragraph about hashed gradients."]
    assert list(splits["evaluation"]["text"]) == list(base["evaluation"]["text"])  # the further corpus' evaluation split is unused


def test_local_evaluation_files_with_auxiliary_corpora_are_all_client_data(corpus_files):
    corpus = LocalCorpus(evaluation_files=[str(corpus_files["evaluation"])],
                         auxiliary_corpora=[LocalCorpus([str(corpus_files["auxiliary"])], [str(corpus_files["auxiliary"])])])
    splits = corpus.load()
    assert len(splits["evaluation"]) == 12 and list(splits["evaluation"]["text"])[0].startswith("Held out line 0")
    assert not any(t.startswith("Held out") for t in splits["auxiliary"]["text"])
