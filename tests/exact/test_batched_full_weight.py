"""The batched attack on full-weight updates of a tiny GPT-2 (d = 32, MLP 128, two layers, a vocabulary of 16,
sequences of 12 tokens) whose batch outnumbers the model's width: the wide sites (MLP down-projections), the bag from the first layer's span, both
against slow references, and the attack's parts put together."""

from __future__ import annotations

import math

import pytest
import torch

from datamodules.federated import FedSGDClient, UpdatePipeline
from datamodules.federated.observed import ParameterSelection
from datamodules.metrics import score_batch
from datamodules.targets import HFCausalLM
from exact.batched import BatchedLoRA, BatchedOptions, SiteWhitening, least_squares_check, wide_sites
from exact.batched.bag import SPAN_BAG_THRESHOLD, span_bag
from exact.batched.sites import capture_site_inputs
from exact.layers import find_layers

VOCAB, WIDTH, LENGTH = 16, 32, 12
EPS32 = torch.finfo(torch.float32).eps


def gpt2() -> HFCausalLM:
    return HFCausalLM(architecture="gpt2", config=dict(n_embd=WIDTH, n_layer=2, n_head=2, n_positions=16,
                                                       vocab_size=VOCAB, bos_token_id=0, eos_token_id=0), init_seed=0)


def pipeline(batch: int, observed: ParameterSelection | None = None) -> UpdatePipeline:
    return UpdatePipeline(gpt2(), client=FedSGDClient("eval", batch), observed=observed)


def batch_ids(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(seed))


def update_of(pipe: UpdatePipeline, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    observed = pipe({"input_ids": ids[None]}, keep_update=True)
    return {n: g[0].double() for n, g in pipe.split(observed.update).items()}, observed.update[0]


def test_the_wide_sites_of_gpt2_are_its_mlp_down_projections_and_their_rows_lie_in_the_span_of_their_inputs():
    pipe = pipeline(4)
    sites = wide_sites(pipe.target, list(pipe.names))
    assert [s.modules[0] for s in sites] == [f"model.transformer.h.{i}.mlp.c_proj" for i in range(2)]
    assert all(s.transposed and s.weights == (s.modules[0] + ".weight",) for s in sites)
    # B = 1, 11 input tokens: fewer than the 128-wide input, so every row lies in the inputs' span (the reference:
    # the inputs the forward pass computes, captured by hooks)
    ids = batch_ids(1, 0)
    update, _ = update_of(pipeline(1), ids)
    pipe.target.eval()  # GPT-2's default dropout off, as the client's eval-mode step
    inputs = capture_site_inputs(pipe.target, sites, lambda: pipe.target.model(ids[:, :-1]))
    for site, x in zip(sites, inputs):
        rows = site.rows(update)
        assert rows.shape == (WIDTH, 4 * WIDTH)
        assert torch.equal(rows, update[site.weights[0]].T)
        q, _ = torch.linalg.qr(x.reshape(-1, x.shape[-1]).double().T)
        off = (rows.T - q @ (q.T @ rows.T)).norm() / rows.norm()
        assert off < 100 * EPS32


def test_wide_sites_refuse_an_update_without_one_in_one_line():
    pipe = pipeline(2, ParameterSelection(include=["*attn.c_attn.weight"]))
    with pytest.raises(ValueError, match="none of the observed weights") as error:
        wide_sites(pipe.target, list(pipe.names))
    assert "\n" not in str(error.value)


def reference_span_bag(first: torch.Tensor, target, positions: int) -> set[int]:
    """Every token at every position, one at a time, its distance to the span by least squares (singular values
    below 1e-6 of the largest dropped, the span's numerical rank)."""
    inputs = find_layers(target).inputs
    found = set()
    for token in range(VOCAB):
        for position in range(positions):
            x = inputs(torch.tensor([token]), position, torch.float64)[0]
            fit = torch.linalg.lstsq(first.double(), x[:, None], rcond=1e-6, driver="gelsd").solution
            if float((first.double() @ fit)[:, 0].sub(x).norm() / x.norm()) < SPAN_BAG_THRESHOLD:
                found.add(token)
                break
    return found


def test_the_span_bag_matches_a_per_token_reference_and_holds_the_visible_tokens():
    # 2 sequences of 11 inputs: at most 16 distinct tokens + 11 positions, within the 32-wide first layer
    pipe = pipeline(2)
    ids = batch_ids(2, 3)
    update, _ = update_of(pipe, ids)
    layers = find_layers(pipe.target)
    first = layers.first.input_space(update)
    bag = span_bag(first, layers.inputs, LENGTH - 1)
    visible = set(ids[:, :-1].flatten().tolist())
    assert set(bag.tokens) == visible
    # The reference tests the span by least squares (rank-revealing), to the same threshold
    assert set(bag.tokens) == reference_span_bag(first, pipe.target, LENGTH - 1)
    # True inputs lie in the span to float32 rounding (the gradient is float32), far inside the threshold
    assert max(bag.residuals) < 1e3 * EPS32


def test_the_span_bag_of_a_full_span_is_empty():
    layers = find_layers(gpt2())
    full = torch.randn(WIDTH, 3 * WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert span_bag(full, layers.inputs, LENGTH - 1).tokens == []


def test_a_model_with_a_position_table_is_whitened_without_a_vocabulary_part_and_its_cache_round_trips(tmp_path):
    pipe = pipeline(2)
    sites = wide_sites(pipe.target, list(pipe.names))
    auxiliary = torch.randint(0, VOCAB, (64, LENGTH), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "whitening.safetensors"
    fitted = SiteWhitening.load_or_fit(path, pipe.target, sites, auxiliary, "tiny-gpt2", say=lambda _: None)
    assert fitted.vocabulary is None and fitted.sites.shape == (2, 4 * WIDTH, 4 * WIDTH)
    loaded = SiteWhitening.load_or_fit(path, pipe.target, sites, auxiliary, "tiny-gpt2", say=lambda _: None)
    assert loaded.vocabulary is None and torch.equal(loaded.sites, fitted.sites)


def test_the_attack_reads_a_full_weight_update_whose_batch_outnumbers_the_width():
    # B = 4: 44 inputs against a 32-wide model (the second attention layer's span full; the first layer's holds at
    # most 16 tokens + 11 positions + 1 < 32, which the bag relies on), within the MLP's 128
    batch = 4
    pipe = pipeline(batch)
    pipe.target.train()  # the attack runs in eval mode and gives each module its own mode back
    next(m for m in pipe.target.modules() if isinstance(m, torch.nn.Dropout)).eval()
    modes = [m.training for m in pipe.target.modules()]
    one = pipe.with_client(FedSGDClient("eval", 1))
    names = list(pipe.names)
    sites = wide_sites(pipe.target, names)
    whitening = SiteWhitening.fit(pipe.target, sites,
                                  torch.randint(0, VOCAB, (64, LENGTH), generator=torch.Generator().manual_seed(1)))

    def simulate(sequences):
        return one({"input_ids": torch.tensor(sequences)[:, None]}, keep_update=True).update

    attack = BatchedLoRA(pipe.target, names, whitening, BatchedOptions(lm_weight=0.0, refine=2, regrow=0),
                         sites=sites)
    accuracies = []
    for seed in (5, 6, 7):
        ids = batch_ids(batch, seed)
        update, flat = update_of(pipe, ids)
        # The refit certifies the true batch (the server's simulation of full weights is the client's)
        assert least_squares_check(flat, simulate(ids.tolist()))[0] < 1e3 * EPS32
        result = attack.attack(update, batch, LENGTH, simulate, flat)
        assert set(result.bag) == set(ids[:, :-1].flatten().tolist())
        assert len(result.sequences) == batch and all(len(s) == LENGTH for s in result.sequences)
        # input positions (the last token is a label, never an input), sequences matched one to one
        accuracies.append(score_batch([s[:-1] for s in result.sequences], ids[:, :-1], None)["token_acc"])
    assert [m.training for m in pipe.target.modules()] == modes and len(set(modes)) == 2
    # Chance is about one token in the bag's 16; the search reads most of them (about 88% when written)
    assert sum(accuracies) / len(accuracies) > 0.5


def test_a_whitening_cache_of_a_model_without_a_position_table_is_refused_for_one_with_it(tmp_path):
    from safetensors.torch import save_file

    from exact.batched.whitening import FORMAT
    from exact.batched.whitening import SiteWhitening as Whitening

    pipe = pipeline(2)
    sites = wide_sites(pipe.target, list(pipe.names))
    auxiliary = torch.randint(0, VOCAB, (8, LENGTH), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "whitening.safetensors"
    eye = torch.eye(4 * WIDTH, dtype=torch.float64)
    save_file({"vocabulary": torch.eye(WIDTH, dtype=torch.float64), "sites": eye.expand(2, -1, -1).contiguous()},
              str(path), metadata={"format": FORMAT, "key": Whitening.key("tiny-gpt2", sites, auxiliary)})
    with pytest.raises(ValueError, match="without a position table") as error:
        Whitening.load_or_fit(path, pipe.target, sites, auxiliary, "tiny-gpt2")
    assert "\n" not in str(error.value)


def test_a_full_weight_attack_without_the_first_layer_observed_is_refused_in_one_line():
    pipe = pipeline(2, ParameterSelection(include=["*mlp.c_proj.weight"]))
    names = list(pipe.names)
    sites = wide_sites(pipe.target, names)
    whitening = SiteWhitening(None, torch.eye(4 * WIDTH, dtype=torch.float64).expand(2, -1, -1).clone())
    with pytest.raises(ValueError, match="first attention layer") as error:
        BatchedLoRA(pipe.target, names, whitening, sites=sites)
    assert "\n" not in str(error.value)


def test_an_update_without_the_first_layer_gradient_is_refused_in_one_line():
    pipe = pipeline(2)
    names = list(pipe.names)
    sites = wide_sites(pipe.target, names)
    whitening = SiteWhitening(None, torch.eye(4 * WIDTH, dtype=torch.float64).expand(2, -1, -1).clone())
    attack = BatchedLoRA(pipe.target, names, whitening, BatchedOptions(lm_weight=0.0), sites=sites)
    update, _ = update_of(pipe, batch_ids(2, 0))
    update = {n: g for n, g in update.items() if "h.0.attn.c_attn" not in n}
    with pytest.raises(ValueError, match="no gradient of the first attention layer") as error:
        attack.attack(update, 2, LENGTH)
    assert "\n" not in str(error.value)


def test_the_gram_route_keeps_the_row_space_the_svd_keeps():
    # Three (200, 40) matrices: 30 directions of singular values from 1 down to 2e-5 and 10 at 1e-7 (the float32
    # noise of a returned weight), the tolerance's 1e-5 between them. Slow reference: the SVD. Squaring the
    # condition number leaves the vectors near the cut orthonormal to within eps (1 / 2e-5)^2, about 6e-7.
    from exact.batched.search import ROW_SPACE_TOLERANCE, _bases

    generator = torch.Generator().manual_seed(0)
    stack = []
    for _ in range(3):
        left = torch.linalg.qr(torch.randn(200, 40, generator=generator, dtype=torch.float64))[0]
        right = torch.linalg.qr(torch.randn(40, 40, generator=generator, dtype=torch.float64))[0]
        values = torch.cat([torch.logspace(0, math.log10(2e-5), 30, dtype=torch.float64),
                            torch.full((10,), 1e-7, dtype=torch.float64)])
        stack.append(left @ torch.diag(values) @ right.T)
    matrices = torch.stack(stack)
    fast = _bases(matrices, ROW_SPACE_TOLERANCE, gram=True)
    slow = _bases(matrices, ROW_SPACE_TOLERANCE)
    for basis, reference in zip(fast, slow):
        assert basis.shape == reference.shape == (200, 30)
        assert torch.allclose(basis.T @ basis, torch.eye(30, dtype=torch.float64), atol=1e-6)
        assert torch.allclose(basis @ basis.T, reference @ reference.T, atol=1e-6)


def test_a_wide_site_deflated_through_its_gram_matrix_equals_its_svd_deflation(monkeypatch):
    # GPT-2's 768-row sites take the Gram route (GRAM_ABOVE); the tiny model's 32-row sites are made to take it.
    from exact.batched import search

    batch = 4
    pipe = pipeline(batch)
    names = list(pipe.names)
    sites = wide_sites(pipe.target, names)
    whitening = SiteWhitening.fit(pipe.target, sites,
                                  torch.randint(0, VOCAB, (64, LENGTH), generator=torch.Generator().manual_seed(1)))
    ids = batch_ids(batch, 5)
    update, _ = update_of(pipe, ids)
    scorer = search.SpanScorer([s.rows(update) for s in sites], whitening.sites)
    inputs = capture_site_inputs(pipe.target, sites, lambda: pipe.target.model(ids))
    known = [h[:2, :-1].reshape(-1, h.shape[-1]) for h in inputs]  # two of the four sequences known
    slow = scorer.bases(known)
    assert all(rows.shape[0] <= search.GRAM_ABOVE for rows in scorer.rows)
    monkeypatch.setattr(search, "GRAM_ABOVE", 0)
    fast = scorer.bases(known)
    for (k, rows), (k_ref, rows_ref) in zip(fast, slow):
        assert 0 < rows.shape[1] == rows_ref.shape[1] < scorer.rows[0].shape[0]
        assert torch.equal(k, k_ref)
        assert torch.allclose(rows @ rows.T, rows_ref @ rows_ref.T, atol=1e-8)


@pytest.mark.parametrize("duplicate", ["none", "equal", "near"])
def test_the_refit_solves_its_normal_equations_as_a_rank_revealing_solve_over_the_whole_update(duplicate):
    # Slow reference: LAPACK's SVD least squares (gelsd) over the whole (D, B) update. Two equal sequences make the
    # normal equations singular: the fit stays exact. Two nearly equal ones make them ill-conditioned: the
    # refinement step recovers the reference's coefficients (without it they are off by about 3e-7).
    from exact.batched.attack import least_squares_check

    generator = torch.Generator().manual_seed(0)
    per_sequence = torch.randn(6, 5000, generator=generator, dtype=torch.float64)
    if duplicate == "equal":
        per_sequence[5] = per_sequence[4]
    elif duplicate == "near":
        per_sequence[5] = per_sequence[4] + 1e-4 * torch.randn(5000, generator=generator, dtype=torch.float64)
    weights = torch.tensor([0.5, 1.0, 2.0, 0.25, 1.5, 1.0], dtype=torch.float64)
    update = weights @ per_sequence + 1e-3 * torch.randn(5000, generator=generator, dtype=torch.float64)
    given = per_sequence
    if duplicate == "none":  # float32 updates, as simulated, are fitted in float64
        given = per_sequence.float()
        per_sequence = given.double()
    reference = torch.linalg.lstsq(per_sequence.T, update[:, None], driver="gelsd").solution[:, 0]
    residual, coefficients = least_squares_check(update, given)
    expected = float((reference @ per_sequence - update).norm() / update.norm())
    assert residual == pytest.approx(expected, rel=1e-9) and 1e-4 < residual < 1e-2
    fitted = torch.tensor(coefficients, dtype=torch.float64) @ per_sequence
    assert torch.allclose(fitted, reference @ per_sequence, atol=1e-9)
    if duplicate != "equal":  # equal sequences share their weight as each solver likes
        assert coefficients == pytest.approx(reference.tolist(), rel=1e-9, abs=1e-9)
