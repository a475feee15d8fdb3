"""The command-line flag tables: data only, read by `megatron/arguments.py`.

Row format of a flag: `(flag, kind, default[, choices[, dest]])`; dest defaults to the flag
name without dashes, '-' -> '_'. Kinds:

  int | float | str    argparse `type=` of that name
  raw                  no `type=` (strings)
  num                  int or float (only the deprecated `--warmup`, see DEPRECATED_HELP)
  bool                 `type=bool` (any non-empty string is True, as in Megatron-LM)
  true | false         store_true / store_false
  list                 nargs='*' strings
  +int                 nargs='+' ints

`MEGATRON_GROUPS` holds the 223 flags of Megatron-LM 23.05/23.06 in Megatron's group order
(`--help` lists them in this order); `EXTRA_GROUP` holds the flags this framework adds.
The NOT_SUPPORTED tables list what is parsed but rejected when set to a non-default value:
delete a row when the feature lands.
"""
from __future__ import annotations

from typing import Optional

MEGATRON_DESCRIPTION = "Megatron-LM Arguments"

MEGATRON_GROUPS = (
    ("network size", (
        ("--num-layers", "int", None),
        ("--encoder-num-layers", "int", None),
        ("--decoder-num-layers", "int", None),
        ("--hidden-size", "int", None),
        ("--ffn-hidden-size", "int", None),
        ("--num-attention-heads", "int", None),
        ("--kv-channels", "int", None),
        ("--max-position-embeddings", "int", None),
        ("--use-rotary-position-embeddings", "true", False),
        ("--rotary-percent", "float", 1.0),
        ("--no-position-embedding", "false", True, None, "add_position_embedding"),
        ("--make-vocab-size-divisible-by", "int", 128),
        ("--layernorm-epsilon", "float", 1e-05),
        ("--apply-layernorm-1p", "true", False),
        ("--apply-residual-connection-post-layernorm", "true", False),
        ("--openai-gelu", "true", False),
        ("--squared-relu", "true", False),
        ("--swiglu", "true", False),
        ("--onnx-safe", "bool", None),
        ("--bert-no-binary-head", "false", True, None, "bert_binary_head"),
        ("--num-experts", "int", None),
        ("--untie-embeddings-and-output-weights", "true", False),
        ("--embedding-weights-in-fp32", "true", False),
    )),
    ("regularization", (
        ("--attention-dropout", "float", 0.1),
        ("--hidden-dropout", "float", 0.1),
        ("--weight-decay", "float", 0.01),
        ("--start-weight-decay", "float", None),
        ("--end-weight-decay", "float", None),
        ("--weight-decay-incr-style", "str", "constant", ("constant", "linear", "cosine")),
        ("--clip-grad", "float", 1.0),
        ("--adam-beta1", "float", 0.9),
        ("--adam-beta2", "float", 0.999),
        ("--adam-eps", "float", 1e-08),
        ("--sgd-momentum", "float", 0.9),
    )),
    ("training", (
        ("--micro-batch-size", "int", None),
        ("--batch-size", "int", None),
        ("--global-batch-size", "int", None),
        ("--rampup-batch-size", "list", None),
        ("--recompute-activations", "true", False),
        ("--recompute-granularity", "str", None, ("full", "selective")),
        ("--distribute-saved-activations", "true", False),
        ("--recompute-method", "str", None, ("uniform", "block")),
        ("--recompute-num-layers", "int", 1),
        ("--checkpoint-activations", "true", False),
        ("--train-iters", "int", None),
        ("--train-samples", "int", None),
        ("--log-interval", "int", 100),
        ("--exit-interval", "int", None),
        ("--exit-duration-in-mins", "int", None),
        ("--exit-signal-handler", "true", False),
        ("--tensorboard-dir", "str", None),
        ("--no-masked-softmax-fusion", "false", True, None, "masked_softmax_fusion"),
        ("--no-bias-gelu-fusion", "false", True, None, "bias_gelu_fusion"),
        ("--no-bias-dropout-fusion", "false", True, None, "bias_dropout_fusion"),
        ("--use-flash-attn", "true", False),
        ("--disable-bias-linear", "false", True, None, "add_bias_linear"),
        ("--optimizer", "str", "adam", ("adam", "sgd")),
        ("--dataloader-type", "str", None, ("single", "cyclic")),
        ("--no-async-tensor-model-parallel-allreduce",
         "false", True, None, "async_tensor_model_parallel_allreduce"),
        ("--no-persist-layer-norm", "true", False),
        ("--sequence-parallel", "true", False),
        ("--no-gradient-accumulation-fusion", "false", True, None, "gradient_accumulation_fusion"),
    )),
    ("initialization", (
        ("--seed", "int", 1234),
        ("--data-parallel-random-init", "true", False),
        ("--init-method-std", "float", 0.02),
        ("--init-method-xavier-uniform", "true", False),
    )),
    ("learning rate", (
        ("--lr", "float", None),
        ("--lr-decay-style",
         "str", "linear", ("constant", "linear", "cosine", "inverse-square-root")),
        ("--lr-decay-iters", "int", None),
        ("--lr-decay-samples", "int", None),
        ("--lr-warmup-fraction", "float", None),
        ("--lr-warmup-iters", "int", 0),
        ("--lr-warmup-samples", "int", 0),
        ("--warmup", "num", None),
        ("--min-lr", "float", 0.0),
        ("--override-opt_param-scheduler", "true", False),
        ("--use-checkpoint-opt_param-scheduler", "true", False),
    )),
    ("checkpointing", (
        ("--save", "str", None),
        ("--save-interval", "int", None),
        ("--no-save-optim", "true", None),
        ("--no-save-rng", "true", None),
        ("--load", "str", None),
        ("--no-load-optim", "true", None),
        ("--no-load-rng", "true", None),
        ("--finetune", "true", False),
        ("--no-initialization", "false", True, None, "perform_initialization"),
        ("--use-checkpoint-args", "true", False),
        ("--exit-on-missing-checkpoint", "true", False),
    )),
    ("mixed precision", (
        ("--fp16", "true", False),
        ("--bf16", "true", False),
        ("--loss-scale", "float", None),
        ("--initial-loss-scale", "float", 4294967296),
        ("--min-loss-scale", "float", 1.0),
        ("--loss-scale-window", "float", 1000),
        ("--hysteresis", "int", 2),
        ("--fp32-residual-connection", "true", False),
        ("--no-query-key-layer-scaling", "false", True, None, "apply_query_key_layer_scaling"),
        ("--attention-softmax-in-fp32", "true", False),
        ("--accumulate-allreduce-grads-in-fp32", "true", False),
        ("--fp16-lm-cross-entropy", "true", False),
    )),
    ("distributed", (
        ("--tensor-model-parallel-size", "int", 1),
        ("--pipeline-model-parallel-size", "int", 1),
        ("--pipeline-model-parallel-split-rank", "int", None),
        ("--model-parallel-size", "int", None),
        ("--num-layers-per-virtual-pipeline-stage", "int", None),
        ("--overlap-p2p-communication", "true", False, None, "overlap_p2p_comm"),
        ("--distributed-backend", "raw", "nccl", ("nccl", "gloo")),
        ("--distributed-timeout-minutes", "int", 10),
        ("--DDP-impl", "raw", "local", ("local", "torch")),
        ("--no-contiguous-buffers-in-local-ddp",
         "false", True, None, "use_contiguous_buffers_in_local_ddp"),
        ("--no-scatter-gather-tensors-in-pipeline",
         "false", True, None, "scatter_gather_tensors_in_pipeline"),
        ("--use-ring-exchange-p2p", "true", False),
        ("--local_rank", "int", None),
        ("--lazy-mpu-init", "bool", None),
        ("--use-cpu-initialization", "true", None),
        ("--empty-unused-memory-level", "int", 0, (0, 1, 2)),
        ("--standalone-embedding-stage", "true", False),
        ("--use-distributed-optimizer", "true", False),
    )),
    ("validation", (
        ("--eval-iters", "int", 100),
        ("--eval-interval", "int", 1000),
        ("--skip-train", "true", False),
    )),
    ("data and dataloader", (
        ("--data-path", "list", None),
        ("--split", "str", "969, 30, 1"),
        ("--train-data-path", "list", None),
        ("--valid-data-path", "list", None),
        ("--test-data-path", "list", None),
        ("--data-cache-path", "raw", None),
        ("--vocab-size", "int", None),
        ("--vocab-file", "str", None),
        ("--merge-file", "str", None),
        ("--vocab-extra-ids", "int", 0),
        ("--seq-length", "int", None),
        ("--encoder-seq-length", "int", None),
        ("--decoder-seq-length", "int", None),
        ("--retriever-seq-length", "int", 256),
        ("--sample-rate", "float", 1.0),
        ("--mask-prob", "float", 0.15),
        ("--short-seq-prob", "float", 0.1),
        ("--mmap-warmup", "true", False),
        ("--num-workers", "int", 2),
        ("--tokenizer-type", "str", None, (
            "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
            "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "NullTokenizer",
            "HuggingFaceTokenizer")),  # the last: an extension (a local tokenizer.json)
        ("--tokenizer-model", "str", None),
        # lazy, cached: Megatron-LM 23.04's (23.05 refuses them), accepted with NO_EFFECT's
        # warning: every value reads the format from the index's magic
        ("--data-impl", "str", "infer", ("mmap", "infer", "lazy", "cached")),
        ("--reset-position-ids", "true", False),
        ("--reset-attention-mask", "true", False),
        ("--eod-mask-loss", "true", False),
    )),
    ("autoresume", (
        ("--adlr-autoresume", "true", False),
        ("--adlr-autoresume-interval", "int", 1000),
    )),
    ("biencoder", (
        ("--ict-head-size", "int", None),
        ("--biencoder-projection-dim", "int", 0),
        ("--biencoder-shared-query-context-model", "true", False),
        ("--ict-load", "str", None),
        ("--bert-load", "str", None),
        ("--titles-data-path", "str", None),
        ("--query-in-block-prob", "float", 0.1),
        ("--use-one-sent-docs", "true", False),
        ("--evidence-data-path", "str", None),
        ("--retriever-report-topk-accuracies", "+int", []),
        ("--retriever-score-scaling", "true", False),
        ("--block-data-path", "str", None),
        ("--embedding-path", "str", None),
        ("--indexer-batch-size", "int", 128),
        ("--indexer-log-interval", "int", 1000),
    )),
    ("vision", (
        ("--num-classes", "int", 1000),
        ("--img-h", "int", 224),
        ("--img-w", "int", 224),
        ("--num-channels", "int", 3),
        ("--patch-dim", "int", 16),
        ("--classes-fraction", "float", 1.0),
        ("--data-per-class-fraction", "float", 1.0),
        ("--no-data-sharding", "false", True, None, "data_sharding"),
        ("--head-lr-mult", "float", 1.0),
        ("--vision-pretraining", "true", False),
        ("--vision-pretraining-type", "str", "classify", ("classify", "inpaint", "dino")),
        ("--vision-backbone-type", "str", "vit", ("vit", "mit", "swin")),
        ("--swin-backbone-type", "str", "tiny", ("tiny", "base", "h3")),
        ("--mask-type", "str", "random", ("random", "row")),
        ("--mask-factor", "float", 1.0),
        ("--iter-per-epoch", "int", 1250),
        ("--dino-local-img-size", "int", 96),
        ("--dino-local-crops-number", "int", 10),
        ("--dino-head-hidden-size", "int", 2048),
        ("--dino-bottleneck-size", "int", 256),
        ("--dino-freeze-last-layer", "float", 1),
        ("--dino-norm-last-layer", "true", False),
        ("--dino-warmup-teacher-temp", "float", 0.04),
        ("--dino-teacher-temp", "float", 0.07),
        ("--dino-warmup-teacher-temp-epochs", "int", 30),
    )),
    ("logging", (
        ("--log-params-norm", "true", False),
        ("--log-num-zeros-in-grad", "true", False),
        ("--timing-log-level", "int", 0, (0, 1, 2)),
        ("--no-barrier-with-level-1-timing", "false", True, None, "barrier_with_L1_time"),
        ("--timing-log-option", "str", "minmax", ("max", "minmax", "all")),
        ("--tensorboard-log-interval", "int", 1),
        ("--tensorboard-queue-size", "int", 1000),
        ("--log-timers-to-tensorboard", "true", False),
        ("--log-batch-size-to-tensorboard", "true", False),
        ("--no-log-learnig-rate-to-tensorboard",
         "false", True, None, "log_learning_rate_to_tensorboard"),
        ("--no-log-loss-scale-to-tensorboard",
         "false", True, None, "log_loss_scale_to_tensorboard"),
        ("--log-validation-ppl-to-tensorboard", "true", False),
        ("--log-memory-to-tensorboard", "true", False),
        ("--log-world-size-to-tensorboard", "true", False),
    )),
    ("inference", (
        ("--inference-batch-times-seqlen-threshold", "int", 512),
        ("--max-tokens-to-oom", "int", 12000),
        ("--output-bert-embeddings", "true", False),
        ("--bert-embedder-type", "raw", "megatron", ("megatron", "huggingface")),
    )),
    ("Transformer-Engine", (
        ("--fp8-e4m3", "true", False),
        ("--fp8-hybrid", "true", False),
        ("--no-fp8-wgrad", "false", True, None, "fp8_wgrad"),
        ("--fp8-margin", "int", 0),
        ("--fp8-interval", "int", 1),
        ("--transformer-impl", "raw", "local", ("local", "transformer_engine")),
        ("--fp8-amax-history-len", "int", 1),
        ("--fp8-amax-compute-algo", "raw", "most_recent", ("most_recent", "max")),
    )),
    ("retro", (
        ("--retro-workdir", "raw", None),
        ("--retro-add-retriever", "true", False),
        ("--retro-cyclic-train-iters", "int", None),
        ("--retro-encoder-layers", "int", 2),
        ("--retro-encoder-hidden-dropout", "float", 0.1),
        ("--retro-encoder-attention-dropout", "float", 0.1),
        ("--retro-num-neighbors", "int", 2),
        ("--retro-num-retrieved-chunks", "int", 2),
        ("--retro-return-doc-ids", "true", False),
    )),
)

EXTRA_GROUP = ("extensions (not in Megatron-LM 23.05)", (
    ("--config", "str", None),
    ("--dry-run", "true", False),
    ("--mock-data", "true", False),
    ("--compile", "true", None, None, "compile_layers"),
    ("--no-compile", "false", None, None, "compile_layers"),
    ("--compile-mode", "str", "default", ("default", "reduce-overhead", "max-autotune-no-cudagraphs")),
    ("--compile-scope", "str", "auto", ("auto", "layer", "block")),
    ("--adam-kernel", "str", "auto", ("auto", "torch", "triton")),
    ("--attention-backend", "str", "auto", ("auto", "flash", "cudnn", "efficient", "math")),
    ("--cuda-graph-step", "str", "auto", ("auto", "on", "off")),
    ("--cublas-workspace", "str", "none", ("none", "torch")),
    ("--cross-entropy-kernel", "str", "auto", ("auto", "torch", "triton")),
    ("--gelu-kernel", "str", "auto", ("auto", "torch", "polynomial", "epilogue")),
    ("--gemm-algorithms", "str", "auto"),
    ("--normalization", "str", "LayerNorm", ("LayerNorm", "RMSNorm")),
    ("--group-query-attention", "true", False),
    ("--num-query-groups", "int", None),
    ("--position-embedding-type", "str", None, ("learned_absolute", "rope", "rope+learned")),
    ("--rotary-base", "float", 10000.0),
    ("--overlap-grad-reduce", "true", False),
    ("--no-overlap-grad-reduce", "false", False, None, "overlap_grad_reduce"),
    ("--ddp-bucket-size", "int", None),
    ("--overlap-param-gather", "true", False),
    ("--async-tensor-model-parallel-allreduce", "true", True),
    ("--gradient-accumulation-fusion", "true", True),
    ("--expert-model-parallel-size", "int", 1),
    ("--gpu-memory-gb", "float", None),
    ("--nan-loss-policy", "str", "stop", ("stop", "skip", "rollback")),
    ("--async-save", "true", False),
    ("--profile", "true", False),
    ("--profile-step-start", "int", 10),
    ("--profile-step-end", "int", 12),
    ("--profile-ranks", "+int", [0]),
    ("--record-memory-history", "true", False),
    ("--memory-snapshot-path", "str", "snapshot.pickle"),
))

# --help texts of the extension flags (those of Megatron-LM's flags: arguments_help.py).
EXTRA_HELP = {
    "--config": "YAML file of flag: value pairs; command-line flags override it",
    "--dry-run": "validate for $WORLD_SIZE ranks, print the layout, parameter counts, a "
                 "memory estimate and missing input files, and with --load what the load "
                 "would do, then exit (status 1 when something would fail)",
    "--mock-data": "train on random tokens instead of --data-path",
    "--compile": "torch.compile each transformer layer (default: on when CUDA is available)",
    "--no-compile": "never torch.compile the transformer layers",
    "--compile-mode": "torch.compile mode of the layers (reduce-overhead adds CUDA graphs)",
    "--adam-kernel": "AdamW implementation: auto (one Triton launch per param group that also "
                     "writes the fp16/bf16 model params, when Triton and CUDA are there and "
                     "every grad is in a grad buffer; else torch's fused AdamW), torch, triton",
    "--compile-scope": "layer: one compiled graph shared by every transformer layer, from "
                       "its input norm to the next norm, so residual adds fuse with the "
                       "norms (short start-up, grads ready layer by layer for "
                       "--overlap-grad-reduce); block: the stage's whole layer stack as one "
                       "graph (same speed, about 3x the compile time); auto (default): layer",
    "--attention-backend": "scaled_dot_product_attention kernel: auto (torch's choice), flash "
                           "(on the CPU only without attention dropout), cudnn or efficient "
                           "(CUDA), math (reference)",
    "--cross-entropy-kernel": "output layer + cross entropy: auto (default: one Triton pass "
                              "per token computes the loss and overwrites the logits with "
                              "their gradient, in any dtype, where Triton runs on the "
                              "device and --fp16-lm-cross-entropy is off; under tensor "
                              "parallelism on the vocabulary slices), "
                              "torch (separate layer and loss), triton (insist)",
    "--gelu-kernel": "how the MLP's GeLU is computed. The erf GeLU: torch (torch's erf), "
                     "polynomial (erf by a five-term polynomial and one exponential, |error| "
                     "< 1.5e-7, the backward reusing the exponential; Triton kernels on CUDA, "
                     "torch ops elsewhere), auto (default: polynomial on CUDA with Triton, "
                     "else torch). The tanh form (--openai-gelu, or the default GeLU with "
                     "biases and bias-GeLU fusion, as Megatron-LM): auto = epilogue, inside "
                     "the MLP's products (fc1's forward adds the bias and writes GeLU(h) and "
                     "h, fc2's input grad multiplies by GeLU'(h); cuBLASLt epilogues on CUDA, "
                     "torch ops elsewhere); torch = torch's tanh GeLU. epilogue with the erf "
                     "GeLU computes the tanh form instead (for a model meant to have it, "
                     "prefer --openai-gelu, which checkpoints and exports record)",
    "--cuda-graph-step": "record the whole training step (forward, backward, optimizer) as one "
                         "CUDA graph and replay it from the third step: auto (default: when "
                         "the run allows it -- one GPU, no dropout, the Triton AdamW kernel; "
                         "fp16 decides skips on the GPU, read one step late; falls back to eager "
                         "steps if the capture fails), on (insist), off",
    "--cublas-workspace": "cuBLAS's GEMM workspace: none (default: the entry point sets "
                          "CUBLAS_WORKSPACE_CONFIG=:0:0 before CUDA starts, unless the "
                          "environment sets it, CUBLASLT_WORKSPACE_SIZE or "
                          "TORCH_BLAS_PREFER_CUBLASLT; cuBLAS then picks kernels that need "
                          "no workspace and no memset: +1.0-1.5%% gpt2-124m, +0.3%% gpt-1.3b "
                          "on an H200), torch (leave torch's workspace; needed when code "
                          "prefers cuBLASLt)",
    "--gemm-algorithms": "cuBLASLt algorithms for the linear layers' products, measured "
                         "fastest at the GPU's power limit: auto (default: the tables in "
                         "megatron/gemm_tables measured on this GPU model and cuBLASLt "
                         "version, for the product shapes they list; torch's choice "
                         "elsewhere and on the CPU), a JSON FILE from tools/tune_gemms.py "
                         "(CUDA; refused on another GPU model or cuBLASLt version), or "
                         "none (torch's choice for every product)",
    "--normalization": "normalization layer type",
    "--group-query-attention": "grouped-query attention (see --num-query-groups)",
    "--num-query-groups": "number of key/value groups with --group-query-attention (default 1)",
    "--position-embedding-type": "learned_absolute, rope (rotary only, as "
                                 "--use-rotary-position-embeddings --no-position-embedding) "
                                 "or rope+learned (both, as --use-rotary-position-embeddings)",
    "--rotary-base": "base of the rotary embedding frequencies",
    "--overlap-grad-reduce": "overlap the data-parallel gradient all-reduce with backward",
    "--no-overlap-grad-reduce": "do not overlap the gradient all-reduce (default)",
    "--ddp-bucket-size": "elements per gradient all-reduce bucket",
    "--overlap-param-gather": "with --use-distributed-optimizer: all-gather the updated "
                              "parameters while the next forward pass runs",
    "--async-tensor-model-parallel-allreduce": "overlap the tensor-parallel input-grad "
                                               "all-reduce with the weight-grad GEMM (default)",
    "--gradient-accumulation-fusion": "grads accumulate into main_grad inside the layers: "
                                      "weight grads in the GEMM, norm and bias grads in "
                                      "the backward (default)",
    "--expert-model-parallel-size": "ranks the experts of --num-experts would be split over "
                                    "(a later Megatron-LM flag)",
    "--gpu-memory-gb": "memory of one GPU for the --dry-run memory check (default: what the "
                       "local GPU has; no check without a GPU)",
    "--profile": "record a torch profiler trace (tensorboard-readable, under --tensorboard-dir "
                 "or ./profile) for iterations --profile-step-start + 1 to --profile-step-end "
                 "(as Megatron-LM); on GPU the steps also carry NVTX ranges for nsys",
    "--profile-step-start": "iterations done when profiling starts (0: from the first)",
    "--profile-step-end": "iterations done when profiling stops",
    "--profile-ranks": "global ranks that write a trace",
    "--record-memory-history": "record the CUDA caching allocator's history on every rank "
                               "(for https://pytorch.org/memory_viz): the last rank writes a "
                               "snapshot to --memory-snapshot-path every --log-interval "
                               "iterations, a rank that runs out of memory writes "
                               "<stem>_oom_rank<R><ext> beside it; slows every allocation "
                               "(debugging only); needs CUDA",
    "--memory-snapshot-path": "the snapshot file of --record-memory-history (default "
                              "snapshot.pickle)",
    "--async-save": "checkpoint saves block training only while the state is copied to CPU; "
                    "a background thread writes the files, and the tracker file is written "
                    "once every rank has finished (the run waits for it at exit)",
    "--nan-loss-policy": "on a NaN/Inf loss: stop with a message (default); skip the "
                         "iteration; or roll back to the last checkpoint and skip the batches "
                         "since it, stopping after 3 rollbacks in a row that get no further "
                         "(skip and rollback check every iteration: one host sync)",
}

# ---------------------------------------------------------------------------------------
# Parsed but rejected when set to a non-default value. Delete a row when the feature lands.

_BERT = "BERT/T5 models are not part of this GPT framework"
_T5 = "encoder-decoder (T5) models are not part of this GPT framework"
_VISION = "vision models are not part of this GPT framework"
_BIENCODER = "biencoder/ICT retrieval models are not part of this GPT framework"
_RETRO = "RETRO models are not part of this GPT framework"
_FP8 = "Transformer Engine and fp8 are not supported by this framework yet"
_EP = ("expert model parallelism is not supported: with --num-experts every expert is "
       "replicated over data-parallel ranks and split over tensor-parallel ranks like the "
       "dense MLP, as in Megatron-LM 23.05")

# Every flag of these Megatron groups except those listed in ALLOWED_IN_REJECTED_GROUPS.
NOT_SUPPORTED_GROUPS = {
    "biencoder": _BIENCODER,
    "vision": _VISION,
    "retro": _RETRO,
    "Transformer-Engine": _FP8,
}
ALLOWED_IN_REJECTED_GROUPS = ("--no-data-sharding",)  # read by the cyclic GPT loader too

NOT_SUPPORTED = {
    # other model families
    "--decoder-num-layers": _T5,
    "--decoder-seq-length": _T5,
    "--pipeline-model-parallel-split-rank": _T5,
    "--bert-no-binary-head": _BERT,
    "--mask-prob": _BERT,
    "--short-seq-prob": _BERT,
    "--sample-rate": "only the BERT/T5/ICT datasets read it; GPT datasets do not",
    "--retriever-seq-length": _BIENCODER,
    "--output-bert-embeddings": _BERT,
    "--bert-embedder-type": _BERT,
    # features not built (yet)
    "--expert-model-parallel-size": _EP,
    "--onnx-safe": "ONNX export is not supported",
    "--lazy-mpu-init": "lazy model-parallel initialization (for external tools) is not supported",
    "--adlr-autoresume": "ADLR autoresume is an NVIDIA cluster service and is not supported; "
                         "use --exit-signal-handler or --exit-duration-in-mins",
    "--adlr-autoresume-interval": "ADLR autoresume is not supported",
}

# Accepted, but they change nothing here: one warning each when set.
NO_EFFECT = {
    "--no-scatter-gather-tensors-in-pipeline": "never read by Megatron-LM 23.05 either",
    "--use-ring-exchange-p2p": "never read by Megatron-LM 23.05 either",
    "--no-masked-softmax-fusion": "attention uses torch scaled_dot_product_attention",
    "--no-bias-dropout-fusion": "there is no fused bias-dropout kernel",
    "--no-persist-layer-norm": "layer norms are torch.nn layers",
    "--use-flash-attn": "torch scaled_dot_product_attention picks a flash kernel by itself",
    "--data-impl": "the format is read from each index's magic (mmap, or legacy TNTIDX "
                   "written by older Megatron-LM's --dataset-impl lazy/cached)",
    "--attention-softmax-in-fp32": "always on: scaled_dot_product_attention computes the "
                                   "softmax in fp32 for fp16/bf16 inputs (every backend)",
    "--no-query-key-layer-scaling": "the scaling only kept fp16 attention scores from "
                                    "overflowing; scaled_dot_product_attention computes them "
                                    "in fp32, so it never changes the result",
    "--inference-batch-times-seqlen-threshold": "text generation (tools/generate.py, "
                                                "tools/run_text_generation_server.py) passes "
                                                "each batch through the pipeline stages "
                                                "whole: no micro-batching to tune",
    "--max-tokens-to-oom": "read by tools/run_text_generation_server.py only (it refuses "
                           "requests above it)",
    "--mmap-warmup": "page-cache warm-up only; the .bin/.idx files are memory-mapped and "
                     "paged in on first use",
}

# NO_EFFECT values that name what is done anyway: not warned (every Megatron-LM 23.05
# script passes --data-impl mmap, and mmap files are what is read; the default, infer, is
# never warned either).
NO_EFFECT_QUIET_VALUES = {"--data-impl": ("mmap",)}

# Flags from older Megatron-LM releases that 23.05 no longer knows: error with the modern
# spelling.
REMOVED = {
    "--activations-checkpoint-method": "--recompute-granularity full --recompute-method <value>",
    "--activations-checkpoint-num-layers": "--recompute-num-layers",
    "--checkpoint-granularity": "--recompute-granularity",
    "--checkpoint-method": "--recompute-method",
    "--checkpoint-num-layers": "--recompute-num-layers",
    "--distribute-checkpointed-activations": "--distribute-saved-activations",
    "--model-parallel-memory-opt": "--sequence-parallel",
    "--checkpoint-attention": "--recompute-granularity selective",
}

# Flags of later Megatron-LM releases (which scripts copied from them carry) that this
# project does not know: the unknown-flag error says what each one is and what to do,
# instead of a look-alike flag ('--use-mcore-models (did you mean --compile-mode?)').
LATER_FLAGS = {
    "--norm-epsilon": "later Megatron-LM's name of --layernorm-epsilon: pass that instead",
    "--use-mcore-models": "later Megatron-LM's switch to its megatron.core model: drop it; "
                          "this project has one GPT model, saved in Megatron-LM 23.05's "
                          "checkpoint layout",
    "--use-legacy-models": "later Megatron-LM's switch to its 23.05-style model: drop it; "
                           "this project's one GPT model is saved in that layout",
    "--ckpt-format": "later Megatron-LM's checkpoint format: drop it; checkpoints here are "
                     "Megatron-LM 23.05's per-rank torch files (its --ckpt-format torch), "
                     "torch_dist and zarr are not written",
    "--use-dist-ckpt": "later Megatron-LM's distributed checkpoint: drop it; checkpoints here "
                       "are Megatron-LM 23.05's per-rank torch files",
    "--spec": "later Megatron-LM's layer-spec module: drop it; the layer is set by flags "
              "(--normalization, --swiglu, --position-embedding-type, ...)",
    "--qk-layernorm": "later Megatron-LM's norm of queries and keys: not offered (Megatron-LM "
                      "23.05 has none)",
    "--rotary-seq-len-interpolation-factor": "later Megatron-LM's rotary position "
                                             "interpolation: not offered; --rotary-base and "
                                             "--rotary-percent are",
    "--apply-rope-fusion": "later Megatron-LM's fused rotary embedding: drop it; the rotary "
                           "embedding here is one fused kernel on CUDA already",
    "--no-rope-fusion": "later Megatron-LM's switch off its fused rotary embedding: drop it; "
                        "no flag here picks the rotary embedding's kernel",
    "--bias-swiglu-fusion": "later Megatron-LM's fused SwiGLU: drop it; --swiglu here is one "
                            "fused kernel on CUDA already",
    "--no-bias-swiglu-fusion": "later Megatron-LM's switch off its fused SwiGLU: drop it; no "
                               "flag here picks the SwiGLU kernel",
    "--cross-entropy-loss-fusion": "later Megatron-LM's fused cross entropy: use "
                                   "--cross-entropy-kernel (auto fuses it on CUDA)",
    "--moe-router-topk": "later Megatron-LM's MoE: not offered; --num-experts routes as "
                         "Megatron-LM 23.05 does (top-1)",
    "--moe-aux-loss-coeff": "later Megatron-LM's MoE: not offered; --num-experts routes as "
                            "Megatron-LM 23.05 does (top-1, no auxiliary loss)",
    "--expert-tensor-parallel-size": "later Megatron-LM's MoE: not offered; drop it. The "
                                     "experts of --num-experts are split over the "
                                     "--tensor-model-parallel-size ranks like the dense MLP",
    "--moe-grouped-gemm": "later Megatron-LM's MoE: drop it; the experts of --num-experts run "
                          "as grouped GEMMs by themselves where torch supports it",
    "--no-create-attention-mask-in-dataloader": "later Megatron-LM's switch: drop it; no "
                                                "mask is built unless --reset-attention-mask "
                                                "asks for one (plain causal attention)",
    "--no-mmap-bin-files": "later Megatron-LM's switch: drop it; .bin files are "
                           "memory-mapped, as in Megatron-LM 23.05",
}

# Every other --moe-* flag is later Megatron-LM's MoE too: answered as such rather than
# with a look-alike ('--moe-token-dispatcher-type (did you mean --tokenizer-type?)').
_LATER_MOE = ("later Megatron-LM's MoE: not offered; drop it. --num-experts is Megatron-LM "
              "23.05's switch MLP: top-1 routing, no capacity limit or auxiliary loss, "
              "experts as wide as --ffn-hidden-size and replicated over data-parallel ranks")


def later_flag_hint(flag: str) -> Optional[str]:
    """What to say of `flag` (no value), a flag of a later Megatron-LM release this project
    does not know: its LATER_FLAGS entry, the MoE answer for any other --moe-* flag, or
    None for a flag of no later release known here."""
    if flag in LATER_FLAGS:
        return LATER_FLAGS[flag]
    return _LATER_MOE if flag.startswith("--moe-") else None

# Second spellings of a flag. torch >= 2.0's `python -m torch.distributed.launch` (which
# Megatron-LM's example scripts, e.g. evaluate_zeroshot_gpt.sh, use) passes --local-rank=N
# where older versions passed --local_rank=N; later Megatron-LM versions accept both.
ALIASES = {
    "--local_rank": ("--local-rank",),
}

DEPRECATED_HELP = {
    "--model-parallel-size": "deprecated: use --tensor-model-parallel-size",
    "--batch-size": "deprecated: use --micro-batch-size",
    "--warmup": "deprecated: a value < 1 is --lr-warmup-fraction, otherwise --lr-warmup-iters",
    "--checkpoint-activations": "deprecated: use --recompute-granularity full "
                                "--recompute-method uniform",
    "--distributed-backend": "accepted for compatibility, the value ignored: the backend is "
                             "nccl when CUDA is available, else gloo (another value is warned)",
}
