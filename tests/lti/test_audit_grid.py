"""`SerialGrid` stamps messages as a SuperLink does (a unique id, its run, the time it accepted them) on Flower's
public API only: no private field of a Flower object is written, the node reads what the server sent and the
server what the node replied, and the task identity each side runs under is restored after it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

flwr = pytest.importorskip("flwr")

import numpy as np  # noqa: E402
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.constant import SUPERLINK_NODE_ID  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from lti.audit import federation  # noqa: E402
from lti.audit.federation import SerialGrid, current_task_identity, set_task_identity, task_identity  # noqa: E402

FLOWER = f"Flower {flwr.__version__}"


def test_the_grid_writes_no_private_flower_field():
    source = Path(federation.__file__).read_text()
    for pattern in (r"__dict__", r"TaskIdentity\._", r"metadata\._", r"\._(message|run|created|node|task)_?(id|at)\b",
                    r"setattr\(\s*\w*metadata"):
        assert not re.search(pattern, source), f"lti/audit/federation.py matches {pattern!r}"


def echo_app(seen: list) -> ClientApp:
    """A ClientApp that records what it received (with its context and task identity) and returns the arrays it got."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen.append((msg, context, current_task_identity()))
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 1})}),
                       reply_to=msg)

    return app


def test_message_ids_are_unique_run_ids_match_and_each_node_gets_its_own_messages():
    seen: list = []
    grid = SerialGrid(echo_app(seen), num_nodes=3, run_id=7)
    before = current_task_identity()
    pushed, ids, replies = [], [], []
    with grid.serving():
        assert current_task_identity() == (7, SUPERLINK_NODE_ID, 0)
        for round_ in (1, 2):
            messages = []
            for node_id in grid.get_node_ids():
                arrays = ArrayRecord([np.full((2, 3), round_ * 10 + node_id % 10, dtype=np.float32)])
                messages.append(Message(RecordDict({"arrays": arrays}), node_id, "train", group_id=str(round_)))
            pushed += messages
            round_ids = list(grid.push_messages(messages))
            ids += round_ids
            replies += list(grid.pull_messages(round_ids))
        assert current_task_identity() == (7, SUPERLINK_NODE_ID, 0)  # restored after every node's call
    assert current_task_identity() == before

    assert len(ids) == len(set(ids)) == 6 and all(ids)
    assert [m.metadata.message_id for m in pushed] == [""] * 6  # the strategy's own messages are left as built
    assert len(seen) == len(replies) == 6
    for message, (delivered, context, identity), reply, message_id in zip(pushed, seen, replies, ids):
        node_id = message.metadata.dst_node_id
        assert delivered.metadata.message_id == message_id == reply.metadata.reply_to_message_id
        assert delivered.metadata.run_id == reply.metadata.run_id == grid.run.run_id == 7
        assert delivered.metadata.src_node_id == SUPERLINK_NODE_ID == reply.metadata.dst_node_id
        assert delivered.metadata.dst_node_id == node_id == reply.metadata.src_node_id == context.node_id
        assert context.node_config["partition-id"] == grid.node_to_client[node_id]
        assert identity == (7, node_id, 0)
        assert delivered.metadata.created_at >= message.metadata.created_at
        assert delivered.metadata.group_id == message.metadata.group_id
        assert delivered is not message and reply.content["arrays"] is not delivered.content["arrays"]
        assert reply.content["arrays"]["0"].data == message.content["arrays"]["0"].data  # the bytes themselves
    assert sorted(grid.node_to_client.values()) == [0, 1, 2]
    assert list(grid.pull_messages(ids)) == []  # each reply is handed over once


def test_flower_still_takes_a_messages_sender_from_the_task_identity():
    with task_identity(11, 22, 3):
        message = Message(RecordDict(), 5, "train")
    assert (message.metadata.run_id, message.metadata.src_node_id, message.metadata.src_task_id) == (11, 22, 3), (
        f"{FLOWER}: Message(...) no longer stamps run/node/task from TaskIdentity; SerialGrid.serving must change")


def test_flower_still_accepts_none_as_an_unset_task_identity():
    """`set_task_identity(None, ...)` restores "not set" through TaskIdentity's public setters (no private field):
    this relies on the setter storing None and the getter raising on it."""
    previous = current_task_identity()
    try:
        set_task_identity(None, None, None)
        unset = current_task_identity()
        raised = []
        for part in ("run_id", "node_id", "task_id"):
            try:
                getattr(TaskIdentity, part)
            except RuntimeError:
                raised.append(part)
    except Exception as error:  # noqa: BLE001 - one line naming the Flower version, whatever broke
        pytest.fail(f"{FLOWER}: TaskIdentity no longer accepts None as 'not set' ({error!r}); "
                    "lti/audit/federation.set_task_identity must change", pytrace=False)
    finally:
        set_task_identity(*previous)
    if unset != (None, None, None) or len(raised) != 3:
        pytest.fail(f"{FLOWER}: TaskIdentity no longer reads None as 'not set' (read {unset}); "
                    "lti/audit/federation.set_task_identity must change", pytrace=False)
