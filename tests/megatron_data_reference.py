"""Megatron-LM 23.05's training data order, written out plainly from the facts sheet
(reference/megatron-23.05-facts.md, sections a.3 and c): which token windows a run reads,
in which order, on which data-parallel rank. Independent of megatron/core/datasets (it
imports nothing from the project); the tests compare the project's builder and loaders
with it element for element.

Everything here favours the obvious loop over speed: the corpora in the tests are small.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

# ---------------------------------------------------------------- run-level counts


def split_bounds(split: str, num_docs: int) -> List[int]:
    """[0, b1, b2, num_docs]: weights padded/truncated to 3, normalised, each share rounded
    (Python's round), the excess of the last bound taken back from b1..b3."""
    sep = "," if "," in split else ("/" if "/" in split else None)
    parts = [float(x) for x in (split.split(sep) if sep else [split])]
    while len(parts) < 3:
        parts.append(0.0)
    parts = parts[:3]
    norm = sum(parts)
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + int(round(p / norm * float(num_docs))))
    excess = bounds[3] - num_docs
    return [bounds[0]] + [b - excess for b in bounds[1:]]


def rampup_gbs(consumed: int, rampup: Optional[Sequence[int]], gbs: int) -> int:
    """Global batch of the step that starts after `consumed` samples."""
    if not rampup:
        return gbs
    start, incr, ramp_samples = (int(v) for v in rampup)
    if consumed > ramp_samples:
        return gbs
    per_increment = ramp_samples / ((gbs - start) / incr)
    return start + int(consumed / per_increment) * incr


def train_iters_of(train_iters: Optional[int], train_samples: Optional[int], gbs: int,
                   rampup: Optional[Sequence[int]] = None) -> int:
    if train_iters:
        return train_iters
    if not rampup:
        return train_samples // gbs
    consumed = steps = 0
    while consumed <= int(rampup[2]):
        consumed += rampup_gbs(consumed, rampup, gbs)
        steps += 1
    return steps + (train_samples - consumed) // gbs


def split_num_samples(train_iters: int, train_samples: Optional[int], gbs: int,
                      eval_interval: int, eval_iters: int) -> List[int]:
    """[train, valid, test] samples asked of the dataset builder (gbs: the final one)."""
    train = train_samples if train_samples else train_iters * gbs
    return [train, (train_iters // eval_interval + 1) * eval_iters * gbs, eval_iters * gbs]


def blend_weights(data_path: Sequence[str]) -> Tuple[List[str], List[float]]:
    """`w1 p1 w2 p2 ...` -> (stripped prefixes, weights / their running sum)."""
    raw = [float(w) for w in data_path[0::2]]
    total = 0.0
    for w in raw:
        total += w
    return [p.strip() for p in data_path[1::2]], [w / total for w in raw]


def member_num_samples(n: int, weights: Sequence[float]) -> List[int]:
    return [int(math.ceil(n * w * 1.005)) for w in weights]


# ---------------------------------------------------------------- one GPT dataset


def gpt_index(sizes: np.ndarray, first_doc: int, end_doc: int, num_samples: int,
              seq_length: int, seed: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx int32, sample_idx int32 [Ns+1, 2], shuffle_idx) of documents
    [first_doc, end_doc) of a file whose sequence lengths are `sizes`."""
    docs = list(range(first_doc, end_doc))
    tokens = sum(int(sizes[d]) for d in docs)
    epochs = 1
    while (epochs * tokens - 1) // seq_length < num_samples:
        epochs += 1
    separate = False
    if epochs > 1:
        before_last = ((epochs - 1) * tokens - 1) // seq_length
        per_epoch = (tokens - 1) // seq_length
        separate = num_samples - before_last < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    if separate:
        head = np.array(docs * (epochs - 1), dtype=np.int32)
        rng.shuffle(head)
        tail = np.array(docs, dtype=np.int32)
        rng.shuffle(tail)
        doc_idx = np.concatenate([head, tail])
    else:
        doc_idx = np.array(docs * epochs, dtype=np.int32)
        rng.shuffle(doc_idx)
    total = (epochs * tokens - 1) // seq_length
    # Token t of the epoch stream belongs to doc_idx position owner[t], at offset[t].
    lengths = [int(sizes[d]) for d in doc_idx]
    owner = np.repeat(np.arange(len(doc_idx)), lengths)
    offset = np.concatenate([np.arange(n) for n in lengths])
    starts = np.arange(total + 1) * seq_length
    sample_idx = np.stack([owner[starts], offset[starts]], axis=1).astype(np.int32)
    sample_idx[0] = (0, 0)  # the helper's first row, whatever the first document holds
    cut = ((epochs - 1) * tokens - 1) // seq_length if separate else total
    dtype = np.int64 if total >= 2**32 - 2 else np.uint32
    first = np.arange(cut, dtype=dtype)
    rng.shuffle(first)
    parts = [first]
    if cut < total:
        rest = np.arange(cut, total, dtype=dtype)
        rng.shuffle(rest)
        parts.append(rest)
    return doc_idx, sample_idx, np.concatenate(parts)


def gpt_description(prefix: str, name: str, num_samples: int, seq_length: int, seed: int,
                    split: str) -> str:
    return (f"GPT Dataset\n\nData prefix {prefix}\nDataset name {name}\n"
            f"Number of samples {num_samples}\nSequence length {seq_length}\n"
            f"Random seed {seed}\nSplit {split}\n")


def cache_name(description: str) -> str:
    return hashlib.md5(description.encode("utf-8")).hexdigest()


class RefGPT:
    """Samples of one split of one corpus: item i is the window [j*S, j*S + S] of the
    stream of documents in doc_idx order, j = shuffle_idx[i]."""

    def __init__(self, docs: Sequence[np.ndarray], prefix: str, name: str, first_doc: int,
                 end_doc: int, num_samples: int, seq_length: int, seed: int, split: str):
        sizes = np.array([len(d) for d in docs])
        self.doc_idx, self.sample_idx, self.shuffle_idx = gpt_index(
            sizes, first_doc, end_doc, num_samples, seq_length, seed)
        self.stream = np.concatenate([docs[d] for d in self.doc_idx]).astype(np.int64)
        self.seq_length = seq_length
        self.desc = gpt_description(prefix, name, num_samples, seq_length, seed, split)

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.shuffle_idx[i])
        return self.stream[j * self.seq_length: (j + 1) * self.seq_length + 1]


# ---------------------------------------------------------------- blends


def blending(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """The greedy: sample s goes to the dataset furthest behind its share
    (w_d * max(s, 1) - taken_d, ties to the lowest d)."""
    taken = [0] * len(weights)
    which, nth = [], []
    for s in range(size):
        lag = [w * float(max(s, 1)) - float(t) for w, t in zip(weights, taken)]
        d = 0
        for k in range(1, len(lag)):
            if lag[k] > lag[d]:
                d = k
        which.append(d)
        nth.append(taken[d])
        taken[d] += 1
    return np.array(which, dtype=np.uint8), np.array(nth, dtype=np.int64)


class RefBlend:
    def __init__(self, members: List[RefGPT], weights: Sequence[float], size: int):
        w = np.array(weights, dtype=np.float64)
        w /= np.sum(w)  # the blend normalises the (already normalised) weights again
        self.members, self.size = members, size
        self.weights = w
        self.dataset_index, self.dataset_sample_index = blending(list(w), size)

    @property
    def desc(self) -> str:
        """The blend's description (its md5 names `H_index.npy`, `H_sample_index.npy`)."""
        members = "".join(m.desc + "\n\n" for m in self.members)
        return (f"Blendable dataset\n\nDatasets:\n{members}Weights: {self.weights}\n"
                f"Size: {self.size}\n")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.members[self.dataset_index[i]][int(self.dataset_sample_index[i])]


def reference_datasets(corpora: Dict[str, List[np.ndarray]], data_path: Sequence[str],
                       split: str, num_samples: Sequence[int], seq_length: int,
                       seed: int) -> list:
    """[train, valid, test] (RefGPT, RefBlend or None) for `--data-path data_path`;
    `corpora` maps each prefix to its documents (one sequence each)."""
    if len(data_path) == 1:
        prefixes, weights, per = [data_path[0]], [1.0], [[int(n)] for n in num_samples]
    else:
        prefixes, weights = blend_weights(data_path)
        per = [member_num_samples(int(n), weights) for n in num_samples]  # [split][member]
    out = []
    for k, name in enumerate(("train", "valid", "test")):
        members = []
        for i, prefix in enumerate(prefixes):
            b = split_bounds(split, len(corpora[prefix]))
            if b[k + 1] > b[k]:
                members.append(RefGPT(corpora[prefix], prefix, name, b[k], b[k + 1],
                                      per[k][i], seq_length, seed, split))
        if not members:
            out.append(None)
        elif len(members) < len(prefixes):  # Megatron's blend asserts one per weight
            raise ValueError(f"{name}: a weighted dataset has no document in this split")
        elif len(data_path) == 1:
            out.append(members[0])
        else:
            out.append(RefBlend(members, weights, sum(per[k])))
    return out


def reference_separate_datasets(corpora: Dict[str, List[np.ndarray]], paths: Sequence,
                                split: str, num_samples: Sequence[int], seq_length: int,
                                seed: int) -> list:
    """[train, valid, test] for --train/valid/test-data-path `paths` (each None, one
    prefix or `w1 p1 ...`): all documents of each file, --split only in the description."""
    out = []
    for name, path, n in zip(("train", "valid", "test"), paths, num_samples):
        if path is None:
            out.append(None)
            continue
        if len(path) == 1:
            prefixes, weights, per = [path[0]], [1.0], [int(n)]
        else:
            prefixes, weights = blend_weights(path)
            per = member_num_samples(int(n), weights)
        members = [RefGPT(corpora[p], p, name, 0, len(corpora[p]), c, seq_length, seed, split)
                   for p, c in zip(prefixes, per)]
        out.append(members[0] if len(path) == 1 else RefBlend(members, weights, sum(per)))
    return out


# ---------------------------------------------------------------- loaders


def rank_micro_batches(consumed: int, num_micro: int, mbs: int, dp: int,
                       rank: int) -> List[List[int]]:
    """Sample ids of the `num_micro` micro-batches rank `rank` reads from `consumed` on:
    each takes mbs*dp consecutive samples, the rank the slice [rank*mbs, (rank+1)*mbs)."""
    out = []
    for m in range(num_micro):
        first = consumed + m * mbs * dp + rank * mbs
        out.append(list(range(first, first + mbs)))
    return out


def run_reads(train_iters: int, gbs: int, mbs: int, dp: int, rank: int, eval_interval: int,
              eval_iters: int, rampup=None, start_iteration: int = 0,
              consumed_train: int = 0, consumed_valid: int = 0,
              stop_iteration: Optional[int] = None,
              skip_train: bool = False) -> List[Tuple[str, List[int]]]:
    """(split, sample ids) of every micro-batch rank `rank` reads, in order, in a run from
    `start_iteration` (with the counters of that checkpoint) to `train_iters`: the
    training steps, an evaluation (--eval-iters global batches of validation samples,
    the batch size of the step just taken) after every step that is a multiple of
    --eval-interval, then the final validation and test draws. A run stopped at
    `stop_iteration` (--exit-interval) ends there without the final draws. --skip-train
    (`skip_train`): only the final draws, validation from its first sample, at the batch
    size of the checkpoint's consumed samples (loading it sets the micro-batch count)."""
    reads: List[Tuple[str, List[int]]] = []
    iteration, ct, cv = start_iteration, consumed_train, consumed_valid
    g = rampup_gbs(ct, rampup, gbs)
    end = train_iters if stop_iteration is None else stop_iteration
    if skip_train:
        end, cv = iteration, 0
    while iteration < end:
        g = rampup_gbs(ct, rampup, gbs)
        reads += [("train", ids) for ids in rank_micro_batches(ct, g // (mbs * dp), mbs, dp, rank)]
        ct += g
        iteration += 1
        if eval_interval and iteration % eval_interval == 0 and eval_iters:
            for _ in range(eval_iters):
                reads += [("valid", ids) for ids in rank_micro_batches(cv, g // (mbs * dp),
                                                                       mbs, dp, rank)]
                cv += g
    if stop_iteration is not None or not eval_iters:
        return reads
    for split, consumed in (("valid", cv), ("test", 0)):
        for _ in range(eval_iters):
            reads += [(split, ids) for ids in rank_micro_batches(consumed, g // (mbs * dp),
                                                                 mbs, dp, rank)]
            consumed += g
    return reads
