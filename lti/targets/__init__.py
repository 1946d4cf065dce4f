"""Global models the clients train (the "target" of the attack). Plain PyTorch, no Lightning."""

from lti.targets.base import TargetLM
from lti.targets.hf import HFCausalLM
from lti.targets.transformer3 import Transformer3

__all__ = ["TargetLM", "Transformer3", "HFCausalLM"]
from lti.targets.hf_encoder import HFEncoderLM  # noqa: E402
__all__.append("HFEncoderLM")
