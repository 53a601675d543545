"""The checkpoint's own tokenizer: ``tokenizer.json`` (Hugging Face ``tokenizers``) or
``tokenizer.model`` (``sentencepiece``, imported only when such a checkpoint is used)."""
from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """encode(text) -> ids (with BOS, as Llama was trained), decode(ids) -> text."""

    def __init__(self, encode, decode, bos_id: int | None):
        self._encode, self._decode, self.bos_id = encode, decode, bos_id

    def encode(self, text: str) -> list[int]:
        ids = list(self._encode(text))
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids) -> str:
        return self._decode([int(i) for i in ids])

    @classmethod
    def words(cls, vocab_size: int, bos_id: int | None = None) -> "Tokenizer":
        """A stand-in for a preset's random weights (``--model tiny``): id i is the word ``w<i>``
        (``tokenizers``' WordLevel, split on whitespace; an unknown word is ``w0``), so any text
        encodes and any ids decode, e.g. ``[5, 9]`` to ``"w5 w9"``."""
        from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

        tok = HFTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return cls(lambda text: tok.encode(text).ids, lambda ids: tok.decode(ids), bos_id)

    @classmethod
    def from_directory(cls, directory: str | Path, bos_id: int | None = None) -> "Tokenizer | None":
        """The directory's tokenizer, or None when it has none (then prompts are given as ids)."""
        directory = Path(directory)
        if (directory / "tokenizer.json").exists():
            from tokenizers import Tokenizer as HFTokenizer

            try:
                tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
            except Exception as exc:  # tokenizers raises a bare Exception naming no file
                raise ValueError(f"{directory / 'tokenizer.json'}: not a readable tokenizer ({exc})") from None
            return cls(lambda text: tok.encode(text).ids, lambda ids: tok.decode(ids, skip_special_tokens=True),
                       bos_id)
        if (directory / "tokenizer.model").exists():
            try:
                import sentencepiece
            except ImportError:
                raise ImportError(f"{directory / 'tokenizer.model'}: a sentencepiece tokenizer; "
                                  "pip install sentencepiece, or pass prompts as token ids") from None
            sp = sentencepiece.SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
            return cls(sp.encode, sp.decode, sp.bos_id() if bos_id is None else bos_id)
        return None
