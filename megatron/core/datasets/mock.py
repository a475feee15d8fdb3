"""Synthetic GPT samples for `--mock-data`.

Sample i of a split is a deterministic function of (seed, split, i) only -- never of the rank -- so every
parallel layout sees the same samples. The token stream follows a fixed random
permutation of the vocabulary with some noise, so a model can learn it and the loss falls.
"""
from __future__ import annotations

import torch


class MockGPTDataset:
    """`len` samples of `seq_length + 1` token ids in [0, vocab_size)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, num_samples: int = 2**40,
                 noise: float = 0.1, split_index: int = 0):
        if vocab_size < 2:
            raise ValueError(f"mock data needs a vocabulary of at least 2 tokens, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = num_samples
        self.noise = noise
        self.split_index = split_index  # train/valid/test draw different samples of one language
        g = torch.Generator().manual_seed(seed)
        self.next_token = torch.randperm(vocab_size, generator=g)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} outside [0, {self.num_samples})")
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + idx) * 4 + self.split_index)
        n = self.seq_length + 1
        random_tokens = torch.randint(0, self.vocab_size, (n,), generator=g)
        keep_chain = torch.rand(n, generator=g) >= self.noise
        text = torch.empty(n, dtype=torch.int64)
        text[0] = random_tokens[0]
        for t in range(1, n):  # sequential by nature; cheap at these sizes
            text[t] = self.next_token[text[t - 1]] if keep_chain[t] else random_tokens[t]
        return {"text": text}
