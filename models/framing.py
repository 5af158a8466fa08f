"""The special tokens around every sequence a retriever reads, as its tokenizer puts them.

An encoder's tokenizer frames a text as ``[CLS] text [SEP]``; a decoder's as ``<s> text``
(Llama, Mistral) or as the bare text (Qwen2). A decoder retriever pools its last token,
which must be the end-of-sequence token (RepLLaMA, E5-Mistral and gte-Qwen2 all append
it), so last-token pooling appends the tokenizer's EOS where its template does not end
with it already. Corpora are stored without special tokens; the framing is added as rows
are batched, the same way in training, encoding, mining and evaluation, and the export's
tokenizer is saved with it as its own template, so that whoever loads the export (with
sentence-transformers or ``AutoTokenizer``) frames texts as training did.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A word every vocabulary splits into at least one token that is not special.
_PROBE = "retrieval"


@dataclass(frozen=True)
class Framing:
    head: tuple[int, ...]  # token ids before the text
    tail: tuple[int, ...]  # token ids after it
    pad_id: int

    @classmethod
    def bert(cls, cls_id: int, sep_id: int, pad_id: int) -> Framing:
        return cls((cls_id,), (sep_id,), pad_id)

    @classmethod
    def of(cls, tokenizer, last_token: bool = False) -> Framing:
        """The tokenizer's own template for one text, found by tokenizing a probe word with
        and without special tokens; with ``last_token``, its EOS appended unless the
        template ends with it already (never twice)."""
        plain = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
        full = list(tokenizer(_PROBE)["input_ids"])
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
        if not plain or start is None:
            raise ValueError(f"{type(tokenizer).__name__}: its special tokens do not frame the text they are added to")
        head, tail = tuple(full[:start]), tuple(full[start + len(plain) :])
        eos = tokenizer.eos_token_id
        if last_token:
            if eos is None and not tail:
                raise ValueError(
                    f"{type(tokenizer).__name__}: last-token pooling needs an end-of-sequence token, and this tokenizer "
                    "has no eos_token and ends texts with no special token"
                )
            if eos is not None and tail[-1:] != (eos,):
                tail += (eos,)
        pad = tokenizer.pad_token_id
        return cls(head, tail, int(pad if pad is not None else eos if eos is not None else 0))

    @property
    def extra(self) -> int:
        """Special tokens per sequence."""
        return len(self.head) + len(self.tail)

    def room(self, max_len: int) -> int:
        """Text tokens that fit in ``max_len`` beside the special tokens."""
        if max_len <= self.extra:
            raise ValueError(f"max_len {max_len} leaves no room for text beside {self.extra} special tokens")
        return max_len - self.extra

    def frame(self, chunks: list[np.ndarray], max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """``head chunk tail`` per chunk, right-padded, as an (N, max_len) int32 array, and
        the lengths. Each chunk must hold at most ``room(max_len)`` tokens."""
        out = np.full((len(chunks), max_len), self.pad_id, dtype=np.int32)
        lengths = np.zeros(len(chunks), dtype=np.int32)
        head, tail = np.asarray(self.head, dtype=np.int32), np.asarray(self.tail, dtype=np.int32)
        for i, chunk in enumerate(chunks):
            row = np.concatenate([head, np.asarray(chunk, dtype=np.int32), tail])
            out[i, : len(row)] = row
            lengths[i] = len(row)
        return out, lengths

    def save_as_template(self, tokenizer, out_dir: str) -> None:
        """Save ``tokenizer`` to ``out_dir`` with this framing as its template, and a pad
        token (its EOS) where it has none, as batching with it needs one."""
        from tokenizers import processors

        names = tokenizer.convert_ids_to_tokens([*self.head, *self.tail])
        head, tail = names[: len(self.head)], names[len(self.head) :]
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join([*head, "$A", *tail]),
            pair=" ".join([*head, "$A", *tail, "$B:1", *tail]),
            special_tokens=sorted({(name, i) for name, i in zip(names, [*self.head, *self.tail])}),
        )
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.save_pretrained(out_dir)

    def frame_truncated(self, token_lists: list, max_len: int, prefix=()) -> tuple[np.ndarray, np.ndarray]:
        """``head prefix ids tail`` per token list, the text cut to fit ``max_len``."""
        room, front = self.room(max_len), np.asarray(prefix, dtype=np.int32)
        return self.frame([np.concatenate([front, np.asarray(t, dtype=np.int32)])[:room] for t in token_lists], max_len)
