"""Text corpora with two disjoint splits: `auxiliary` (the server's training data) and `evaluation`
(stand-in for the clients' private data). Every source yields `datasets.Dataset`s with a `text` column,
loaded through `datasets` so hub names and local files share its caching.

Where copies of the text go: the embedded corpus writes its splits as text files under
`$LTI_CACHE_DIR/corpora`, and `datasets` keeps an Arrow copy of every local or embedded file (and of its
tokenisation) in its cache (`~/.cache/huggingface/datasets`). With `$LTI_TEXT_CACHE_DIR` set, both go
there instead (`corpora/`, `datasets/`): `lti audit` points it into its `--out_dir`, and `lti fit`,
`validate`, `test` and `predict` to `<trainer.default_root_dir>/corpus_cache` (unless set), so the clients'
text stays in the run folder. Hub datasets (`HubCorpus`) stay in the `datasets` cache: public text,
downloaded once.
"""

from __future__ import annotations

import bz2
import importlib.util
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Literal

from datamodules.federated.hashing import cache_dir
from datamodules.registry import Registry

CORPORA: Registry["TextCorpus"] = Registry("corpus")
SPLITS = ("auxiliary", "evaluation")
#: The environment variable naming a folder for the copies of corpus text (see the module's docstring).
TEXT_CACHE_VARIABLE = "LTI_TEXT_CACHE_DIR"


def text_cache_dir() -> Path | None:
    """`$LTI_TEXT_CACHE_DIR`, where copies of local and embedded corpus text go; None: the usual caches."""
    folder = os.environ.get(TEXT_CACHE_VARIABLE)
    return Path(folder) if folder else None


def datasets_cache_dir() -> str | None:
    """The `cache_dir` for `datasets.load_dataset` of local and embedded text (None: its own default)."""
    folder = text_cache_dir()
    return str(folder / "datasets") if folder is not None else None


class TextCorpus(CORPORA.base(), ABC):
    name: ClassVar[str]

    @abstractmethod
    def load(self):
        """Return a `datasets.DatasetDict` with splits `auxiliary` and `evaluation`, column `text`."""

    @property
    def rows_are_documents(self) -> bool:
        """True if a row is a whole document/paragraph, False if rows are independent samples."""
        return True


def _split_by_fraction(dataset, eval_fraction: float, seed: int):
    """Row-level split (rows are paragraphs/lines, so packed blocks never straddle the two sides)."""
    from datasets import DatasetDict

    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} must be in (0, 1)")
    parts = dataset.train_test_split(test_size=eval_fraction, seed=seed, shuffle=True)
    return DatasetDict(auxiliary=parts["train"], evaluation=parts["test"])


def _drop_blank(dataset):
    return dataset.filter(lambda row: bool(row["text"] and row["text"].strip()), desc="dropping blank rows")


class HubCorpus(TextCorpus):
    """A Hugging Face dataset by name (needs network on first use), e.g. WikiText-103 as in LTI."""

    name = "hub"

    def __init__(
        self,
        path: str = "wikitext",
        config: str | None = "wikitext-103-v1",
        auxiliary_split: str = "train",
        evaluation_split: str = "validation",
        text_column: str = "text",
    ) -> None:
        """
        Args:
            path: Dataset name on the hub (or a local dataset script/folder).
            config: Dataset configuration name.
            auxiliary_split: Split the server trains on.
            evaluation_split: Split standing in for client data (never overlaps the auxiliary split).
            text_column: Column holding the text.
        """
        if auxiliary_split == evaluation_split:
            raise ValueError(f"auxiliary and evaluation split are both {auxiliary_split!r}; they must differ")
        self.path, self.config = path, config
        self.auxiliary_split, self.evaluation_split = auxiliary_split, evaluation_split
        self.text_column = text_column

    def load(self):
        from datasets import DatasetDict, load_dataset

        out = {}
        for split, source in zip(SPLITS, (self.auxiliary_split, self.evaluation_split)):
            ds = load_dataset(self.path, self.config, split=source)
            if self.text_column != "text":
                ds = ds.rename_column(self.text_column, "text")
            out[split] = _drop_blank(ds.select_columns(["text"]))
        return DatasetDict(out)


class LocalCorpus(TextCorpus):
    """Local files: plain text (`text`, one paragraph or sentence per line) or TSV with a text column."""

    name = "local"

    def __init__(
        self,
        auxiliary_files: Sequence[str] = (),
        evaluation_files: Sequence[str] = (),
        format: Literal["text", "tsv"] = "text",
        text_column: str = "text",
        eval_fraction: float = 0.1,
        seed: int = 0,
        one_sample_per_line: bool = False,
        auxiliary_corpora: Sequence[TextCorpus] = (),
    ) -> None:
        """
        Args:
            auxiliary_files: Files the server trains on.
            evaluation_files: Files standing in for client data. If empty, `eval_fraction` of the
                auxiliary rows (lines) is held out instead. Given without `auxiliary_files` but with
                `auxiliary_corpora`, they are all client data and the server's data is those corpora's.
            format: `text` (one row per line) or `tsv` (tab-separated with a header row).
            text_column: Column with the text for `tsv`.
            eval_fraction: Held-out fraction when no evaluation files are given.
            seed: Seed of that split.
            one_sample_per_line: Rows are independent samples (sentences), not running text.
            auxiliary_corpora: Further corpora whose auxiliary split is added to the server's data
                (e.g. the embedded Wikipedia sample next to a WikiText file); their evaluation
                splits are not used.
        """
        files = list(auxiliary_files) + list(evaluation_files)
        if not files:
            raise ValueError("LocalCorpus needs at least one file: pass --data.corpus.init_args.evaluation_files '[FILE]' "
                             "(and auxiliary_files, unless auxiliary_corpora supply the server's data)")
        for f in files:
            if not Path(f).is_file():
                raise FileNotFoundError(f"corpus file {f!r} does not exist")
            if Path(f).stat().st_size == 0:
                raise ValueError(f"corpus file {f!r} is empty")
        if format not in ("text", "tsv"):
            raise ValueError(f"corpus format {format!r} is not allowed; use 'text' or 'tsv'")
        self.auxiliary_files, self.evaluation_files = list(auxiliary_files), list(evaluation_files)
        self.format, self.text_column = format, text_column
        self.eval_fraction, self.seed = eval_fraction, seed
        self.one_sample_per_line = one_sample_per_line
        self.auxiliary_corpora = list(auxiliary_corpora)

    @property
    def rows_are_documents(self) -> bool:
        return not self.one_sample_per_line

    def _load_files(self, files: list[str]):
        from datasets import load_dataset

        try:
            if self.format == "text":
                ds = load_dataset("text", data_files=files, split="train", cache_dir=datasets_cache_dir())
            else:
                ds = load_dataset("csv", data_files=files, delimiter="\t", split="train", cache_dir=datasets_cache_dir())
        except Exception as error:  # datasets wraps a decoding error in its own, without the file's name
            if _caused_by(error, UnicodeDecodeError) and (problem := _first_undecodable(files)):
                raise problem from None
            raise
        if self.format != "text":
            if self.text_column not in ds.column_names:
                raise ValueError(f"TSV files have no column {self.text_column!r}; columns: {ds.column_names}")
            if self.text_column != "text":
                ds = ds.rename_column(self.text_column, "text")
        ds = _drop_blank(ds.select_columns(["text"]))
        if len(ds) == 0:
            raise ValueError(f"corpus files {files} contain no text")
        return ds

    def load(self):
        from datasets import DatasetDict, concatenate_datasets

        if self.evaluation_files and not self.auxiliary_files and self.auxiliary_corpora:
            # The server's data comes from the further corpora only; the files are all client data.
            extra = [corpus.load()["auxiliary"].select_columns(["text"]) for corpus in self.auxiliary_corpora]
            return DatasetDict(auxiliary=concatenate_datasets(extra), evaluation=self._load_files(self.evaluation_files))
        if self.auxiliary_files and self.evaluation_files:
            splits = DatasetDict(
                auxiliary=self._load_files(self.auxiliary_files), evaluation=self._load_files(self.evaluation_files)
            )
        else:
            splits = _split_by_fraction(self._load_files(self.auxiliary_files or self.evaluation_files), self.eval_fraction, self.seed)
        if self.auxiliary_corpora:
            extra = [corpus.load()["auxiliary"].select_columns(["text"]) for corpus in self.auxiliary_corpora]
            splits["auxiliary"] = concatenate_datasets([splits["auxiliary"], *extra])
        return splits


def _caused_by(error: BaseException | None, kind: type) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _likely_encoding(sample: bytes) -> str:
    """An encoding the bytes around a decoding error may be in (iconv's name), for the error's hint."""
    if sample.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "UTF-32"
    if sample.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16"
    try:
        sample.decode("cp1252")
        return "CP1252"  # Windows' Western European; ISO-8859-1 text decodes the same but for a few symbols
    except UnicodeDecodeError:
        return "LATIN1"


def _first_undecodable(files: list[str]) -> ValueError | None:
    """A one-line error naming the first file that is not UTF-8, the byte offset and line of its first
    undecodable byte, and a likely encoding with the command that converts it."""
    import codecs

    for name in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset, lines = 0, 0
        with open(name, "rb") as file:
            head = file.read(4)
            file.seek(0)
            while True:
                chunk = file.read(1 << 20)
                pending = decoder.getstate()[0]  # bytes of a character cut by the previous chunk
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as error:
                    data = pending + chunk
                    position = offset - len(pending) + error.start
                    line = lines + data[: error.start].count(b"\n") + 1
                    byte = data[error.start : error.start + 1].hex() or "end of file"
                    encoding = _likely_encoding(head if head.startswith((b"\xff", b"\xfe", b"\x00")) else data)
                    return ValueError(
                        f"corpus file {name!r} is not UTF-8: byte 0x{byte} at offset {position} (line {line}) cannot be "
                        f"decoded; it may be {encoding}: convert it with `iconv -f {encoding} -t UTF-8 {name} > {name}.utf8`")
                if not chunk:
                    break
                offset += len(chunk)
                lines += chunk.count(b"\n")
    return None


def _gensim_test_data() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the embedded corpus needs the package 'gensim' (pip install gensim)")
    return Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data"


def _wikipedia_articles() -> list[str]:
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    path = _gensim_test_data() / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    articles = []
    with bz2.open(path, "rb") as f:
        for title, text, _ in extract_pages(f):
            plain = re.sub(r"'{2,}", "", filter_wiki(text or ""))  # bold/italic quotes survive filter_wiki
            paragraphs = [" ".join(p.split()) for p in plain.split("\n\n")]
            paragraphs = [p for p in paragraphs if len(p.split()) >= 8]  # skip lists, headings, stubs
            if paragraphs:
                articles.append("\n".join(paragraphs))
    return articles


def _lee_documents() -> list[str]:
    path = _gensim_test_data() / "lee_background.cor"
    return [" ".join(line.split()) for line in path.read_text(encoding="latin-1").splitlines() if line.strip()]


class EmbeddedCorpus(TextCorpus):
    """Offline default: gensim's English Wikipedia sample (~100 articles) and Lee news corpus.

    Split by document (every article/news item goes wholly to one side), written once as plain text
    under the cache directory (`$LTI_TEXT_CACHE_DIR` when set) and then loaded with `datasets` like any local file.
    """

    name = "embedded"

    def __init__(self, sources: Sequence[Literal["wikipedia", "lee"]] = ("wikipedia", "lee"), eval_fraction: float = 0.1, seed: int = 0) -> None:
        """
        Args:
            sources: Which embedded texts to use.
            eval_fraction: Fraction of documents held out as evaluation data.
            seed: Seed of the document split.
        """
        allowed = {"wikipedia": _wikipedia_articles, "lee": _lee_documents}
        unknown = [s for s in sources if s not in allowed]
        if unknown or not sources:
            raise ValueError(f"unknown embedded source(s) {unknown or sources}; allowed: {sorted(allowed)}")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={eval_fraction} must be in (0, 1)")
        self.sources, self.eval_fraction, self.seed = tuple(sources), eval_fraction, seed
        self._readers = allowed

    def files(self) -> dict[str, Path]:
        import random

        folder = (text_cache_dir() or cache_dir()) / "corpora" / f"embedded-{'-'.join(self.sources)}-{self.eval_fraction}-{self.seed}"
        paths = {split: folder / f"{split}.txt" for split in SPLITS}
        if all(p.exists() for p in paths.values()):
            return paths
        # Deduplicated first: the Lee corpus repeats documents, which would leak across the split.
        documents = list(dict.fromkeys(doc for source in self.sources for doc in self._readers[source]()))
        order = list(range(len(documents)))
        random.Random(self.seed).shuffle(order)
        held_out = set(order[: max(1, round(self.eval_fraction * len(documents)))])
        folder.mkdir(parents=True, exist_ok=True)
        for split in SPLITS:
            keep = [documents[i] for i in range(len(documents)) if (i in held_out) == (split == "evaluation")]
            tmp = paths[split].with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text("\n".join(keep) + "\n", encoding="utf-8")
            os.replace(tmp, paths[split])
        return paths

    def load(self):
        from datasets import DatasetDict, load_dataset

        paths = self.files()
        return DatasetDict(
            {split: load_dataset("text", data_files=str(paths[split]), split="train", cache_dir=datasets_cache_dir())
             for split in SPLITS}
        )
