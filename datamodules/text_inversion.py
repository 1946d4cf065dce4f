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
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from datamodules.client_updates import ClientUpdates
from datamodules.federated import ClientProtocol, Defense, FedSGDClient, NoDefense, ParameterSelection, UpdatePipeline
from datamodules.text import EmbeddedCorpus, MarginalSampler, TextCorpus, load_tokenizer, pack_blocks, pack_lines, tokenize_splits
from datamodules.text.pseudo import load_counts, token_counts
from datamodules.inversion_spec import InversionSpec
from datamodules.registry import materialize
from datamodules.targets import TargetLM, Transformer3


class PseudoUpdates(IterableDataset):
    """LTI-P: every batch is a fresh i.i.d. draw from the marginal token distribution.

    Each DDP rank (and loader worker) gets its own generator, so ranks never draw the same samples.
    """

    def __init__(self, sampler: MarginalSampler, batches: int, updates: int, per_update: int, length: int, seed: int, rank: int) -> None:
        self.sampler, self.batches = sampler, batches
        self.updates, self.per_update, self.length = updates, per_update, length
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        if worker is not None and worker.id > 0:
            self.generator.manual_seed(self.generator.initial_seed() + 7919 * worker.id)
        per_worker = self.batches if worker is None else -(-self.batches // worker.num_workers)
        for _ in range(per_worker):
            ids = self.sampler.sample(self.updates * self.per_update, self.length, self.generator)
            ids = ids.view(self.updates, self.per_update, self.length)
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "index": torch.full((self.updates,), -1)}


class TextInversionDataModule(LightningDataModule):
    def __init__(
        self,
        target: TargetLM = lazy_instance(Transformer3),
        corpus: TextCorpus = lazy_instance(EmbeddedCorpus),
        tokenizer: str = "embedded-gpt2",
        training_data: Literal["auxiliary", "pseudo"] = "auxiliary",
        marginal_file: str | None = None,
        seq_len: int = 16,
        packing: Literal["blocks", "lines"] = "blocks",
        client: ClientProtocol = lazy_instance(FedSGDClient),
        defense: Defense = lazy_instance(NoDefense),
        observed: ParameterSelection = lazy_instance(ParameterSelection),
        hash_fraction: float = 0.1,
        hash_bins: int | None = None,
        hash_seed: int = 0,
        hash_signed: bool = False,
        batch_size: int = 64,
        train_samples: int | None = None,
        eval_samples: int | None = 1000,
        pseudo_batches_per_epoch: int | None = None,
        keep_eval_updates: bool = True,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        """
        Args:
            target: The global model (default: the LTI paper's `transformer3`, random init).
            corpus: Text source with disjoint auxiliary/evaluation splits (default: embedded offline corpus).
            tokenizer: `embedded-gpt2` (offline GPT-2 BPE) or a name/folder for `AutoTokenizer`.
            training_data: `auxiliary` (LTI: real auxiliary text) or `pseudo` (LTI-P: i.i.d. tokens
                from the auxiliary corpus' unigram distribution, freshly drawn for every batch).
            marginal_file: Token counts (.npy/.pt/.json) to use instead of counting the auxiliary corpus.
            seq_len: Tokens per sequence L.
            packing: `blocks` (running text cut into L-token blocks) or `lines` (one sample per row, padded).
            client: The client protocol, how a client computes its update: `FedSGDClient` (default:
                train mode, one sequence per update), `FedAvgClient` (local epochs of SGD, sends the
                weight delta) or `LoRAClient` (peft adapters only). Training and evaluation updates
                both come from it, so LTI and LTI-P train against the protocol they attack.
            defense: Client-side defense (default: none); under FedAvg DP-SGD acts on every local
                step and the other defenses on the delta sent.
            observed: Which parameters the server observes (default: all but embedding/decoder;
                `preset: layer0_ffn_in` etc. for partial observation; LoRA keeps only adapters).
            hash_fraction: Hashed features k as a fraction of the observed dimension (paper: 0.1).
            hash_bins: Exact k; overrides `hash_fraction`.
            hash_seed: Seed of the mmh3 feature hash.
            hash_signed: Multiply every coordinate by a hashed +-1 sign before summing (paper: unsigned).
            batch_size: Client updates per batch.
            train_samples: Use at most this many auxiliary samples (None: all).
            eval_samples: Evaluate on the first this many held-out samples (sequences; grouped into
                updates of `client.sequences_per_update`) (None: all; paper: 1000).
            pseudo_batches_per_epoch: LTI-P batches per epoch (default: as many as auxiliary batches).
            keep_eval_updates: Put the defended update into evaluation batches (needed by exact attacks).
            num_workers: DataLoader workers (the update computation itself runs in the main process).
            seed: Seed of the sample grouping and of the pseudo-data draws.
        """
        super().__init__()
        if training_data not in ("auxiliary", "pseudo"):
            raise ValueError(f"training_data {training_data!r} is not allowed; use 'auxiliary' (LTI) or 'pseudo' (LTI-P)")
        if packing not in ("blocks", "lines"):
            raise ValueError(f"packing {packing!r} is not allowed; use 'blocks' or 'lines'")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        for name, value in (("eval_samples", eval_samples), ("train_samples", train_samples)):
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1 or null")
        target, corpus, client, defense, observed = map(materialize, (target, corpus, client, defense, observed))
        self.target = target
        self.target.check_sequence_length(seq_len)
        self.tokenizer = load_tokenizer(tokenizer)
        if len(self.tokenizer) > self.target.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer!r} has {len(self.tokenizer)} tokens but the target model's vocabulary has "
                f"{self.target.vocab_size}; use a matching tokenizer or target vocab_size"
            )
        self.corpus = corpus
        self.training_data, self.marginal_file = training_data, marginal_file
        self.seq_len, self.packing = seq_len, packing
        self.client = client
        self.pipeline = UpdatePipeline(
            self.target, self.client, defense, observed,
            hash_fraction=hash_fraction, hash_bins=hash_bins, hash_seed=hash_seed, hash_signed=hash_signed,
        )
        self.target = self.pipeline.target  # the protocol's view of the global model (LoRA: with adapters)
        self.batch_size, self.train_samples, self.eval_samples = batch_size, train_samples, eval_samples
        self.pseudo_batches_per_epoch, self.keep_eval_updates = pseudo_batches_per_epoch, keep_eval_updates
        self.num_workers, self.seed = num_workers, seed
        self._splits: dict[str, ClientUpdates] | None = None
        self._counts: Tensor | None = None

    # ---------------------------------------------------------------- data preparation
    @property
    def sequences_per_update(self) -> int:
        return self.client.sequences_per_update

    def _samples(self, tokenized) -> tuple[Tensor, Tensor]:
        if self.packing == "blocks":
            ids = pack_blocks(tokenized, self.seq_len)
            return ids, torch.ones_like(ids)
        return pack_lines(tokenized, self.seq_len, self.tokenizer.pad_token_id)

    def _as_updates(self, ids: Tensor, mask: Tensor, limit: int | None, shuffle: bool) -> ClientUpdates:
        if shuffle:  # group random sequences into updates, fixed once by the seed
            order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(self.seed))
            ids, mask = ids[order], mask[order]
        if limit is not None:
            ids, mask = ids[:limit], mask[:limit]
        m = self.sequences_per_update
        usable = ids.shape[0] // m * m
        if usable == 0:
            raise ValueError(f"only {ids.shape[0]} samples of {self.seq_len} tokens: too few for one update of {m}")
        return ClientUpdates(input_ids=ids[:usable].view(-1, m, self.seq_len), attention_mask=mask[:usable].view(-1, m, self.seq_len))

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
        self._splits = {
            "auxiliary": self._as_updates(aux_ids, aux_mask, self.train_samples, shuffle=True),
            "evaluation": self._as_updates(eval_ids, eval_mask, self.eval_samples, shuffle=False),
        }
        vocab = self.target.vocab_size
        self._counts = (
            load_counts(self.marginal_file, vocab) if self.marginal_file else token_counts(aux_ids, vocab, aux_mask)
        )
        aux = self._splits["auxiliary"]
        flat = aux.fields["input_ids"].view(len(aux), -1)
        # Per-position majority token of the server's data: the attack-free baseline.
        self.majority_tokens = torch.stack(
            [torch.bincount(flat[:, p], minlength=vocab).argmax() for p in range(flat.shape[1])]
        )

    @property
    def inversion_spec(self) -> InversionSpec:
        if self._counts is None:
            raise RuntimeError("call setup() before asking for the inversion spec")
        return InversionSpec(
            num_features=self.pipeline.spec.num_bins,
            num_positions=self.sequences_per_update * self.seq_len,
            vocab_size=self.target.vocab_size,
            embedding=self.target.embedding_matrix.detach().cpu(),
            token_counts=self._counts,
        )

    def auxiliary_inputs(self, limit: int) -> Tensor:
        """Up to `limit` of the server's auxiliary sequences (N, seq_len): model inputs an exact attack may
        use as a prior (never evaluation data)."""
        if self._splits is None:
            raise RuntimeError("call setup() before asking for auxiliary inputs")
        return self._splits["auxiliary"].fields["input_ids"].reshape(-1, self.seq_len)[:limit]

    # ---------------------------------------------------------------- loaders
    def _rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    def train_dataloader(self) -> DataLoader:
        aux = self._splits["auxiliary"]
        if self.training_data == "pseudo":
            batches = self.pseudo_batches_per_epoch or max(1, len(aux) // self.batch_size)
            world = self.trainer.world_size if self.trainer is not None else 1
            pseudo = PseudoUpdates(
                MarginalSampler(self._counts), max(1, batches // world), self.batch_size,
                self.sequences_per_update, self.seq_len, self.seed, self._rank(),
            )
            return DataLoader(pseudo, batch_size=None, num_workers=self.num_workers)
        return DataLoader(aux, batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=self.num_workers)

    def _eval_loader(self) -> DataLoader:
        return DataLoader(self._splits["evaluation"], batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    val_dataloader = test_dataloader = predict_dataloader = _eval_loader

    # ---------------------------------------------------------------- the server's observation
    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        ids = batch["input_ids"]
        self.pipeline.to(ids.device)
        training = self.trainer is not None and self.trainer.training
        mask = None if self.packing == "blocks" else batch["attention_mask"]
        observed = self.pipeline(ids, mask, keep_update=self.keep_eval_updates and not training)
        batch["features"] = observed.features
        if observed.update is not None:
            batch["update"] = observed.update
        return batch

    def decode(self, ids: Tensor, mask: Tensor | None = None) -> list[str]:
        """(U, m*L) token ids -> U texts (the m sequences of an update joined by newlines)."""
        texts = []
        for u in range(ids.shape[0]):
            rows = ids[u].view(self.sequences_per_update, self.seq_len)
            keep = None if mask is None else mask[u].view(self.sequences_per_update, self.seq_len).bool()
            parts = []
            for i in range(self.sequences_per_update):
                row = rows[i] if keep is None else rows[i][keep[i]]
                parts.append(self.tokenizer.decode(row.tolist()))
            texts.append("\n".join(parts))
        return texts

    def describe(self) -> dict:
        """JSON-safe summary of the threat model, saved with checkpoints and results."""
        setting = {
            "target": type(self.target).__name__,
            "client": self.client.describe(),
            "defense": self.pipeline.defense.describe(),
            "observed_parameters": len(self.pipeline.names),
            "observed_dim": self.pipeline.observed_dim,
            "hash_bins": self.pipeline.spec.num_bins,
            "training_data": self.training_data,
            "seq_len": self.seq_len,
            "sequences_per_update": self.sequences_per_update,
        }
        # DP-SGD reports its (epsilon, delta) for one client's local steps under this protocol.
        privacy = self.pipeline.defense.privacy(*self.client.privacy_steps())
        if privacy is not None:
            setting["privacy"] = privacy
        return setting
