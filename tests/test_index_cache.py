"""A cached GPT index is used only for the dataset it fits: stale sets (another document
range under the same name, data preprocessed again) and unreadable files are reported."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

from megatron.core.datasets import gpt_dataset as gd
from megatron.core.datasets import gpt_index as gi
from megatron.core.datasets.blend_cache import blend_cache_paths, blend_key
from megatron.core.datasets.blended import BLENDING_INDEX_VERSION
from megatron.core.datasets.gpt_dataset import build_train_valid_test_datasets
from tests import megatron_data_reference as mref
from tests.test_gpt_dataset import CASES, make_corpus, ref_indices

SPLIT = "969, 30, 1"


@pytest.mark.parametrize("sizes,num_samples,seq_length,seed", CASES)
def test_megatron_built_indexes_are_accepted(sizes, num_samples, seq_length, seed):
    sizes = np.array(sizes, dtype=np.int32)
    documents = np.arange(len(sizes), dtype=np.int32)
    arrays = ref_indices(documents, sizes, num_samples, seq_length, seed)[:3]
    assert gi.index_mismatch(arrays, documents, sizes, num_samples, seq_length) is None
    assert gi.index_mismatch(arrays, documents[:-1], sizes, num_samples, seq_length)
    # Same documents, twice the tokens: the data at the prefix was preprocessed again.
    assert gi.index_mismatch(arrays, documents, sizes * 2, num_samples, seq_length)


@pytest.mark.parametrize("errno_, fix", [
    ("ENOSPC", "the disk is full: free space there (it needs 1.5 KiB), or pass "
               "--data-cache-path with a directory on a disk with room. No partial file was "
               "left under a cache name"),
    ("EDQUOT", "your disk quota there is full: free space within it (it needs 1.5 KiB), or "
               "pass --data-cache-path with a directory on a disk with room in your quota. "
               "No partial file was left under a cache name"),
    ("EACCES", "pass a writable --data-cache-path")])
def test_the_index_cache_write_error_words_its_fix_as_the_blend_cache_does(errno_, fix):
    """The index cache's write error said 'the disk, your quota or a file-size limit is
    full' for all three; it now names which, as the blend cache's does (one helper)."""
    import errno

    from megatron.core.datasets.index_cache import cache_write_error

    e = OSError(getattr(errno, errno_), os.strerror(getattr(errno, errno_)), "/c/x.npy")
    arrays = (np.zeros(256, np.int32), np.zeros(128, np.int32))  # 1.5 KiB
    assert cache_write_error("/c", e, arrays) == (
        f"cannot write the dataset index cache to /c ({e.strerror}: /c/x.npy); {fix}")


@pytest.mark.parametrize("errno_, why", [
    ("ENOSPC", "the disk is full: free space there (it needs 1.8 KiB)"),
    ("EDQUOT", "your disk quota there is full: free space within it (it needs 1.8 KiB)"),
    ("EFBIG", "the process's file-size limit (ulimit -f) is smaller than the cache")])
def test_a_full_disk_found_by_the_blend_write_probe_is_named(tmp_path, monkeypatch, errno_,
                                                             why):
    """The trial write before a blend's build said 'pass a writable --data-cache-path' for
    a full disk or quota too; now it names which and the room the blend's cache needs."""
    import errno

    from megatron.core.datasets import index_cache

    (tmp_path / "data").mkdir()
    a, _ = make_corpus(tmp_path / "data" / "a", [30] * 40, seed=1)
    b, _ = make_corpus(tmp_path / "data" / "b", [17] * 60, seed=2)
    path, split, counts = ["0.3", a, "0.7", b], "100,0,0", [200, 0, 0]
    build_train_valid_test_datasets(path, split, counts, 16, 7)  # members' indexes
    real = index_cache.create_new_beside

    def full(target, *args, **kwargs):
        if os.path.basename(target) == "write-test":
            raise OSError(getattr(errno, errno_), os.strerror(getattr(errno, errno_)))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(index_cache, "create_new_beside", full)
    cache = str(tmp_path / "cache")
    with pytest.warns(UserWarning) as got:
        build_train_valid_test_datasets(path, split, counts, 16, 7, cache)
    texts = [str(w.message) for w in got]
    assert len(texts) == 1 and why in texts[0], texts
    assert "writable" not in texts[0] and texts[0].endswith("to keep them")


@pytest.mark.parametrize("chunk", [3, 1 << 22])
def test_the_check_reads_in_blocks_and_counts_every_document(monkeypatch, chunk):
    """The check walks the arrays in blocks (memory bounded for any index): blocks of 3
    rows give the same verdicts as one block; a doc_idx with one document twice and
    another missing (same length, same range) is refused."""
    monkeypatch.setattr(gi, "_CHUNK", chunk)
    sizes, num_samples, seq_length, seed = CASES[-1]
    sizes = np.array(sizes, dtype=np.int32)
    documents = np.arange(len(sizes), dtype=np.int32)
    doc_idx, sample_idx, shuffle_idx = ref_indices(documents, sizes, num_samples, seq_length,
                                                   seed)[:3]
    assert gi.index_mismatch((doc_idx, sample_idx, shuffle_idx), documents, sizes,
                             num_samples, seq_length) is None
    swapped = np.array(doc_idx)
    first = int(swapped[0])
    other = int(documents[documents != first][0])
    swapped[swapped == other] = first
    missing = gi.index_mismatch((swapped, sample_idx, shuffle_idx), documents, sizes,
                                num_samples, seq_length)
    assert missing is not None and "does not hold each of the" in missing


def _cache_files(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def test_whole_file_index_is_not_reused_for_the_train_split(tmp_path):
    (tmp_path / "data").mkdir()
    prefix, _ = make_corpus(tmp_path / "data" / "c", [20] * 30)
    index_cache = tmp_path / "data" / "index-cache"
    whole, _, _ = build_train_valid_test_datasets(None, SPLIT, [10, 2, 1], 8, 1234,
                                                  train_data_path=[prefix])
    assert int(np.max(whole.doc_idx)) == 29
    built = _cache_files(index_cache)
    with pytest.raises(ValueError, match=r"the train dataset of .*c \(documents 0\.\.28\) "
                                         r"does not match it \(.*index-cache: doc_idx has 30 "
                                         r"entries, not 1 epochs x 29 documents\).*Stale files: "
                                         r".*_doc_idx\.npy.*delete them.*--data-cache-path"):
        build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1234)
    assert _cache_files(index_cache) == built, "the stale files are left alone"
    cache = str(tmp_path / "cache")
    with pytest.warns(UserWarning, match="ignoring the index cache"):
        train, _, _ = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1234,
                                                      cache)
    assert int(np.max(train.doc_idx)) == 28 and "cache" in train.cache_paths["doc"]
    # Each configuration keeps finding its own index from now on.
    with pytest.warns(UserWarning, match=r"ignoring the index cache .*index-cache/\w+\{\.dsc"):
        again, _, _ = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1234,
                                                      cache)
    assert again.cache_paths == train.cache_paths
    whole2, _, _ = build_train_valid_test_datasets(None, SPLIT, [10, 2, 1], 8, 1234, cache,
                                                   train_data_path=[prefix])
    assert whole2.cache_paths == whole.cache_paths


def test_every_stale_index_is_named_in_one_error(tmp_path):
    """After --train-data-path X --valid-data-path X, --data-path X finds both whole-file
    indexes under its train and valid names: one error names both (not one per start),
    and nothing is built or touched meanwhile."""
    (tmp_path / "data").mkdir()
    prefix, _ = make_corpus(tmp_path / "data" / "c", [20] * 30)
    index_cache = tmp_path / "data" / "index-cache"
    build_train_valid_test_datasets(None, SPLIT, [10, 2, 1], 8, 1234, train_data_path=[prefix],
                                    valid_data_path=[prefix])
    built = _cache_files(index_cache)
    with pytest.raises(ValueError) as info:
        build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1234)
    text = str(info.value)
    assert text.startswith("the index caches of 2 datasets do not match them (each was built "
                           "for other data under the same name")
    assert f"\n  the train dataset of {prefix} (documents 0..28): {index_cache}: doc_idx has " \
           "30 entries" in text
    assert f"\n  the valid dataset of {prefix} (documents 29..29): {index_cache}: " in text
    assert text.count("_doc_idx.npy") == 2
    assert text.endswith("\nFix: delete all these files to rebuild, or pass --data-cache-path "
                         "with another directory to build a separate index there")
    assert _cache_files(index_cache) == built, "nothing built while the run cannot start"
    for name in built:
        os.remove(index_cache / name)
    train, valid, _ = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1234)
    assert int(np.max(train.doc_idx)) == 28 and int(np.min(valid.doc_idx)) == 29


def test_index_of_data_preprocessed_again_is_refused(tmp_path):
    prefix, _ = make_corpus(tmp_path / "c", [30] * 200)
    build_train_valid_test_datasets([prefix], SPLIT, [50, 5, 5], 16, 7)
    make_corpus(tmp_path / "c", [30] * 8, seed=3)  # same prefix, other data
    with pytest.raises(ValueError, match=r"does not match it .*Stale files"):
        build_train_valid_test_datasets([prefix], SPLIT, [50, 5, 5], 16, 7)
    make_corpus(tmp_path / "c", [31] * 200, seed=3)  # as many documents, other sizes
    with pytest.raises(ValueError, match=r"do(es)? not match"):
        build_train_valid_test_datasets([prefix], SPLIT, [50, 5, 5], 16, 7)


def test_index_of_data_whose_sizes_moved_by_a_token_is_refused(tmp_path):
    """Preprocessed again with one document a token longer and the next a token shorter
    (same documents, same tokens: every count and bound of the old index still fits), the
    old sample_idx would cut a sample of S+2 tokens and one of S: refused, as the row that
    no longer starts at token i*S. The same sizes with other token ids keep the index (it
    depends on the sizes only): a fresh build would give the same arrays."""
    sizes = [int(x) for x in np.random.default_rng(0).integers(5, 60, 100)]
    prefix, _ = make_corpus(tmp_path / "c", sizes, seed=1)
    build_train_valid_test_datasets([prefix], "98,2,0", [50, 5, 0], 16, 1234)
    make_corpus(tmp_path / "c", sizes, seed=2)  # other ids, same sizes: reused
    train, _, _ = build_train_valid_test_datasets([prefix], "98,2,0", [50, 5, 0], 16, 1234)
    assert train.index_build_s is None
    assert {len(train[i]["text"]) for i in range(len(train))} == {17}
    moved = list(sizes)
    moved[0] += 1
    moved[1] -= 1
    make_corpus(tmp_path / "c", moved, seed=2)
    with pytest.raises(ValueError, match=r"train dataset .*sample_idx row \d+ does not start "
                                         r"at token \d+ of the documents' current sizes"):
        build_train_valid_test_datasets([prefix], "98,2,0", [50, 5, 0], 16, 1234)


@pytest.mark.parametrize("chunk", [2, 5, 1 << 22])
def test_the_sample_start_check_in_blocks(monkeypatch, chunk):
    """The start-token check gives the same verdicts whatever the block size (empty
    documents, several epochs): Megatron's arrays pass, a row moved by a token fails."""
    monkeypatch.setattr(gi, "_CHUNK", chunk)
    for sizes, num_samples, seq_length, seed in CASES:
        sizes = np.array(sizes, dtype=np.int32)
        documents = np.arange(len(sizes), dtype=np.int32)
        doc_idx, sample_idx, _ = ref_indices(documents, sizes, num_samples, seq_length,
                                             seed)[:3]
        assert gi._sample_starts_mismatch(sample_idx, doc_idx, sizes, seq_length) is None
        shifted = np.array(sample_idx)
        row = len(shifted) // 2
        shifted[row, 1] += 1 if shifted[row, 1] == 0 else -1
        assert gi._sample_starts_mismatch(shifted, doc_idx, sizes, seq_length) == (
            f"sample_idx row {row} does not start at token {row * seq_length} of the "
            "documents' current sizes")


def test_truncated_cache_file_is_named(tmp_path):
    prefix, _ = make_corpus(tmp_path / "c", [20] * 30)
    train, _, _ = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1)
    path = train.cache_paths["sample"]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    with pytest.raises(ValueError, match=rf"index cache file {path} is unreadable .*delete it"):
        build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1)
    assert not [n for n in _cache_files(tmp_path / "index-cache") if ".tmp" in n]


def _two_ranks(rank, world_size, prefix, cache):
    import torch.distributed as dist

    kwargs = dict(is_builder_rank=rank == 0, barrier=dist.barrier)
    try:
        build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 5, **kwargs)
    except ValueError as e:
        refused = "Stale files" in str(e)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train, _, _ = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 5, cache,
                                                      **kwargs)
    return {"refused": refused, "doc": train.cache_paths["doc"],
            "max": int(np.max(train.doc_idx))}


def test_stale_index_under_two_ranks(tmp_path):
    from tests.dist_utils import run_distributed

    (tmp_path / "data").mkdir()
    prefix, _ = make_corpus(tmp_path / "data" / "c", [20] * 30)
    build_train_valid_test_datasets(None, SPLIT, [10, 2, 1], 8, 5, train_data_path=[prefix])
    cache = str(tmp_path / "cache")
    out = run_distributed(_two_ranks, 2, prefix, cache)
    assert all(r["refused"] for r in out), "every rank stops, none waits forever"
    assert out[0]["doc"] == out[1]["doc"] and out[0]["doc"].startswith(cache)
    assert out[0]["max"] == out[1]["max"] == 28
    names = os.listdir(cache)
    assert len(names) == 8 and not [n for n in names if ".tmp" in n]  # train and valid


@pytest.mark.parametrize("damage", ["truncate", "extend", "key"])
def test_a_damaged_blend_cache_is_warned_about_and_rebuilt(tmp_path, damage):
    """A blend cache file cut short (an interrupted copy), grown, or a key file of another
    blend is not loaded (a truncated .npy stopped the run; a grown one would have been read
    as it was): one warning naming the file, then the blend is built and written again,
    the same arrays as the first build."""
    a, _ = make_corpus(tmp_path / "a", [30] * 40, seed=1)
    b, _ = make_corpus(tmp_path / "b", [17] * 60, seed=2)
    cache = tmp_path / "cache"
    args = (["0.3", a, "0.7", b], "90,10,0", [200, 20, 0], 16, 7, str(cache))
    first = build_train_valid_test_datasets(*args)[0]
    want = (np.array(first.dataset_index), np.array(first.dataset_sample_index))
    assert not [n for n in _cache_files(cache) if ".tmp" in n]
    paths = first.cache_paths
    path = paths["key"] if damage == "key" else paths["sample_index"]
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(os.path.getsize(path) - 8)
        elif damage == "extend":
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * 8)
        else:
            f.write(b"Blending indices\nBuilder version 0\n")
    with pytest.warns(UserWarning, match=rf"ignoring the blending index cache in {cache} "
                                         rf"\({path}: .*\); building the blend again") as got:
        again = build_train_valid_test_datasets(*args)[0]
    assert len([w for w in got if "blending index cache" in str(w.message)]) == 1
    assert again.build_s is not None and again.cache_paths == paths
    np.testing.assert_array_equal(again.dataset_index, want[0])
    np.testing.assert_array_equal(again.dataset_sample_index, want[1])
    third = build_train_valid_test_datasets(*args)[0]  # the rebuilt set is read
    assert third.build_s is None and np.array_equal(third.dataset_sample_index, want[1])


def test_a_blend_cache_another_run_is_still_writing_is_built_without_a_warning(tmp_path):
    """Two runs sharing a cache dir: one has renamed its arrays into place but not yet its
    key file (written last, so a set without it is incomplete, not damaged). The other
    builds the blend itself and writes it, as when nothing is there; it used to warn that
    it ignored a damaged cache ('No such file or directory')."""
    import warnings

    a, _ = make_corpus(tmp_path / "a", [30] * 40, seed=1)
    b, _ = make_corpus(tmp_path / "b", [17] * 60, seed=2)
    cache = tmp_path / "cache"
    args = (["0.3", a, "0.7", b], "90,10,0", [200, 20, 0], 16, 7, str(cache))
    first = build_train_valid_test_datasets(*args)[0]
    want = np.array(first.dataset_sample_index)
    os.remove(first.cache_paths["key"])  # the other run's arrays are there, its key not yet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = build_train_valid_test_datasets(*args)[0]
    assert again.build_s is not None and again.cache_paths == first.cache_paths
    np.testing.assert_array_equal(again.dataset_sample_index, want)
    assert os.path.isfile(first.cache_paths["key"])


def test_cache_files_go_through_fresh_temporary_names(tmp_path):
    """Each file was written through `<file>.tmp<pid>`, opened without O_EXCL: a link there
    (planted in a shared data directory) had the build write through it into its target,
    and two jobs on shared storage with equal process ids (containers) wrote one file. Now
    a fresh name is created exclusively, and the files get the umask's mode (readable by
    the other users of a shared cache)."""
    (tmp_path / "data").mkdir()
    prefix, _ = make_corpus(tmp_path / "data" / "c", [20] * 30)
    train, _, _ = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1)
    victim = tmp_path / "victim.txt"
    victim.write_text("not the cache's")
    for path in train.cache_paths.values():
        os.remove(path)
        os.symlink(victim, f"{path}.tmp{os.getpid()}")
    umask = os.umask(0o022)
    try:
        again, _, _ = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1)
    finally:
        os.umask(umask)
    assert victim.read_text() == "not the cache's"
    assert np.array_equal(again.doc_idx, train.doc_idx)
    for path in again.cache_paths.values():
        assert not os.path.islink(path) and os.stat(path).st_mode & 0o777 == 0o644, path


def _three_corpora(tmp_path):
    (tmp_path / "data").mkdir()
    corpora = {}
    for i, sizes in enumerate(([9, 40, 3] * 200, [12, 5] * 260, [70] * 510)):
        prefix, docs = make_corpus(tmp_path / "data" / f"c{i}", sizes, seed=i)
        corpora[prefix] = docs
    p = list(corpora)
    return corpora, ["5", p[0], "2", p[1], "1", p[2]]


def test_cache_files_are_megatrons_names_and_arrays(tmp_path):
    """The files a build writes: for each split of each blended dataset
    md5(description).{dsc,_doc_idx.npy,_sample_idx.npy,_shuffle_idx.npy} (Megatron's) and
    for each blend blend-K.{dsc,_index.npy,_sample_index.npy} (ours: K names the exact
    weights, the size and the builder's version), all in --data-cache-path (the last
    directory looked in), nothing in <data dir>/index-cache/; each .npy holds the
    reference's array (dtype, shape, values) and loads as Megatron loads it."""
    corpora, path = _three_corpora(tmp_path)
    cache = tmp_path / "cache"
    counts = [500, 60, 20]
    build_train_valid_test_datasets(path, "969,30,1", counts, 16, 31, str(cache))
    ref = mref.reference_datasets(corpora, path, "969,30,1", counts, 16, 31)
    expected = set()
    for blend in ref:
        for member in blend.members:
            h = mref.cache_name(member.desc)
            expected |= {h + ".dsc", h + "_doc_idx.npy", h + "_sample_idx.npy",
                         h + "_shuffle_idx.npy"}
            where = cache
            assert (where / f"{h}.dsc").read_text() == member.desc
            for suffix, want in (("_doc_idx.npy", member.doc_idx),
                                 ("_sample_idx.npy", member.sample_idx),
                                 ("_shuffle_idx.npy", member.shuffle_idx)):
                got = np.load(where / (h + suffix), allow_pickle=True, mmap_mode="r")
                assert got.dtype == want.dtype and got.shape == want.shape, suffix
                np.testing.assert_array_equal(got, want)
        key = blend_key(blend.weights, blend.size, BLENDING_INDEX_VERSION)
        paths = blend_cache_paths(str(cache), key)
        assert open(paths["key"]).read() == key
        index = np.load(paths["index"], allow_pickle=True)
        sample_index = np.load(paths["sample_index"], allow_pickle=True)
        assert index.dtype == np.uint8 and sample_index.dtype == np.int64
        np.testing.assert_array_equal(index, blend.dataset_index)
        np.testing.assert_array_equal(sample_index, blend.dataset_sample_index)
        expected |= {os.path.basename(p) for p in paths.values()}
    assert set(_cache_files(cache)) == expected
    assert not (tmp_path / "data" / "index-cache").exists()


def test_a_megatron_written_cache_is_used_as_it_is(tmp_path, monkeypatch):
    """Index files Megatron wrote (np.save with allow_pickle=True, under its names) in
    <data dir>/index-cache/ are loaded, not rebuilt, and give the reference's samples."""
    corpora, path = _three_corpora(tmp_path)
    prefix = path[1]
    counts = [300, 30, 10]
    ref = mref.reference_datasets(corpora, [prefix], "98,2,0", counts, 32, 9)
    where = tmp_path / "data" / "index-cache"
    where.mkdir()
    for member in ref[:2]:
        h = mref.cache_name(member.desc)
        (where / f"{h}.dsc").write_text(member.desc)
        for suffix, array in (("_doc_idx.npy", member.doc_idx),
                              ("_sample_idx.npy", member.sample_idx),
                              ("_shuffle_idx.npy", member.shuffle_idx)):
            np.save(where / (h + suffix), array, allow_pickle=True)

    def rebuilt(*args, **kwargs):
        raise AssertionError("the index was rebuilt, not loaded")

    monkeypatch.setattr(gd, "build_index_arrays", rebuilt)
    ours = build_train_valid_test_datasets([prefix], "98,2,0", counts, 32, 9)
    assert ours[2] is None and ref[2] is None
    for got, want in zip(ours[:2], ref[:2]):
        assert got.cache_paths["doc"].startswith(str(where))
        assert [got[i]["text"].tolist() for i in range(len(got))] == \
            [want[i].tolist() for i in range(len(want))]


def test_an_unwritable_cache_dir_for_the_blend_is_warned_and_built_in_memory(tmp_path):
    """The members' indexes found in `index-cache/` beside the data, the blend's to be
    written into a --data-cache-path that cannot be created: one warning naming the
    directory and the fix (for the train and the validation blend), and the blends are
    built in memory (the run stopped with a ValueError, though a blend needs no file)."""
    (tmp_path / "data").mkdir()
    a, _ = make_corpus(tmp_path / "data" / "a", [30] * 40, seed=1)
    b, _ = make_corpus(tmp_path / "data" / "b", [17] * 60, seed=2)
    path, split, counts = ["0.3", a, "0.7", b], "90,10,0", [200, 20, 0]
    want = build_train_valid_test_datasets(path, split, counts, 16, 7)[0]  # data/index-cache
    (tmp_path / "file").write_text("")
    cache = str(tmp_path / "file" / "cache")  # under a regular file: never a directory
    with pytest.warns(UserWarning) as got:
        train = build_train_valid_test_datasets(path, split, counts, 16, 7, cache)[0]
    assert [str(w.message) for w in got] == [
        f"cannot write the blending index cache to {cache} ([Errno 20] Not a directory: "
        f"'{cache}'): the blends are built again at every start, on every rank; pass a "
        "writable --data-cache-path to keep them"]
    assert train.cache_paths is None and train.build_s is not None
    np.testing.assert_array_equal(train.dataset_index, want.dataset_index)
    np.testing.assert_array_equal(train.dataset_sample_index, want.dataset_sample_index)


@pytest.mark.parametrize("chunk", [3, 1 << 22])
@pytest.mark.parametrize("case", [1, 2])  # one permutation; the last epoch shuffled apart
def test_a_shuffle_idx_that_is_not_megatrons_permutation_is_refused(monkeypatch, chunk, case):
    """A shuffle_idx with a sample twice and another not at all (same length, same bounds)
    would have training read one sample twice an epoch and skip another, silently: refused
    in any block size. With the last epoch shuffled apart (Megatron permutes the first E-1
    epochs' samples and the last epoch's separately), one whose halves trade a sample is a
    permutation of the whole but not Megatron's: refused too."""
    monkeypatch.setattr(gi, "_CHUNK", chunk)
    sizes, num_samples, seq_length, seed = CASES[case]
    sizes = np.array(sizes, dtype=np.int32)
    documents = np.arange(len(sizes), dtype=np.int32)
    doc_idx, sample_idx, shuffle_idx, _, separate = ref_indices(documents, sizes, num_samples,
                                                                seq_length, seed)

    def mismatch(shuffle):
        return gi.index_mismatch((doc_idx, sample_idx, shuffle), documents, sizes, num_samples,
                                 seq_length)

    assert mismatch(shuffle_idx) is None
    twice = np.array(shuffle_idx)
    twice[-1] = twice[-2]
    assert mismatch(twice).endswith(": it never reads 1 of them and reads others more than "
                                    "once (damaged, or written by another tool)")
    assert separate == (case == 2)
    if separate:
        traded = np.array(shuffle_idx)
        traded[[0, -1]] = traded[[-1, 0]]
        assert sorted(traded) == list(range(len(traded)))
        first = len(sample_idx) - 1 - 10  # the last epoch's 10 samples
        assert mismatch(traded).startswith(
            f"shuffle_idx is not a permutation of samples 0..{first - 1} then one of "
            f"{first}..{len(traded) - 1} (the last epoch shuffled apart): its entries 0..")


def test_a_damaged_shuffle_idx_in_the_cache_is_not_used(tmp_path):
    """A cached shuffle_idx repeating a sample takes the path of any mismatching set:
    beside the data with no cache dir, an error naming the files and the fix (never
    overwritten); with a cache dir, a warning and a fresh index there."""
    (tmp_path / "data").mkdir()
    prefix, _ = make_corpus(tmp_path / "data" / "c", [20] * 30)
    train, _, _ = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1234)
    good = np.array(train.shuffle_idx)
    damaged = good.copy()
    damaged[0] = damaged[1]
    np.save(train.cache_paths["shuffle"], damaged)
    with pytest.raises(ValueError, match=r"the train dataset of .*does not match it \(.*"
                                         r"index-cache: shuffle_idx is not a permutation of the "
                                         r"\d+ samples: it never reads 1 of them.*Stale files: "
                                         r".*_shuffle_idx\.npy.*Fix: delete them to rebuild"):
        build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1234)
    np.testing.assert_array_equal(np.load(train.cache_paths["shuffle"]), damaged)
    with pytest.warns(UserWarning, match=r"ignoring the index cache .*shuffle_idx is not a "
                                         r"permutation"):
        fresh, _, _ = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1234,
                                                      str(tmp_path / "cache"))
    assert fresh.index_build_s is not None and "cache" in fresh.cache_paths["shuffle"]
    np.testing.assert_array_equal(np.asarray(fresh.shuffle_idx), good)


def test_a_run_building_the_same_cache_name_at_the_same_time_keeps_its_index(tmp_path,
                                                                               monkeypatch):
    """--data-path X (train split: documents 0..28) and --train-data-path X (all 30) name
    their train indexes alike. Both start, find nothing and build; the second to finish
    replaced the first one's files, and the first one's loader workers (which reopen the
    files by name) then trained on the other run's index -- the validation document 29
    included -- and the builder reloaded its set unchecked. Now a file already there is
    kept, and the set is checked after the build: the later run stops, naming it."""
    (tmp_path / "data").mkdir()
    prefix, _ = make_corpus(tmp_path / "data" / "c", [20] * 30)
    cache = str(tmp_path / "cache")
    build = gi.build_index_arrays
    first = {}

    def while_building(*args, **kwargs):  # the split run starts and finishes meanwhile
        monkeypatch.setattr(gd, "build_index_arrays", build)
        first["train"] = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1234,
                                                         cache)[0]
        return build(*args, **kwargs)

    monkeypatch.setattr(gd, "build_index_arrays", while_building)
    with pytest.raises(ValueError, match=r"the train dataset of .*\(documents 0\.\.29\) does "
                                         r"not match it .*written by another run using this "
                                         r"cache name while this one built its index"):
        build_train_valid_test_datasets(None, SPLIT, [10, 2, 1], 8, 1234, cache,
                                        train_data_path=[prefix])
    train = first["train"]
    train._load()  # as a loader worker does
    assert int(np.max(train.doc_idx)) == 28
    assert not [n for n in _cache_files(cache) if n.endswith(".tmp")]


def test_runs_building_one_index_at_the_same_time_share_it(tmp_path, monkeypatch):
    """Two jobs of one configuration (a slurm array) build the same index at once: the
    later one keeps the files the earlier one wrote and uses them (they are equal)."""
    prefix, _ = make_corpus(tmp_path / "c", [20] * 30)
    cache = str(tmp_path / "cache")
    build = gi.build_index_arrays
    first = {}

    def while_building(*args, **kwargs):
        monkeypatch.setattr(gd, "build_index_arrays", build)
        train = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1, cache)[0]
        first["train"] = train
        first["inodes"] = {k: os.stat(p).st_ino for k, p in train.cache_paths.items()}
        return build(*args, **kwargs)

    monkeypatch.setattr(gd, "build_index_arrays", while_building)
    second = build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1, cache)[0]
    assert {k: os.stat(p).st_ino for k, p in second.cache_paths.items()} == first["inodes"]
    assert np.array_equal(second.shuffle_idx, first["train"].shuffle_idx)
    assert not [n for n in _cache_files(cache) if n.endswith(".tmp")]


def test_temporary_files_of_a_killed_build_are_removed_by_a_later_build(tmp_path):
    """A build killed while writing (SIGKILL, the OOM killer) leaves its temporary file,
    as large as the array; every later build writes under a fresh name, so the files
    piled up for good. A later build removes those untouched for ten minutes;
    a younger one (another run's live write) and other files stay."""
    prefix, _ = make_corpus(tmp_path / "c", [20] * 30)
    cache = tmp_path / "cache"
    cache.mkdir()
    h = "0123456789abcdef0123456789abcdef"
    killed = [f"{h}_shuffle_idx.npy.0123456789ab.tmp", f"{h}.dsc.ba9876543210.tmp",
              f"blend-{h}_index.npy.aaaaaaaaaaaa.tmp"]
    live, other = f"{h}_doc_idx.npy.bbbbbbbbbbbb.tmp", "notes.tmp"
    old = os.path.getmtime(prefix + ".bin") - 86400  # a day
    for name in killed + [live, other]:
        (cache / name).write_bytes(b"\x93NUMPY" + bytes(1000))
        if name != live:
            os.utime(cache / name, (old, old))
    with pytest.warns(UserWarning, match=r"removed 3 temporary file\(s\) of index builds "
                                         r"killed while writing from .*cache"):
        build_train_valid_test_datasets([prefix], SPLIT, [10, 2, 1], 8, 1, str(cache))
    left = _cache_files(cache)
    assert not set(killed) & set(left)
    assert live in left and other in left


_FILE_SIZE_LIMITED = """
import resource, signal, sys
import numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
from megatron.core.datasets.gpt_dataset import build_train_valid_test_datasets
from megatron.core.datasets.index_cache import save_npy
try:
    save_npy(sys.argv[1] + "/small.npy", np.arange(500, dtype=np.int64))
except OSError as exc:
    print("save_npy failed:", exc)
try:
    build_train_valid_test_datasets([sys.argv[1] + "/c"], "969, 30, 1", [2000, 2, 1], 8, 1)
except ValueError as exc:
    print("build failed:", exc)
"""


def test_a_full_disk_leaves_no_truncated_cache_file_and_says_so(tmp_path):
    """A full disk, quota or file-size limit (here RLIMIT_FSIZE) while writing the index:
    numpy's write of a real file buffers in C and drops the error of the last flush, so a
    truncated .npy was renamed into place as complete (the next run stopped on it: 'delete
    it'), and a larger write failed with '4060 requested and 992 written' and the fix
    'pass a writable --data-cache-path'. Now the write fails, no file is left under the
    name, and the error names the reason, the directory, which limit it met and the room
    the index takes, worded as the blend cache's (`cache_write_fix`)."""
    import subprocess
    import sys

    make_corpus(tmp_path / "c", [20] * 30)
    proc = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMITED, str(tmp_path)],
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "save_npy failed: [Errno 27] File too large" in proc.stdout, proc.stdout
    assert not (tmp_path / "small.npy").exists()
    assert re.search(rf"build failed: cannot write the dataset index cache to {tmp_path}/"
                     r"index-cache \(File too large\); the process's file-size limit "
                     r"\(ulimit -f\) is smaller than the cache \(it needs [0-9.]+ KiB\): "
                     r"raise it \(ulimit -f unlimited\) before the run\. No partial file "
                     "was left under a cache name", proc.stdout), proc.stdout
    for name in _cache_files(tmp_path / "index-cache"):
        assert ".tmp" not in name, name
        if not name.endswith(".npy"):
            continue
        arr = np.load(tmp_path / "index-cache" / name)  # whatever is there is complete
        assert arr.size > 0
