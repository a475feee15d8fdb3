"""tools/beam_search.py, Megatron-LM 23.05's beam search: a hand-computed bigram case
(stop hypotheses, length normalisation, the done rule at equality, live beams added at
the end); the walk's rule that a stop token ranked B or worse among the 2B candidates is
skipped; the finished set's bookkeeping; and, on tiny random models, the same hypotheses
and scores (within 1e-5) as a plain reference that recomputes every beam alone, with the
key/value cache, without it and with the static decoder's step, for several stop tokens,
widths, length penalties and prevent_newline_after_colon's rule."""
from __future__ import annotations

import math

import pytest
import torch

from megatron.core.models.gpt.static_decode import StaticDecoder
from tests.test_kv_cache import _model
from tools.beam_search import Hypotheses, _walk, beam_search, run_beams

# a bigram "model" over 4 tokens (3 is the stop token): P[last] = p(next | last)
BIGRAM = {0: [0.05, 0.6, 0.3, 0.05], 1: [0.1, 0.1, 0.1, 0.7], 2: [0.5, 0.1, 0.1, 0.3]}


def _bigram_search(max_new: int, penalty: float = 1.0):
    calls, reorders = [], []

    def next_logits(beams):
        calls.append([list(b) for b in beams])
        return torch.log(torch.tensor([BIGRAM[b[-1]] for b in beams]))

    hyps = run_beams(next_logits, reorders.append, [0], 2, max_new, stop_token=3,
                     length_penalty=penalty)
    return hyps, calls, reorders


def test_hand_computed_bigram_case():
    """Step 1 (beam 0 only): 1 (.6), 2 (.3). Step 2: [1]+3 .42 (stop, rank 0: hypothesis
    [1], length 2), [2]+0 .15, [2]+3 .09 (stop, rank 2: skipped), [1]+0 .06 (first of
    three equal ones). Step 3: [2,0]+1 .09, [2,0]+2 .045. With 3 new tokens the live beams
    end as hypotheses of length 3; with more, step 4's [2,0,1]+3 .063 fills the set and
    its score equals the bound of the best candidate (the same .063): done."""
    hyps, calls, reorders = _bigram_search(3)
    assert [ids for ids, _ in hyps] == [[1], [2, 0, 1]]
    assert [s for _, s in hyps] == pytest.approx([math.log(.42) / 2, math.log(.09) / 3],
                                                 abs=1e-6)
    assert calls[-1] == [[0, 2, 0], [0, 1, 0]] and reorders == [[0, 0], [1, 0], [0, 0]]
    hyps, calls, _ = _bigram_search(6)
    assert [ids for ids, _ in hyps] == [[1], [2, 0, 1]] and len(calls) == 4
    assert [s for _, s in hyps] == pytest.approx([math.log(.42) / 2, math.log(.063) / 4],
                                                 abs=1e-6)
    hyps, _, _ = _bigram_search(3, penalty=0.0)  # raw sums: the shorter wins by more
    assert [s for _, s in hyps] == pytest.approx([math.log(.42), math.log(.09)], abs=1e-6)


def test_stop_ranked_b_or_worse_is_skipped():
    hyps = Hypotheses(2, 1.0)
    ranked = [(-1.0, 0, 3), (-1.5, 1, 5), (-2.0, 1, 3), (-2.5, 0, 6), (-3.0, 1, 7)]
    chosen = _walk(ranked, [[9, 4], [9, 5]], 1, hyps, stop_token=3, length=2)
    assert chosen == [(-1.5, 1, 5), (-2.5, 0, 6)]
    assert hyps.best_first() == [([4], -0.5)]  # rank 2's stop ([5]) skipped


def test_hypotheses_keep_the_best():
    hyps = Hypotheses(2, 2.0)
    hyps.add([1], -4.0, 2)  # -1.0
    hyps.add([2], -8.0, 2)  # -2.0
    assert hyps.done(-8.0, 2)  # the best candidate's -2.0 cannot beat the worst kept
    assert not hyps.done(-7.9, 2) and not Hypotheses(3, 2.0).done(-100.0, 2)
    hyps.add([3], -8.0, 2)  # ties the worst: not taken
    hyps.add([4], -6.0, 2)  # -1.5 replaces [2]
    assert hyps.best_first() == [([1], -1.0), ([4], -1.5)]


# ----------------------------------------------------------- random models, reference
def _reference(model, prompt, width, new, stop, penalty, vocab, forbid=None):
    """Megatron's beam search written plainly: each beam recomputed alone from scratch,
    every (beam, token) candidate a Python tuple, Python floats."""
    def logp(seq):
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0, -1, :vocab].float()
        if forbid is not None and seq[-1] == forbid[0]:
            logits[forbid[1]] = -1e10
        return torch.log_softmax(logits, dim=-1).tolist()

    beams = [(list(prompt), 0.0)] * width
    kept, stats = [], {"stops": 0, "skipped": 0, "early": 0}
    for step in range(1, new + 1):
        cands = [(score + lp, b, t) for b, (seq, score) in enumerate(beams[:1 if step == 1
                                                                        else width])
                 for t, lp in enumerate(logp(seq))]
        cands = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[:2 * width]
        nxt = []
        for rank, (score, b, t) in enumerate(cands):
            if t == stop and rank >= width:
                stats["skipped"] += 1
            elif t == stop:
                stats["stops"] += 1
                kept = _keep(kept, score / step ** penalty, beams[b][0][len(prompt):], width)
            else:
                nxt.append((beams[b][0] + [t], score))
            if len(nxt) == width:
                break
        if len(kept) == width and min(s for s, _ in kept) >= cands[0][0] / step ** penalty:
            stats["early"] += 1
            break
        beams = nxt
    else:
        for seq, score in beams:
            kept = _keep(kept, score / new ** penalty, seq[len(prompt):], width)
    return [(ids, s) for s, ids in sorted(kept, key=lambda k: -k[0])], stats


def _keep(kept, score, ids, width):
    if len(kept) == width and score <= min(s for s, _ in kept):
        return kept
    kept = kept + [(score, ids)]
    if len(kept) > width:
        kept.pop(min(range(len(kept)), key=lambda i: (kept[i][0], i)))
    return kept


def _same(got, want):
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-5)


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_random_models_match_the_reference(variant):
    """Vocabulary 8 of the model's 128 logits, prompt of 3, 5 new tokens; the even tokens
    as the stop token (and one never met), widths 2 and 3, length penalties 1 and 0.5:
    the cached, recomputed and static-step searches give the reference's hypotheses.
    Across the sweep stop hypotheses are kept, stop candidates skipped for their rank,
    and searches end early (the branches all ran)."""
    model, prompt, total = _model(variant), [4, 9, 1], {"stops": 0, "skipped": 0, "early": 0}
    decoder = StaticDecoder(model, graphed=False)  # the static step, eager on the CPU
    for width, penalty in ((2, 1.0), (3, 0.5)):
        for stop in (0, 2, 4, 6, -1):
            want, stats = _reference(model, prompt, width, 5, stop, penalty, 8)
            for key in total:
                total[key] += stats[key]
            kw = dict(stop_token=stop, length_penalty=penalty, vocab_limit=8)
            _same(beam_search(model, prompt, width, 5, **kw), want)
            _same(beam_search(model, prompt, width, 5, use_cache=False, **kw), want)
            _same(beam_search(model, prompt, width, 5, decoder=decoder, **kw), want)
            assert len(want) == width
    assert all(total.values()), total


def test_forbidden_pair_and_limits():
    """prevent_newline_after_colon's rule in beam search: with (a, b) = a pair the best
    beam has, b never follows a, as in the reference; the search stops at the model's
    last position; too small a vocabulary and no room are refused."""
    model, prompt = _model("gpt2"), [4, 9, 1]
    best = beam_search(model, prompt, 2, 6, stop_token=-1, vocab_limit=16)[0][0]
    seq = prompt + best
    pair = (seq[3], seq[4])
    got = beam_search(model, prompt, 2, 6, stop_token=-1, vocab_limit=16, forbid=pair)
    _same(got, _reference(model, prompt, 2, 6, -1, 1.0, 16, forbid=pair)[0])
    for ids, _ in got:
        full = prompt + ids
        assert all(full[i:i + 2] != list(pair) for i in range(len(full) - 1))
    assert got != beam_search(model, prompt, 2, 6, stop_token=-1, vocab_limit=16)
    long_prompt = list(range(20))  # 24 positions: 4 new tokens at most
    assert {len(ids) for ids, _ in beam_search(model, long_prompt, 2, 10, stop_token=-1,
                                               vocab_limit=16)} == {4}
    with pytest.raises(ValueError, match="at least 2 x width candidate tokens"):
        beam_search(model, prompt, 3, 4, stop_token=-1, vocab_limit=5)
    with pytest.raises(ValueError, match="leaves room"):
        beam_search(model, list(range(24)), 2, 4, stop_token=-1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_cuda_graph_beams_equal_the_recompute(variant):
    """--decode-cuda-graph on: the beams are a batch of B rows whose one-token steps are
    replays of a graph captured once for B rows (the cache reordered in place between
    replays): the hypotheses of the recompute path; a second search reuses the graph."""
    model = _model(variant).cuda()
    decoder = StaticDecoder.for_mode(model, "on")
    kw = dict(stop_token=2, length_penalty=0.5, vocab_limit=8)
    want = beam_search(model, [4, 9, 1], 3, 5, use_cache=False, **kw)
    for _ in range(2):
        _same(beam_search(model, [4, 9, 1], 3, 5, decoder=decoder, **kw), want)
    assert decoder.graph is not None and decoder.num_captures == 1
