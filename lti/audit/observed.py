"""`ObservedStrategy`: any Flower strategy (message API) whose train replies are read before it aggregates them.

The one way the server side of this workbench observes a federation: it wraps a strategy, as Flower's DP wrappers
do, records the arrays each train message carries to its node, and when the replies come back shows them, with
what was sent to each node, to `observe_round`, then hands the replies, untouched, to the wrapped strategy.
`lti audit` observes its own federation with it (every reply recorded for its attacks); `LeakageAudit` is one
(it runs the attacks and writes a report).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

#: What an observer gets of one round: (server round, {node id: arrays sent to it}, the replies).
RoundObserver = Callable[[int, dict[int, ArrayRecord], list[Message]], None]


class ObservedStrategy(Strategy):
    """Wraps `strategy`; every observed round's train replies go to `observe_round` before aggregation.

    Args:
        strategy: The Flower strategy to wrap; it configures and aggregates as if unwrapped.
        observe_round: Called with (server round, {node id: the arrays sent to that node}, the replies); None: the
            subclass's `observe_round`.
        rounds: The rounds to observe (1-based, Flower's numbering); None: every round.
        arrays_key: The record key of the arrays in train messages and replies (Flower's default "arrays").
        config: Entries added to every train round's config before the wrapped strategy sees it (what the
            clients should be told, e.g. a resumed federation's round offset).
    """

    def __init__(self, strategy: Strategy, observe_round: RoundObserver | None = None,
                 rounds: Iterable[int] | None = None, arrays_key: str = "arrays",
                 config: dict | None = None) -> None:
        super().__init__()
        self.strategy, self.arrays_key = strategy, arrays_key
        self.rounds = None if rounds is None else {int(r) for r in rounds}
        self._observer = observe_round
        self._config = dict(config or {})
        self._sent: dict[int, dict[int, ArrayRecord]] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.strategy!r})"

    def summary(self) -> None:
        log(INFO, "\t├── %s: client replies read before aggregation", type(self).__name__)
        self.strategy.summary()

    def observed(self, server_round: int) -> bool:
        return self.rounds is None or server_round in self.rounds

    def observe_round(self, server_round: int, sent: dict[int, ArrayRecord], replies: list[Message]) -> None:
        if self._observer is None:
            raise NotImplementedError("give observe_round, or override it")
        self._observer(server_round, sent, replies)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        for key, value in self._config.items():
            config[key] = value
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if self.observed(server_round):
            self._sent[server_round] = {m.metadata.dst_node_id: m.content[self.arrays_key] for m in messages}
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        sent = self._sent.pop(server_round, None)
        if sent is not None:
            self.observe_round(server_round, sent, replies)
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)
