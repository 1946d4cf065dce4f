"""Federated LoRA fine-tuning in Flower, with every client update handed to the server's attacks.

- `make_client_app`: a Flower `ClientApp` whose clients train with the workbench's client code (the
  threat model's `UpdatePipeline`: peft LoRA adapters, FedSGD per-sample gradients of a batch of B
  sequences or FedAvg's local SGD steps over them, train-mode dropout, the workbench defense) and
  return their new adapter weights (w - lr * update, or FedAvg's w - delta), through Flower's DP mods
  when asked.
- `observed_fedavg`: Flower's `FedAvg` (message API) wrapped in `ObservedStrategy`, which first hands every reply's
  arrays, exactly as Flower delivered them, with the arrays sent that round, to an observer; then aggregates.
- `SerialGrid`: a Flower `Grid` that runs the `ClientApp` of every node in this process, one message at
  a time, each message and reply passing through Flower's wire format (protobuf) as on a network.
  Flower's own simulation runtime needs Ray (its only backend); on a 2-core CPU with one model copy per
  client process it only adds cost, so the audit drives the same `ClientApp` and strategy itself. It writes
  no private Flower field: the ids, run and time a SuperLink stamps on a message are written into the
  message's protobuf form (the wire format's own fields), and the task identity is set through its public
  setters (`TaskIdentity` and the serialisation helpers are Flower modules outside its documented exports).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from uuid import uuid4

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from datamodules.federated import FedAvgClient, FedSGDClient, LoRAClient, UpdatePipeline
from datamodules.federated.defenses import NoDefense
from datamodules.federated.hashing import FeatureHasher, Hashing
from datamodules.threat_model import load_parameters
from lti.audit.observed import ObservedStrategy

#: The keys of the records a train message and its reply carry (Flower's FedAvg defaults).
ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"
#: Config keys the audit adds to Flower's own ("server-round"): the absolute round of a resumed audit.
ROUND_OFFSET = "audit-round-offset"


def client_pipeline(server_pipeline: UpdatePipeline, batch_size: int, local_epochs: int = 1,
                    minibatch_size: int | None = None, lr: float = 1e-3) -> UpdatePipeline:
    """The clients' own copy of the threat model's pipeline (a separate model object), with B sequences
    per update, computing every adapter's update: a client sends all its adapters, whatever subset the
    server's threat model observes (`data.observed` selects what the server's inverter reads). The
    threat model's LoRA client must take a FedSGD step; with `local_epochs` > 1 or a `minibatch_size`
    below B the clients run FedAvg instead (local SGD at `lr`, in the threat model's mode)."""
    client = server_pipeline.client
    if not isinstance(client, LoRAClient):
        raise ValueError(f"the audit federates LoRA fine-tuning; the threat model's client is {type(client).__name__} "
                         "(use datamodules.federated.LoRAClient)")
    if not isinstance(client.local, FedSGDClient):
        raise ValueError(f"the audit reads its clients' protocol from the threat model's one FedSGD step and the "
                         f"federation options; the threat model's LoRA local computation is {type(client.local).__name__} "
                         "(use FedSGDClient, and --federation.local_epochs / --federation.minibatch_size for FedAvg)")
    pipeline = copy.deepcopy(server_pipeline)
    minibatch = minibatch_size or batch_size
    if local_epochs == 1 and minibatch == batch_size:
        local = FedSGDClient(client.local.mode, batch_size, client.local.implementation)
    else:
        if not isinstance(server_pipeline.defense, NoDefense):
            # A workbench defense of a FedAvg client acts on its weight delta (noise in weight units) or at
            # every local step (DP-SGD): the threat model's settings would mean something else than for
            # the one-step updates the server trained on.
            raise ValueError(f"FedAvg clients in the audit run without a workbench defense (the threat model has "
                             f"{type(server_pipeline.defense).__name__}); use Flower's DP mods (--flower_dp.mode)")
        local = FedAvgClient(client.local.mode, batch_size, local_epochs, minibatch, lr,
                             implementation=client.local.implementation)
    lora = copy.copy(pipeline.client)
    lora.local = local
    pipeline.client = lora  # the deep copy's own: its model already carries the adapters
    params = dict(pipeline.target.named_parameters())
    pipeline.names = lora.adapter_names(pipeline.target)
    shapes = tuple((name, tuple(params[name].shape)) for name in pipeline.names)
    # The clients hash nothing the server reads: one bin keeps the pipeline's hashing step off their path.
    pipeline.spec = Hashing(bins=1).spec(shapes, pipeline.spec.target_fingerprint)
    pipeline.hasher = FeatureHasher(pipeline.spec)
    return pipeline


def adapter_state(pipeline: UpdatePipeline) -> dict[str, torch.Tensor]:
    """The observed (adapter) weights of the pipeline's model, as float32 copies."""
    params = dict(pipeline.target.named_parameters())
    return {name: params[name].detach().to(torch.float32).clone() for name in pipeline.names}


def load_adapter_state(pipeline: UpdatePipeline, state: dict[str, torch.Tensor]) -> None:
    """Set the pipeline model's adapter weights (a round's global model) in place: every adapter in
    `state`, which must hold at least the ones the pipeline observes."""
    load_parameters(pipeline.target, list(pipeline.names), state)


#: (client index, absolute round) -> that client's batch of B sequences: {"input_ids": (1, B, L), ...}
ClientData = Callable[[int, int], dict[str, torch.Tensor]]


def weight_change(pipeline: UpdatePipeline, lr: float) -> float:
    """What a client's update is multiplied by to give w - new w: lr for a FedSGD gradient, 1 for
    FedAvg's delta (its local steps already took lr)."""
    return lr if isinstance(pipeline.client.local, FedSGDClient) else 1.0


def make_client_app(pipeline: UpdatePipeline, data: ClientData, lr: float, mods: list | None = None,
                    sent: Callable[[int, int, ArrayRecord], None] | None = None) -> ClientApp:
    """A Flower `ClientApp`: on a train message, load the global adapters, compute the update of this
    client's batch for the round with the workbench's pipeline, return w - lr * update (FedSGD) or
    w - delta (FedAvg: the pipeline's update is the delta of its local steps).

    `sent(client, round, arrays)`, when given, records what the client's own code returned (before Flower's
    mods), for tests of what reaches the server.
    """
    app = ClientApp(mods=list(mods or []))
    step = weight_change(pipeline, lr)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        client = int(context.node_config["partition-id"])
        config = msg.content[CONFIG]
        absolute_round = int(config["server-round"]) + int(config.get(ROUND_OFFSET, 0))
        global_state = msg.content[ARRAYS].to_torch_state_dict()
        load_adapter_state(pipeline, global_state)
        batch = data(client, absolute_round)
        # The generator fixes the defense's random draws (noise) per client and round: reruns repeat them.
        generator = torch.Generator().manual_seed(1_000_003 * absolute_round + client)
        update = pipeline(batch, keep_update=True, generator=generator).update[0]
        new_state = {}
        for name, delta in pipeline.split(update[None]).items():
            new_state[name] = (global_state[name].to(torch.float32) - step * delta[0].to(torch.float32)).contiguous()
        arrays = ArrayRecord(torch_state_dict=new_state)
        if sent is not None:
            sent(client, absolute_round, arrays)
        # Only the example count (FedAvg's weights): a metric of the update itself would pass Flower's DP mods,
        # which act on the arrays alone.
        metrics = MetricRecord({"num-examples": int(batch["input_ids"].shape[1])})
        return Message(RecordDict({ARRAYS: arrays, METRICS: metrics}), reply_to=msg)

    return app


#: observer(round, client, global arrays sent, reply arrays as received)
Observer = Callable[[int, int, ArrayRecord, ArrayRecord], None]


def observed_fedavg(observer: Observer, node_to_client: dict[int, int], round_offset: int = 0,
                    **fedavg: object) -> ObservedStrategy:
    """Flower's FedAvg (`fedavg`: its arguments), with every client reply shown to `observer` before it is
    aggregated (`lti.audit.observed.ObservedStrategy`).

    The observer receives (absolute round, client index, the arrays sent to the client, the `ArrayRecord` of its
    reply exactly as the grid delivered it: no copy, no conversion); `node_to_client` maps Flower node ids to the
    audit's client indices; `round_offset` makes Flower's round numbers absolute in a resumed audit (the clients
    are told it too). A client's failure stops the round with one line naming it.
    """
    fedavg.setdefault("fraction_evaluate", 0.0)  # utility is measured on the server (evaluate_fn)

    def observe_round(server_round: int, sent: dict[int, ArrayRecord], replies: list[Message]) -> None:
        for reply in sorted(replies, key=lambda m: node_to_client[m.metadata.src_node_id]):
            node = reply.metadata.src_node_id
            if reply.has_error():
                raise RuntimeError(f"client {node_to_client[node]} failed in round {server_round + round_offset}: "
                                   f"{reply.error.reason}")
            observer(server_round + round_offset, node_to_client[node], sent[node], reply.content[ARRAYS])

    return ObservedStrategy(FedAvg(**fedavg), observe_round, config={ROUND_OFFSET: int(round_offset)})


#: The three parts of Flower's task identity, in the order `task_identity` takes them.
IDENTITY = ("run_id", "node_id", "task_id")


def current_task_identity() -> tuple[int | None, int | None, int | None]:
    """Flower's process-wide task identity (run, node, task), None for a part not set: read through
    `TaskIdentity`'s public properties, which raise where a part is not set."""
    identity = []
    for part in IDENTITY:
        try:
            identity.append(getattr(TaskIdentity, part))
        except RuntimeError:  # "TaskIdentity.<part> is not set."
            identity.append(None)
    return identity[0], identity[1], identity[2]


def set_task_identity(run_id: int | None, node_id: int | None, task_id: int | None) -> None:
    """Set Flower's task identity through `TaskIdentity`'s public setters, as Flower's runtimes do when they
    start a ServerApp or ClientApp process. None restores "not set": the setter stores what it is given and
    the getter raises on None (Flower 1.42; tests/lti/test_audit_grid.py fails, naming the Flower version,
    where a release stops accepting it)."""
    for part, value in zip(IDENTITY, (run_id, node_id, task_id)):
        setattr(TaskIdentity, part, value)


@contextmanager
def task_identity(run_id: int, node_id: int, task_id: int = 0) -> Iterator[None]:
    """Flower's process-wide task identity (run, node, task), which stamps every message created inside;
    Flower's runtimes set it per process, the serial grid per call. The previous identity is restored."""
    previous = current_task_identity()
    set_task_identity(run_id, node_id, task_id)
    try:
        yield
    finally:
        set_task_identity(*previous)


def over_the_wire(message: Message, *, message_id: str | None = None, run_id: int | None = None,
                  created_at: float | None = None) -> Message:
    """The message as its receiver gets it: serialised to Flower's protobuf `Message` and back. The given
    `message_id`, `run_id` and `created_at` are what a SuperLink stamps on a message it accepts; they are
    written into the protobuf's metadata (public fields of the wire format), so `message` itself is left as
    it was and no Flower object's private field is written."""
    proto = message_to_proto(message)
    if message_id is not None:
        proto.metadata.message_id = message_id
    if run_id is not None:
        proto.metadata.run_id = run_id
    if created_at is not None:
        proto.metadata.created_at = created_at
    return message_from_proto(proto)


@dataclass
class _Node:
    node_id: int
    context: Context


class SerialGrid(Grid):
    """A Flower `Grid` that delivers each message to its node's `ClientApp` in this process, in order.

    Messages and replies are serialised to Flower's protobuf messages and back, as the SuperLink
    transports them, so the server reads what a networked client would have sent. Run the strategy
    inside `with grid.serving():` (the server's task identity, which stamps the messages it creates).
    A pushed message is left as the strategy built it: the copy its node receives carries the id, run
    and acceptance time this grid stamps (as a SuperLink does), and `push_messages` returns those ids.
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, run_id: int = 1) -> None:
        self.client_app = client_app
        self._run = Run.create_empty(run_id)
        self._nodes = {}
        for index in range(num_nodes):
            node_id = 1_000 + index
            context = Context(run_id=run_id, node_id=node_id, node_config={"partition-id": index, "num-partitions": num_nodes},
                              state=RecordDict(), run_config={})
            self._nodes[node_id] = _Node(node_id, context)
        self._replies: dict[str, Message] = {}

    def serving(self):
        return task_identity(self._run.run_id, SUPERLINK_NODE_ID)

    @property
    def node_to_client(self) -> dict[int, int]:
        return {node_id: int(node.context.node_config["partition-id"]) for node_id, node in self._nodes.items()}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            if message.metadata.dst_node_id not in self._nodes:
                raise ValueError(f"no node {message.metadata.dst_node_id} in this grid")
            # As a SuperLink accepting it: a fresh id, this grid's run, the time it was accepted.
            delivered = over_the_wire(message, message_id=str(uuid4()), run_id=self._run.run_id, created_at=time.time())
            node = self._nodes[delivered.metadata.dst_node_id]
            with task_identity(self._run.run_id, node.node_id):
                reply = self.client_app(delivered, node.context)
            self._replies[delivered.metadata.message_id] = over_the_wire(reply)
            ids.append(delivered.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))
