"""Data: `datasets` loading, tokenization, packing, and the sequence/data-parallel sampler.

Every rank of a sequence-parallel group must see the same full batch (the patch slices
it), data-parallel groups must see disjoint samples, and an epoch visits every sample
once: :class:`ParallelSampler` does this from ``(dp_rank, dp_size)`` alone, so the
sequence-parallel ranks of a group, which share ``dp_rank``, draw identical indices; its position in an
epoch counts the samples of all groups together, so a resume under another layout continues it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from .errors import ConfigError

__all__ = ["ByteTokenizer", "FILE_FORMATS", "ParallelSampler", "build_text_dataset", "build_train_dataset",
           "collate", "data_fingerprint", "detect_format", "document_labels", "load_raw_dataset",
           "load_tokenizer", "pack_documents", "pack_token_lists", "passkey_spec", "require_tokenizer",
           "tokenize_and_pack"]

FILE_FORMATS = {  # extension -> the `datasets` builder
    ".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text", ".md": "text",
    ".parquet": "parquet", ".csv": "csv"}


_BYTE_TOKENIZER_FILE = "lightseq_tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) and an end-of-text id 256: no files needed."""

    vocab_size = 257
    eos_token_id = 256

    def __call__(self, texts: str | list[str], **_: Any) -> dict[str, list]:
        if isinstance(texts, str):
            return {"input_ids": list(texts.encode("utf-8"))}
        return {"input_ids": [list(t.encode("utf-8")) for t in texts]}

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, directory: str | Path) -> None:
        """Mark ``directory`` (a checkpoint) as using this tokenizer (:func:`load_tokenizer` reads it)."""
        Path(directory, _BYTE_TOKENIZER_FILE).write_text('{"tokenizer": "bytes", "vocab_size": 257}\n')


def load_tokenizer(name: str | None, model_path: str | None = None) -> Any:
    """``bytes`` -> :class:`ByteTokenizer`; a path -> ``AutoTokenizer``; None -> model_path's or None."""
    if name == "bytes":
        return ByteTokenizer()
    path = name or model_path
    if path is None:
        return None
    if Path(path, _BYTE_TOKENIZER_FILE).is_file():  # a checkpoint of a run that used `bytes`
        return ByteTokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        if name is None:  # model directory without tokenizer files
            return None
        raise


def detect_format(paths: Sequence[str], fmt: str = "auto") -> str:
    """The `datasets` builder for local files: json (also jsonl), text, parquet or csv."""
    if fmt != "auto":
        return fmt
    found = set()
    for p in paths:
        suffixes = [s for s in Path(p).suffixes if s not in (".gz", ".bz2", ".xz", ".zst")]
        ext = suffixes[-1].lower() if suffixes else ""
        if ext not in FILE_FORMATS:
            raise ConfigError(f"data.paths: cannot tell the format of {p!r} from its extension; "
                             "set data.format")
        found.add(FILE_FORMATS[ext])
    if len(found) != 1:
        raise ConfigError(f"data.paths mix formats ({', '.join(sorted(found))}); use one format per run")
    return found.pop()


def load_raw_dataset(data_cfg: Any) -> Any:
    """Load documents with `datasets`: local files (data.type files) or a hub name (data.type hub)."""
    import datasets

    try:
        with _quiet_datasets():
            if data_cfg.type == "files":
                builder = detect_format(data_cfg.paths, data_cfg.format)
                ds = datasets.load_dataset(builder, data_files=list(data_cfg.paths), split="train")
            else:
                ds = datasets.load_dataset(data_cfg.name, data_cfg.subset, split=data_cfg.split)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - `datasets` wraps the reader's error (encoding, syntax, network)
        raise ConfigError(_unreadable_data(data_cfg, e)) from e
    if data_cfg.text_field not in ds.column_names:
        raise ConfigError(
            f"data.text_field: column {data_cfg.text_field!r} not in the data (columns: "
            f"{', '.join(ds.column_names)})"
        )
    if data_cfg.max_documents is not None:
        ds = ds.select(range(min(data_cfg.max_documents, len(ds))))
    return ds


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """`datasets` without its progress bars and its own log lines (a failure is reported in one line)."""
    import datasets

    bars = datasets.utils.are_progress_bars_disabled()
    level = datasets.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if not bars:
            datasets.utils.enable_progress_bars()


def _unreadable_data(data_cfg: Any, error: BaseException) -> str:
    """One line for data that `datasets` could not read: what, the reader's reason, and the fix."""
    cause = error
    while cause.__cause__ is not None and not isinstance(cause, UnicodeDecodeError):
        cause = cause.__cause__
    what = (f"data.paths {', '.join(map(str, data_cfg.paths[:3]))}" if data_cfg.type == "files"
            else f"data.name {data_cfg.name}")
    reason = " ".join(str(cause).split())[:300] or type(cause).__name__
    if isinstance(cause, UnicodeDecodeError):
        return (f"{what}: not UTF-8 text ({reason}); convert the file to UTF-8, e.g. "
                "iconv -f latin1 -t utf-8 FILE > FILE.utf8")
    return f"{what}: could not be read ({type(cause).__name__}: {reason}); fix or remove the malformed record"


def data_fingerprint(data_cfg: Any, context_length: int) -> str:
    """A digest of what the training samples are made of: the data settings (``data.*``) that shape them,
    the context length and, for local files, their bytes (not their paths: a moved copy is the same
    data)."""
    from .saving import file_sha256

    settings = data_cfg.model_dump(exclude={"paths", "num_proc", "synthetic"})
    if data_cfg.type == "synthetic":
        settings["synthetic"] = data_cfg.synthetic.model_dump(exclude={"eval_samples"})
    h = hashlib.sha256(json.dumps([settings, context_length], sort_keys=True, default=str).encode())
    if data_cfg.type == "files":
        for path in data_cfg.paths:
            h.update(file_sha256(Path(path)).encode())
    return h.hexdigest()[:16]


def pack_token_lists(docs: Iterable[Sequence[int]], context_length: int, eos_id: int | None = None,
                     carry: list[int] | None = None) -> tuple[list[list[int]], list[int]]:
    """Concatenate documents (each followed by ``eos_id`` when given) and cut ``context_length`` blocks.

    Returns the full blocks and the leftover tokens (pass them back as ``carry`` to continue).
    """
    blocks, _, tail, _ = pack_documents(docs, context_length, eos_id, carry)
    return blocks, tail


def pack_documents(docs: Iterable[Sequence[int]], context_length: int, eos_id: int | None = None,
                   carry: list[int] | None = None, carry_positions: list[int] | None = None
                   ) -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
    """:func:`pack_token_lists` that also returns each block's position ids, restarting at every document.

    A document cut by a block boundary continues in the next block as a new document (positions from
    0). Returns (blocks, their position ids, leftover tokens, leftover positions).
    """
    buf, pos = list(carry or []), list(carry_positions or range(len(carry or [])))
    blocks, positions = [], []
    for doc in docs:
        piece = list(doc) + ([eos_id] if eos_id is not None else [])
        buf.extend(piece)
        pos.extend(range(len(piece)))
        while len(buf) >= context_length:
            blocks.append(buf[:context_length])
            head = pos[:context_length]
            positions.append(head)
            buf, pos = buf[context_length:], pos[context_length:]
            if pos and pos[0] != 0:  # the rest of a cut document starts the next block as its own
                end, offset = _first_restart(pos), pos[0]
                pos[:end] = [i - offset for i in pos[:end]]
    return blocks, positions, buf, pos


def _first_restart(pos: list[int]) -> int:
    """Index of the first position 0 after the start (the next document), or len(pos)."""
    return next((i for i in range(1, len(pos)) if pos[i] == 0), len(pos))


def document_labels(block: Sequence[int], positions: Sequence[int]) -> list[int]:
    """Labels of a packed block: the tokens, with -100 at each document's first token.

    The model shifts labels (``label[t] = token[t + 1]``), so a document's last token then predicts
    nothing instead of the next document's first token: the loss stays inside documents.
    """
    return [-100 if p == 0 else t for t, p in zip(block, positions)]


def tokenize_and_pack(ds: Any, tokenizer: Any, context_length: int, text_field: str = "text",
                      add_eos: bool = True, num_proc: int | None = None,
                      batch_docs: int = 1000, packing: str = "documents") -> Any:
    """Tokenize a `datasets` column and pack it into ``context_length`` blocks with labels.

    Packing runs per map batch of ``batch_docs`` documents; each batch's tail shorter than a
    block is dropped (as in Transformers' run_clm). ``packing="documents"`` keeps the document
    boundaries: each block carries ``position_ids`` restarting at every document (the patch turns
    them into segments, so attention never crosses a document) and labels that never predict across
    one (:func:`document_labels`). ``packing="concat"``: one causal sequence per block, labels equal
    input_ids (HF's run_clm).
    """
    if packing not in ("documents", "concat"):
        raise ValueError(f"packing must be 'documents' or 'concat'; got {packing!r}")
    eos = getattr(tokenizer, "eos_token_id", None) if add_eos else None

    def tokenize(batch: dict) -> dict:
        bad = [t for t in batch[text_field] if not isinstance(t, str)]
        if bad:
            raise ConfigError(f"data.text_field: column {text_field!r} holds {type(bad[0]).__name__} values "
                              f"(such as {repr(bad[0])[:40]}), not text; fix or drop those records")
        enc = tokenizer(batch[text_field], add_special_tokens=False) if not isinstance(
            tokenizer, ByteTokenizer) else tokenizer(batch[text_field])
        return {"ids": enc["input_ids"]}

    def pack(batch: dict) -> dict:
        blocks, positions, _, _ = pack_documents(batch["ids"], context_length, eos)
        if packing == "concat":
            return {"input_ids": blocks, "labels": [list(b) for b in blocks]}
        return {"input_ids": blocks, "position_ids": positions,
                "labels": [document_labels(b, p) for b, p in zip(blocks, positions)]}

    tok = ds.map(tokenize, batched=True, remove_columns=ds.column_names, num_proc=num_proc,
                 desc="tokenizing")
    packed = tok.map(pack, batched=True, batch_size=batch_docs, remove_columns=["ids"],
                     num_proc=num_proc, desc=f"packing into {context_length}-token sequences")
    if len(packed) == 0:
        raise ConfigError(
            f"the data holds fewer than context_length={context_length} tokens per packing batch; "
            "add data or lower context_length"
        )
    packed.set_format("torch")
    return packed


def build_text_dataset(data_cfg: Any, context_length: int, tokenizer: Any,
                       main_process_first: Callable | None = None) -> Any:
    """Load, tokenize and pack the documents ``data.*`` names into ``context_length`` blocks (the main
    process builds the cache first)."""
    import contextlib

    ctx = main_process_first() if main_process_first is not None else contextlib.nullcontext()
    refused: ConfigError | None = None
    with ctx:  # a refusal leaves the block normally: the other ranks wait for the main one in it
        try:
            raw = load_raw_dataset(data_cfg)
            packed = tokenize_and_pack(raw, tokenizer, context_length, data_cfg.text_field,
                                       data_cfg.add_eos, data_cfg.num_proc, packing=data_cfg.packing)
        except ConfigError as e:
            refused = e
    if refused is not None:
        raise refused  # every rank reads the same data and refuses it the same way
    return packed


class ParallelSampler(Sampler[int]):
    """Indices for one data-parallel group: disjoint across groups, identical within one.

    Each epoch shuffles ``range(num_samples)`` with ``seed + epoch``; the groups take that order in turns,
    group ``dp_rank`` every ``dp_size``-th index, so after any number of steps all groups together have
    consumed a prefix of it. ``start`` (``set_epoch``) is the length of that prefix, all groups together:
    the epoch continues from there, under this sampler's ``dp_size`` whatever the ``dp_size`` that consumed
    the prefix (resuming mid-epoch under another layout). The rest is topped up to a multiple of ``dp_size``
    with the epoch's first entries (only when ``dp_size`` does not divide it, as DistributedSampler does),
    so every group takes the same number of samples.
    """

    def __init__(self, num_samples: int, dp_size: int = 1, dp_rank: int = 0, shuffle: bool = True,
                 seed: int = 0) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self.num_samples, self.dp_size, self.dp_rank = num_samples, dp_size, dp_rank
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Draw epoch ``epoch``'s order, from its sample ``start`` on (all groups together)."""
        self.epoch, self.start = epoch, start

    def order(self) -> list[int]:
        """The epoch's order of every sample, before it is dealt to the groups."""
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def indices(self) -> list[int]:
        order = self.order()
        rest = order[min(self.start, self.num_samples):]
        rest += [order[i % len(order)] for i in range(-len(rest) % self.dp_size)]
        return rest[self.dp_rank:: self.dp_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return math.ceil(max(self.num_samples - self.start, 0) / self.dp_size)


def _integers(samples: list[dict], key: str) -> torch.Tensor:
    """The samples' ``key`` stacked as int64; ValueError for values that are not whole numbers (a cast
    would truncate 3.5 to 3 and train on other boundaries or tokens than the data says)."""
    x = torch.stack([torch.as_tensor(s[key]) for s in samples])
    bad = x.flatten() if x.dtype == torch.bool or x.is_complex() else x[:0]
    if x.is_floating_point():
        bad = x[~torch.isfinite(x) | (x != torch.round(x))]
    if bad.numel():
        raise ValueError(f"data: {key} must hold whole numbers; found {bad[0].item()!r} ({x.dtype}). "
                         "Fix the dataset's column")
    return x.long()


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack equal-length samples into ``input_ids``, ``labels`` (and ``position_ids``): ``(B, N)`` int64
    each; values that are not whole numbers are refused."""
    ids = _integers(samples, "input_ids")
    labels = _integers(samples, "labels") if "labels" in samples[0] else ids.clone()
    out = {"input_ids": ids, "labels": labels}
    if "position_ids" in samples[0]:
        out["position_ids"] = _integers(samples, "position_ids")
    return out


def build_train_dataset(data_cfg: Any, context_length: int, vocab_size: int, tokenizer: Any = None,
                        main_process_first: Callable | None = None) -> Dataset:
    """The training dataset ``data.*`` names, in sequences of ``context_length`` tokens: the synthetic task
    (ids below the model's ``vocab_size``) or packed text."""
    if data_cfg.type == "synthetic":
        from .synthetic import PasskeyDataset

        spec = passkey_spec(data_cfg.synthetic, context_length, vocab_size)
        return PasskeyDataset(spec, data_cfg.synthetic.num_samples)
    require_tokenizer(tokenizer)
    return build_text_dataset(data_cfg, context_length, tokenizer, main_process_first)


def require_tokenizer(tokenizer: Any) -> None:
    """ConfigError for text data without a tokenizer (model.path holds none, and none is named)."""
    if tokenizer is None:
        raise ConfigError("tokenizer: text data needs a tokenizer, and model.path holds none: set tokenizer "
                          "to a tokenizer directory or name, or to 'bytes'")


def passkey_spec(synthetic: Any, context_length: int, vocab_size: int, seed: int | None = None) -> Any:
    """The PasskeySpec of ``data.synthetic`` at ``context_length`` for a model of ``vocab_size`` ids
    (``seed`` overrides, e.g. a held-out evaluation seed)."""
    from .synthetic import PasskeySpec

    s = synthetic
    return PasskeySpec(context_length, vocab_size, s.num_values, s.passkey_len, s.needle_max_frac,
                       s.seed if seed is None else seed, filler=s.filler, filler_period=s.filler_period,
                       needle_repeat=s.needle_repeat)
