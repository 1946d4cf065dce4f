"""What an honest-but-curious server knows of a text deployment, as one plain object: the global model,
the clients' protocol, their defense, which parameters the server observes, how updates are hashed, the
tokenizer and the sequence length. No Lightning.

Build it from Python objects, or from a config: a file or dict holding these keys, or an `lti fit` config
(its `data:` section is read and its other keys ignored, so the threat model of an inverter's config is the
same object). `to_dict()` is the content it was built from with every default filled in; stored beside
results, `ThreatModel.from_dict` rebuilds the same threat model without the file it came from.

    threat = ThreatModel.from_config("configs/audit/tiny_llama_lora.yaml")
    per_sequence = threat.simulate([[464, 3290, 318, 257], [632, 373, 257, 1110]])   # (2, D) updates
    grads = threat.split(per_sequence.mean(0))                                   # {name: gradient}
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import ArgumentParser, lazy_instance
from torch import Tensor

from datamodules.federated import FedSGDClient, NoDefense, UpdatePipeline
from datamodules.federated.defenses import Defense
from datamodules.federated.hashing import Hashing
from datamodules.federated.observed import ParameterSelection
from datamodules.federated.protocols import ClientProtocol
from datamodules.registry import materialize
from datamodules.targets import TargetLM, Transformer3

#: The keys of a threat model's config (the `data:` keys of an `lti fit` config that define it).
KEYS = ("target", "client", "defense", "observed", "hashing", "tokenizer", "seq_len")


def _build(target: TargetLM = lazy_instance(Transformer3), client: ClientProtocol = lazy_instance(FedSGDClient),
           defense: Defense = lazy_instance(NoDefense), observed: ParameterSelection = lazy_instance(ParameterSelection),
           hashing: Hashing = Hashing(), tokenizer: str = "embedded-gpt2", seq_len: int = 16) -> dict[str, Any]:
    """The threat model's parts (the signature the config is parsed against).

    Args:
        target: The global model.
        client: The client protocol (FedSGD, FedAvg, LoRA) and its samples per update.
        defense: The clients' defense.
        observed: Which parameters the server observes.
        hashing: How the observed update is hashed for the learned inverter.
        tokenizer: `embedded-gpt2` or a name/folder for `AutoTokenizer`.
        seq_len: Tokens per sequence L.
    """
    return dict(target=materialize(target), client=materialize(client), defense=materialize(defense),
                observed=materialize(observed), hashing=hashing, tokenizer=tokenizer, seq_len=seq_len)


def _parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False, default_env=False)
    parser.add_function_arguments(_build)
    return parser


def _override(content: dict, dotted: str, value: Any) -> None:
    """Set `content[a][b]...` for the key `a.b...` (the intermediate mappings made where the config has none)."""
    keys = dotted.split(".")
    if keys[0] not in KEYS:
        raise ValueError(f"override {dotted!r}: the threat model's keys are {', '.join(KEYS)}")
    node = content
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif isinstance(child, str):  # a class given by name alone: its arguments go beside it
            child = node[key] = {"class_path": child}
        elif not isinstance(child, dict):
            raise ValueError(f"override {dotted!r}: {key!r} holds {child!r}, not a mapping")
        node = child
    node[keys[-1]] = value


def _parse(parser: ArgumentParser, content: dict):
    try:
        return parser.parse_object(content)
    except Exception as error:  # jsonargparse's message names the key and what it expected
        raise ValueError(f"threat model config: {str(error).splitlines()[0]}") from None


class ThreatModel:
    """The server's knowledge of a deployment; `pipeline` turns client batches into what it observes.

    `ThreatModel(target, client, defense, observed, hashing, tokenizer, seq_len)` from Python objects, or
    `from_config` / `from_dict`. The target is prepared by the client protocol (LoRA injects its adapters);
    `names` are the observed parameters, in the order of a flat update.
    """

    def __init__(self, target: torch.nn.Module, client: ClientProtocol | None = None, defense: Defense | None = None,
                 observed: ParameterSelection | None = None, hashing: Hashing | None = None,
                 tokenizer: str = "embedded-gpt2", seq_len: int = 16, content: dict | None = None,
                 loaded_tokenizer=None) -> None:
        """`loaded_tokenizer`: the tokenizer `tokenizer` names, when the caller has loaded it already."""
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len} must be >= 2 (a sequence's last token is a label only)")
        self.pipeline = UpdatePipeline(target, client, defense, observed, hashing)
        self.hashing = hashing or Hashing()
        self.tokenizer_name, self.seq_len = tokenizer, int(seq_len)
        self._content = content
        self._tokenizer, self._single = loaded_tokenizer, None

    @classmethod
    def from_config(cls, source: str | os.PathLike | dict, overrides: dict[str, Any] | None = None) -> ThreatModel:
        """From a YAML file or dict of the threat model's keys, or of an `lti fit` config (its `data:` section).

        `overrides`: dotted keys over the config, as `lti fit` takes them without `--data.`, e.g.
        `{"client.init_args.rank": 16, "seq_len": 32}` (a leading `data.` is allowed)."""
        if isinstance(source, dict):
            raw = source
        else:
            path = Path(source)
            if not path.is_file():
                raise FileNotFoundError(f"threat model config {path} does not exist")
            raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"a threat model config is a mapping of {', '.join(KEYS)}; got {type(raw).__name__}")
        section = raw.get("data", raw) if isinstance(raw.get("data"), dict) else raw
        content = copy.deepcopy({key: section[key] for key in KEYS if key in section})  # overrides leave `source` as it was
        unknown = [key for key in section if key not in KEYS] if section is raw else []
        if unknown:
            raise ValueError(f"threat model config has unknown key {unknown[0]!r}; its keys are {', '.join(KEYS)}")
        for dotted, value in (overrides or {}).items():
            _override(content, dotted.removeprefix("data."), value)
        parser = _parser()
        parsed = _parse(parser, content)
        normalised = yaml.safe_load(parser.dump(parsed, skip_none=False))
        parts = _build(**vars(parser.instantiate_classes(parsed)))
        return cls(**parts, content=normalised)

    @classmethod
    def from_pipeline(cls, pipeline: UpdatePipeline, seq_len: int, tokenizer: str = "embedded-gpt2",
                      loaded_tokenizer=None) -> ThreatModel:
        """Around a pipeline already built (its target, client, defense and observed parameters, shared)."""
        threat = cls.__new__(cls)
        threat.pipeline, threat.tokenizer_name, threat.seq_len = pipeline, tokenizer, int(seq_len)
        threat.hashing = None  # the pipeline's spec holds what it hashes with; not stored by content
        threat._content, threat._tokenizer, threat._single = None, loaded_tokenizer, None
        return threat

    def record_content(self, section: dict) -> None:
        """Remember the config this threat model was built from (a DataModule's `data:` section: its
        threat-model keys are kept, normalised with every default filled in), so that `to_dict` can store
        it by content. The config is parsed again, not instantiated."""
        if self.hashing is None:
            raise ValueError("a threat model built around a pipeline has no content to record")
        parser = _parser()
        content = {key: section[key] for key in KEYS if key in section}
        # The hashing built, not the section's: a DataModule folds its deprecated hash_* options into it.
        content["hashing"] = dataclasses.asdict(self.hashing)
        self._content = yaml.safe_load(parser.dump(_parse(parser, content), skip_none=False))

    @classmethod
    def from_dict(cls, content: dict) -> ThreatModel:
        """The inverse of `to_dict`."""
        return cls.from_config(dict(content))

    @property
    def has_content(self) -> bool:
        """Whether it was built from a config (and `to_dict` can store it by content)."""
        return self._content is not None

    def to_dict(self) -> dict:
        """The content this threat model was built from, every default filled in (a config `from_dict` reads)."""
        if self._content is None:
            raise ValueError("this threat model was built from Python objects; build it with ThreatModel.from_config "
                             "to store it by content")
        return yaml.safe_load(yaml.safe_dump(self._content))

    # What the attacks read.
    @property
    def target(self) -> torch.nn.Module:
        """The global model as the clients train it (LoRA: with its adapters)."""
        return self.pipeline.target

    @property
    def names(self) -> list[str]:
        return list(self.pipeline.names)

    @property
    def fingerprint(self) -> str:
        """A digest of the global model's weights when the threat model was built."""
        return self.pipeline.spec.target_fingerprint

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from datamodules.text import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_name)
        return self._tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def split(self, update: Tensor) -> dict[str, Tensor]:
        """(D,) flat observed update -> {name: gradient} in float64."""
        return {name: grads[0].double() for name, grads in self.pipeline.split(update.reshape(1, -1)).items()}

    def load_weights(self, state: dict[str, Tensor]) -> None:
        """Set the global model to a round's weights: every parameter in `state` (which holds at least the
        observed ones), in place."""
        load_parameters(self.target, self.names, state)

    def weights(self) -> dict[str, Tensor]:
        """The observed parameters' current values (float32 copies), as a server sends them."""
        params = dict(self.target.named_parameters())
        return {name: params[name].detach().to(torch.float32).clone() for name in self.names}

    def simulate(self, sequences: list[list[int]] | Tensor) -> Tensor:
        """(N, D): the update each sequence alone gives at the current weights (the server's own simulation: the
        threat model's client, defense included, sending one sequence per update)."""
        ids = torch.as_tensor(sequences, dtype=torch.long)
        return self._one_sequence_pipeline()({"input_ids": ids[:, None]}, keep_update=True).update

    def _one_sequence_pipeline(self) -> UpdatePipeline:
        """The pipeline with a client of one sample per update, sharing the model (made once)."""
        if self.pipeline.client.samples_per_update == 1:
            return self.pipeline
        if self._single is None:
            self._single = self.pipeline.with_client(self.pipeline.client.single_sample())
        return self._single

    def update_from_weights(self, sent: dict[str, Tensor], returned: dict[str, Tensor], lr: float,
                            steps: int = 1) -> Tensor:
        """(D,) the update a client's returned weights imply (`weight_update`)."""
        return weight_update(sent, returned, lr, self.names, steps)


def weight_update(sent: dict[str, Tensor], returned: dict[str, Tensor], lr: float, names: list[str],
                  steps: int = 1) -> Tensor:
    """(D,) float32: a client's update u in `names`' order from the weights sent and returned, (sent - returned) /
    (lr * steps), computed in float64 (a client of `steps` local SGD steps: their mean gradient). The rounding of
    the returned float32 weights stays in it, as it does for a real server."""
    missing = [name for name in names if name not in returned]
    if missing:
        raise ValueError(f"the returned weights lack observed parameter {missing[0]!r}")
    parts = [((torch.as_tensor(sent[n]).double() - torch.as_tensor(returned[n]).double()) / (lr * steps)).flatten()
             for n in names]
    return torch.cat(parts).to(torch.float32)


def load_parameters(target: torch.nn.Module, names: list[str], state: dict[str, Tensor]) -> None:
    """Set `target`'s parameters to `state` in place: every one in `state`, which must hold every name in `names`
    (the observed ones) and nothing the model lacks, each of the model's shape."""
    params = dict(target.named_parameters())
    missing = [name for name in names if name not in state]
    if missing:
        raise ValueError(f"the arrays lack observed parameter {missing[0]!r} of the threat model")
    unknown = [name for name in state if name not in params]
    if unknown:
        raise ValueError(f"the arrays hold {unknown[0]!r}, which the threat model's model does not have")
    with torch.no_grad():
        for name in state:
            value = torch.as_tensor(state[name])
            if tuple(value.shape) != tuple(params[name].shape):
                raise ValueError(f"parameter {name!r} has shape {tuple(value.shape)}, the model's is {tuple(params[name].shape)}")
            params[name].copy_(value.to(params[name].dtype))
