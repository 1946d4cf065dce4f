"""The workbench's client-side defenses as Flower client mods, beside Flower's own `LocalDpMod` and
`fixedclipping_mod`: `defense_mod(Sign())`, `defense_mod(TopKPruning(0.99))`, `defense_mod(GaussianNoise(0.01))`.

A mod wraps the ClientApp: after the client has trained, it reads what the client would send as the change of
its weights, delta = sent - returned (for FedSGD lr times the gradient, for FedAvg the weight delta), defends
it as a workbench client defends what it sends (`Defense.on_delta`, over all the arrays as one update) and
returns sent - defended delta: the defense acts in weight units, as on a workbench FedAvg client's delta (a
FedSGD client's sign is then a step of 1, and noise's sigma is in weight units, not gradient units). DP-SGD acts at every local step, inside the client's training: no mod can apply
it afterwards (use Flower's `LocalDpMod`, or the workbench's own client).

    app = ClientApp(mods=[defense_mod(Sign())])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, Context, Message, MessageType

from datamodules.federated.defenses import Defense


def defense_mod(defense: Defense, seed: int = 0) -> Callable[[Message, Context, Callable], Message]:
    """A Flower client mod applying `defense` to each train reply's weight change. Random draws (noise) come from
    a generator seeded by (`seed`, node, round): reruns repeat them, clients and rounds differ."""
    if defense.acts_per_step:
        raise ValueError(f"{type(defense).__name__} acts at every local step, inside the client's training: no mod can "
                         "apply it to the weights afterwards (use Flower's LocalDpMod)")

    def mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        if len(msg.content.array_records) != 1 or len(reply.content.array_records) != 1:
            raise ValueError("defense_mod reads one ArrayRecord in the train message and one in its reply")
        sent = next(iter(msg.content.array_records.values())).to_torch_state_dict()
        key, returned_record = next(iter(reply.content.array_records.items()))
        returned = returned_record.to_torch_state_dict()
        if list(sent) != list(returned):
            raise ValueError("defense_mod: the reply's arrays are not the ones the server sent (names differ)")
        delta = torch.cat([(sent[n].double() - returned[n].double()).flatten() for n in returned])
        config = next(iter(msg.content.config_records.values()), {})
        generator = torch.Generator().manual_seed(
            hash((seed, int(context.node_id), int(config.get("server-round", 0)))) % 2**63)
        defended = defense.on_delta(delta[None].float(), generator)[0].double()
        new, start = {}, 0
        for name, value in returned.items():
            size = value.numel()
            new[name] = (sent[name].double() - defended[start : start + size].view_as(value)).to(value.dtype).contiguous()
            start += size
        reply.content.array_records[key] = ArrayRecord(torch_state_dict=new)
        return reply

    mod.__name__ = f"defense_mod({type(defense).__name__})"
    return mod
