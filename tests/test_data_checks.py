"""Checks made when a run opens its data: train documents exist when training is asked
for, token ids fit the padded vocabulary, and blends report their achieved ratios."""
from __future__ import annotations

import dataclasses
import os
import re
import warnings

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import (
    TOKEN_SCAN_BYTES,
    DataFileChangedError,
    IndexedDatasetBuilder,
    MMapIndexedDataset,
    check_token_ids,
)
from megatron.data_loading import build_datasets
from tests import forked_script
from tests.dist_utils import cpu_env
from tests.gpt_helpers import tiny_config
from tests.test_gpt_dataset import make_corpus


def _config(iters=3, skip_train=False, **data):
    cfg = tiny_config(mbs=2, gbs=2, iters=iters)  # padded vocabulary: 128 ids
    cfg.data = dataclasses.replace(cfg.data, mock_data=False, **data)
    cfg.training = dataclasses.replace(cfg.training, eval_interval=2, eval_iters=1,
                                       skip_train=skip_train)
    return cfg


def _build(cfg):
    return build_datasets(cfg, 0, cfg.model.padded_vocab_size)


def test_no_train_data_is_a_clean_error_when_training(tmp_path):
    prefix, _ = make_corpus(tmp_path / "c", [20] * 30, vocab=100)
    with pytest.raises(SystemExit, match=r"^error: could not build the datasets: --split "
                                         r"'0,100,0' gives the train split no documents "
                                         rf"\({prefix}: 30 documents\).*--skip-train"):
        _build(_config(data_path=[prefix], split="0,100,0"))
    with pytest.raises(SystemExit, match=r"no train data is given \(--valid-data-path/"
                                         r"--test-data-path without --train-data-path\)"):
        _build(_config(valid_data_path=[prefix]))
    empty = IndexedDatasetBuilder(str(tmp_path / "e.bin"), np.uint16)
    for _ in range(3):
        empty.end_document()  # documents with no text: no sequence
    empty.finalize(str(tmp_path / "e.idx"))
    with pytest.raises(SystemExit, match=rf"no non-empty documents to train on \({tmp_path}/e: "
                                         r"0 documents\)"):
        _build(_config(data_path=[str(tmp_path / "e")]))
    # Not training: nothing to complain about.
    for cfg in (_config(skip_train=True, data_path=[prefix], split="0,100,0"),
                _config(iters=0, valid_data_path=[prefix])):
        datasets = _build(cfg)
        assert datasets["train"] is None and len(datasets["valid"]) > 0


def test_token_ids_beyond_the_padded_vocabulary(tmp_path):
    prefix, _ = make_corpus(tmp_path / "c", [20] * 30, vocab=1000)
    with pytest.raises(SystemExit, match=rf"{prefix}\.bin: token id \d+ in it is outside the "
                                         r"padded vocabulary of 128 ids.*--vocab-size"):
        _build(_config(data_path=[prefix]))
    fits, _ = make_corpus(tmp_path / "ok", [20] * 30, vocab=128)
    assert _build(_config(data_path=[fits]))["train"] is not None
    check_token_ids(MMapIndexedDataset(prefix), 65536)  # uint16 always fits: no scan


def test_ids_past_the_tokenizer_in_the_padding_rows_are_warned(tmp_path, capsys):
    """Ids in [tokenizer vocab, padded vocab) fit the model but are padding rows the run's
    tokenizer never produces: the data was made with another tokenizer (e.g.
    SentencePieceTokenizer's <EOD>, appended after the pieces, under
    GPTSentencePieceTokenizer). Megatron-LM trains on it in silence; here a warning names
    the file. Data within the tokenizer's ids: no warning."""
    import pretrain_gpt

    wide, _ = make_corpus(tmp_path / "wide", [20] * 30, vocab=120)  # ids up to 119
    fits, _ = make_corpus(tmp_path / "fits", [20] * 30, vocab=101)
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1", "--eval-iters",
            "0", "--log-interval", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "100", "--split", "100,0,0", "--data-path"]  # 101 ids, 128 rows
    assert pretrain_gpt.main(argv + [wide]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"WARNING: {wide}\.bin: token id 1[01]\d in it is past the 101 ids of "
                     r"this run's tokenizer \(a padding row of the model's 128", out), out
    assert pretrain_gpt.main(argv + [fits]) == 0
    assert "past the 101 ids" not in capsys.readouterr().out


def test_a_dtype_narrower_than_the_tokenizer_is_warned(tmp_path):
    """A uint16 .bin under a tokenizer of more than 65536 ids: the tools write int32 for
    such a vocabulary, so the data was tokenized with a smaller one (a GPT-2 corpus under
    a 100k-id tokenizer, say). Every id it holds is valid here: it trained in silence."""
    prefix, _ = make_corpus(tmp_path / "c", [20] * 30, vocab=1000)
    data = MMapIndexedDataset(prefix)
    assert data.dtype == np.uint16
    with pytest.warns(UserWarning, match=rf"^{prefix}\.bin: its ids are uint16 \(at most "
                                         r"65535\) but this run's tokenizer has 100001 ids; .*"
                                         r"Pass the --tokenizer-type and files it was "
                                         r"preprocessed with"):
        check_token_ids(data, 100096, tokenizer_vocab_size=100001)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_token_ids(data, 65536, tokenizer_vocab_size=65536)  # every id fits uint16
        check_token_ids(data, 100096)  # no tokenizer size given: nothing to compare


def test_an_id_outside_the_scanned_windows_stops_at_its_sample(tmp_path, monkeypatch):
    """The opening scan reads a bounded sample of each .bin; an id outside it used to reach
    the embedding (IndexError on CPU, a device-side assert on CUDA, a silent zero row with
    tensor parallelism). Every sample read is checked: an error naming the file, the id
    and the sequence, in the data loader."""
    import megatron.core.datasets.gpt_dataset as gpt_dataset

    prefix, docs = make_corpus(tmp_path / "c", [20] * 30, vocab=100)
    with open(prefix + ".bin", "r+b") as f:  # sequence 17, token 5 -> id 5000
        f.seek((17 * 20 + 5) * 2)
        f.write(np.array([5000], dtype=np.uint16).tobytes())
    monkeypatch.setattr(gpt_dataset, "check_token_ids", lambda *a, **k: None)  # not sampled
    train = _build(_config(data_path=[prefix], split="100,0,0"))["train"]
    bad = [i for i in range(len(train)) if 17 * 20 + 5 in _positions(train, i)]
    assert bad
    with pytest.raises(ValueError, match=rf"{prefix}\.bin: token id 5000 in sample {bad[0]} of "
                                         r"the train dataset \(sequence\(s\) [0-9, ]*17"
                                         r"[0-9, ]*\) is outside the padded vocabulary of 128"):
        train[bad[0]]
    good = next(i for i in range(len(train)) if i not in bad)
    assert train[good]["text"].max() < 100


@pytest.mark.parametrize("workers", [0, 2])
def test_an_id_outside_the_scanned_windows_ends_the_run_with_one_line(tmp_path, monkeypatch,
                                                                       workers):
    """The same id met by a training run's loader (a reader thread, or --num-workers
    processes) ends it with the one-line error, not the reader's and the loop's tracebacks
    (twice over, with the worker's traceback quoted in the message, with --num-workers)."""
    import megatron.core.datasets.gpt_dataset as gpt_dataset
    from megatron.data_iterators import make_iterator

    prefix, _ = make_corpus(tmp_path / "c", [20] * 30, vocab=100)
    with open(prefix + ".bin", "r+b") as f:  # sequence 17, token 5 -> id 5000
        f.seek((17 * 20 + 5) * 2)
        f.write(np.array([5000], dtype=np.uint16).tobytes())
    monkeypatch.setattr(gpt_dataset, "check_token_ids", lambda *a, **k: None)  # not sampled
    cfg = _config(data_path=[prefix], split="100,0,0", num_workers=workers)
    train = _build(cfg)["train"]
    message = _exit_message(make_iterator(cfg, train, 0, 0, 1, pin=False), len(train))
    assert re.fullmatch(rf"error: {prefix}\.bin: token id 5000 in sample \d+ of the train "
                        r"dataset \(sequence\(s\) [0-9, ]*17[0-9, ]*\) is outside the padded "
                        r"vocabulary of 128 ids: .* preprocessed with", message), message


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_a_data_file_cut_short_while_the_run_reads_it_is_named(tmp_path, suffix):
    """A .bin or .idx truncated (or rewritten in place) after the run mapped it used to
    kill the reader with SIGBUS at the first page past the new end: no message at all with
    --num-workers 0, torch's 'out of shared memory' guess with workers. The read says which
    file shrank and what to do, before touching the map."""
    prefix, docs = make_corpus(tmp_path / "c", [20] * 30, vocab=100)
    ds = MMapIndexedDataset(prefix)
    assert list(ds.get(3)) == list(docs[3])
    os.remove(prefix + ".idx")  # a deleted file still reads: its inode stays mapped
    assert list(ds.get(29)) == list(docs[29])
    prefix, docs = make_corpus(tmp_path / "d", [20] * 30, vocab=100)
    ds = MMapIndexedDataset(prefix)
    size = os.path.getsize(prefix + suffix)
    os.truncate(prefix + suffix, 40)
    with pytest.raises(DataFileChangedError, match=rf"^{prefix}\{suffix} is now 40 bytes, "
                                                   rf"{size} when this run opened it: it was "
                                                   r"truncated or rewritten .* resume from "
                                                   r"the last checkpoint$"):
        ds.get(0)


def test_a_data_file_cut_short_ends_a_loader_with_workers_in_one_line(tmp_path):
    """The same with --num-workers: the run ends with that one line, not torch's
    'DataLoader worker ... killed by signal: Bus error ... out of shared memory'."""
    from megatron.data_iterators import make_iterator

    prefix, _ = make_corpus(tmp_path / "c", [20] * 30, vocab=100)
    cfg = _config(data_path=[prefix], split="100,0,0", num_workers=2)
    train = _build(cfg)["train"]
    message = _exit_message(make_iterator(cfg, train, 0, 0, 1, pin=False), len(train),
                            lambda: os.truncate(prefix + ".bin", 2))
    assert re.fullmatch(rf"error: {prefix}\.bin is now 2 bytes, \d+ when this run opened "
                        r"it: .* resume from the last checkpoint", message), message


def _exit_message(it, batches: int, after_first=None) -> str:
    """The SystemExit message with which iterator `it` stops within `batches` batches
    (`after_first()` called after the first one); the iterator is closed either way."""
    try:
        if after_first is not None:
            next(it)
            after_first()
        with pytest.raises(SystemExit) as stop:
            for _ in range(batches):
                next(it)
    finally:
        it.close()
    return str(stop.value.code)


def _positions(ds, i):
    """Token positions in the .bin (in tokens) that sample `i` of `ds` reads."""
    j = int(ds.shuffle_idx[i])
    (doc_f, off_f), (doc_l, off_l) = ds.sample_idx[j], ds.sample_idx[j + 1]
    sizes, out = ds.indexed_dataset.sizes, set()
    for d in range(int(doc_f), int(doc_l) + 1):
        seq = int(ds.doc_idx[d])
        start = int(sizes[:seq].sum())
        lo = int(off_f) if d == doc_f else 0
        hi = int(off_l) + 1 if d == doc_l else int(sizes[seq])
        out.update(range(start + lo, start + hi))
    return out


def test_token_id_scan_is_bounded(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "big.bin"), np.int32)
    ids = np.zeros(1 << 20, dtype=np.int32)  # 4 MiB
    ids[len(ids) // 2 + 1000] = 500  # between the sampled windows
    ids[-1] = 400  # in the last window
    b.add_item(ids)
    b.end_document()
    b.finalize(str(tmp_path / "big.idx"))
    ds = MMapIndexedDataset(str(tmp_path / "big"))
    lo, hi, scanned = ds.token_id_range(max_bytes=64 << 10)
    assert (lo, hi, scanned) == (0, 400, 64 << 10)
    with pytest.raises(ValueError, match=r"big\.bin: token id 400 in the 0\.1 MiB of it sampled"):
        check_token_ids(ds, 300, max_bytes=64 << 10)
    assert ds.token_id_range(max_bytes=8 << 20)[1] == 500  # 4 MiB < 8 MiB: the whole file
    assert ds.token_id_range()[2] == TOKEN_SCAN_BYTES  # the default reads 1 MiB of 4


def test_blend_prints_achieved_ratios(tmp_path, capsys):
    a, _ = make_corpus(tmp_path / "a", [30] * 40, seed=1, vocab=100)
    b, _ = make_corpus(tmp_path / "b", [17] * 60, seed=2, vocab=100)
    datasets = _build(_config(data_path=["0.3", a, "0.7", b], split="90,10,0"))
    out = capsys.readouterr().out
    train = datasets["train"]
    assert f" > blended dataset for --data-path (train): {len(train)} samples; sample " \
           "ratios:" in out
    achieved = train.achieved_weights()
    assert f"   dataset 0, input: 0.3, achieved: {achieved[0]:g}\n" in out
    assert f"   dataset 1, input: 0.7, achieved: {achieved[1]:g}\n" in out
    assert "--data-path (valid)" in out


def test_the_dataset_phase_prints_megatrons_lines(tmp_path, capsys):
    """Megatron-LM's lines around the dataset build, target sizes aligned as it aligns
    them (log parsers and side-by-side comparisons of the two tools' logs rely on them)."""
    prefix, _ = make_corpus(tmp_path / "c", [20] * 30, vocab=100)
    _build(_config(data_path=[prefix], split="90,10,0"))
    out = capsys.readouterr().out
    assert out.startswith("> building train, validation, and test datasets ...\n"
                          " > datasets target sizes (minimum size):\n"
                          "    train:      6\n"
                          "    validation: 4\n"
                          "    test:       2\n"
                          "> building train, validation, and test datasets for GPT ...\n"), out
    assert out.endswith("> finished creating GPT datasets ...\n"), out


def test_blend_with_a_member_too_small_for_a_split(tmp_path):
    """--split 90,8,2 gives a 10-document dataset no test document. Evaluating, the
    blend cannot weight it: an error naming that dataset and its size (it said 'a blended
    member'). Not evaluating (--eval-iters 0: no validation or test samples), the unread
    splits are not blended and the run trains (it stopped with the same error)."""
    big, _ = make_corpus(tmp_path / "big", [20] * 200, seed=1, vocab=100)
    small, _ = make_corpus(tmp_path / "small", [20] * 10, seed=2, vocab=100)
    data = ["0.5", big, "0.5", small]
    with pytest.raises(SystemExit, match=rf"--data-path \(test\): --split '90,8,2' leaves "
                                         rf"this split no documents of {small} \(10 documents\)"):
        _build(_config(data_path=data, split="90,8,2"))
    cfg = _config(data_path=data, split="90,8,2")
    cfg.training = dataclasses.replace(cfg.training, eval_iters=0)
    datasets = _build(cfg)
    assert len(datasets["train"]) > 0 and datasets["test"] is None


def test_blend_too_small_for_validation_names_a_split_that_builds(tmp_path):
    """--split 990,9,1 gives a 50-document dataset of a blend neither a validation nor a
    test document: the error names a --split (train number kept) that gives it both, and
    the blend builds with it (the error named no --split)."""
    big, _ = make_corpus(tmp_path / "big", [20] * 200, seed=1, vocab=100)
    small, _ = make_corpus(tmp_path / "small", [20] * 50, seed=2, vocab=100)
    data = ["0.5", big, "0.5", small]
    with pytest.raises(SystemExit) as e:
        _build(_config(data_path=data, split="990,9,1"))
    assert (f"--data-path (valid): --split '990,9,1' leaves this split no documents of {small} "
            "(50 documents)") in str(e.value.code)
    assert ("until every weighted dataset gets a document (e.g. --split 990,20,20), or leave "
            "the small dataset out") in str(e.value.code)
    datasets = _build(_config(data_path=data, split="990,20,20"))
    assert all(len(datasets[s]) > 0 for s in ("train", "valid", "test")), datasets
    from megatron.core.datasets.splits import split_with_documents

    assert split_with_documents("990,9,1", [200, 50], test=False) == "990,20,1"
    assert split_with_documents("990,9,1", [200, 50], valid=False, test=True) == "990,9,20"
    assert split_with_documents("990,9", [50]) is None  # not three numbers


def test_a_blend_member_without_documents_is_named_with_the_fix(tmp_path):
    """One shard of a blend that holds no document (its input was empty): no --split can
    help, so the error says to leave it out (it said to raise that share of --split)."""
    big, _ = make_corpus(tmp_path / "big", [20] * 200, seed=1, vocab=100)
    empty, _ = make_corpus(tmp_path / "empty", [], seed=2, vocab=100)
    with pytest.raises(SystemExit, match=rf"--data-path: {empty} holds no non-empty document "
                                         r"\(0 sequences in the .idx\), so no --split can give "
                                         r"the blend its weight there; leave it out of "
                                         "--data-path"):
        _build(_config(data_path=["0.5", big, "0.5", empty], split="90,8,2"))


def test_a_train_data_path_member_without_documents_is_named(tmp_path):
    big, _ = make_corpus(tmp_path / "big", [20] * 200, seed=1, vocab=100)
    empty, _ = make_corpus(tmp_path / "empty", [], seed=2, vocab=100)
    with pytest.raises(SystemExit, match=rf"{empty}: holds no non-empty documents "
                                         r"\(0 sequences\)"):
        _build(_config(train_data_path=["0.5", big, "0.5", empty], valid_data_path=[big]))


def test_missing_data_files_stop_the_run_before_the_model_is_built(tmp_path):
    """pretrain_gpt.py with a --data-path whose files are absent stops right after start-up
    with every missing file, the relative path resolved and preprocess_data.py's name when
    that exists; the dataset builder met the first one only after the model, optimizer and
    checkpoint load."""
    import os
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prefix, _ = make_corpus(tmp_path / "c_text_document", [20] * 30, vocab=100)
    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --lr 1e-3 --train-iters 2 "
            "--tokenizer-type NullTokenizer --vocab-size 100 --no-compile --data-path "
            f"1 c 1 {tmp_path}/absent 1 {prefix}").split()
    proc = forked_script.run([sys.executable, os.path.join(repo, "pretrain_gpt.py"), *argv],
                             cpu_env(), timeout=120, cwd=tmp_path)  # its imports come free
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "number of parameters" not in proc.stdout  # no model was built
    assert ("error: data files not found: c.bin and c.idx (--data-path: preprocess_data.py "
            "names its output <output-prefix>_<json key>_document (_sentence with "
            f"--split-sentences): pass c_text_document; looked for {tmp_path}/c.*); "
            f"{tmp_path}/absent.bin and {tmp_path}/absent.idx (--data-path)\n") in proc.stderr
