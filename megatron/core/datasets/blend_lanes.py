"""The blending greedy for many datasets (from 16), in lanes run side by side.

The greedy (blended.py) picks at sample s the dataset d maximising
`fl(fl(w_d * max(s, 1)) - count_d)`, ties to the lowest d. Each pick depends on all earlier
ones, so one step costs a numpy call or more; this builder runs many stretches of the blend
at once, one lane each, so that every numpy call advances all lanes by one sample:

- lane 0 starts from the true counts; lane j > 0 starts `burn` samples before its stretch
  from guessed counts (the weights' shares of its first sample rounded to whole samples
  adding up to it). The greedy forgets where it started: after some hundred samples a lane
  from wrong counts mostly takes the same picks as the true greedy. A lane's stretch is
  kept from where its counts equal the true counts there (those the stretches before it
  end with); before that point, the plain greedy builds the samples (and later burns are
  longer where that took over 1%), so what is kept is the greedy's, bit for bit, whatever
  the guess.
- datasets of equal weight are one item (`_Groups`): the greedy takes them in turn.
- each lane looks at a few candidate groups at a time, not all: for the next `window`
  samples the picks can only be groups whose value at the window's last sample reaches
  the window-th largest value at its first (values only rise until picked, and at most
  window - 1 of the window-th largest's betters are picked before any sample of the window,
  so the winner's value never falls under it). The candidates of a lane keep their order,
  so argmax's first maximum is the lowest dataset as in the greedy (among groups of several
  datasets, ties go to the lowest next member explicitly).

About 0.25-0.65 microsecond per sample from 16 to 254 datasets on a busy 2-core machine
(benchmarks/RESULTS.md).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import numpy as np

Progress = Optional[Callable[[int], None]]

LANES = 512  # stretches of the blend run side by side
_STRETCH_MAX = 1 << 15  # samples each lane keeps at most
HEAD_PER_DATASET = 4  # samples per dataset the caller builds first, by the plain greedy
_BURN_PER_DATASET = 8  # samples a lane runs from guessed counts, per dataset, at first
_BURN_MAX_PER_DATASET = 256  # ... at most (doubled after each mismatch)
_MEET_EVERY = 64  # samples of the plain greedy between comparisons with a lane
_REPAIRED_MAX = 100  # a batch whose plain greedy took more than 1/this: burns double
_WINDOW_PER_ROOT = 3.75  # samples between choices of candidates, per root of the groups
_NUMBERED = 1 << 20  # samples whose sample indices are numbered at once
_NOBODY = 1 << 20  # the next member of the dummy group (above every dataset)


def occurrence_numbers(picks: np.ndarray, before: np.ndarray) -> np.ndarray:
    """int64 [len(picks)]: for each pick of dataset d, how many picks of d came before
    it (`before[d]` of them before this block)."""
    order = np.argsort(picks, kind="stable")  # radix sort of uint8: each dataset's in order
    ranked = picks[order]
    first = np.searchsorted(ranked, ranked, side="left")  # where each dataset's run starts
    numbers = np.empty(len(picks), dtype=np.int64)
    numbers[order] = np.arange(len(picks)) - first + before[ranked]
    return numbers


class _Groups:
    """The datasets grouped by weight (groups in the order of their first dataset). Within
    a group the greedy takes the members in turn (the one taken least, ties to the lowest),
    so a group is one item of the greedy: its `total` picks so far make its next member
    `members[total % n]`, whose value is `w * s - total // n` (`quot`; `rest` = total % n).
    Distinct weights make one group per dataset, in dataset order."""

    def __init__(self, weights: np.ndarray):
        values, first, inverse = np.unique(weights, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        rank = np.empty(len(values), dtype=np.int64)
        rank[order] = np.arange(len(values))
        group = rank[inverse.ravel()]
        self.num, self.count = len(weights), len(values)
        self.distinct = self.count == self.num
        self.weights = np.append(values[order], 0.0)  # the last: a dummy never winning
        self.sizes = np.append(np.bincount(group, minlength=self.count), 1)
        self.members = np.full((self.count + 1, int(self.sizes.max())), _NOBODY, np.int64)
        place = occurrence_numbers(group.astype(np.uint8), np.zeros(self.count, np.int64))
        self.members[group, place] = np.arange(self.num)
        self.group, self.place = group, place

    def state(self, totals: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(quot float64, rest int64) [lanes, groups + 1] of group totals [lanes, groups]."""
        quot = np.full((len(totals), self.count + 1), np.inf)
        rest = np.zeros((len(totals), self.count + 1), dtype=np.int64)
        quot[:, :-1], rest[:, :-1] = np.divmod(totals, self.sizes[:-1])
        return quot, rest

    def member_counts(self, totals: np.ndarray) -> np.ndarray:
        """int64 [lanes, datasets]: each dataset's picks of group `totals` [lanes, groups]."""
        quot, rest = np.divmod(totals[:, self.group], self.sizes[self.group])
        return quot + (self.place < rest)

    def guessed_totals(self, starts: np.ndarray) -> np.ndarray:
        """int64 [lanes, groups]: each lane's start s shared by the groups' weights and
        rounded to whole samples adding up to s (largest remainders first)."""
        weights = self.weights[:-1] * self.sizes[:-1]
        share = np.multiply.outer(starts.astype(np.float64), weights / weights.sum())
        totals = np.floor(share)
        short = starts - totals.sum(axis=1).astype(np.int64)  # samples still to hand out
        rank = np.empty(share.shape, dtype=np.int64)
        order = np.argsort(totals - share, axis=1, kind="stable")  # largest remainder first
        np.put_along_axis(rank, order, np.arange(share.shape[1])[None, :], axis=1)
        return (totals + (rank < short[:, None])).astype(np.int64)


def _candidates(weights: np.ndarray, quot: np.ndarray, first: np.ndarray,
                window: int) -> np.ndarray:
    """int64 [lanes, m]: per lane, the groups that can win in samples first..first+window-1
    (ascending), padded with the dummy group `len(weights) - 1` (never winning)."""
    num = len(weights) - 1
    real = quot[:, :num]
    now = np.multiply(np.maximum(first, 1.0)[:, None], weights[:num]) - real
    last = np.multiply(np.maximum(first + (window - 1), 1.0)[:, None], weights[:num]) - real
    floor = np.partition(now, num - window, axis=1)[:, num - window]  # window-th largest
    rows, cols = np.nonzero(last >= floor[:, None])
    sizes = np.bincount(rows, minlength=len(quot))
    place = np.arange(len(rows)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    picked = np.full((len(quot), int(sizes.max())), num, dtype=np.int64)
    picked[rows, place] = cols
    return picked


def _window(groups: _Groups, quot: np.ndarray, rest: np.ndarray, first: np.ndarray,
            size: int) -> np.ndarray:
    """int64 [size, lanes]: the datasets each lane picks in samples first..first+size-1
    (`quot` and `rest` updated)."""
    lanes = len(first)
    idx = _candidates(groups.weights, quot, first, size)
    rows, width = np.arange(lanes)[:, None], idx.shape[1]
    w, q, r = groups.weights[idx], quot[rows, idx], rest[rows, idx]
    err = np.empty_like(q)
    won = np.empty((size, lanes), dtype=np.int64)
    base = np.arange(lanes) * width
    q_flat, r_flat = q.reshape(-1), r.reshape(-1)
    if groups.distinct:  # one dataset a group: argmax's first maximum is the lowest
        for t in range(size):
            np.multiply(w, np.maximum(first + t, 1.0)[:, None], out=err)
            np.subtract(err, q, out=err)
            at = base + err.argmax(axis=1)
            won[t] = at
            q_flat[at] += 1.0
        chosen = groups.members[idx.reshape(-1)[won], 0]
    else:  # ties between groups go to the lowest next member
        n_flat, g_flat = groups.sizes[idx].reshape(-1), idx.reshape(-1)
        nxt = groups.members[idx, r]
        chosen = np.empty((size, lanes), dtype=np.int64)
        for t in range(size):
            np.multiply(w, np.maximum(first + t, 1.0)[:, None], out=err)
            np.subtract(err, q, out=err)
            top = err == err.max(axis=1)[:, None]
            at = base + np.where(top, nxt, _NOBODY).argmin(axis=1)
            chosen[t] = nxt.reshape(-1)[at]
            turn = r_flat[at] + 1
            wrap = turn == n_flat[at]
            turn[wrap] = 0
            q_flat[at] += wrap
            r_flat[at] = turn
            nxt.reshape(-1)[at] = groups.members[g_flat[at], turn]
    quot[rows, idx], rest[rows, idx] = q, r
    return chosen


def _run_lanes(groups: _Groups, totals: np.ndarray, starts: np.ndarray, steps: int,
               window: int) -> np.ndarray:
    """uint8 [steps, lanes]: the greedy's picks of each lane from its first sample `starts`
    and group `totals` [lanes, groups] there."""
    quot, rest = groups.state(totals)
    picks = np.empty((steps, len(starts)), dtype=np.uint8)
    for begin in range(0, steps, window):
        size = min(window, steps - begin)
        first = (starts + begin).astype(np.float64)
        picks[begin:begin + size] = _window(groups, quot, rest, first, size)
    return picks


def blending_lanes(weights: np.ndarray, size: int, dataset_index: np.ndarray,
                   sample_index: np.ndarray, done: int = 0,
                   progress: Progress = None) -> None:
    """Fill `dataset_index` and `sample_index` from sample `done` on with the greedy's picks
    (module docstring); `weights` has a positive sum. The first samples should already be
    there (HEAD_PER_DATASET per dataset): until each dataset was picked about once, their
    values are too close for few candidates."""
    num, groups = len(weights), _Groups(weights)
    window = min(groups.count, max(4, int(round(_WINDOW_PER_ROOT * math.sqrt(groups.count)))))
    burn = _BURN_PER_DATASET * num
    stretch = max(min(_STRETCH_MAX, -(-size // LANES)), 4 * burn)
    true = np.bincount(dataset_index[:done], minlength=num).astype(np.int64)
    while done < size:
        lanes = max(1, min(LANES, -(-(size - done - burn) // stretch)))
        starts = done + np.arange(lanes, dtype=np.int64) * stretch  # lane j's first sample
        totals = np.empty((lanes, groups.count), dtype=np.int64)
        totals[0] = np.bincount(groups.group, weights=true, minlength=groups.count)
        totals[1:] = groups.guessed_totals(starts[1:])
        picks = _run_lanes(groups, totals, starts, stretch + burn, window)
        kept, repaired = _joined(weights, picks, groups.member_counts(totals), true, starts,
                                 burn)
        take = min(len(kept), size - done)
        for begin in range(0, take, _NUMBERED):  # numbered in pieces: bounded memory
            chunk = kept[begin:min(begin + _NUMBERED, take)]
            dataset_index[done:done + len(chunk)] = chunk
            sample_index[done:done + len(chunk)] = occurrence_numbers(chunk, true)
            true += np.bincount(chunk, minlength=num)
            done += len(chunk)
        if repaired * _REPAIRED_MAX > len(kept):  # guesses too far off: longer burns
            burn = min(2 * burn, _BURN_MAX_PER_DATASET * num)
            stretch = max(stretch, 4 * burn)
        if progress is not None:
            progress(done)


def _greedy_until_met(weights: np.ndarray, counts: np.ndarray, first: int,
                      lane: np.ndarray, lane_counts: np.ndarray) -> Tuple[List[int], int]:
    """The plain greedy from sample `first` and the true `counts`, until its counts equal
    those of `lane` (picks from `first` on, made from `lane_counts` at `first`): (its picks,
    the samples it took; the lane's picks from there on are the greedy's)."""
    w, c = [float(x) for x in weights], [int(x) for x in counts]
    seen = [int(x) for x in lane_counts]
    picks: List[int] = []
    for i in range(len(lane)):
        if i % _MEET_EVERY == 0 and c == seen:
            return picks, i
        sd = float(first + i) if first + i > 1 else 1.0
        best, best_err = 0, w[0] * sd - c[0]
        for d in range(1, len(w)):
            err = w[d] * sd - c[d]
            if err > best_err:
                best, best_err = d, err
        picks.append(best)
        c[best] += 1
        seen[lane[i]] += 1
    return picks, len(lane)


def _joined(weights: np.ndarray, picks: np.ndarray, guessed: np.ndarray, true: np.ndarray,
            starts: np.ndarray, burn: int) -> Tuple[np.ndarray, int]:
    """(the greedy's picks from lane 0's first sample on, the samples the plain greedy took):
    lane 0 whole, then each lane's stretch (after `burn`); where a lane's counts there
    differ from the true counts, the plain greedy runs until they meet."""
    num = len(weights)
    parts, repaired = [picks[:, 0]], 0
    state = true + np.bincount(picks[:, 0], minlength=num)
    for j in range(1, picks.shape[1]):
        own = picks[burn:, j]
        met = 0
        if not np.array_equal(guessed[j] + np.bincount(picks[:burn, j], minlength=num), state):
            lane_counts = guessed[j] + np.bincount(picks[:burn, j], minlength=num)
            fixed, met = _greedy_until_met(weights, state, int(starts[j]) + burn, own,
                                           lane_counts)
            fixed = np.array(fixed, dtype=np.uint8)
            parts.append(fixed)
            state += np.bincount(fixed, minlength=num)
            repaired += met
        parts.append(own[met:])
        state += np.bincount(own[met:], minlength=num)
    return np.concatenate(parts), repaired
