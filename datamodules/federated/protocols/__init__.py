"""Client protocols: how a client turns its samples into the update it sends (one code path for
every modality; the `ClientLoss` supplies the gradients). Registry `CLIENT_PROTOCOLS`: fedsgd,
fedavg, lora, chosen in YAML by `class_path`/`init_args` under `data.client`."""

from datamodules.federated.protocols.base import CLIENT_PROTOCOLS, ClientProtocol, FiniteCheck, Observation, model_mode
from datamodules.federated.protocols.fedavg import FedAvgClient
from datamodules.federated.protocols.fedsgd import FedSGDClient
from datamodules.federated.protocols.local_sgd import LocalSGD, SingleStep
from datamodules.federated.protocols.lora import LoRAClient

__all__ = [
    "CLIENT_PROTOCOLS", "ClientProtocol", "FedAvgClient", "FedSGDClient", "FiniteCheck", "LoRAClient", "LocalSGD",
    "Observation", "SingleStep", "model_mode",
]
