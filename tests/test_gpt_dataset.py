"""GPT sample indexing vs a loop-based reference written from the Megatron 23.05 facts:
epochs, separate last epoch, split boundaries, caching, builder rank, the whole builder vs
the Megatron reference. Blending: tests/test_gpt_dataset_blending.py; masks:
tests/test_gpt_dataset_masks.py."""
from __future__ import annotations

import hashlib
import os
import re

import numpy as np
import pytest
import torch

from megatron.core.datasets import gpt_dataset as gd
from megatron.core.datasets import gpt_index as gi
from megatron.core.datasets.blended import BlendedDataset
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    build_train_valid_test_datasets,
    get_train_valid_test_split,
)
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset
from tests.dist_utils import run_distributed

# ---------------------------------------------------------------- reference (loops)


def ref_num_epochs(tokens_per_epoch, seq_length, num_samples):
    epochs, total = 0, 0
    while True:
        epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            return epochs


def ref_doc_idx(documents, epochs, rng, separate):
    if not separate or epochs == 1:
        out = np.array([d for _ in range(epochs) for d in documents], dtype=np.int32)
        rng.shuffle(out)
        return out
    first = ref_doc_idx(documents, epochs - 1, rng, False)
    return np.concatenate((first, ref_doc_idx(documents, 1, rng, False)))


def ref_sample_idx(sizes, doc_idx, seq_length, epochs, tokens_per_epoch):
    """Megatron's helpers.build_sample_idx, transliterated."""
    num_samples = (epochs * tokens_per_epoch - 1) // seq_length
    out = [(0, 0)]
    index, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[index]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                index += 1
                offset = 0
        out.append((index, offset))
    return np.array(out, dtype=np.int32)


def ref_indices(documents, sizes, num_samples, seq_length, seed):
    tokens = int(sum(sizes[d] for d in documents))
    epochs = ref_num_epochs(tokens, seq_length, num_samples)
    separate = False
    if epochs > 1:
        from_prev = ((epochs - 1) * tokens - 1) // seq_length
        per_epoch = (tokens - 1) // seq_length
        separate = num_samples - from_prev < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    doc_idx = ref_doc_idx(list(documents), epochs, rng, separate)
    sample_idx = ref_sample_idx(sizes, doc_idx, seq_length, epochs, tokens)
    total = len(sample_idx) - 1
    first = ((epochs - 1) * tokens - 1) // seq_length if separate else total
    shuffle = np.arange(first, dtype=np.uint32)
    rng.shuffle(shuffle)
    if first < total:
        last = np.arange(first, total, dtype=np.uint32)
        rng.shuffle(last)
        shuffle = np.concatenate((shuffle, last))
    return doc_idx, sample_idx, shuffle, epochs, separate


# ---------------------------------------------------------------- helpers


def make_corpus(path, sizes, seed=0, vocab=1000, eod=None):
    """One sequence per document with the given sizes; returns the prefix and the docs."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, n) for n in sizes]
    if eod is not None:
        docs = [np.append(d[:-1], eod) if len(d) else d for d in docs]
    builder = IndexedDatasetBuilder(str(path) + ".bin", np.uint16)
    for d in docs:
        builder.add_item(d)
        builder.end_document()
    builder.finalize(str(path) + ".idx")
    return str(path), docs


CASES = [  # (sizes, num_samples, seq_length, seed): single epoch, several, separate last
    ([5, 7, 3, 9, 1, 12, 4], 3, 8, 1),
    ([5, 7, 3, 9, 1, 12, 4], 40, 8, 2),
    ([10] * 10, 10, 10, 3),   # E=2, last epoch 1 sample < 0.8*9: shuffled apart
    ([10] * 10, 17, 10, 4),   # E=2, last epoch 8 samples: shuffled together
    ([3, 0, 4, 0, 0, 6, 2], 9, 4, 5),  # empty documents
    ([50, 1, 1, 1, 80], 30, 16, 6),
]


@pytest.mark.parametrize("sizes,num_samples,seq_length,seed", CASES)
def test_index_matches_reference(tmp_path, sizes, num_samples, seq_length, seed):
    prefix, docs = make_corpus(tmp_path / "c", sizes, seed)
    ds_sizes = np.array(sizes, dtype=np.int32)
    documents = np.arange(len(sizes), dtype=np.int32)
    doc_idx, sample_idx, shuffle = gi.build_index_arrays(documents, ds_sizes, num_samples,
                                                         seq_length, seed)
    r_doc, r_sample, r_shuffle, epochs, separate = ref_indices(documents, ds_sizes, num_samples,
                                                               seq_length, seed)
    np.testing.assert_array_equal(doc_idx, r_doc)
    np.testing.assert_array_equal(sample_idx, r_sample)
    np.testing.assert_array_equal(shuffle, r_shuffle)
    assert doc_idx.dtype == np.int32 and sample_idx.dtype == np.int32
    assert shuffle.dtype == np.uint32
    # Every sample is the window [j*S, j*S + S] of the epoch-concatenated token stream.
    ds = GPTDataset("train", prefix, documents, MMapIndexedDataset(prefix), num_samples,
                    seq_length, seed, "1,0,0", cache_dir=str(tmp_path / "cache"))
    stream = np.concatenate([docs[d] for d in r_doc])
    assert len(ds) == (epochs * sum(sizes) - 1) // seq_length >= num_samples
    for i in range(len(ds)):
        j = int(r_shuffle[i])
        text = ds[i]["text"]
        assert text.dtype == np.int64 and len(text) == seq_length + 1
        np.testing.assert_array_equal(text, stream[j * seq_length: j * seq_length + seq_length + 1])
    with pytest.raises(IndexError):
        ds[len(ds)]


@pytest.mark.parametrize("sizes,num_samples,seq_length,seed", CASES)
def test_sample_idx_in_chunks_matches_reference(monkeypatch, sizes, num_samples, seq_length,
                                                seed):
    """Samples located a few at a time (chunk boundaries everywhere) give Megatron's rows."""
    monkeypatch.setattr(gi, "_SAMPLE_CHUNK", 3)
    ds_sizes = np.array(sizes, dtype=np.int32)
    documents = np.arange(len(sizes), dtype=np.int32)
    _, sample_idx, _ = gi.build_index_arrays(documents, ds_sizes, num_samples, seq_length, seed)
    r_doc, r_sample, *_ = ref_indices(documents, ds_sizes, num_samples, seq_length, seed)
    np.testing.assert_array_equal(sample_idx, r_sample)
    assert sample_idx.dtype == np.int32


def test_sample_idx_random_cases_match_reference(monkeypatch):
    """Random sizes (empty documents too), lengths and chunk sizes: Megatron's rows."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        sizes = rng.integers(0, 30, int(rng.integers(1, 40))).astype(np.int32)
        if not sizes.any():
            continue
        seq_length, num_samples = int(rng.integers(1, 40)), int(rng.integers(1, 80))
        tokens = int(sizes.sum())
        epochs = gi.num_epochs_needed(tokens, seq_length, num_samples)
        doc_idx = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
        rng.shuffle(doc_idx)
        monkeypatch.setattr(gi, "_SAMPLE_CHUNK", int(rng.integers(1, 12)))
        np.testing.assert_array_equal(
            gi.build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens),
            ref_sample_idx(sizes, doc_idx, seq_length, epochs, tokens))


def test_sample_idx_positions_past_int32_are_int64(tmp_path, monkeypatch):
    """doc_idx positions past int32 (over 2**31 entries) are kept as int64, not wrapped
    negative (which read other documents, and the index just built was refused as another
    run's). The limit is lowered here so that a small index crosses it."""
    assert gi.sample_idx_dtype(2**31) is np.int32  # positions 0 .. 2**31 - 1 fit
    assert gi.sample_idx_dtype(2**31 + 1) is np.int64
    sizes, num_samples, seq_length, seed = CASES[1]
    prefix, docs = make_corpus(tmp_path / "c", sizes, seed)
    documents = np.arange(len(sizes), dtype=np.int32)
    ds_sizes = np.array(sizes, dtype=np.int32)
    r_doc, r_sample, r_shuffle, *_ = ref_indices(documents, ds_sizes, num_samples, seq_length,
                                                 seed)
    monkeypatch.setattr(gi, "INT32_MAX_POSITION", 4)
    monkeypatch.setattr(gi, "_SAMPLE_CHUNK", 3)
    assert r_sample[:, 0].max() > 4
    ds = GPTDataset("train", prefix, documents, MMapIndexedDataset(prefix), num_samples,
                    seq_length, seed, "1,0,0", cache_dir=str(tmp_path / "cache"))
    assert ds.sample_idx.dtype == np.int64
    np.testing.assert_array_equal(ds.sample_idx, r_sample)
    again = GPTDataset("train", prefix, documents, MMapIndexedDataset(prefix), num_samples,
                       seq_length, seed, "1,0,0", cache_dir=str(tmp_path / "cache"))
    assert again.index_build_s is None  # the int64 cache is read back and accepted
    stream = np.concatenate([docs[d] for d in r_doc])
    for i in range(len(again)):
        j = int(r_shuffle[i])
        np.testing.assert_array_equal(again[i]["text"],
                                      stream[j * seq_length: (j + 1) * seq_length + 1])


def test_sample_idx_memory_is_the_result_plus_a_chunk(monkeypatch):
    """Building sample_idx holds the result (8 bytes a sample) and the work of one chunk of
    doc_idx: not several int64 arrays as long as the samples and the documents (48 bytes a
    sample and 16 a doc_idx entry: more than 30 GB for 500M samples)."""
    import tracemalloc

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 40, 200_000).astype(np.int32)
    doc_idx = rng.permutation(len(sizes)).astype(np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    seq_length = 2  # many samples per document: the samples dominate
    monkeypatch.setattr(gi, "_SAMPLE_CHUNK", 1 << 14)  # (4M in use: more than these docs)
    tracemalloc.start()
    try:
        sample_idx = gi.build_sample_idx(sizes, doc_idx, seq_length, 1, tokens)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    samples = len(sample_idx)
    assert samples == (tokens - 1) // seq_length + 1
    chunk = gi._SAMPLE_CHUNK
    chunk_work = 6 * 8 * chunk + 3 * 8 * chunk * 40 // seq_length  # docs, then their samples
    assert peak <= 8 * samples + chunk_work + (1 << 20), peak
    assert peak < 16 * samples, (peak, samples)


def test_doc_and_shuffle_idx_shuffle_the_last_epoch_apart_in_place():
    """With the last epoch apart, doc_idx and shuffle_idx are the two shuffles of
    Megatron's concatenation, built without a second copy of the array."""
    import tracemalloc

    documents = np.arange(100_000, dtype=np.int32)
    rng, ref_rng = np.random.RandomState(5), np.random.RandomState(5)
    tracemalloc.start()
    try:
        doc_idx = gi.build_doc_idx(documents, 3, rng, True)
        doc_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        shuffle_idx = gi.build_shuffle_idx(250_000, 300_000, rng)
        shuffle_peak = tracemalloc.get_traced_memory()[1] - doc_idx.nbytes
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(doc_idx, ref_doc_idx(list(documents), 3, ref_rng, True))
    first, last = np.arange(250_000, dtype=np.uint32), np.arange(250_000, 300_000,
                                                                 dtype=np.uint32)
    ref_rng.shuffle(first)
    ref_rng.shuffle(last)
    np.testing.assert_array_equal(shuffle_idx, np.concatenate((first, last)))
    assert doc_peak < 1.2 * doc_idx.nbytes + documents.nbytes, doc_peak
    assert shuffle_peak < 1.2 * shuffle_idx.nbytes, shuffle_peak


def test_index_built_and_checked_over_aligned_sizes(tmp_path, monkeypatch):
    """The mapped .idx holds sizes at byte 34 (unaligned: numpy gathers from it 2-3x
    slower); building and checking the index gather them once per doc_idx entry, from an
    aligned copy. The index is the one built from the mapped sizes."""
    prefix, _ = make_corpus(tmp_path / "c", [5, 7, 3, 9, 1, 12, 4])
    indexed = MMapIndexedDataset(prefix)
    assert not indexed.sizes.flags.aligned
    seen = []
    build, check = gi.build_index_arrays, gi.index_mismatch

    def spy_build(documents, sizes, *args):
        seen.append(sizes.flags.aligned)
        return build(documents, sizes, *args)

    def spy_check(arrays, documents, sizes, *args):
        seen.append(sizes.flags.aligned)
        return check(arrays, documents, sizes, *args)

    monkeypatch.setattr(gd, "build_index_arrays", spy_build)
    monkeypatch.setattr(gd, "index_mismatch", spy_check)
    documents = np.arange(7, dtype=np.int32)
    ds = GPTDataset("train", prefix, documents, indexed, 20, 8, 3, "1,0,0",
                    cache_dir=str(tmp_path / "cache"))
    assert seen == [True, True]
    expected = build(documents, np.array(indexed.sizes), 20, 8, 3)
    for got, want in zip((ds.doc_idx, ds.sample_idx, ds.shuffle_idx), expected):
        np.testing.assert_array_equal(got, want)


def test_epochs_and_last_epoch_rule():
    assert gi.num_epochs_needed(100, 10, 9) == 1 and gi.num_epochs_needed(100, 10, 10) == 2
    for t, s, n in [(100, 10, 10), (100, 10, 17), (997, 7, 5000), (64, 64, 3)]:
        e = gi.num_epochs_needed(t, s, n)
        assert e == ref_num_epochs(t, s, n)
    assert gi.separate_last_epoch(100, 10, 10, 2) is True
    assert gi.separate_last_epoch(100, 10, 17, 2) is False
    assert gi.separate_last_epoch(100, 10, 5, 1) is False


@pytest.mark.parametrize("split,size,expected", [
    ("969,30,1", 1000, [0, 969, 999, 1000]),
    ("949,50,1", 10, [0, 10, 10, 10]),
    ("969,30,1", 17, [0, 16, 17, 17]),
    ("969, 30, 1", 17, [0, 16, 17, 17]),
    ("98/2", 100, [0, 98, 100, 100]),
    ("1", 7, [0, 7, 7, 7]),
    ("1,1,1", 10, [0, 4, 7, 10]),  # 3+3+3 = 9: the missing one shifts all
])
def test_split_boundaries(split, size, expected):
    assert get_train_valid_test_split(split, size) == expected


def test_split_bad_values():
    with pytest.raises(ValueError, match="--split"):
        get_train_valid_test_split("a,b", 10)
    with pytest.raises(ValueError, match="positive sum"):
        get_train_valid_test_split("0,0,0", 10)
    for split in ("nan,1,1", "inf,1,1", "1,inf"):  # float() takes them; round() did not
        with pytest.raises(ValueError, match=rf"--split '{split}': weights must be finite"):
            get_train_valid_test_split(split, 10)


def test_a_split_whose_rounding_leaves_train_below_zero_is_named(tmp_path):
    """--split 0,1,1 over 3 documents: valid and test each round 1.5 up to 2, one document
    too many, and train has none to give back. Megatron's arithmetic puts the first
    boundary at -1 (validation would start at document -1, the last one, which test reads
    too; its dataset stops on an assertion): a one-line error naming the --split and a
    split that works, also from the builder (it said only that documents must be a subset
    of [0, 3)), and from the dry run's check of a run that only evaluates."""
    assert mref.split_bounds("0,1,1", 3) == [0, -1, 1, 3]
    message = ("--split '0,1,1' over 3 documents rounds to 0 + 2 + 2 = 4 documents, more than "
               "there are, and train has none to give back (Megatron-LM's first boundary would "
               "be -1: it stops on an assertion); give train a share, or valid and test shares "
               "that add up to 3 documents, e.g. --split 0,2,1")
    with pytest.raises(ValueError) as info:
        get_train_valid_test_split("0,1,1", 3)
    assert str(info.value) == message
    assert get_train_valid_test_split("0,2,1", 3) == [0, 0, 2, 3]
    prefix, _ = make_corpus(tmp_path / "c", [20] * 3)
    for counts in ([0, 4, 4], [4, 4, 4]):
        with pytest.raises(ValueError) as info:
            build_train_valid_test_datasets([prefix], "0,1,1", counts, 8, 1)
        assert str(info.value) == message
        with pytest.raises(ValueError) as info:
            gd.check_splits([prefix], "0,1,1", counts)
        assert str(info.value) == message


@pytest.mark.parametrize("weight", ["nan", "inf", "-inf"])
def test_data_path_weights_must_be_finite(weight):
    """A weight of nan or inf stopped the dataset builder with 'cannot convert float NaN to
    integer', naming neither --data-path nor the weight."""
    from megatron.core.datasets.blended import parse_weighted_prefixes

    with pytest.raises(ValueError, match="data path weights .* must be finite numbers"):
        parse_weighted_prefixes([weight, "a", "1", "b"])


def test_builder_logs_the_split_and_the_epochs_of_each_dataset(tmp_path):
    """Megatron-LM prints each prefix's document split and each dataset's epoch count:
    a run that loops 20 times over a corpus too small for it can be seen at start-up."""
    prefix, _ = make_corpus(tmp_path / "c", [20] * 30)
    lines = []
    train, _, _ = build_train_valid_test_datasets([prefix], "90,10,0", [200, 2, 1], 8, 1234,
                                                  str(tmp_path / "cache"), log=lines.append)
    assert lines[:4] == [f" > dataset split of {prefix} (30 documents, --split '90,10,0'):",
                         "    train: document indices in [0, 27) total of 27 documents",
                         "    validation: document indices in [27, 30) total of 3 documents",
                         "    test: document indices in [30, 30) total of 0 documents"]
    assert lines[4] == " > building the missing dataset indices on global rank 0 ..."
    epochs = len(train.doc_idx) // 27
    cache = tmp_path / "cache"  # the last place looked at
    assert epochs > 1 and re.fullmatch(
        rf"    train dataset of {prefix}: {len(train)} samples of 8 tokens, {epochs} epoch\(s\) "
        rf"over 27 documents \(index built into {cache} in \d+\.\d\d s\)", lines[5]), lines[5]
    assert lines[6].startswith(f"    validation dataset of {prefix}: ") and len(lines) == 7


def test_builder_logs_what_it_builds_reads_and_how_long_a_blend_took(tmp_path):
    """With other ranks waiting, the builder rank says once that it builds (they print
    nothing meanwhile); each dataset line says where its index was read from or built
    into; a blend built prints Megatron-LM's line before and its elapsed time after (a
    blend of many datasets over many samples takes minutes)."""
    a, _ = make_corpus(tmp_path / "a", [20] * 30, seed=1)
    b, _ = make_corpus(tmp_path / "b", [30] * 30, seed=2)
    cache = tmp_path / "cache"
    args = (["1", a, "3", b], "90,10,0", [50, 5, 0], 8, 1234, str(cache))
    lines = []
    build_train_valid_test_datasets(*args, barrier=lambda: None, log=lines.append)
    announce = (" > building the missing dataset indices on global rank 0; the other ranks "
                "wait for it ...")
    assert lines.count(announce) == 1 and lines.index(announce) < lines.index(
        next(x for x in lines if x.startswith("    train dataset of")))
    assert sum(f"(index built into {cache} in " in x for x in lines) == 4
    blend = lines.index("> building indices for blendable datasets ... (--data-path (train): 2 "
                        "datasets, 51 samples)")
    assert lines[blend + 1] == " > blended dataset for --data-path (train): 51 samples; sample " \
        "ratios:"
    assert re.fullmatch(r"> elapsed time for building blendable dataset indices: \d+\.\d\d "
                        r"\(sec\)", lines[blend + 4]), lines[blend + 4]
    lines.clear()  # again: every index read, nothing built, nothing announced
    build_train_valid_test_datasets(*args, barrier=lambda: None, log=lines.append)
    assert sum(f"(index read from {cache})" in x for x in lines) == 4
    assert not [x for x in lines if "building" in x or "built" in x or "elapsed" in x]


def test_cache_names_reuse_and_lookup(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    prefix, _ = make_corpus(tmp_path / "data" / "c", [20] * 30)
    cache = tmp_path / "cache"
    train, valid, test = build_train_valid_test_datasets([prefix], "969, 30, 1", [10, 2, 1], 8,
                                                         1234, str(cache))
    desc = ("GPT Dataset\n\n" f"Data prefix {prefix}\n" "Dataset name train\n"
            "Number of samples 10\n" "Sequence length 8\n" "Random seed 1234\n"
            "Split 969, 30, 1\n")
    h = hashlib.md5(desc.encode("utf-8")).hexdigest()
    assert train.desc == desc and train.desc_hash == h
    for suffix in (".dsc", "_doc_idx.npy", "_sample_idx.npy", "_shuffle_idx.npy"):
        assert (cache / (h + suffix)).is_file()
    assert (cache / (h + ".dsc")).read_text() == desc
    assert valid is not None and test is None  # 30 docs: test split is empty
    first = [train[i]["text"].tolist() for i in range(len(train))]

    def fail(*args, **kwargs):
        raise AssertionError("index rebuilt although cached")

    monkeypatch.setattr(gd, "build_index_arrays", fail)
    again, _, _ = build_train_valid_test_datasets([prefix], "969, 30, 1", [10, 2, 1], 8, 1234,
                                                  str(cache))
    assert [again[i]["text"].tolist() for i in range(len(again))] == first
    # Files in <dirname(prefix)>/index-cache are found first.
    (tmp_path / "data" / "index-cache").mkdir()
    for f in cache.iterdir():
        os.replace(f, tmp_path / "data" / "index-cache" / f.name)
    third, _, _ = build_train_valid_test_datasets([prefix], "969, 30, 1", [10, 2, 1], 8, 1234,
                                                  str(cache))
    assert "index-cache" in third.cache_paths["doc"]
    with pytest.raises(AssertionError, match="rebuilt"):  # a different split string: new hash
        build_train_valid_test_datasets([prefix], "969,30,1", [10, 2, 1], 8, 1234, str(cache))


def test_no_data_error():
    with pytest.raises(ValueError, match="--data-path"):
        build_train_valid_test_datasets(None, "1", [1, 1, 1], 8, 1)


# ---------------------------------------------------------------- builder rank + barrier


def _two_ranks(rank, world_size, prefix, cache):
    import torch.distributed as dist

    train, _, _ = build_train_valid_test_datasets([prefix], "1", [25, 0, 0], 8, 3, cache,
                                                  is_builder_rank=rank == 0,
                                                  barrier=dist.barrier)
    return torch.tensor(np.stack([train[i]["text"] for i in range(len(train))]))


def test_builder_rank_and_barrier(tmp_path):
    prefix, _ = make_corpus(tmp_path / "c", [11] * 20)
    cache = str(tmp_path / "cache")
    out = run_distributed(_two_ranks, 2, prefix, cache)
    assert torch.equal(out[0], out[1]) and out[0].shape[1] == 9
    assert len(os.listdir(cache)) == 4
    with pytest.raises(ValueError, match="missing on this rank after the builder rank .* every node sees"):
        build_train_valid_test_datasets([prefix], "1", [26, 0, 0], 8, 3, cache,
                                        is_builder_rank=False)


def test_blends_kept_in_memory_are_built_after_the_barrier(tmp_path):
    """Without a cache dir a blend's indices live in each rank's memory, so every rank
    builds them: the builder rank builds its own after the barrier, beside the others (it
    built them before, and the others waited for that: twice the time of one build).
    A blend written to the cache dir is built before the barrier, and read by the others."""
    a, _ = make_corpus(tmp_path / "a", [20] * 30, seed=1)
    b, _ = make_corpus(tmp_path / "b", [30] * 30, seed=2)
    path, counts = ["1", a, "3", b], [50, 5, 0]
    for cache, after in ((None, True), (str(tmp_path / "cache"), False)):
        lines = []
        train, valid, _ = build_train_valid_test_datasets(
            path, "90,10,0", counts, 8, 1234, cache, barrier=lambda: lines.append("BARRIER"),
            log=lines.append)
        blends = [i for i, x in enumerate(lines) if x.startswith("> building indices for blend")]
        assert len(blends) == 2 and (min(blends) > lines.index("BARRIER")) == after, lines
        assert len([x for x in lines if x.startswith("    train dataset of")]) == 2, lines
        assert len([x for x in lines if x.startswith(" > dataset split of")]) == 2, lines
        alone = build_train_valid_test_datasets(path, "90,10,0", counts, 8, 1234, cache)
        for got, want in ((train, alone[0]), (valid, alone[1])):
            np.testing.assert_array_equal(got.dataset_index, want.dataset_index)
            assert [got[i]["text"].tolist() for i in range(len(got))] == \
                [want[i]["text"].tolist() for i in range(len(want))]


@pytest.mark.slow
def test_ten_billion_token_index_is_fast(tmp_path):
    """5M documents of 2000 tokens, seq 2048: the whole index in well under 10 s of CPU
    time (~2 s here). This process's CPU time, not wall time: on a busy machine (CI's
    `-n 2` on two cores, other jobs) the wall time of the same work passed 10 s."""
    import time

    sizes = np.full(5_000_000, 2000, dtype=np.int32)
    documents = np.arange(len(sizes), dtype=np.int32)
    num_samples = (10_000_000_000 - 1) // 2048
    start = time.process_time()
    doc_idx, sample_idx, shuffle_idx = gi.build_index_arrays(documents, sizes, num_samples,
                                                             2048, 1234)
    elapsed = time.process_time() - start
    assert len(shuffle_idx) == num_samples and elapsed < 10, elapsed
    # Spot-check the vectorised sample index against the running token count.
    ends = np.cumsum(sizes[doc_idx].astype(np.int64))
    for i in (1, 12345, num_samples):
        k, off = sample_idx[i]
        assert ends[k] - sizes[doc_idx[k]] + off == i * 2048


def test_datasets_pickle(tmp_path):
    import pickle

    prefix, _ = make_corpus(tmp_path / "c", [13] * 12)
    train, _, _ = build_train_valid_test_datasets([prefix], "1", [20, 0, 0], 8, 5,
                                                  str(tmp_path / "cache"))
    clone = pickle.loads(pickle.dumps(train))
    for i in range(len(train)):
        np.testing.assert_array_equal(clone[i]["text"], train[i]["text"])


# ---------------------------------------------------------------- whole builder vs reference

from tests import megatron_data_reference as mref  # noqa: E402

SHAPES = {  # name: (document sizes per prefix, --data-path, --split, samples per split, seq)
    # documents of 1-3 tokens, many epochs; --split 98,2,0 leaves test empty
    "tiny-docs": ({"a": [1, 2, 3, 1, 1, 2] * 20}, ["a"], "98,2,0", [400, 40, 0], 16),
    # documents longer than a sample, one epoch
    "long-docs": ({"a": [50, 130, 77, 200, 64] * 4}, ["a"], "969, 30, 1", [60, 4, 1], 8),
    # 1000 tokens of train documents, S=10: 100 samples a second epoch needs 1, apart
    "last-epoch-apart": ({"a": [10] * 100}, ["a"], "1", [100, 0, 0], 10),
    # ... needs 80 of the 99 an epoch gives (>= 0.8 x 99 = 79): shuffled with the others
    "last-epoch-together": ({"a": [10] * 100}, ["a"], "1", [179, 0, 0], 10),
    # ... needs 78 (< 79): apart
    "last-epoch-apart-78": ({"a": [10] * 100}, ["a"], "1", [177, 0, 0], 10),
    # three datasets, uneven weights (3 : 1 : 0.25), every split of 969,30,1 populated
    "blend-3": ({"a": [7, 30, 2, 11] * 150, "b": [40, 3] * 300, "c": [5] * 700},
                ["3", "a", "1", "b", "0.25", "c"], "969,30,1", [900, 120, 40], 12),
    # two datasets, weights that do not sum to 1, --split 98,2,0
    # a blend of one (`--data-path 1 a`): ceil(n x 1.005) samples, wrapped as a blend
    "blend-1": ({"a": [13, 4, 25] * 30}, ["1", "a"], "90,10,0", [200, 20, 0], 8),
    "blend-2": ({"a": [9, 14, 3] * 40, "b": [21, 2, 8, 1] * 30}, ["0.7", "a", "0.6", "b"],
                "98,2,0", [300, 60, 0], 8),
}


def test_split_boundaries_match_the_reference_for_every_size():
    """Every document count up to 2000 (shares landing on .5 round half to even)."""
    for split in ("969,30,1", "969, 30, 1", "98,2,0", "1,1", "1/1/1", "3", "949,50,1",
                  "80,10,10,5", "0.5,0.25,0.25", "2,3"):
        for n in range(1, 2001):
            assert get_train_valid_test_split(split, n) == mref.split_bounds(split, n), (split, n)


def _build_shape(tmp_path, shape):
    sizes, data_path, split, counts, seq = SHAPES[shape]
    corpora, prefixes = {}, {}
    for i, (name, doc_sizes) in enumerate(sizes.items()):
        prefix, docs = make_corpus(tmp_path / name, doc_sizes, seed=10 + i)
        corpora[prefix], prefixes[name] = docs, prefix
    path = [prefixes.get(x, x) for x in data_path]
    ours = build_train_valid_test_datasets(path, split, counts, seq, 1234,
                                           str(tmp_path / "cache"))
    return ours, mref.reference_datasets(corpora, path, split, counts, seq, 1234)


def _assert_same_gpt(got, want, what):
    np.testing.assert_array_equal(np.asarray(got.doc_idx), want.doc_idx, err_msg=what)
    np.testing.assert_array_equal(np.asarray(got.sample_idx), want.sample_idx, err_msg=what)
    np.testing.assert_array_equal(np.asarray(got.shuffle_idx), want.shuffle_idx, err_msg=what)
    assert (got.doc_idx.dtype, got.sample_idx.dtype, got.shuffle_idx.dtype) == (
        want.doc_idx.dtype, want.sample_idx.dtype, want.shuffle_idx.dtype), what
    assert got.desc == want.desc and got.desc_hash == mref.cache_name(want.desc), what


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_builder_matches_the_megatron_reference(tmp_path, shape):
    """Each split's doc_idx, sample_idx, shuffle_idx (values and dtypes), descriptions, the
    blend's dataset_index / dataset_sample_index and sizes (ceil(n * w * 1.005) per member),
    and every sample's tokens, against tests/megatron_data_reference.py."""
    ours, ref = _build_shape(tmp_path, shape)
    for split, got, want in zip(("train", "valid", "test"), ours, ref):
        what = f"{shape} {split}"
        assert (got is None) == (want is None), what
        if want is None:
            continue
        assert len(got) == len(want), what
        if isinstance(want, mref.RefBlend):
            assert isinstance(got, BlendedDataset) and len(got.datasets) == len(want.members)
            np.testing.assert_array_equal(got.weights, want.weights, err_msg=what)
            np.testing.assert_array_equal(got.dataset_index, want.dataset_index, err_msg=what)
            np.testing.assert_array_equal(got.dataset_sample_index, want.dataset_sample_index,
                                          err_msg=what)
            assert got.dataset_index.dtype == np.uint8 and got.dataset_sample_index.dtype == np.int64
            for g, w in zip(got.datasets, want.members):
                _assert_same_gpt(g, w, what)
        else:
            _assert_same_gpt(got, want, what)
        for i in range(len(want)):
            np.testing.assert_array_equal(got[i]["text"], want[i], err_msg=f"{what} sample {i}")


def test_reference_shapes_cover_what_they_claim(tmp_path):
    """The shapes above reach the cases they are named for (a guard on the test itself)."""
    ref = {}
    for shape in ("tiny-docs", "long-docs", "last-epoch-apart", "last-epoch-together",
                  "last-epoch-apart-78"):
        (tmp_path / shape).mkdir()
        ref[shape] = _build_shape(tmp_path / shape, shape)[1]
    assert len(ref["tiny-docs"][0].doc_idx) > 10 * 117 and ref["tiny-docs"][2] is None
    assert len(ref["long-docs"][0].doc_idx) == 19  # one epoch of the 19 train documents
    for name, apart in (("last-epoch-apart", True), ("last-epoch-together", False),
                        ("last-epoch-apart-78", True)):
        shuffle = ref[name][0].shuffle_idx
        assert len(shuffle) == 199
        assert (sorted(shuffle[:99]) == list(range(99))) == apart, name



def test_separate_data_paths_match_the_megatron_reference(tmp_path):
    """--train-data-path (a weighted pair), --valid-data-path (one file), no test path:
    every document of each file, the --split string only in the descriptions."""
    corpora, prefixes = {}, []
    for i, sizes in enumerate(([9, 31, 4] * 30, [17, 2] * 40, [6, 50, 11] * 10)):
        prefix, docs = make_corpus(tmp_path / f"c{i}", sizes, seed=40 + i)
        corpora[prefix] = docs
        prefixes.append(prefix)
    paths = (["0.8", prefixes[0], "0.4", prefixes[1]], [prefixes[2]], None)
    counts = [250, 30, 10]
    ours = build_train_valid_test_datasets(None, "969, 30, 1", counts, 16, 99,
                                           str(tmp_path / "cache"), *paths)
    ref = mref.reference_separate_datasets(corpora, paths, "969, 30, 1", counts, 16, 99)
    assert ours[2] is None and ref[2] is None
    np.testing.assert_array_equal(ours[0].dataset_index, ref[0].dataset_index)
    np.testing.assert_array_equal(ours[0].dataset_sample_index, ref[0].dataset_sample_index)
    for got, want in list(zip(ours[0].datasets, ref[0].members)) + [(ours[1], ref[1])]:
        _assert_same_gpt(got, want, got.desc)
    for got, want in zip(ours[:2], ref[:2]):
        assert len(got) == len(want)
        for i in range(len(want)):
            np.testing.assert_array_equal(got[i]["text"], want[i])


def test_same_layout_range_bounds_the_counts_with_one_index_layout():
    """`same_layout_range` (a resume's 'keeps the saved order' advice) against every count:
    all inside share the layout of the count asked about, the neighbours outside do not."""
    from megatron.core.datasets.gpt_index import index_layout, same_layout_range

    for tokens, seq in [(100, 7), (57, 16), (640, 16), (16, 16), (17, 16), (5, 16)]:
        for n in range(0, 8 * max(tokens // seq, 1) + 40):
            lo, hi = same_layout_range(tokens, seq, n)
            layout = index_layout(tokens, seq, n)
            assert lo <= n <= hi
            assert all(index_layout(tokens, seq, m) == layout for m in range(lo, hi + 1))
            assert index_layout(tokens, seq, hi + 1) != layout
            assert lo == 0 or index_layout(tokens, seq, lo - 1) != layout
