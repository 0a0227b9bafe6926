"""The built-in example job: a small character-level language model.

Its text needs no download: the Python standard library's own ``.py`` files,
read as raw bytes (vocabulary 256, no tokenizer). The runtime trains it
data-parallel; this module only supplies the model, the optimizer, the data and
a loss that sums, so that the caller can divide the all-reduced gradient by the
global token count of the step and stay exact when ranks get uneven shares.

Dropout draws from the global torch RNG (no private generators), so the
runtime makes it reproducible by calling ``torch.manual_seed`` before each
microbatch.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

#: Every byte value is a token.
VOCAB_SIZE = 256

#: Directories under the stdlib path whose contents are not the standard
#: library: third-party installs differ between machines and would break the
#: "every worker reads the same text" guarantee.
_NOT_STDLIB = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class LMConfig:
    """Model, data and optimizer settings of the example job.

    The defaults are sized for CPU: four workers sharing two cores commit
    several steps per second with a global batch of 32 and micro-batches of 8.
    """

    #: Characters per sample; the target at each position is the next byte.
    context: int = 64
    #: Width of the residual stream.
    d_model: int = 64
    #: Attention heads per layer; must divide ``d_model``.
    heads: int = 4
    #: Transformer encoder layers.
    layers: int = 2
    #: Dropout probability in the attention and feed-forward blocks.
    dropout: float = 0.1
    #: Cap on the bytes of text read from the standard library.
    corpus_bytes: int = 2_000_000
    #: AdamW learning rate. High for a transformer, but this model is tiny and
    #: the example should show the loss falling within a short run.
    lr: float = 3e-3

    def __post_init__(self) -> None:
        for name in ("context", "d_model", "heads", "layers", "corpus_bytes"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"LMConfig {name} must be positive, got {value!r}")
        if self.d_model % self.heads != 0:
            raise ValueError(
                f"LMConfig d_model ({self.d_model}) must be a multiple of heads ({self.heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LMConfig dropout must be in [0, 1), got {self.dropout!r}")
        if not self.lr > 0.0:
            raise ValueError(f"LMConfig lr must be positive, got {self.lr!r}")


def _python_sources(directory: Path) -> Iterator[Path]:
    """The ``.py`` files under ``directory`` in sorted path order.

    Entries are sorted by name at each level and directories are entered at
    their sorted position, which is the order of ``sorted()`` over the full
    paths (paths compare component by component). Being lazy, the walk stops
    as soon as the caller has read enough.
    """
    for entry in sorted(directory.iterdir(), key=lambda path: path.name):
        if entry.is_dir():
            if entry.name not in _NOT_STDLIB and not entry.is_symlink():
                yield from _python_sources(entry)
        elif entry.suffix == ".py":
            yield entry


def _read_stdlib_text(limit: int) -> bytes:
    """The standard library's source files concatenated, cut at ``limit`` bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in _python_sources(stdlib):
        chunk = path.read_bytes()[: limit - total]
        chunks.append(chunk)
        total += len(chunk)
        if total >= limit:
            break
    return b"".join(chunks)


class CharCorpus(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The standard library's source text as next-byte prediction samples.

    The stdlib's ``.py`` files (found via ``sysconfig.get_paths()["stdlib"]``,
    third-party ``site-packages`` excluded) are read in sorted path order and
    concatenated up to ``config.corpus_bytes``. The text is cut into
    non-overlapping chunks of ``context + 1`` bytes; sample ``i`` is
    ``(chunk[:-1], chunk[1:])`` as ``LongTensor[context]`` each. A trailing
    partial chunk is dropped.
    """

    def __init__(self, config: LMConfig) -> None:
        text = _read_stdlib_text(config.corpus_bytes)
        #: SHA-256 (hex) of the corpus bytes, which depend on the Python
        #: version's stdlib. Workers do not compare it: the job's fingerprint
        #: compares what they read (its ``data`` field, docs/worker.md).
        self.fingerprint: str = hashlib.sha256(text).hexdigest()
        #: Length of the corpus text in bytes.
        self.num_bytes: int = len(text)
        self._chunk = config.context + 1
        self._samples = len(text) // self._chunk
        if self._samples == 0:
            raise ValueError(
                f"corpus has {len(text)} bytes, fewer than one sample of {self._chunk}"
            )
        self._text = torch.frombuffer(bytearray(text), dtype=torch.uint8)

    def __len__(self) -> int:
        return self._samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self._samples:
            raise IndexError(f"sample {index} out of range 0..{self._samples - 1}")
        start = index * self._chunk
        chunk = self._text[start : start + self._chunk].long()
        return chunk[:-1], chunk[1:]


class CharTransformer(nn.Module):
    """A small causal transformer over bytes.

    Token embedding plus learned position embedding, ``config.layers``
    pre-norm ``nn.TransformerEncoderLayer`` blocks under a causal mask, a final
    LayerNorm and a linear head to the 256 byte values.
    """

    causal_mask: torch.Tensor

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.context = config.context
        self.token_embedding = nn.Embedding(VOCAB_SIZE, config.d_model)
        self.position_embedding = nn.Embedding(config.context, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        block = nn.TransformerEncoderLayer(
            d_model=config.d_model,
            nhead=config.heads,
            dim_feedforward=4 * config.d_model,
            dropout=config.dropout,
            activation="gelu",
            batch_first=True,
            # Pre-norm trains stably at the high learning rate without warm-up.
            norm_first=True,
        )
        # Nested tensors only help with padding masks, which this model never
        # uses; turning them off also silences the warning about norm_first.
        self.blocks = nn.TransformerEncoder(
            block, num_layers=config.layers, enable_nested_tensor=False
        )
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, VOCAB_SIZE)
        # A buffer, so it follows the model's device; not persistent, so it is
        # neither in the state dict nor among the tensors the runtime syncs.
        self.register_buffer(
            "causal_mask",
            nn.Transformer.generate_square_subsequent_mask(config.context),
            persistent=False,
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, length, 256]`` for byte ids ``inputs[batch, length]``,
        ``length <= context``; position ``t`` sees only ``inputs[:, : t + 1]``."""
        length = inputs.shape[1]
        if length > self.context:
            raise ValueError(f"input length {length} exceeds the context of {self.context}")
        positions = torch.arange(length, device=inputs.device)
        hidden = self.dropout(self.token_embedding(inputs) + self.position_embedding(positions))
        hidden = self.blocks(hidden, mask=self.causal_mask[:length, :length], is_causal=True)
        logits: torch.Tensor = self.head(self.norm(hidden))
        return logits


def loss_sum(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Cross-entropy summed over every predicted token, and the token count.

    Summing (not averaging) lets the caller all-reduce gradients and divide by
    the step's global token count, which is exact however the step's samples
    were split across ranks and microbatches.
    """
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1), reduction="sum")
    return loss, targets.numel()


def build(config: LMConfig, seed: int) -> tuple[CharTransformer, torch.optim.Optimizer, CharCorpus]:
    """The example job: model, optimizer and corpus.

    The model's weights come from ``torch.manual_seed(seed)``, so workers that
    build with the same seed start identical. This reseeds the global torch
    RNG. The optimizer is AdamW with ``config.lr`` (3e-3 by default) and
    PyTorch's default betas and weight decay (0.01).
    """
    torch.manual_seed(seed)
    model = CharTransformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    return model, optimizer, CharCorpus(config)
