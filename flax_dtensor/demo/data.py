"""The demo corpus, byte-level tokens, and batches.

The corpus is Lewis Carroll's *Alice's Adventures in Wonderland* (1865, in
the public domain), the Millennium Fulcrum Edition 2.9 text as distributed by
Project Gutenberg (without its header and licence), shipped in
``flax_dtensor/demo/data/alice.txt`` (about 145 KiB). Tokens are bytes:
``vocab_size`` is 256 and no tokenizer is needed.
"""

from __future__ import annotations

import functools
import importlib.resources

import numpy as np

CORPUS_FILE = 'alice.txt'
HELD_OUT_FRACTION = 0.1


@functools.cache
def corpus_text() -> str:
  """Returns the shipped corpus as text."""
  files = importlib.resources.files('flax_dtensor.demo') / 'data'
  return (files / CORPUS_FILE).read_text(encoding='ascii')


def encode(text: str) -> np.ndarray:
  """Returns the bytes of `text` (UTF-8) as int32 token ids."""
  return np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.int32)


def decode(tokens: np.ndarray) -> str:
  """Returns the text of byte token ids (invalid UTF-8 is replaced)."""
  return bytes(np.asarray(tokens, np.uint8)).decode('utf-8', 'replace')


def split_tokens() -> tuple[np.ndarray, np.ndarray]:
  """Returns the corpus tokens split into (train, held-out) parts.

  The held-out part is the last `HELD_OUT_FRACTION` of the text, so no
  training window overlaps it.
  """
  tokens = encode(corpus_text())
  cut = int(len(tokens) * (1 - HELD_OUT_FRACTION))
  return tokens[:cut], tokens[cut:]


class Batches:
  """Random windows of a token array, as ``(batch, length + 1)`` int32.

  Each row holds ``length + 1`` consecutive tokens: the model reads the first
  ``length`` and predicts the last ``length``.

  Args:
    tokens: The token ids to sample from.
    batch_size: Rows per batch.
    length: Tokens the model reads per row.
    seed: Seed of the window offsets.
  """

  def __init__(
    self, tokens: np.ndarray, batch_size: int, length: int, *, seed: int = 0
  ):
    if len(tokens) < length + 2:
      raise ValueError(
        f'Expected more than {length + 1} tokens to cut windows of length '
        f'{length} + 1; got {len(tokens)}.'
      )
    self.tokens = tokens
    self.batch_size = batch_size
    self.length = length
    self._rng = np.random.default_rng(seed)

  def __iter__(self) -> Batches:
    return self

  def __next__(self) -> np.ndarray:
    starts = self._rng.integers(
      0, len(self.tokens) - self.length - 1, self.batch_size
    )
    idx = starts[:, None] + np.arange(self.length + 1)[None, :]
    return self.tokens[idx]


def held_out_batch(batch_size: int, length: int) -> np.ndarray:
  """Returns a fixed ``(batch_size, length + 1)`` batch of held-out text."""
  held_out = split_tokens()[1]
  stride = (len(held_out) - length - 1) // batch_size
  starts = np.arange(batch_size) * stride
  idx = starts[:, None] + np.arange(length + 1)[None, :]
  return held_out[idx]
