"""tools/generate.py's `generate_batch`: the prompts of a request decoded together through
one key/value cache give, per prompt, the tokens `generate` gives alone (greedy, fp32:
identical ids) for prompts of different lengths -- one token long, ending exactly at
--max-position-embeddings, and past it (generated alone) -- with rows that stop early on
EOD or `stop`; seeded sampling draws per row from that row's generator; the model is
called once per position, not once per prompt and position."""
from __future__ import annotations

import pytest
import torch

from tests.test_kv_cache import MAX_POS, VARIANTS, _model
from tools import generate

# lengths 1 and 7; 19 + 6 - 1 = 24 = MAX_POS fills the cache exactly; 22 + 6 - 1 > 24
# runs alone (sliding window); 4 twice
LENGTHS = (4, 1, 19, 7, 22, 4)
NEW = 6


def _prompts(lengths=LENGTHS, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (n,), generator=gen).tolist() for n in lengths]


def _alone(model, prompts, new, **kw):
    gens = kw.pop("generators", [None] * len(prompts))
    return [generate.generate(model, p, new, generator=g, **kw) for p, g in zip(prompts, gens)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_batch_equals_each_prompt_alone(variant):
    model = _model(variant)
    prompts = _prompts()
    batch = generate.generate_batch(model, prompts, NEW, greedy=True, vocab_limit=100)
    assert batch == _alone(model, prompts, NEW, greedy=True, vocab_limit=100)
    assert [len(x) for x in batch] == [NEW] * len(prompts)
    assert generate.generate_batch(model, prompts, 0) == [[]] * len(prompts)


def test_rows_stop_on_their_own():
    """EOD (and `stop`) end one row; the others run on, unchanged."""
    model = _model("llama")
    prompts = _prompts((3, 9, 5))
    free = _alone(model, prompts, 8, greedy=True)
    eod = free[1][2]  # row 1's third token; absent from the other rows' answers
    assert all(eod not in row for i, row in enumerate(free) if i != 1), free
    batch = generate.generate_batch(model, prompts, 8, greedy=True, eod=eod)
    assert batch == _alone(model, prompts, 8, greedy=True, eod=eod)
    assert [len(x) for x in batch] == [8, free[1].index(eod) + 1, 8]

    def stop(ids):  # ends a row after 2 new tokens of row 0 only
        return ids[:3] == prompts[0] and len(ids) == 5

    batch = generate.generate_batch(model, prompts, 8, greedy=True, stop=stop)
    assert [len(x) for x in batch] == [2, 8, 8] and batch[0] == free[0][:2]


def test_seeded_sampling_draws_per_row():
    """Row i draws from generators[i] alone: the batch gives what `generate` gives for each
    prompt with that generator, and the same seeds give the same answer."""
    model = _model("gpt2")
    prompts = _prompts()

    def run(fn):
        gens = [torch.Generator().manual_seed(11 + i) for i in range(len(prompts))]
        return fn(model, prompts, NEW, temperature=1.3, top_k=20, generators=gens)

    batch = run(generate.generate_batch)
    assert batch == run(generate.generate_batch) == run(_alone)


def test_one_model_call_per_position(monkeypatch):
    """The batch is prefilled up to its shortest prompt, then one call per position with
    every row: calls = longest prompt + new tokens - shortest prompt (not per prompt)."""
    model = _model("llama")
    prompts = _prompts((4, 1, 7, 4))
    shapes = []
    real = generate.forward_incremental
    monkeypatch.setattr(generate, "forward_incremental", lambda m, ids, cache, **kw:
                        shapes.append(tuple(ids.shape)) or real(m, ids, cache, **kw))
    generate.generate_batch(model, prompts, NEW, greedy=True)
    assert shapes == [(4, 1)] * (7 + NEW - 1)


def test_refusals():
    model = _model("gpt2")
    with pytest.raises(ValueError, match=r"no empty prompt \(got prompt lengths \[2, 0\]\)"):
        generate.generate_batch(model, [[1, 2], []], 3)
    with pytest.raises(ValueError, match="1 generators for 2 prompts"):
        generate.generate_batch(model, [[1], [2]], 3, generators=[None])
    assert MAX_POS == 24  # LENGTHS above are chosen around it


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_batch_logprobs_equal_one_forward_per_sequence(variant):
    """The server's log-probs of a batch (one forward, padded on the right) equal one
    forward per answer within 1e-5 (fp32), for answers of 1 to 24 tokens."""
    from tools.text_generation_api import batch_token_logprobs

    model = _model(variant)
    seqs = _prompts((5, 1, 24, 2, 11))
    with torch.no_grad():
        alone = []
        for ids in seqs:  # the previous per-answer computation, written out
            logp = torch.log_softmax(model(torch.tensor([ids]))[0, :-1, :100], dim=-1)
            alone.append(logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
    batch = batch_token_logprobs(model, seqs, 100)
    assert [len(x) for x in batch] == [len(s) - 1 for s in seqs]
    for got, want in zip(batch, alone):
        assert got == pytest.approx(want, abs=1e-5)
    assert batch_token_logprobs(model, [[3], [4]], 100) == [[], []]
