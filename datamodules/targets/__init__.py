"""Global models the clients train (the "target" of the attack). Plain PyTorch, no Lightning."""

from datamodules.targets.base import TargetLM
from datamodules.targets.hf import HFCausalLM
from datamodules.targets.hf_encoder import HFEncoderLM
from datamodules.targets.transformer3 import Transformer3

__all__ = ["TargetLM", "Transformer3", "HFCausalLM", "HFEncoderLM"]
