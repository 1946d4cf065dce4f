"""The candidate-pointer attack (`lti candidates`): the batched candidate evidence against DAGER's
float64 per-update reference, the coefficients against a per-update least-squares solve, the evidence
files, the pointer's symmetry, and a fit on the tiny LoRA Llama that learns the order."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules.targets import Transformer3
from exact.dager.span import token_distances
from exact.span_evidence import CandidateEvidence, SpanEvidence
from lti.candidates.evidence_file import build, load
from lti.candidates.pointer import CandidatePointer, pointer_targets, predict_tokens
from lti.cli import main
from lti.trainer_cli import instantiate

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "audit" / "tiny_llama_lora.yaml")


@pytest.fixture(scope="module")
def tiny_updates():
    _, data = instantiate(TINY)
    data.setup("fit")
    pipeline = data.pipeline
    ids = data.blocks("evaluation")[0][:6]
    update = pipeline.split(pipeline({"input_ids": ids[:, None]}, keep_update=True).update)
    return pipeline, ids, update, SpanEvidence(pipeline.target, list(pipeline.names), data.seq_len, data.seq_len)


def test_candidates_are_the_reference_closest_tokens_and_hold_every_token_that_gets_a_gradient(tiny_updates):
    pipeline, ids, update, evidence = tiny_updates
    found = CandidateEvidence(evidence, 16, chunk=4)(update)
    assert found.ids.shape == (6, 16) and found.coefficients.shape == (6, 16, 16)  # q and v lora_A: 2 r rows
    for u, basis in enumerate(evidence.spans(update)):
        reference = token_distances(basis, evidence.inputs, [None])[0]  # DAGER's float64 distances
        closest = reference.topk(16, largest=False).indices
        assert set(found.ids[u].tolist()) == set(closest.tolist())
        # the last token predicts nothing and nothing attends to it: every other one is in the span
        assert set(ids[u, :-1].tolist()) <= set(found.ids[u].tolist())
        assert bool((found.scores[u, :-1] >= found.scores[u, 1:]).all())  # closest first


def test_coefficients_match_a_per_update_least_squares_solve_and_rebuild_the_span_rows(tiny_updates):
    pipeline, ids, update, evidence = tiny_updates
    found = CandidateEvidence(evidence, 16, chunk=4)(update)
    spaces = evidence.input_spaces(update).double()
    for u in range(ids.shape[0]):
        x = evidence.inputs(found.ids[u], None).numpy()  # (K, d)
        solution = np.linalg.lstsq(x.T, spaces[u].numpy(), rcond=None)[0]  # (K, width)
        expected = solution / np.linalg.norm(solution)
        assert np.allclose(found.coefficients[u].numpy(), expected, atol=1e-5)
        rebuilt = x.T @ solution  # the true tokens are among the candidates: the rows are rebuilt exactly
        assert np.abs(rebuilt - spaces[u].numpy()).max() <= 1e-6 * np.abs(spaces[u].numpy()).max()


def test_a_target_with_position_embeddings_and_a_bad_count_are_refused_in_one_line(tiny_updates):
    evidence = tiny_updates[3]
    with pytest.raises(ValueError, match="count 0 must be in"):
        CandidateEvidence(evidence, 0)
    target = Transformer3(vocab_size=300, hidden_size=32, num_heads=2, ffn_size=32, num_layers=2, max_positions=8)
    names = [n for n, _ in target.named_parameters()]
    with pytest.raises(ValueError, match="no position"):
        CandidateEvidence(SpanEvidence(target, names, 4, 4), 8)


def test_the_pointer_is_equivariant_to_the_candidates_order_and_decodes_their_ids():
    torch.manual_seed(0)
    pointer = CandidatePointer(torch.randn(50, 8), coefficient_width=4, positions=5, hidden=16, layers=2, heads=2).eval()
    ids = torch.stack([torch.randperm(50)[:7] for _ in range(3)])
    scores, coefficients = torch.randn(3, 7), torch.randn(3, 7, 4)
    logits = pointer(ids, scores, coefficients)
    assert logits.shape == (3, 5, 8)  # 7 candidates and "none"
    perm = torch.randperm(7)
    permuted = pointer(ids[:, perm], scores[:, perm], coefficients[:, perm])
    assert torch.allclose(permuted[..., :-1], logits[..., :-1][..., perm], atol=1e-5)
    assert torch.allclose(permuted[..., -1], logits[..., -1], atol=1e-5)
    assert torch.equal(predict_tokens(ids, logits), ids.gather(1, logits[..., :-1].argmax(-1)))
    truth = torch.tensor([[ids[0, 2], ids[0, 2], 999, ids[0, 0], ids[0, 6]]])
    assert pointer_targets(ids[:1], truth).tolist() == [[2, 2, 7, 0, 6]]


def test_evidence_files_round_trip_and_refuse_mixing_threat_models(tmp_path):
    paths = build(TINY, "auxiliary", tmp_path / "aux.safetensors", count=12, limit=40, batch=16, shards=2)
    assert [p.name for p in paths] == ["aux.00-of-02.safetensors", "aux.01-of-02.safetensors"]
    data = load(paths)
    assert len(data) == 40 and data.ids.shape == (40, 12) and data.truth.shape == (40, 8)
    assert data.metadata["split"] == "auxiliary" and data.metadata["count"] == "12"
    other = build(TINY, "auxiliary", tmp_path / "other.safetensors", count=10, limit=8, batch=8)
    with pytest.raises(ValueError, match="differ in count"):
        load([paths[0], *other])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load([tmp_path / "missing.safetensors"])
    held_out = build(TINY, "evaluation", tmp_path / "eval.safetensors", count=12, limit=8, batch=8)
    with pytest.raises(ValueError, match="differ in split"):  # client text never joins the server's
        load([paths[0], *held_out])
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load([tmp_path / "junk.safetensors"])
    (tmp_path / "junk.safetensors").unlink()
    (tmp_path / "eval.safetensors").unlink()
    with pytest.raises(ValueError, match="samples_per_update"):
        build(TINY, "auxiliary", tmp_path / "m2.safetensors", limit=8,
              overrides=["--data.client.init_args.local.init_args.samples_per_update", "2"])
    assert not (tmp_path / "m2.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["aux.00-of-02.safetensors", "aux.01-of-02.safetensors",
                                                                 "other.safetensors"])


def test_fit_learns_the_order_beyond_the_span_test_alone(tmp_path, capsys):
    """On the tiny LoRA Llama the pointer, trained on the auxiliary split, reads held-out updates
    far better than the span test's top candidate put at every position."""
    main(["candidates", "build", "--config", TINY, "--split", "auxiliary", "--limit", "1024", "--count", "12",
          "--batch", "64", "--out", str(tmp_path / "aux.safetensors")])
    main(["candidates", "build", "--config", TINY, "--split", "evaluation", "--limit", "128", "--count", "12",
          "--out", str(tmp_path / "eval.safetensors")])
    main(["candidates", "fit", "--train", str(tmp_path / "aux.safetensors"), "--eval", str(tmp_path / "eval.safetensors"),
          "--out_dir", str(tmp_path / "fit"), "--max_steps", "150", "--val_every", "75", "--hidden", "32",
          "--layers", "2", "--batch_size", "32"])
    result = json.loads((tmp_path / "fit" / "result.json").read_text())
    assert result["steps"] == 150 and result["eval_blocks"] == 128
    # A second run into the same folder, or onto the same candidate file, is refused: nothing is replaced.
    weights = (tmp_path / "fit" / "pointer.safetensors").read_bytes()
    with pytest.raises(SystemExit) as error:
        main(["candidates", "fit", "--train", str(tmp_path / "aux.safetensors"), "--eval", str(tmp_path / "eval.safetensors"),
              "--out_dir", str(tmp_path / "fit"), "--max_steps", "2"])
    assert error.value.code == 2 and "holds an earlier run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as error:
        main(["candidates", "build", "--config", TINY, "--split", "evaluation", "--limit", "4",
              "--out", str(tmp_path / "eval.safetensors")])
    assert error.value.code == 2 and "exists" in capsys.readouterr().err
    assert (tmp_path / "fit" / "pointer.safetensors").read_bytes() == weights
    assert result["val/token_acc"] > result["val/top_candidate_acc"] + 0.15, result
    rows = (tmp_path / "fit" / "curve.csv").read_text().splitlines()
    assert rows[0].startswith("step,samples,wall_minutes") and len(rows) == 3


def test_fit_refuses_evaluation_candidates_of_the_training_split(tmp_path, capsys):
    main(["candidates", "build", "--config", TINY, "--split", "auxiliary", "--limit", "16", "--count", "8",
          "--out", str(tmp_path / "a.safetensors")])
    with pytest.raises(SystemExit) as error:
        main(["candidates", "fit", "--train", str(tmp_path / "a.safetensors"), "--eval", str(tmp_path / "a.safetensors"),
              "--out_dir", str(tmp_path / "fit")])
    assert error.value.code == 2
    assert "both come from the auxiliary split" in capsys.readouterr().err


def test_the_lm_beam_search_finds_the_brute_force_optimum_and_without_the_lm_is_the_argmax():
    import itertools

    from lti.candidates.decoding import assign_positions, lm_beam_search

    _, data = instantiate(TINY)
    lm = data.pipeline.target.model.eval()
    torch.manual_seed(0)
    count, length, k = 3, 3, 3
    ids = torch.stack([torch.randperm(500)[:k] for _ in range(count)])
    logits = torch.randn(count, length, k + 1)
    assert torch.equal(lm_beam_search(ids, logits, lm, 0.0, beam=2), predict_tokens(ids, logits))
    found = lm_beam_search(ids, logits, lm, 1.0, beam=k ** (length - 1))  # wide enough to be exhaustive
    logp = torch.log_softmax(logits, -1)[..., :-1]
    for u in range(count):
        def total(columns):
            tokens = ids[u, list(columns)]
            with torch.no_grad():
                lm_logp = torch.log_softmax(lm(input_ids=tokens[None]).logits[0].float(), -1)
            return float(sum(logp[u, p, c] for p, c in enumerate(columns))
                         + sum(lm_logp[p - 1, tokens[p]] for p in range(1, length)))
        best = max(itertools.product(range(k), repeat=length), key=total)
        assert found[u].tolist() == ids[u, list(best)].tolist()
    assigned = assign_positions(ids, logits)
    assert all(len(set(row)) == length for row in assigned.tolist())  # each candidate at most once
    with pytest.raises(ValueError, match="too few"):
        assign_positions(ids[:, :2], logits[..., [0, 1, 3]])  # 2 candidates for 3 positions


def test_evaluate_scores_each_rule_and_refuses_candidates_of_another_threat_model(tmp_path, capsys):
    build(TINY, "auxiliary", tmp_path / "aux.safetensors", count=8, limit=32)
    build(TINY, "evaluation", tmp_path / "eval.safetensors", count=8, limit=8)
    main(["candidates", "fit", "--train", str(tmp_path / "aux.safetensors"), "--eval", str(tmp_path / "eval.safetensors"),
          "--out_dir", str(tmp_path / "fit"), "--max_steps", "2", "--val_every", "2", "--hidden", "16", "--layers", "1",
          "--heads", "2", "--batch_size", "8", "--holdout", "8"])
    assert json.loads((tmp_path / "fit" / "result.json").read_text())["holdout_blocks"] == 8
    pointer = str(tmp_path / "fit" / "pointer.safetensors")
    main(["candidates", "evaluate", "--pointer", pointer, "--eval", str(tmp_path / "aux.safetensors"), "--tail", "8",
          "--decode", "argmax", "assign", "lm", "--lm_weight", "0", "1", "--beam", "2", "--out", str(tmp_path / "ev.json")])
    rows = json.loads((tmp_path / "ev.json").read_text())["rows"]
    assert [(r["decode"], r["lm_weight"]) for r in rows] == [("argmax", None), ("assign", None), ("lm", 0.0), ("lm", 1.0)]
    assert all(r["blocks"] == 8 and r["split"] == "auxiliary" for r in rows)
    assert rows[2]["token_acc"] == rows[0]["token_acc"]  # the beam without the LM is the argmax
    for tail in ("0", "9"):  # the whole training split, or more than its held-out blocks: refused
        with pytest.raises(SystemExit) as error:
            main(["candidates", "evaluate", "--pointer", pointer, "--eval", str(tmp_path / "aux.safetensors"), "--tail", tail])
        assert error.value.code == 2 and "the pointer's training split" in capsys.readouterr().err
    build(TINY, "evaluation", tmp_path / "other.safetensors", count=6, limit=4)
    with pytest.raises(SystemExit) as error:
        main(["candidates", "evaluate", "--pointer", pointer, "--eval", str(tmp_path / "other.safetensors")])
    assert error.value.code == 2 and "differ from" in capsys.readouterr().err
