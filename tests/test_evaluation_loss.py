"""The value of the validation loss, as Megatron-LM 23.05 averages it.

Each micro-batch's loss is its mean over the tokens its loss mask keeps (with
--eod-mask-loss the EOD tokens drop out, so micro-batches keep different numbers of
tokens); the validation loss is the plain mean of those micro-batch losses over the
micro-batches of --eval-iters global batches and over the data-parallel replicas -- not
the mean over all kept tokens. Checked on 2 gloo ranks (dp 2) whose micro-batches keep
very different token counts, against the per-micro-batch losses recomputed here from the
model's per-token losses. A few training steps first teach the model one repeated token,
so that micro-batches made of it score far lower than random ones and the two averages
differ.
"""
from __future__ import annotations

import torch

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.initialize import Runtime, set_random_seed
from megatron.train_step import model_chunks
from megatron.training import build_trainer, evaluate, train_step
from tests.dist_utils import run_distributed
from tests.gpt_helpers import tiny_config

EOD, SEQ, MBS, EVAL_ITERS = 0, 16, 2, 2


REPEATED = 5  # the token the model learns


def _micro_batches(rank: int, count: int) -> list:
    """`count` micro-batches of [MBS, SEQ + 1] tokens; the k-th has k * 5 + rank EOD
    tokens among its inputs, so the kept-token counts differ between micro-batches and
    between the two ranks. The even ones are the learnt token repeated (low loss), the
    odd ones random tokens (high loss)."""
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for k in range(count):
        text = torch.randint(1, 128, (MBS, SEQ + 1), generator=gen)
        if k % 2 == 0:
            text.fill_(REPEATED)
        eods = k * 5 + rank
        text.view(-1)[:eods * 2:2] = EOD  # inputs only: positions < MBS * (SEQ + 1) - 1
        out.append({"text": text})
    return out


@torch.no_grad()
def _masked_sums(tr, micro_batches) -> list:
    """(sum of the kept tokens' losses, number of kept tokens) of each micro-batch."""
    tr.model.eval()
    (model,) = model_chunks(tr)
    out = []
    for mb in micro_batches:
        tokens, labels = mb["text"][:, :-1], mb["text"][:, 1:]
        per_token = model(tokens, position_ids=None, labels=labels, attention_mask=None)
        keep = (tokens != EOD).float()
        out.append((float((per_token.float() * keep).sum()), float(keep.sum())))
    tr.model.train()
    return out


def _worker(rank, world_size):
    torch.manual_seed(0)
    cfg = tiny_config(world_size=world_size, mbs=MBS, gbs=8, iters=6, lr=1e-2)
    cfg.data.eod_mask_loss = True
    cfg.training.eval_iters = EVAL_ITERS
    ps = ParallelState.build(world_size, rank)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(),
                 backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    tr.eod = EOD
    learn = iter(lambda: {"text": torch.full((MBS, SEQ + 1), REPEATED)}, None)
    for _ in range(cfg.training.train_iters):
        train_step(tr, learn)
    batches = _micro_batches(rank, EVAL_ITERS * cfg.data.num_micro_batches)
    value = evaluate(tr, iter(batches))
    return {"value": value, "sums": _masked_sums(tr, batches)}


def test_validation_loss_is_the_mean_of_micro_batch_means_over_ranks():
    results = run_distributed(_worker, 2)
    sums = [s for r in results for s in r["sums"]]
    counts = {c for _, c in sums}
    assert len(counts) > 3, f"the micro-batches should keep different token counts: {counts}"
    megatron = sum(total / kept for total, kept in sums) / len(sums)
    token_weighted = sum(t for t, _ in sums) / sum(c for _, c in sums)
    assert abs(megatron - token_weighted) > 1e-4 * abs(megatron), "the test cannot tell them apart"
    for rank, r in enumerate(results):
        assert abs(r["value"] - megatron) <= 1e-5 * abs(megatron), (
            f"rank {rank}: validation loss {r['value']} != Megatron's mean of micro-batch "
            f"means {megatron} (token-weighted: {token_weighted})")
