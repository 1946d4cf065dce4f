"""The LightningDataModule of text inversion: corpus -> samples -> client updates -> defense -> hashed features.

It owns everything the server knows (global model, client protocol, defense, hasher, tokenizer) and
computes the observed updates on the batch's device in `on_after_batch_transfer`. Training batches are
auxiliary samples (LTI) or fresh marginal pseudo-samples (LTI-P); evaluation batches are held-out
samples and additionally carry the defended update itself (`batch["update"]`) for exact attacks.
Targets (`input_ids`) travel in the batch only for the loss and the metrics.
"""

from __future__ import annotations

from typing import Literal

import torch
from jsonargparse import lazy_instance
from torch import Tensor
from torch.utils.data import DataLoader

from datamodules.inversion_data import InversionDataModule
from datamodules.inversion_spec import InversionSpec
from datamodules.registry import materialize
from datamodules.targets import TargetLM, Transformer3
from datamodules.text import (
    EmbeddedCorpus,
    MarginalSampler,
    TextCorpus,
    load_tokenizer,
    pack_blocks,
    pack_lines,
    tokenize_splits,
)
from datamodules.text.pseudo import load_counts, token_counts
from datamodules.threat_model import ThreatModel
from datamodules.training_stream import SampledStream


class TextInversionDataModule(InversionDataModule):
    def __init__(
        self,
        target: TargetLM = lazy_instance(Transformer3),
        corpus: TextCorpus = lazy_instance(EmbeddedCorpus),
        tokenizer: str = "embedded-gpt2",
        training_data: Literal["auxiliary", "pseudo", "pseudo_pool"] = "auxiliary",
        marginal_file: str | None = None,
        seq_len: int = 16,
        packing: Literal["blocks", "lines"] = "blocks",
        pseudo_batches_per_epoch: int | None = None,
        pseudo_pool_size: int | None = None,
        **kwargs,
    ) -> None:
        """
        Args:
            target: The global model (default: the LTI paper's `transformer3`, random init).
            corpus: Text source with disjoint auxiliary/evaluation splits (default: embedded offline corpus).
            tokenizer: `embedded-gpt2` (offline GPT-2 BPE) or a name/folder for `AutoTokenizer`.
            training_data: `auxiliary` (LTI: real auxiliary text), `pseudo` (LTI-P: i.i.d. tokens
                from the auxiliary corpus' unigram distribution, freshly drawn for every batch) or
                `pseudo_pool` (LTI-P from a fixed pool of such blocks drawn once with `seed`, reused
                every epoch like auxiliary data, so its updates can be cached with `cache.path`).
            marginal_file: Token counts (.npy/.pt/.json) to use instead of counting the auxiliary corpus.
            seq_len: Tokens per sequence L.
            packing: `blocks` (running text cut into L-token blocks) or `lines` (one sample per row, padded).
            pseudo_batches_per_epoch: LTI-P batches per epoch (default: as many as auxiliary batches).
            pseudo_pool_size: Samples in the `pseudo_pool` (default: as many as auxiliary samples).
            **kwargs: What the server observes and the sizes, shared with every modality
                (`InversionDataModule`: client, defense, observed, hashing, cache, batch_size, ...).
        """
        super().__init__(**kwargs)
        if training_data not in ("auxiliary", "pseudo", "pseudo_pool"):
            raise ValueError(
                f"training_data {training_data!r} is not allowed; use 'auxiliary' (LTI), 'pseudo' (LTI-P) or 'pseudo_pool'"
            )
        if pseudo_pool_size is not None and (training_data != "pseudo_pool" or pseudo_pool_size < 1):
            raise ValueError("pseudo_pool_size needs training_data 'pseudo_pool' and a positive size")
        if packing not in ("blocks", "lines"):
            raise ValueError(f"packing {packing!r} is not allowed; use 'blocks' or 'lines'")
        if training_data == "pseudo" and self.observation.cache.path:
            raise ValueError(
                "LTI-P draws fresh pseudo-data every batch, so there is nothing to cache; drop data.cache.path "
                "or train on a fixed pool (training_data: pseudo_pool)"
            )
        target, corpus = materialize(target), materialize(corpus)
        target.check_sequence_length(seq_len)
        self.tokenizer = load_tokenizer(tokenizer)
        if len(self.tokenizer) > target.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer!r} has {len(self.tokenizer)} tokens but the target model's vocabulary has "
                f"{target.vocab_size}; use a matching tokenizer or target vocab_size"
            )
        self.corpus = corpus
        self.training_data, self.marginal_file = training_data, marginal_file
        self.seq_len, self.packing = seq_len, packing
        # The server's knowledge of the deployment, the same object `lti audit` and the Python API build
        # (its content is recorded by the CLI that parsed this DataModule's config: `lti.trainer_cli`).
        settings = self.observation
        self.threat_model = ThreatModel(target, settings.client, settings.defense, settings.observed,
                                        settings.hashing, tokenizer, seq_len, loaded_tokenizer=self.tokenizer)
        self.pipeline = self.threat_model.pipeline
        self.target = self.pipeline.target
        self.pseudo_batches_per_epoch, self.pseudo_pool_size = pseudo_batches_per_epoch, pseudo_pool_size
        # The pool is a split of its own, so exact attacks' priors (prior_split) and the majority
        # baseline stay on the real auxiliary text.
        self.train_split = "pseudo_pool" if training_data == "pseudo_pool" else "auxiliary"
        self._counts: Tensor | None = None
        self._blocks: dict[str, tuple[Tensor, Tensor]] = {}
        self.majority_tokens: Tensor | None = None  # per-position majority token of the auxiliary data (setup)

    # ---------------------------------------------------------------- data preparation
    def _samples(self, tokenized) -> tuple[Tensor, Tensor]:
        if self.packing == "blocks":
            ids = pack_blocks(tokenized, self.seq_len)
            return ids, torch.ones_like(ids)
        return pack_lines(tokenized, self.seq_len, self.tokenizer.pad_token_id)

    def _sample_unit(self) -> str:
        return f" of {self.seq_len} tokens"

    def prepare_data(self) -> None:
        self.corpus.load()  # downloads (hub) or extracts (embedded) once, on one process

    def setup(self, stage: str | None = None) -> None:
        if self._splits is not None:
            return
        tokenized = tokenize_splits(self.corpus.load(), self.tokenizer)
        aux_ids, aux_mask = self._samples(tokenized["auxiliary"])
        eval_ids, eval_mask = self._samples(tokenized["evaluation"])
        if aux_ids.shape[0] == 0 or eval_ids.shape[0] == 0:
            raise ValueError(f"the corpus yields no sample of {self.seq_len} tokens in one of its splits")
        self._blocks = {"auxiliary": (aux_ids, aux_mask), "evaluation": (eval_ids, eval_mask)}
        self._splits = {
            "auxiliary": self._as_updates(self.train_samples, True, "auxiliary", input_ids=aux_ids, attention_mask=aux_mask),
            "evaluation": self._as_updates(self.eval_samples, False, input_ids=eval_ids, attention_mask=eval_mask),
        }
        vocab = self.target.vocab_size
        self._counts = (
            load_counts(self.marginal_file, vocab) if self.marginal_file else token_counts(aux_ids, vocab, aux_mask)
        )
        if self.training_data == "pseudo_pool":
            # Drawn once from its own seeded generator: the same pool (and cache key) in every run and rank.
            size = self.pseudo_pool_size or aux_ids.shape[0]
            pool = MarginalSampler(self._counts).sample(size, self.seq_len, torch.Generator().manual_seed(self.seed))
            self._splits["pseudo_pool"] = self._as_updates(None, True, "pseudo_pool", input_ids=pool, attention_mask=torch.ones_like(pool))
        aux = self._splits["auxiliary"]
        flat = aux.fields["input_ids"].view(len(aux), -1)
        # Per-position majority token of the server's data: the attack-free baseline.
        self.majority_tokens = torch.stack(
            [torch.bincount(flat[:, p], minlength=vocab).argmax() for p in range(flat.shape[1])]
        )

    def blocks(self, split: str) -> tuple[Tensor, Tensor]:
        """Every sample of a split in corpus order, before any subsampling: (N, L) token ids and mask.
        The split's documents lie in consecutive samples (packing keeps the corpus order)."""
        if not self._blocks:
            raise RuntimeError("call setup() before asking for a split's samples")
        if split not in self._blocks:
            raise ValueError(f"no split {split!r}; the splits are {', '.join(self._blocks)}")
        return self._blocks[split]

    @property
    def inversion_spec(self) -> InversionSpec:
        if self._counts is None:
            raise RuntimeError("call setup() before asking for the inversion spec")
        return InversionSpec(
            num_features=self.pipeline.spec.num_bins,
            num_positions=self.samples_per_update * self.seq_len,
            vocab_size=self.target.vocab_size,
            embedding=self.target.embedding_matrix.detach().cpu(),
            token_counts=self._counts,
        )

    # ---------------------------------------------------------------- loaders
    def train_dataloader(self) -> DataLoader:
        if self.training_data != "pseudo":
            return super().train_dataloader()

        aux = self._splits["auxiliary"]
        batches = self.pseudo_batches_per_epoch or max(1, len(aux) // self.batch_size)
        sampler = MarginalSampler(self._counts)
        updates, per_update, length = self.batch_size, self.samples_per_update, self.seq_len

        def draw(generator: torch.Generator) -> dict[str, Tensor]:
            # LTI-P: a fresh i.i.d. draw from the marginal token distribution for every batch.
            ids = sampler.sample(updates * per_update, length, generator).view(updates, per_update, length)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "index": torch.full((updates,), -1)}

        return self._stream_loader(SampledStream(
            draw, max(1, batches // self._world_size()), self.seed, self._rank(), self._world_size(), self.training_position,
        ))

    # ---------------------------------------------------------------- the server's observation
    def client_batch(self, batch: dict) -> dict[str, Tensor]:
        fields = super().client_batch(batch)
        if self.packing == "blocks":  # every token is real: no mask (the engines' faster path)
            fields.pop("attention_mask", None)
        return fields

    def decode(self, ids: Tensor, mask: Tensor | None = None) -> list[str]:
        """(U, m*L) token ids -> U texts (the m sequences of an update joined by newlines)."""
        texts = []
        for u in range(ids.shape[0]):
            rows = ids[u].view(self.samples_per_update, self.seq_len)
            keep = None if mask is None else mask[u].view(self.samples_per_update, self.seq_len).bool()
            parts = []
            for i in range(self.samples_per_update):
                row = rows[i] if keep is None else rows[i][keep[i]]
                parts.append(self.tokenizer.decode(row.tolist()))
            texts.append("\n".join(parts))
        return texts

    def _describe_data(self) -> dict:
        return {"training_data": self.training_data, "seq_len": self.seq_len}
