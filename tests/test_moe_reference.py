"""--num-experts against the independent fp64 reference of Megatron-LM 23.05's GPT
(tests/gpt_reference.py: its SwitchMLP is every expert on every token, then the softmax
argmax expert's output, fc2 bias included, times its probability).

1. Numerics: per-token losses and the gradient of every parameter (router and experts
   included) of one step equal the reference's, at tensor-parallel size 1 and 2, in
   training and in evaluation mode (Megatron-LM 23.05 routes alike in both), with the
   grouped-GEMM and the loop dispatch. Tolerance: fp32 against fp64, atol 2e-5 on losses,
   max abs diff <= 1e-5 * (1 + max|g|) on gradients. The core refuses sequence
   parallelism with experts (the grouped dispatch gave wrong losses, the loop a crash).
2. Checkpoints: a TP2 checkpoint written by hand the way Megatron-LM 23.05 writes one
   (nested `language_model` state, per-rank shards: each expert's fc1 rows and fc2
   columns split like the dense MLP's, the router whole on every rank) has the names and
   shapes of this framework's TP2 save exported by `to-megatron`; it loads into a TP2 and
   (resharded) a TP1 run with the reference's losses; `checkpoint_convert.py reshard`
   merges it into the full weights exactly; tools/generate.py (with and without the KV
   cache) greedily decodes what the reference decodes. `to-megatron` warns that
   Megatron-LM 23.05 cannot run experts without biases.
"""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from megatron.core.config import ModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.transformer import SwitchMLP
from megatron.core.tensor_parallel.layers import shard_of_full_weight
from tests.dist_utils import run_distributed
from tests.gpt_helpers import full_named_grads
from tests.gpt_reference import case_batch, case_config, perturb_, reference_forward

CASES = ("experts", "experts_swiglu")
MODES = [(mode, dispatch) for mode in ("train", "eval") for dispatch in ("grouped", "loop")]


def _full_model(case: str, **extra) -> GPTModel:
    fields, _ = case_config(case, **extra)
    torch.manual_seed(0)
    model = GPTModel(ModelConfig(**fields))
    perturb_(model)  # the router too: the tokens spread over the experts
    return model


def _reference(sd: dict, cfg, tokens, labels):
    """(per-token losses [b, s], {name: grad of their mean}) of the fp64 reference."""
    leaves = {k: v.detach().double().requires_grad_() for k, v in sd.items()}
    losses = reference_forward(leaves, cfg, tokens, labels)
    losses.mean().backward()
    return losses.detach(), {k: v.grad for k, v in leaves.items()}


def _ours(model: GPTModel, mode: str, dispatch: str, tokens, labels, tp_group=None):
    switches = [m for m in model.modules() if isinstance(m, SwitchMLP)]
    assert len(switches) == model.config.num_layers
    for m in switches:
        m.dispatch = dispatch
    model.train(mode == "train")
    model.zero_grad(set_to_none=True)
    losses = model(tokens, labels=labels)
    losses.mean().backward()
    return losses.detach().double(), full_named_grads(model, tp_group)


def _check(got, want, what: str) -> None:
    (losses, grads), (ref_losses, ref_grads) = got, want
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=2e-5, msg=what)
    assert grads.keys() == ref_grads.keys(), what
    for name, g in grads.items():
        r = ref_grads[name]
        diff = (g.double() - r).abs().max().item()
        assert diff <= 1e-5 * (1 + r.abs().max().item()), f"{what}: {name} off by {diff}"
    routers = [n for n in grads if n.endswith("mlp.router.weight")]
    assert routers and all(grads[n].abs().sum() > 0 for n in routers), what


@pytest.mark.parametrize("case", CASES)
def test_losses_and_grads_equal_the_reference(case):
    full = _full_model(case)
    tokens, labels, _, _ = case_batch(False)
    want = _reference(full.state_dict(), full.config, tokens, labels)
    for mode, dispatch in MODES:
        _check(_ours(full, mode, dispatch, tokens, labels), want, f"{case} {mode} {dispatch}")


def _tp2_worker(rank, world):
    tp = torch.distributed.new_group(list(range(world)))
    out = {}
    for case in CASES:
        full = _full_model(case)
        sd = full.state_dict()
        model = GPTModel(full.config, tp_group=tp)
        with torch.no_grad():
            for name, p in model.named_parameters():
                w = sd[name]
                if getattr(p, "tensor_model_parallel", False):
                    w = shard_of_full_weight(w, p.partition_dim, p.partition_stride, rank, world)
                p.copy_(w)
        tokens, labels, _, _ = case_batch(False)
        for mode, dispatch in MODES:
            out[case, mode, dispatch] = _ours(model, mode, dispatch, tokens, labels, tp)
    return out


def test_losses_and_grads_equal_the_reference_at_tp2():
    tokens, labels, _, _ = case_batch(False)
    want = {}
    for case in CASES:
        full = _full_model(case)
        want[case] = _reference(full.state_dict(), full.config, tokens, labels)
    for rank, results in enumerate(run_distributed(_tp2_worker, 2)):
        for (case, mode, dispatch), got in results.items():
            _check(got, want[case], f"tp2 rank {rank} {case} {mode} {dispatch}")



def test_the_core_refuses_sequence_parallelism_with_experts():
    """The grouped dispatch summed partial products of different tokens across ranks
    (wrong losses), the loop's all-gather of unequal token counts crashed gloo: the switch
    MLP is refused outright, as the command line refuses the flags together."""
    fields, _ = case_config("experts", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel=True cannot be used with "
                                         r"num_experts=4: .*set sequence_parallel=False"):
        GPTModel(ModelConfig(**fields))


# ---------------------------------------------------------------------- 2. checkpoints
ITERATION = 2
FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--max-position-embeddings 20 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 "
         "--train-iters 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 63 "
         "--make-vocab-size-divisible-by 32 --hidden-dropout 0 --attention-dropout 0 "
         "--num-workers 0 --num-experts 4").split()  # vocabulary padded to 64 at tp 1 and 2
# Megatron-LM's default MLP: biases and the fused bias-GeLU, i.e. the tanh form
CKPT_MODEL = dict(activation="openai_gelu")
COLUMN = ("word_embeddings.weight", "query_key_value.weight", "query_key_value.bias",
          "dense_h_to_4h.weight", "dense_h_to_4h.bias")
ROW = ("self_attention.dense.weight", "dense_4h_to_h.weight")


def _megatron_shard(name: str, w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Megatron-LM 23.05's tensor-parallel piece of a full weight: column-parallel ones
    (vocabulary, QKV, each expert's fc1) cut along rows, row-parallel ones (attention
    output, each expert's fc2) along columns; the router, norms, positions and the
    row-parallel biases whole on every rank."""
    if name.endswith(COLUMN):
        return w.chunk(tp, dim=0)[rank].clone()
    if name.endswith(ROW):
        return w.chunk(tp, dim=1)[rank].clone()
    return w.clone()


def _megatron_nested(flat: dict) -> dict:
    """{'language_model': {'embedding': {'word_embeddings': {'weight'}, ...}, 'encoder':
    {'layers.0.mlp.router.weight': ...}}}: how Megatron-LM 23.05 nests a GPT's state."""
    lm = {"embedding": {}, "encoder": {}}
    for name, w in flat.items():
        name = name[len("language_model."):]
        part, rest = name.split(".", 1)
        if part == "encoder":
            lm["encoder"][rest] = w
        else:
            table, key = rest.split(".")
            lm[part].setdefault(table, {})[key] = w
    return {"language_model": lm}


def _write_megatron_checkpoint(root: str, sd: dict, tp: int = 2) -> None:
    """A --no-save-optim --no-save-rng checkpoint as Megatron-LM 23.05 writes it for
    `--tensor-model-parallel-size tp --num-experts 4` (args: an argparse Namespace)."""
    args = argparse.Namespace(
        num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
        kv_channels=8, seq_length=16, max_position_embeddings=20, padded_vocab_size=64,
        vocab_size=63, make_vocab_size_divisible_by=32, tokenizer_type="NullTokenizer",
        num_experts=4, add_bias_linear=True, bias_gelu_fusion=True, swiglu=False,
        openai_gelu=False, squared_relu=False, add_position_embedding=True,
        use_rotary_position_embeddings=False, untie_embeddings_and_output_weights=False,
        apply_residual_connection_post_layernorm=False, apply_layernorm_1p=False,
        layernorm_epsilon=1e-5, params_dtype=torch.float32, fp16=False, bf16=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, data_parallel_size=1,
        world_size=tp, micro_batch_size=2, global_batch_size=8, train_iters=4, lr=1e-3,
        iteration=ITERATION,
        consumed_train_samples=ITERATION * 8, consumed_valid_samples=0)
    for rank in range(tp):
        shard = {k: _megatron_shard(k, v, rank, tp) for k, v in sd.items()}
        path = os.path.join(root, f"iter_{ITERATION:07d}", f"mp_rank_{rank:02d}")
        os.makedirs(path)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                    "model": _megatron_nested(shard)},
                   os.path.join(path, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))


def _shapes(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_shapes(value, f"{prefix}{key}/"))
        else:
            out[prefix + key] = tuple(value.shape)
    return out


def _save_ours(rank, world, root, extra=()):
    """Save the freshly built model of FLAGS (+ `extra`) at tp = world, as iteration 2."""
    from megatron.trainer_checkpoint import save_trainer_checkpoint
    from tests.gpt_helpers import cli_trainer

    _, _, tr = cli_trainer(FLAGS + ["--tensor-model-parallel-size", str(world), "--save", root,
                                    "--save-interval", "2", *extra], world, rank)
    tr.state.iteration = ITERATION
    save_trainer_checkpoint(tr)


def _raw(path: str) -> dict:
    from megatron.checkpoint_files import megatron_globals

    with torch.serialization.safe_globals(megatron_globals()):
        return torch.load(path, weights_only=True)


def test_saved_keys_and_shapes_are_megatron_lms(tmp_path):
    """This framework's TP2 save, exported by to-megatron, holds per rank exactly the
    nested names and shapes of the hand-written Megatron-LM checkpoint; its router is the
    same on both ranks."""
    from tools.checkpoint_convert import to_megatron

    ours, export, mega = (str(tmp_path / n) for n in ("ours", "export", "mega"))
    run_distributed(_save_ours, 2, ours)
    to_megatron(ours, export)
    _write_megatron_checkpoint(mega, _full_model("experts", **CKPT_MODEL).state_dict())
    routers = []
    for rank in range(2):
        rel = os.path.join(f"iter_{ITERATION:07d}", f"mp_rank_{rank:02d}", "model_optim_rng.pt")
        got, want = _raw(os.path.join(export, rel))["model"], _raw(os.path.join(mega, rel))["model"]
        assert _shapes(got) == _shapes(want), rank
        encoder = got["language_model"]["encoder"]
        assert encoder["layers.1.mlp.experts.3.dense_h_to_4h.weight"].shape == (64, 32)
        assert encoder["layers.1.mlp.experts.3.dense_4h_to_h.weight"].shape == (32, 64)
        assert encoder["layers.1.mlp.router.weight"].shape == (4, 32)
        routers.append(encoder["layers.1.mlp.router.weight"])
    assert torch.equal(*routers)


def _load_and_score(rank, world, root, tp):
    from megatron.trainer_checkpoint import load_trainer_checkpoint
    from tests.gpt_helpers import cli_trainer

    flags = FLAGS + ["--tensor-model-parallel-size", str(tp), "--load", root,
                     "--no-load-optim", "--no-load-rng"]
    _, _, tr = cli_trainer(flags, world, rank)
    converted = load_trainer_checkpoint(tr)
    assert tr.state.iteration == ITERATION
    model = tr.model.unwrapped()[0]
    model.eval()
    tokens, labels, _, _ = case_batch(False)
    with torch.no_grad():
        return model(tokens, labels=labels).double(), converted


def test_a_megatron_lm_tp2_checkpoint_loads_with_the_reference_losses(tmp_path, capsys):
    """At TP2 as written, at TP1 resharded on load, merged offline by `reshard` (exactly
    the full weights), and decoded greedily by tools/generate.py as the reference does."""
    from megatron.checkpoint_files import load_checkpoint_file
    from tools import checkpoint_convert, generate

    full = _full_model("experts", **CKPT_MODEL)
    sd = full.state_dict()
    root = str(tmp_path / "mega")
    _write_megatron_checkpoint(root, sd)
    tokens, labels, _, _ = case_batch(False)
    want = reference_forward(sd, full.config, tokens, labels)
    for rank, (got, converted) in enumerate(run_distributed(_load_and_score, 2, root, 2)):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5, msg=f"tp2 rank {rank}")
        assert converted is None
    got, converted = _load_and_score(0, 1, root, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5, msg="tp1")
    assert "resharded" in converted

    out = str(tmp_path / "tp1")
    checkpoint_convert.reshard(root, out, 1, 1)
    merged = load_checkpoint_file(
        os.path.join(out, f"iter_{ITERATION:07d}", "mp_rank_00", "model_optim_rng.pt"))
    assert merged["model"].keys() == sd.keys()
    for name, w in sd.items():
        assert torch.equal(merged["model"][name], w), name

    prompt = tokens[0, :5].tolist()
    ids = torch.tensor([prompt])
    for _ in range(6):  # the reference's greedy continuation, recomputed from scratch
        logits = reference_forward(sd, full.config, ids)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    capsys.readouterr()
    for cache in ([], ["--no-kv-cache"]):
        assert generate.main(["--load", root, "--prompt-ids", ",".join(map(str, prompt)),
                              "--max-new-tokens", "6", "--greedy", "--no-stop-at-eod",
                              "--json", *cache]) == 0
        got_ids = json.loads(capsys.readouterr().out)["generated_ids"]
        assert got_ids == ids[0, 5:].tolist(), cache



@pytest.mark.parametrize("extra,warned", [([], False), (["--disable-bias-linear"], True),
                                          (["--swiglu", "--disable-bias-linear"], True)])
def test_to_megatron_warns_that_23_05_cannot_run_experts_without_biases(tmp_path, capsys,
                                                                        extra, warned):
    """Megatron-LM 23.05's switch MLP expands every expert's fc2 bias: with
    --disable-bias-linear it loads the export and stops at its first forward. The export
    is still written."""
    from tools import checkpoint_convert

    root, out = str(tmp_path / "ours"), str(tmp_path / "mega")
    _save_ours(0, 1, root, extra)
    capsys.readouterr()
    assert checkpoint_convert.main(["to-megatron", "--load", root, "--save", out]) == 0
    err = capsys.readouterr().err
    message = ("warning: Megatron-LM 23.05 cannot run this model (--num-experts 4 with "
               "--disable-bias-linear: its switch MLP scales each expert's fc2 bias and stops "
               "at the first forward without one)")
    assert (message in err) == warned, err
    assert os.path.isfile(os.path.join(out, f"iter_{ITERATION:07d}", "mp_rank_00",
                                       "model_optim_rng.pt"))
