"""`ObservedStrategy`: any Flower strategy's train replies shown to an observer, only in the rounds asked for,
with the arrays sent to each node, while the wrapped strategy aggregates exactly as unwrapped; config entries
reach the clients."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord  # noqa: E402
from flwr.serverapp.strategy import FedProx  # noqa: E402
from test_audit import random_data, tiny_pipeline  # noqa: E402

from lti.audit.federation import SerialGrid, adapter_state, client_pipeline, make_client_app  # noqa: E402
from lti.audit.observed import ObservedStrategy  # noqa: E402


def run(strategy_of, rounds: int = 3, clients: int = 2):
    pipeline = tiny_pipeline()
    configs = []
    app = make_client_app(client_pipeline(pipeline, 2, lr=0.05), random_data, 0.05)
    grid = SerialGrid(app, clients)
    strategy = strategy_of(FedProx(proximal_mu=0.1, fraction_evaluate=0.0, min_train_nodes=clients,
                                   min_available_nodes=clients))
    original = strategy.strategy.configure_train if isinstance(strategy, ObservedStrategy) else None
    if original is not None:
        def configure(server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid_):
            configs.append(dict(config))
            return original(server_round, arrays, config, grid_)
        strategy.strategy.configure_train = configure
    with grid.serving():
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(torch_state_dict=adapter_state(pipeline)),
                                num_rounds=rounds)
    return result.arrays.to_torch_state_dict(), configs, grid


def test_only_the_rounds_asked_for_are_shown_and_the_aggregate_is_the_unwrapped_ones():
    seen = []

    def observe(server_round, sent, replies):
        assert sorted(sent) == sorted(reply.metadata.src_node_id for reply in replies)
        seen.append((server_round, len(replies), {node: arrays.to_torch_state_dict() for node, arrays in sent.items()}))

    wrapped, configs, _ = run(lambda s: ObservedStrategy(s, observe, rounds=[2, 3], config={"round-offset": 7}))
    unwrapped, _, _ = run(lambda s: s)
    assert [(r, n) for r, n, _ in seen] == [(2, 2), (3, 2)]
    for name, value in unwrapped.items():
        assert torch.equal(wrapped[name], value)
    assert all(config["round-offset"] == 7 for config in configs) and len(configs) == 3
    # What was sent to both nodes in a round is the round's global model: the same arrays.
    _, _, sent = seen[0]
    first, second = sent.values()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_an_observer_must_be_given_or_the_method_overridden():
    wrapped = ObservedStrategy(FedProx(proximal_mu=0.1))
    with pytest.raises(NotImplementedError, match="give observe_round, or override it"):
        wrapped.observe_round(1, {}, [])
