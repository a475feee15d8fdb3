"""The --dry-run memory estimate: model-state arithmetic by hand, the activation terms against
Korthikanti et al.'s formula, and against the tensors this model really saves for backward
(counted with saved-tensor hooks, single process and tensor parallel on 2 gloo processes)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.arguments import count_parameters, dry_run_report, parse_and_validate
from megatron.memory_estimate import (
    WORKSPACE_BYTES,
    _head_bytes,
    activation_bytes,
    estimate_memory,
    estimate_stage_memory,
    layer_activation_terms,
)
from tests.dist_utils import run_distributed
from tests.gpt_helpers import tiny_config

BASE = ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
        "--max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 512 "
        "--lr 2e-4 --train-iters 10 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 50257").split()


def cli(extra="", world_size=8):
    return parse_and_validate(BASE + extra.split(), world_size=world_size, env={},
                              cuda_available=False)


# ------------------------------------------------------------------- model state by hand


def test_model_state_bytes_bf16_replicated_and_distributed():
    cfg = cli("--bf16")
    p = count_parameters(cfg.model).total
    assert p == 1_315_819_520
    est = estimate_memory(cfg)
    assert (est["weights"], est["gradients"], est["optimizer"]) == (2 * p, 4 * p, 12 * p)
    dist = estimate_memory(cfg, use_distributed_optimizer=True)
    assert dist["optimizer"] == 12 * p // 8 and dist["weights"] == 2 * p
    assert est["total"] - dist["total"] == 12 * p - 12 * p // 8
    assert est["step_transient"] == 0 and est["workspace"] == WORKSPACE_BYTES


def test_model_state_bytes_fp32_and_fp16():
    p = count_parameters(cli().model).total
    est = estimate_memory(cli())
    assert (est["weights"], est["gradients"], est["optimizer"]) == (4 * p, 4 * p, 8 * p)
    fp16 = estimate_memory(cli("--fp16"))
    assert (fp16["weights"], fp16["gradients"], fp16["optimizer"]) == (2 * p, 2 * p, 12 * p)
    assert fp16["step_transient"] == 4 * p  # fp32 copy of the fp16 grads in the step
    fp16_acc = estimate_memory(cli("--fp16 --accumulate-allreduce-grads-in-fp32"))
    assert fp16_acc["gradients"] == 4 * p and fp16_acc["step_transient"] == 0
    sgd = estimate_memory(cli("--bf16 --optimizer sgd"))
    assert sgd["optimizer"] == 8 * p  # momentum + fp32 main params


def test_whole_estimate_by_hand_gpt_1_3b():
    """Every term written out for the GPT-3 XL shape: bf16, micro batch 4, s 2048, eager."""
    cfg = cli("--bf16")
    s, b, h, a, V, L, p = 2048, 4, 2048, 16, 50304, 24, 1_315_819_520
    sbh = s * b * h
    layer = (2 * 2 * sbh + 2 * 2 * 4 * s * b + 2 * 2 * sbh + 2 * sbh  # norms, masks
             + 3 * 2 * sbh + 2 * sbh + 4 * a * s * b  # qkv, output, logsumexp
             + 2 * 2 * s * b * 4 * h)  # gelu input and fc2 input
    acts = L * layer + sbh + (2 + 2) * sbh + 8 * s * b  # + embedding mask, final norm
    logits = 2 * 4 * s * b * V
    est = estimate_memory(cfg)
    assert est["activations"] == acts and est["logits"] == logits
    assert est["allocated"] == 18 * p + acts + logits
    assert est["total"] == est["allocated"] + WORKSPACE_BYTES
    assert 38 * 2**30 < est["total"] < 42 * 2**30


# ------------------------------------------------------- activation terms vs the paper


def _paper_model(**kw):
    base = dict(num_layers=2, hidden_size=1024, num_attention_heads=16, padded_vocab_size=128,
                seq_length=2048, max_position_embeddings=2048, hidden_dropout=0.1,
                attention_dropout=0.1)
    base.update(kw)
    return tiny_config(**base).model


@pytest.mark.parametrize("tp,sp", [(1, False), (4, False), (4, True)])
def test_layer_terms_equal_korthikanti_without_flash(tp, sp):
    m = _paper_model()
    s, b, h, a = 2048, 2, 1024, 16
    terms = layer_activation_terms(m, s, b, tp, sp, e=2, flash_attention=False, compiled=False)
    stats = terms.pop("norm_stats")
    assert stats == 2 * 2 * 4 * s * b / (tp if sp else 1)
    if sp:
        paper = s * b * h * (34 / tp + 5 * a * s / (h * tp))
    else:
        paper = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    assert sum(terms.values()) == pytest.approx(paper, rel=1e-12)


def test_flash_drops_the_score_term_and_recompute_variants():
    m = _paper_model()
    s, b, h, a = 2048, 2, 1024, 16
    flash = layer_activation_terms(m, s, b, 1, False, e=2, compiled=False)
    assert "attention_scores" not in flash
    assert sum(flash.values()) == 34 * s * b * h + 4 * a * s * b + 16 * s * b
    swiglu = _paper_model(activation="swiglu", ffn_hidden_size=2816)
    eager = layer_activation_terms(swiglu, s, b, 1, False, e=2, compiled=False)["mlp"]
    compiled = layer_activation_terms(swiglu, s, b, 1, False, e=2, compiled=True)["mlp"]
    assert eager == compiled == 3 * 2 * s * b * 2816  # fc1 output (2f) + fc2 input
    cfg = tiny_config(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048,
                      mbs=2, hidden_dropout=0.1, attention_dropout=0.1)
    one = sum(layer_activation_terms(cfg.model, s, b, 1, False, e=4).values())
    full_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute_granularity="full"))
    assert activation_bytes(full_cfg, 4) == 4 * (4 * s * b * h) + one
    block = dataclasses.replace(full_cfg, model=dataclasses.replace(
        full_cfg.model, recompute_method="block", recompute_num_layers=1))
    assert activation_bytes(block, 4) == 4 * s * b * h + 3 * one + one


# ---------------------------------------------- against the tensors the model saves


def _saved_bytes(model, tokens, labels) -> int:
    """Bytes of the distinct floating-point storages autograd saves (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and t.is_floating_point():
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=labels)
    return sum(seen.values())


def _expected_saved(cfg, layers: int) -> float:
    """What the estimate says is saved after the forward: layers + head + the saved softmax
    (the second fp32 logits buffer is a forward-time peak, not saved)."""
    head = _head_bytes(cfg, True, True)
    s, b, tp = cfg.data.seq_length, cfg.data.micro_batch_size, cfg.parallel.tp_size
    return (activation_bytes(cfg, layers) + head["embedding"] + head["final_norm"]
            + head["rotary_table"]
            + 4 * s * b * cfg.model.padded_vocab_size / tp)


CASES = {
    "gpt": {},
    "bf16": {"params_dtype": torch.bfloat16},
    "swiglu-gqa-untied": {"activation": "swiglu", "num_query_groups": 2, "add_bias_linear": False,
                          "untie_embeddings_and_output_weights": True},
    "selective": {"recompute_granularity": "selective", "num_query_groups": 2},
    "rope-mha": {"position_embedding_type": "rope"},
    "rope-gqa-rmsnorm": {"position_embedding_type": "rope", "num_query_groups": 2,
                         "normalization": "RMSNorm", "activation": "swiglu"},
    "switch-mlp": {"num_experts": 4},
    "switch-mlp-swiglu-nobias": {"num_experts": 3, "activation": "swiglu",
                                 "add_bias_linear": False},
}


def _case_config(name, **over):
    kw = dict(CASES[name])
    cfg = tiny_config(seq_length=128, hidden_size=64, num_attention_heads=4, num_layers=2,
                      padded_vocab_size=256, mbs=2, **kw, **over)
    if kw.get("params_dtype") == torch.bfloat16:
        cfg.optimizer.bf16 = True
    return cfg


@pytest.mark.parametrize("name", sorted(CASES))
def test_estimate_matches_saved_tensors(name):
    """Eager CPU, dropout off (CPU dropout keeps a float mask, CUDA a bool one)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    cfg = _case_config(name)
    model = GPTModel(cfg.model)
    tokens = torch.randint(0, 256, (2, 128))
    got = _saved_bytes(model, tokens, torch.randint(0, 256, (2, 128)))
    tol = 0.01 if name == "bf16" else 1e-9  # CPU keeps bf16 norm statistics, CUDA fp32
    indices = 24 * 128 * 2 * 2 if cfg.model.num_experts else 0  # int64: not counted here
    assert got == pytest.approx(_expected_saved(cfg, 2) - indices, rel=tol)


def test_full_recompute_keeps_layer_inputs_only():
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = _case_config("gpt", recompute_granularity="full")
    got = _saved_bytes(GPTModel(cfg.model), torch.randint(0, 256, (2, 128)),
                       torch.randint(0, 256, (2, 128)))
    one_layer = activation_bytes(_case_config("gpt"), 1)  # rebuilt in backward, not yet
    assert got == pytest.approx(_expected_saved(cfg, 2) - one_layer, rel=1e-9)


def test_compiled_selective_recompute_with_attention_dropout_saves_what_no_recompute_does():
    """Compiled layers leave a dropout attention core out of the selective checkpoint
    (ParallelAttention._recompute_core): the estimate counts the layer as without recompute."""
    plain = cli("--bf16 --attention-dropout 0.1")
    sel = cli("--bf16 --attention-dropout 0.1 --recompute-activations")
    for cfg in (plain, sel):
        cfg.model.compile_layers = True
    assert activation_bytes(sel, 4) == activation_bytes(plain, 4)
    sel.model.attention_dropout = 0.0
    plain.model.attention_dropout = 0.0
    assert activation_bytes(sel, 4) < activation_bytes(plain, 4)
    sel.model.attention_dropout, sel.model.compile_layers = 0.1, False
    assert activation_bytes(sel, 4) < activation_bytes(plain, 4)


def _tp_worker(rank, world_size, sp):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.parallel_state import ParallelState

    ps = ParallelState.build(world_size=2, rank=rank, tp_size=2, sequence_parallel=sp)
    cfg = _case_config("swiglu-gqa-untied", sequence_parallel=sp)
    cfg.parallel.tp_size, cfg.parallel.sequence_parallel = 2, sp
    torch.manual_seed(0)
    model = GPTModel(cfg.model, tp_group=ps.tp_group)
    tokens = torch.randint(0, 256, (2, 128))
    expected = _expected_saved(cfg, 2)
    if sp:
        # scatter_to_sp hands the first layer a slice (a view) of the full embedding
        # output, which then stays alive: (1 - 1/t) * s*b*h elements more than the split.
        expected += 128 * 2 * 64 * 4 / 2
    return _saved_bytes(model, tokens, torch.randint(0, 256, (2, 128))), expected


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_saved_tensors(sp):
    for got, expected in run_distributed(_tp_worker, 2, sp):
        assert got == pytest.approx(expected, rel=1e-9)


# ------------------------------------------------------------ pipeline, dry-run report


def test_pipeline_stage_zero_holds_pp_micro_batches():
    cfg = cli("--bf16")
    cfg.parallel.pp_size, cfg.parallel.dp_size = 4, 2
    layers = activation_bytes(cfg, 6)
    s0 = estimate_stage_memory(cfg, 0)
    s3 = estimate_stage_memory(cfg, 3)
    mask = 2048 * 4 * 2048  # embedding dropout mask
    assert s0["activations"] == round(4 * (layers + mask)) and s0["logits"] == 0
    assert s3["logits"] == 2 * 4 * 2048 * 4 * 50304
    assert estimate_memory(cfg)["stage"] == 0
    cfg.parallel.virtual_pp_size = 2  # interleaved: x (1 + (pp - 1) / (pp * v))
    assert estimate_stage_memory(cfg, 0)["activations"] == round(4 * (1 + 3 / 8) * (layers + mask))


def test_dry_run_prints_breakdown_and_warns(capsys):
    text = dry_run_report(cli("--bf16 --gpu-memory-gb 80"), 8)
    assert "memory per GPU, estimate:" in text and "with the distributed optimizer" in text
    assert "WARNING" not in text
    text = dry_run_report(cli("--bf16 --gpu-memory-gb 24"), 8)
    assert "WARNING: estimated peak memory" in text and "exceeds 24.0 GiB (--gpu-memory-gb)" in text
    if not torch.cuda.is_available():  # default: the local GPU, no check on CPU
        assert "WARNING" not in dry_run_report(cli("--bf16 --micro-batch-size 64 "
                                                   "--global-batch-size 512"), 8)


def test_full_recompute_rebuilds_one_layer_per_stage_not_per_micro_batch_in_flight():
    """Backward rebuilds one layer of one micro-batch at a time: on pipeline stage 0, which
    keeps pp micro-batches in flight, that layer's activations count once. Counted per
    micro-batch, recomputing one layer of a stage (block 1) was estimated above no recompute."""
    cfg = cli("--bf16")
    cfg.parallel.pp_size, cfg.parallel.dp_size = 4, 2
    none = estimate_stage_memory(cfg, 0)["activations"]
    one = activation_bytes(cfg, 1)
    block = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, recompute_granularity="full", recompute_method="block", recompute_num_layers=1))
    got = estimate_stage_memory(block, 0)["activations"]
    assert got < none
    layer_input = 2048 * 4 * cfg.model.hidden_size * 2
    assert got == round(none - 4 * (one - layer_input) + one)


def test_block_recompute_counts_its_layers_in_every_virtual_pipeline_stage():
    """Each virtual stage is a transformer block of its own that recomputes its first
    --recompute-num-layers layers: block N with N = the layers of a virtual stage is a
    full recompute (the estimate counted N layers for the whole pipeline rank)."""
    layers = 24 // 2 // 3
    block = cli(f"--bf16 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage "
                f"{layers} --recompute-granularity full --recompute-method block "
                f"--recompute-num-layers {layers}")
    uniform = cli("--bf16 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage "
                  f"{layers} --recompute-granularity full --recompute-method uniform")
    assert block.parallel.virtual_pp_size == 3
    for stage in (0, 1):
        assert (estimate_stage_memory(block, stage)["activations"]
                == estimate_stage_memory(uniform, stage)["activations"])


def test_reset_attention_mask_counts_the_s_by_s_mask():
    """--reset-attention-mask materialises a [b, 1, s, s] bool mask per micro-batch and the
    attention keeps an additive bias of it (activation dtype) for backward: (1 + e)*b*s*s
    per micro-batch in flight, which at seq 32768 dwarfs a small model's activations."""
    extra = "--bf16 --tensor-model-parallel-size 2 --seq-length 8192 --max-position-embeddings 8192"
    plain = estimate_memory(cli(extra))
    masked = estimate_memory(cli(extra + " --reset-attention-mask"))
    in_flight = 1  # no pipeline parallelism: one micro-batch's activations at a time
    assert masked["activations"] - plain["activations"] == in_flight * 3 * 4 * 8192 ** 2


def test_block_recompute_of_no_layer_is_estimated_as_no_recompute():
    """--recompute-method block --recompute-num-layers -2 recomputes no layer (warned):
    the estimate counted -2 layers as recomputed, i.e. more memory than no recompute."""
    none = estimate_stage_memory(cli("--bf16"), 0)["activations"]
    for n in ("0", "-2"):
        cfg = cli(f"--bf16 --recompute-granularity full --recompute-method block "
                  f"--recompute-num-layers {n}")
        assert estimate_stage_memory(cfg, 0)["activations"] == none, n


@pytest.mark.parametrize("extra, says", [
    ("", "(no recompute, "),
    ("--recompute-activations", "(selective recompute (the attention core), "),
    ("--recompute-granularity full --recompute-method uniform",
     "(full recompute of every layer (24), "),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 5",
     "(full recompute of the first 5 of the 24 layers (--recompute-method block "
     "--recompute-num-layers 5), "),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 30 "
     "--pipeline-model-parallel-size 2", "(full recompute of every layer (12 of each stage), "),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 1 "
     "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 4",
     "(full recompute of the first 1 of the 4 layers of each virtual stage "
     "(--recompute-method block --recompute-num-layers 1), "),
    ("--recompute-granularity full --recompute-method uniform --pipeline-model-parallel-size 4 "
     "--standalone-embedding-stage", "(full recompute of every layer (8 of each stage), "),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 0",
     "(no recompute (--recompute-method block --recompute-num-layers 0), "),
])
def test_dry_run_says_which_layers_are_recomputed(extra, says):
    """The dry run's estimate said "full recompute" for block recompute of some layers
    (or of none): not what the figure assumes."""
    assert says in dry_run_report(cli("--bf16 " + extra), 8)
