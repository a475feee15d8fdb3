"""--split: the document ranges it cuts from a dataset (Megatron's rounding rule), and a
--split to suggest where it leaves a split no document."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence


def get_train_valid_test_split(split_string: str, size: int) -> List[int]:
    """Boundaries [0, b1, b2, size] of the train/valid/test document ranges (Megatron's rule:
    weights normalised, each range rounded with Python's round, the excess taken back)."""
    try:
        if "," in split_string:
            splits = [float(s) for s in split_string.split(",")]
        elif "/" in split_string:
            splits = [float(s) for s in split_string.split("/")]
        else:
            splits = [float(split_string)]
    except ValueError as e:
        raise ValueError(f"--split {split_string!r}: expected numbers like '969,30,1'") from e
    splits = (splits + [0.0, 0.0, 0.0])[:3]
    total = sum(splits)
    if not math.isfinite(total) or total <= 0.0 or min(splits) < 0:
        raise ValueError(f"--split {split_string!r}: weights must be finite numbers >= 0 with a "
                         "positive sum, e.g. '969,30,1'")
    splits = [s / total for s in splits]
    index = [0]
    for i, s in enumerate(splits):
        index.append(index[i] + int(round(s * float(size))))
    diff = index[-1] - size
    if diff > index[1]:  # train rounds to 0, valid and test both round .5 up
        shares = [index[i + 1] - index[i] for i in range(3)]
        raise ValueError(
            f"--split {split_string!r} over {size} documents rounds to "
            f"{' + '.join(map(str, shares))} = {index[-1]} documents, more than there are, "
            f"and train has none to give back (Megatron-LM's first boundary would be "
            f"{index[1] - diff}: it stops on an assertion); give train a share, or valid and "
            f"test shares that add up to {size} documents, e.g. --split 0,{shares[1]},"
            f"{size - shares[1]}")
    for i in range(1, len(index)):
        index[i] -= diff
    assert index[-1] == size
    return index


def _ladder(total: float) -> List[float]:
    """1, 2, 5 x a power of ten, from 1e-4 to 50 times `total`'s order of magnitude."""
    top = math.floor(math.log10(total))
    return [step * 10.0 ** e for e in range(top - 4, top + 2) for step in (1, 2, 5)]


def _gives_documents(split: str, size: int, valid: bool, test: bool) -> bool:
    try:
        b = get_train_valid_test_split(split, size)
    except ValueError:
        return False
    return b[1] > 0 and (b[2] > b[1] or not valid) and (b[3] > b[2] or not test)


def split_with_documents(split: str, sizes: Sequence[int], valid: bool = True,
                         test: bool = False) -> Optional[str]:
    """A --split that gives datasets of each of `sizes` documents a validation (`valid`) and
    a test (`test`) document, train keeping one: `split`'s train number kept, and its
    validation and test numbers too where they already give every dataset one, else the
    smallest of 1, 2, 5 x a power of ten (in the scale of `split`'s numbers) that does.
    None when `split` has not three numbers (the first three count, as in
    `get_train_valid_test_split`) with a positive train share, or none fits."""
    try:
        numbers = [float(x) for x in split.replace("/", ",").split(",")][:3]
        bounds = [get_train_valid_test_split(split, n) for n in sizes]
    except ValueError:
        return None
    if len(numbers) != 3 or not numbers[0] > 0:
        return None
    train, v, t = numbers
    ladder = _ladder(sum(numbers))
    valids = ladder if valid and any(b[2] == b[1] for b in bounds) else [v]
    tests = ladder if test and any(b[3] == b[2] for b in bounds) else [t]
    for v in valids:
        for t in tests:
            candidate = f"{train:g},{v:g},{t:g}"
            if all(_gives_documents(candidate, n, valid, test) for n in sizes):
                return candidate
    return None
