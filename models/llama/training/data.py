"""What a training step consumes: documents read and tokenized (UTF-8 bytes for a tiny model without a
tokenizer), packed whole into an endless reproducible stream of batches, and each data-parallel
rank's share of a batch."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import LlamaConfig
from ..losses import IGNORE_INDEX
from ..tokenizer import Tokenizer


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as token ids: the fallback for tiny models without a tokenizer."""

    def __init__(self):
        super().__init__(lambda text: list(text.encode("utf-8")), lambda ids: bytes(i % 256 for i in ids).decode(
            "utf-8", errors="replace"), None)


def make_tokenizer(config: LlamaConfig, checkpoint: str | None) -> Tokenizer:
    tokenizer = Tokenizer.from_directory(checkpoint, config.bos_token_id) if checkpoint else None
    if tokenizer is not None:
        return tokenizer
    if 256 <= config.vocab_size <= 512:
        return ByteTokenizer()
    where = f"{checkpoint} has no tokenizer.json or tokenizer.model" if checkpoint else "a preset has no tokenizer"
    raise ValueError(f"tokenizer: {where}, and the byte-level fallback needs a vocabulary of 256..512 "
                     f"(this model has {config.vocab_size})")


def read_documents(path: str | Path, tokenizer: Tokenizer, seq_len: int, eos_id: int | None,
                   vocab_size: int) -> list[list[int]]:
    """Token ids of every document; a clear error for an empty file, a bad jsonl line, a token id
    outside the model's vocabulary (a tokenizer that does not match the model), or a document
    longer than the context."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data: {path} is not a file")
    docs = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"data: {path}:{number}: expected a JSON object with a \"text\" field") from None
            else:
                text = line.rstrip("\n")
            ids = tokenizer.encode(text) + ([eos_id] if eos_id is not None else [])
            outside = [i for i in ids if not 0 <= i < vocab_size]
            if outside:
                raise ValueError(f"data: {path}:{number}: token id {outside[0]} is outside the model's vocabulary "
                                 f"0..{vocab_size - 1}: the tokenizer does not match the model")
            if len(ids) > seq_len:
                raise ValueError(f"data: {path}:{number}: {len(ids)} tokens, longer than the context --seq-len "
                                 f"{seq_len}; split the line or raise --seq-len")
            docs.append(ids)
    if not docs:
        raise ValueError(f"data: {path} has no documents (empty file)")
    return docs


def batches(docs: list[list[int]], packing: str, batch_size: int, seq_len: int, seed: int):
    """An endless, reproducible stream of (input_ids, labels, actual_seq_qlen or None) numpy batches:
    each epoch shuffles the documents with seed + epoch and packs them whole."""
    epoch = 0
    while True:
        order = np.random.default_rng(seed + epoch).permutation(len(docs))
        rows, row, used = [], [], 0
        for index in order:  # greedy packing of whole documents into rows of seq_len tokens
            if used + len(docs[index]) > seq_len:
                rows.append(row)
                row, used = [], 0
            row.append(docs[index])
            used += len(docs[index])
        rows.append(row)
        if len(rows) < batch_size:  # no batch in any epoch: the loop would never yield
            raise ValueError(f"data: the {len(docs)} documents pack into {len(rows)} rows of --seq-len {seq_len} "
                             f"tokens, fewer than --batch-size {batch_size}; lower --batch-size or add data")
        for start in range(0, len(rows) - batch_size + 1, batch_size):
            group = rows[start:start + batch_size]
            if packing == "fixed":
                ids = np.zeros((batch_size, seq_len), np.int32)
                labels = np.full((batch_size, seq_len), IGNORE_INDEX, np.int32)
                for b, r in enumerate(group):
                    flat = [t for doc in r for t in doc]
                    ids[b, :len(flat)] = flat
                    labels[b, :len(flat)] = flat
                yield ids, labels, None
            else:
                seqs = [doc for r in group for doc in r]
                flat = np.array([t for doc in seqs for t in doc], np.int32)
                labels = flat.copy()
                ends = np.cumsum([len(doc) for doc in seqs]).astype(np.int64)
                labels[np.concatenate([[0], ends[:-1]])] = IGNORE_INDEX  # no sequence predicts the next's start
                yield flat, labels, ends
        epoch += 1


def data_parallel_share(batch, rank: int, size: int):
    """This rank's part of a batch (rows ``rank::size``, or whole sequences of a packed batch) and
    its share of the batch's scored tokens: (ids, labels, ends, share)."""
    ids, labels, ends = batch
    if size == 1:
        return ids, labels, ends, 1.0
    if ends is None:
        if len(ids) % size:
            raise ValueError(f"--batch-size {len(ids)}: expected a multiple of the {size} data-parallel ranks")
        scored = int((labels[:, 1:] != IGNORE_INDEX).sum())
        ids, labels = ids[rank::size], labels[rank::size]
        return ids, labels, None, int((labels[:, 1:] != IGNORE_INDEX).sum()) / max(1, scored)
    starts = np.concatenate([[0], ends[:-1]])
    if len(ends) < size:
        raise ValueError(f"data: a packed batch of {len(ends)} documents cannot feed {size} data-parallel ranks; "
                         f"raise --batch-size or --seq-len")
    scored = int((labels[1:] != IGNORE_INDEX).sum())
    mine = range(rank, len(ends), size)
    ids = np.concatenate([ids[starts[i]:ends[i]] for i in mine])
    labels = np.concatenate([labels[starts[i]:ends[i]] for i in mine])
    ends = np.cumsum([ends[i] - starts[i] for i in mine]).astype(np.int64)
    return ids, labels, ends, int((labels[1:] != IGNORE_INDEX).sum()) / max(1, scored)
