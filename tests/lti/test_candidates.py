"""The candidate-pointer attack (`lti candidates`): the batched candidate evidence against DAGER's
float64 per-update reference, the coefficients against a per-update least-squares solve, the evidence
files, the pointer's symmetry, and a fit on the tiny LoRA Llama that learns the order."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules.targets import Transformer3
from exact.dager.span import span_basis, token_distances
from exact.layers import capture_input
from exact.span_evidence import DISTANCE_FLOOR, CandidateEvidence, SecondLayerEvidence, SpanEvidence
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


def _second_layer_reference(pipeline, update, u: int, prefix: torch.Tensor) -> float:
    """The slow reference: the whole prefix run through the model, its last second-layer input's distance
    to the update's second-layer span (DAGER's float64 SVD basis, rank capped at L - 1), as a score."""
    second = SecondLayerEvidence(pipeline.target, list(pipeline.names), 8)
    basis = span_basis(second.input_spaces({k: v[u : u + 1] for k, v in update.items()})[0], 1e-6, 7)
    with torch.no_grad():
        hidden = capture_input(second.layers.second_input_module, lambda: pipeline.target.model(input_ids=prefix[None]))
    return float(-torch.log(basis.distance(hidden[0, -1:].double()) + DISTANCE_FLOOR))


def test_the_second_layer_score_of_a_cached_prefix_is_the_whole_prefix_reference(tiny_updates):
    pipeline, ids, update, _ = tiny_updates
    second = SecondLayerEvidence(pipeline.target, list(pipeline.names), ids.shape[1])
    ranges = second.ranges(second.input_spaces(update))  # (6, d, r)
    torch.manual_seed(0)
    wrong = torch.randint(0, 500, ids.shape)
    for rows in (ids, wrong):
        cache, scores = None, []
        for p in range(ids.shape[1]):
            score, cache = second.extend(rows[:, p], p, ranges, cache)
            scores.append(score[:, 0])
        scores = torch.stack(scores, 1)  # (6, L)
        for u in (0, 3):
            for p in (0, 2, 6):
                # compared as distances: float32 rounding of the two forwards moves in-span ones by ~1e-7
                fast, slow = math.exp(-float(scores[u, p])), math.exp(-_second_layer_reference(pipeline, update, u, rows[u, : p + 1]))
                assert abs(fast - slow) <= 1e-6 + 1e-3 * slow
        if rows is ids:
            truth = scores
    # the client's own prefixes lie in the span (up to float32 rounding); random ones do not
    assert float(truth[:, :-1].min()) > float(scores[:, :-1].max()) + 2.0


def test_the_second_layer_beam_search_is_the_brute_force_optimum_and_without_its_weight_the_lm_rule(tiny_updates):
    import itertools

    from lti.candidates.decoding import decode_candidates, lm_beam_search

    pipeline, ids, update, _ = tiny_updates
    lm = pipeline.target.model.eval()
    second = SecondLayerEvidence(pipeline.target, list(pipeline.names), ids.shape[1])
    spaces = second.input_spaces(update)[:4]
    torch.manual_seed(1)
    length, k = 3, 3
    cand = torch.stack([torch.cat([ids[u, :1], torch.randperm(500)[: k - 1] + 1000]) for u in range(4)])
    logits = torch.randn(4, length, k + 1)
    found = lm_beam_search(cand, logits, lm, 0.5, beam=k ** (length - 1), second=second, spaces=spaces, second_weight=0.7)
    logp = torch.log_softmax(logits, -1)[..., :-1]
    for u in range(4):
        def total(columns):
            tokens = cand[u, list(columns)]
            with torch.no_grad():
                lm_logp = torch.log_softmax(lm(input_ids=tokens[None]).logits[0].float(), -1)
            return float(sum(logp[u, p, c] for p, c in enumerate(columns))
                         + 0.5 * sum(lm_logp[p - 1, tokens[p]] for p in range(1, length))
                         + 0.7 * sum(_second_layer_reference(pipeline, update, u, tokens[: p + 1]) for p in range(length)))
        best = max(itertools.product(range(k), repeat=length), key=total)
        assert found[u].tolist() == cand[u, list(best)].tolist()
    without = decode_candidates(cand, logits, "second_layer", lm, 0.5, 4, second, spaces, 0.0)
    assert torch.equal(without, decode_candidates(cand, logits, "lm", lm, 0.5, 4))
    with pytest.raises(ValueError, match="second-layer test of the update"):
        decode_candidates(cand, logits, "second_layer", lm, 0.5, 4)


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
    count, length, k = 8, 3, 3
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
    for tail in ([], ["--tail", "9"]):  # the whole training split, or more than its held-out blocks: refused
        with pytest.raises(SystemExit) as error:
            main(["candidates", "evaluate", "--pointer", pointer, "--eval", str(tmp_path / "aux.safetensors"), *tail])
        assert error.value.code == 2 and "the pointer's training split" in capsys.readouterr().err
    build(TINY, "evaluation", tmp_path / "other.safetensors", count=6, limit=4)
    with pytest.raises(SystemExit) as error:
        main(["candidates", "evaluate", "--pointer", pointer, "--eval", str(tmp_path / "other.safetensors")])
    assert error.value.code == 2 and "differ from" in capsys.readouterr().err


def test_files_record_their_blocks_and_second_layer_gradients_and_evaluate_reads_only_untrained_blocks(tmp_path, capsys):
    build(TINY, "auxiliary", tmp_path / "aux.safetensors", count=8, limit=32)
    build(TINY, "auxiliary", tmp_path / "tail.safetensors", count=8, limit=8, skip=24, second_layer=True)
    full, tail = load([tmp_path / "aux.safetensors"]), load([tmp_path / "tail.safetensors"])
    assert full.blocks.tolist() == list(range(32)) and tail.blocks.tolist() == list(range(24, 32))
    assert torch.equal(tail.truth, full.truth[24:]) and torch.equal(tail.ids, full.ids[24:])  # the same blocks' candidates
    assert full.second_spaces is None and tail.second_spaces.shape[:1] == (8,)
    assert tail.tail(3).blocks.tolist() == [29, 30, 31] and tail.tail(3).second_spaces.shape[0] == 3
    build(TINY, "evaluation", tmp_path / "eval.safetensors", count=8, limit=8)
    main(["candidates", "fit", "--train", str(tmp_path / "aux.safetensors"), "--eval", str(tmp_path / "eval.safetensors"),
          "--out_dir", str(tmp_path / "fit"), "--max_steps", "2", "--val_every", "2", "--hidden", "16", "--layers", "1",
          "--heads", "2", "--batch_size", "8", "--holdout", "8"])  # trains on blocks 0..23
    pointer = str(tmp_path / "fit" / "pointer.safetensors")
    main(["candidates", "evaluate", "--pointer", pointer, "--eval", str(tmp_path / "tail.safetensors"), "--decode", "lm",
          "second_layer", "--lm_weight", "0.5", "--second_weight", "0", "2", "--beam", "2", "--out", str(tmp_path / "ev.json")])
    rows = json.loads((tmp_path / "ev.json").read_text())["rows"]
    assert [(r["decode"], r["second_weight"]) for r in rows] == [("lm", None), ("second_layer", 0.0), ("second_layer", 2.0)]
    assert rows[1]["token_acc"] == rows[0]["token_acc"]  # without its weight the test changes nothing
    build(TINY, "auxiliary", tmp_path / "early.safetensors", count=8, limit=8, skip=20, second_layer=True)
    with pytest.raises(SystemExit) as error:  # blocks 20..23 were trained on
        main(["candidates", "evaluate", "--pointer", pointer, "--eval", str(tmp_path / "early.safetensors")])
    assert error.value.code == 2 and "trained on its blocks before 24" in capsys.readouterr().err
    with pytest.raises(SystemExit) as error:
        main(["candidates", "evaluate", "--pointer", pointer, "--eval", str(tmp_path / "aux.safetensors"), "--tail", "8",
              "--decode", "second_layer"])
    assert error.value.code == 2 and "with --second_layer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as error:
        main(["candidates", "evaluate", "--pointer", pointer, "--eval", str(tmp_path / "tail.safetensors"),
              "--decode", "second_layer", "--second_weight", "-1"])
    assert error.value.code == 2 and "must be finite and >= 0, not -1.0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--skip 1000000: the auxiliary split has"):
        build(TINY, "auxiliary", tmp_path / "none.safetensors", skip=1_000_000, limit=4)


# --------------------------------------------------------------------------------------------------------
# The command line: jsonargparse over `lti.candidates.options`, the argparse spellings rewritten


def _stderr_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_the_new_spelling_parses_silently_and_a_config_file_gives_the_options(tmp_path, capsys):
    from lti.candidates.cli import parse

    command, options = parse(["fit", "--train", "[a.safetensors, b.safetensors]", "--eval+", "c.safetensors",
                              "--out_dir", "o", "--overwrite", "true", "--lr", "5e-4", "--max_time", "00:00:04:00"])
    assert command == "fit" and options.train == ["a.safetensors", "b.safetensors"] and options.eval == ["c.safetensors"]
    assert options.overwrite is True and options.lr == 5e-4 and options.max_time == "00:00:04:00"
    assert options.hidden == 256 and options.holdout == 0  # the defaults of the argparse command
    config = tmp_path / "fit.yaml"
    config.write_text("train: [a.safetensors]\neval: [c.safetensors]\nout_dir: o\nhidden: 64\nheads: 2\n")
    _, from_file = parse(["fit", "--config", str(config), "--heads", "4"])
    assert (from_file.train, from_file.hidden, from_file.heads) == (["a.safetensors"], 64, 4)  # flags after the file win
    _, evaluate = parse(["evaluate", "--pointer", "p", "--eval", "[e]", "--decode", "[lm, second_layer]",
                         "--lm_weight", "[0.25]", "--second_weight", "[0, 2]"])
    assert (evaluate.decode, evaluate.lm_weight, evaluate.second_weight) == (["lm", "second_layer"], [0.25], [0.0, 2.0])
    _, build_options = parse(["build", "--config", TINY, "--out", "x", "--second_layer", "true",
                              "--overrides", '["--data.client.init_args.rank", "16"]'])
    assert build_options.config == TINY and build_options.second_layer is True  # build's --config: the threat model
    assert build_options.overrides == ["--data.client.init_args.rank", "16"]
    assert capsys.readouterr().err == ""


def test_the_argparse_spellings_still_parse_with_one_deprecation_line(capsys):
    from lti.candidates.cli import parse

    old = parse(["evaluate", "--pointer", "p", "--eval", "e1", "e2", "--decode", "argmax", "lm", "--lm_weight", "0", "1",
                 "--second_weight", "2"])
    (line,) = _stderr_lines(capsys)
    new = parse(["evaluate", "--pointer", "p", "--eval", "[e1, e2]", "--decode", "[argmax, lm]", "--lm_weight", "[0, 1]",
                 "--second_weight", "[2]"])
    assert old == new and capsys.readouterr().err == ""
    assert line.startswith("lti candidates: warning: deprecated spelling: --eval e1 e2 -> --eval '[e1, e2]'; ")
    assert "--decode argmax lm -> --decode '[argmax, lm]'" in line and "--lm_weight 0 1 -> --lm_weight '[0, 1]'" in line
    # overrides after `--` become --overrides; values YAML would read as numbers stay strings
    _, build_options = parse(["build", "--config", TINY, "--out", "x", "--", "--data.client.init_args.rank", "16"])
    assert build_options.overrides == ["--data.client.init_args.rank", "16"]
    (line,) = _stderr_lines(capsys)
    assert line.endswith("-- --data.client.init_args.rank 16 -> --overrides '[\"--data.client.init_args.rank\", \"16\"]'")
    # a bare flag is jsonargparse's own spelling too: no line
    _, flagged = parse(["build", "--config", TINY, "--out", "x", "--second_layer", "--overwrite", "--limit", "4"])
    assert flagged.second_layer and flagged.overwrite and flagged.limit == 4 and capsys.readouterr().err == ""


@pytest.mark.parametrize("argv, message", [
    (["fit", "--train", "[a]", "--eval", "[b]", "--out_dir", "o", "--max_stepz", "3"],
     "unknown option 'max_stepz' (did you mean 'max_steps'?); `lti candidates fit --help` lists every option"),
    (["evaluate", "--pointer", "p", "--eval", "[e]", "--decode", "[bogus]"], "bad value for 'decode'"),
    # a learning rate that is not finite and > 0 gets the check's line however it is spelled
    (["fit", "--train", "[a]", "--eval", "[b]", "--out_dir", "o", "--lr", "nan"], "--lr nan must be finite and > 0"),
    (["fit", "--train", "[a]", "--eval", "[b]", "--out_dir", "o", "--lr", ".nan"], "--lr nan must be finite and > 0"),
    (["fit", "--train", "[a]", "--eval", "[b]", "--out_dir", "o", "--lr=-inf"], "--lr -inf must be finite and > 0"),
    (["fit", "--train", "[a]", "--eval", "[b]", "--out_dir", "o", "--lr", "-1"], "--lr -1.0 must be finite and > 0"),
    (["fit", "--train", "[a]", "--eval", "[b]", "--out_dir", "o", "--lr", "1e-3x"], "bad value for 'lr': expected float, got 1e-3x"),
    (["evaluate", "--pointer", "p", "--eval", "[e]", "--lm_weight", "[0.5, NaN]"], "must be finite and >= 0, not nan"),
    (["build", "--config", TINY, "--out", "x", "--overwrite", "maybe"], "option 'overwrite' is a flag"),
    (["evaluate", "--eval", "[e]"], "the following arguments are required: pointer"),
    (["evalute"], "unknown command 'evalute' (did you mean 'evaluate'?)"),
    ([], "name a command: build, fit, evaluate"),
], ids=["unknown-option", "unknown-rule", "lr-nan", "lr-yaml-nan", "lr-minus-inf", "lr-minus-1", "lr-not-a-number",
        "lm_weight-nan", "flag-value", "required", "unknown-command", "no-command"])
def test_bad_options_are_one_line_and_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as error:
        main(["candidates", *argv])
    (line,) = _stderr_lines(capsys)
    assert error.value.code == 2 and line.startswith("lti candidates: error: ") and message in line, line


def test_a_config_files_lr_that_is_not_finite_gets_the_checks_line(tmp_path, capsys):
    config = tmp_path / "fit.yaml"
    for value, said in (("nan", "nan"), (".inf", "inf"), ("-1", "-1.0")):
        config.write_text(f"train: [a]\neval: [b]\nout_dir: o\nlr: {value}\n")
        with pytest.raises(SystemExit) as error:
            main(["candidates", "fit", "--config", str(config)])
        assert error.value.code == 2 and _stderr_lines(capsys) == [f"lti candidates: error: --lr {said} must be finite and > 0"]


def test_help_lists_each_commands_options_from_the_dataclasses(capsys):
    from typing import get_args

    from lti.candidates.decoding import DECODERS
    from lti.candidates.options import Decoder

    assert get_args(Decoder) == DECODERS
    for command, said in (("fit", "Keep the training files' last HOLDOUT blocks out of training"),
                          ("build", "Also store each update's second-layer gradient"),
                          ("evaluate", "Weights of the second-layer span test's score")):
        with pytest.raises(SystemExit) as error:
            main(["candidates", command, "--help"])
        out = " ".join(capsys.readouterr().out.split())  # the help is wrapped to the terminal
        assert error.value.code == 0 and said in out, out
    with pytest.raises(SystemExit) as error:
        main(["candidates", "--help"])
    out = capsys.readouterr().out
    assert error.value.code == 0 and "evaluate  Score a trained pointer on candidate files" in out
