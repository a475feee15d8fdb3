"""Synthetic GPT samples for `--mock-data`.

Sample i of a split is a deterministic function of (seed, split, i) only -- never of the
rank -- so every parallel layout sees the same samples. Each sample is an arithmetic
progression modulo the vocabulary (a random start; one stride per seed) with a fraction
of positions replaced by random tokens, so a model can learn it and the loss falls;
generation is vectorised, cheap enough to feed a GPU.
"""
from __future__ import annotations

import torch


class MockGPTDataset:
    """`num_samples` samples of `seq_length + 1` token ids in [0, vocab_size)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, num_samples: int = 2**40,
                 noise: float = 0.1, split_index: int = 0):
        if vocab_size < 2:
            raise ValueError(f"mock data needs a vocabulary of at least 2 tokens, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = num_samples
        self.noise = noise
        self.split_index = split_index  # train/valid/test draw different samples
        g = torch.Generator().manual_seed(seed)
        self.stride = int(torch.randint(1, vocab_size, (1,), generator=g))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} outside [0, {self.num_samples})")
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + idx) * 4 + self.split_index)
        n = self.seq_length + 1
        start = torch.randint(0, self.vocab_size, (1,), generator=g)
        text = (start + self.stride * torch.arange(n)) % self.vocab_size
        noise = torch.rand(n, generator=g) < self.noise
        random_tokens = torch.randint(0, self.vocab_size, (n,), generator=g)
        return {"text": torch.where(noise, random_tokens, text)}
