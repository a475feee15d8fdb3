"""The `--help` text of Megatron-LM 23.05's flags, as this framework reads them: data, put
together by `flag_help` for `arguments.build_parser`.

`MEGATRON_HELP` says what each of Megatron's flags does HERE: its unit, its default where
the text needs it, and where this framework differs. It never states that a flag is
refused or without effect: `flag_help` adds that from the tables of arguments_table.py
(NOT_SUPPORTED, NOT_SUPPORTED_GROUPS, NO_EFFECT), so the reason is written once. The
extensions' texts are `EXTRA_HELP`, the deprecated spellings' `DEPRECATED_HELP` (both in
arguments_table.py). `flag_help` appends `(default: X)` to a flag that takes a value when
X is not None and the text does not name its default itself.

argparse %-formats help strings: a literal percent sign is written `%%`.
"""
from __future__ import annotations

from typing import Dict, Optional

from megatron.arguments_common import FLAG_SPECS
from megatron.arguments_table import (
    ALLOWED_IN_REJECTED_GROUPS,
    DEPRECATED_HELP,
    EXTRA_HELP,
    NO_EFFECT,
    NOT_SUPPORTED,
    NOT_SUPPORTED_GROUPS,
)

_NETWORK = {
    "--num-layers": "number of transformer layers (required)",
    "--encoder-num-layers": "the same as --num-layers (pass one of them)",
    "--decoder-num-layers": "layers of a T5 decoder",
    "--hidden-size": "width of the residual stream, in channels (required)",
    "--ffn-hidden-size": "width of the MLP's inner layer (default 4 x --hidden-size; with "
                         "--swiglu int(8 x hidden / 3 / 64) x 64, and a given width is kept, "
                         "with a warning, where Megatron-LM replaces it)",
    "--num-attention-heads": "attention heads per layer (required; a multiple of "
                             "--tensor-model-parallel-size)",
    "--kv-channels": "width of one attention head (default --hidden-size / "
                     "--num-attention-heads)",
    "--max-position-embeddings": "rows of the learned position table (required, also with "
                                 "rotary positions only; at least --seq-length)",
    "--use-rotary-position-embeddings": "rotate queries and keys in every layer (RoPE); as "
                                        "in Megatron-LM 23.05 the learned position table "
                                        "stays unless --no-position-embedding "
                                        "(see --position-embedding-type)",
    "--rotary-percent": "share of each head's channels that the rotary embedding rotates",
    "--no-position-embedding": "no learned position table (with "
                               "--use-rotary-position-embeddings: rotary positions only)",
    "--make-vocab-size-divisible-by": "pad the tokenizer's vocabulary with unused rows to a "
                                      "multiple of this x --tensor-model-parallel-size",
    "--layernorm-epsilon": "epsilon added to the variance in LayerNorm and RMSNorm",
    "--apply-layernorm-1p": "LayerNorm weights stored as (weight - 1), zero at the start "
                            "(not with --normalization RMSNorm)",
    "--apply-residual-connection-post-layernorm": "the residual branch starts from the "
                                                  "norm's output, not from the layer input",
    "--openai-gelu": "the tanh approximation of GeLU in the MLP",
    "--squared-relu": "ReLU(x)^2 as the MLP activation",
    "--swiglu": "SwiGLU MLP: a doubled first layer whose halves are gated, SiLU(a) x b",
    "--onnx-safe": "work around ONNX export limits (any value turns it on)",
    "--bert-no-binary-head": "BERT without the sentence-order head",
    "--num-experts": "make every MLP a top-1 switch MLP of this many experts (replicated on "
                     "each data-parallel rank, split over tensor-parallel ranks, as in "
                     "Megatron-LM 23.05; default: the dense MLP)",
    "--untie-embeddings-and-output-weights": "an output layer of its own instead of reusing "
                                             "the word-embedding table",
    "--embedding-weights-in-fp32": "keep the word-embedding table in fp32 under --fp16/--bf16",
}

_REGULARIZATION = {
    "--attention-dropout": "dropout probability of the attention weights",
    "--hidden-dropout": "dropout probability of the embedding output and of each attention "
                        "and MLP output before its residual add",
    "--weight-decay": "decoupled (AdamW-style) weight decay of the weight matrices; biases "
                      "and norm parameters get none",
    "--start-weight-decay": "weight decay at the start of training, with "
                            "--weight-decay-incr-style linear or cosine",
    "--end-weight-decay": "weight decay at the end of training, with "
                          "--weight-decay-incr-style linear or cosine",
    "--weight-decay-incr-style": "how the weight decay goes from --start-weight-decay to "
                                 "--end-weight-decay over the training samples (constant: "
                                 "--weight-decay throughout)",
    "--clip-grad": "clip the global L2 norm of the gradients to this; 0 (or below): no "
                   "clipping",
    "--adam-beta1": "Adam's first-moment decay (on a resume the command line's value wins; "
                    "Megatron-LM keeps the checkpoint's)",
    "--adam-beta2": "Adam's second-moment decay (on a resume the command line's value wins)",
    "--adam-eps": "term added to Adam's denominator (on a resume the command line's value "
                  "wins)",
    "--sgd-momentum": "momentum of --optimizer sgd (on a resume the command line's value "
                      "wins)",
}

_TRAINING = {
    "--micro-batch-size": "samples per forward/backward pass on one data-parallel rank "
                          "(required)",
    "--global-batch-size": "samples per optimizer step over all data-parallel ranks, a "
                           "multiple of --micro-batch-size x data-parallel size; the ratio "
                           "is the number of micro-batches accumulated per step (default: "
                           "one each)",
    "--rampup-batch-size": "START INCR SAMPLES: the global batch starts at START and grows by "
                           "INCR until SAMPLES samples are consumed, then is "
                           "--global-batch-size (needs --train-samples)",
    "--recompute-activations": "the same as --recompute-granularity selective",
    "--recompute-granularity": "activation recomputation in backward: full (whole layers, "
                               "needs --recompute-method) or selective (the attention core "
                               "only)",
    "--distribute-saved-activations": "with full recomputation and tensor parallelism: each "
                                      "tensor-parallel rank keeps 1/tp of every recomputed "
                                      "layer's input (works on torch 2.x, unlike "
                                      "Megatron-LM's version check)",
    "--recompute-method": "with --recompute-granularity full: uniform (every layer) or block "
                          "(the first --recompute-num-layers layers of each (virtual) "
                          "pipeline stage)",
    "--recompute-num-layers": "layers recomputed per stage with --recompute-method block; "
                              "no effect with uniform (every layer is recomputed on its "
                              "own; Megatron-LM recomputes groups of this many)",
    "--train-iters": "optimizer steps to train (this or --train-samples; the lr schedule "
                     "flags then count iterations)",
    "--train-samples": "samples to train on (this or --train-iters; the lr schedule flags "
                       "then count samples)",
    "--log-interval": "iterations between iteration lines (loss, lr, timing) and timer blocks",
    "--exit-interval": "stop, saving a checkpoint with --save, at the first iteration that "
                       "is a multiple of this",
    "--exit-duration-in-mins": "stop, saving a checkpoint with --save, once this many "
                               "minutes have passed since the process started",
    "--exit-signal-handler": "on SIGTERM or SIGUSR1 (Megatron-LM: SIGTERM only) save a "
                             "checkpoint (with --save) after the current iteration and exit",
    "--tensorboard-dir": "write TensorBoard event files here (the last rank writes them)",
    "--no-masked-softmax-fusion": "Megatron-LM: the unfused attention softmax",
    "--no-bias-gelu-fusion": "with biases and the default GeLU, Megatron-LM's MLP adds "
                             "fc1's bias and applies the GeLU in one fused kernel that "
                             "computes the tanh form, and so does this one (see "
                             "--gelu-kernel); this flag asks for torch's erf GeLU instead",
    "--no-bias-dropout-fusion": "Megatron-LM: unfused bias add + dropout",
    "--use-flash-attn": "Megatron-LM: the flash-attn package's attention kernel",
    "--disable-bias-linear": "no biases in the attention and MLP linear layers (the GeLU "
                             "is then torch's erf form, as in Megatron-LM)",
    "--optimizer": "adam: AdamW (decoupled weight decay, as Megatron-LM's apex Adam); sgd: "
                   "SGD with --sgd-momentum",
    "--dataloader-type": "single (default): the samples in the dataset's own shuffled "
                         "order, resumed at the consumed count; cyclic: a new permutation of "
                         "the samples each epoch (see --no-data-sharding)",
    "--no-async-tensor-model-parallel-allreduce": "finish the tensor-parallel all-reduce "
                                                  "of the input gradient before the weight-"
                                                  "gradient product, not during it",
    "--no-persist-layer-norm": "Megatron-LM: apex's non-persistent LayerNorm kernel",
    "--sequence-parallel": "split the norms' and dropouts' activations along the sequence "
                           "over the tensor-parallel ranks (turned off, with a warning, at "
                           "tensor-parallel size 1; --seq-length must divide by it)",
    "--no-gradient-accumulation-fusion": "weight gradients go through .grad and are then "
                                         "added to the gradient buffer, instead of being "
                                         "accumulated into it by the backward products",
}

_INITIALIZATION = {
    "--seed": "base seed of the weights, dropout and data shuffling: rank seed = seed + "
              "100 x pipeline rank (+ 10 x data-parallel rank with "
              "--data-parallel-random-init); tensor-parallel ranks get their own stream",
    "--data-parallel-random-init": "seed each data-parallel replica differently (dropout "
                                   "masks differ); the initial weights are still replica "
                                   "0's, broadcast before the first step",
    "--init-method-std": "standard deviation of the normal initial weights (the attention "
                         "and MLP output projections: divided by sqrt(2 x --num-layers))",
    "--init-method-xavier-uniform": "Xavier-uniform initial weights instead of normal ones",
}

_LEARNING_RATE = {
    "--lr": "peak learning rate, reached at the end of the warmup (required)",
    "--lr-decay-style": "the learning rate's course from --lr to --min-lr after the warmup",
    "--lr-decay-iters": "iterations the learning rate decays over (default --train-iters; "
                        "iteration-based runs)",
    "--lr-decay-samples": "samples the learning rate decays over (default --train-samples; "
                          "sample-based runs)",
    "--lr-warmup-fraction": "share of the decay length spent warming up linearly from 0 "
                            "(instead of --lr-warmup-iters/-samples)",
    "--lr-warmup-iters": "iterations of linear warmup from 0 (iteration-based runs)",
    "--lr-warmup-samples": "samples of linear warmup from 0 (sample-based runs)",
    "--min-lr": "the learning rate at and after the end of the decay",
    "--override-opt_param-scheduler": "on a resume, take the learning-rate and weight-decay "
                                      "schedule from the command line, not the checkpoint "
                                      "(without this flag or the next, a difference is an "
                                      "error)",
    "--use-checkpoint-opt_param-scheduler": "on a resume, take the learning-rate and weight-"
                                            "decay schedule from the checkpoint",
}

_CHECKPOINTING = {
    "--save": "directory to save checkpoints in (Megatron-LM's layout, atomic saves; needs "
              "--save-interval); also saved at the end of training and on an exit condition",
    "--save-interval": "iterations between checkpoints; 0: only the final one",
    "--no-save-optim": "save checkpoints without the optimizer and learning-rate scheduler "
                       "state",
    "--no-save-rng": "save checkpoints without the random-number generators' states",
    "--load": "directory to resume from (the iteration its tracker file names), resharded "
              "to this run's layout; a missing or empty directory starts from scratch",
    "--no-load-optim": "do not load the optimizer and scheduler state: the schedule starts "
                       "again at sample 0",
    "--no-load-rng": "do not load the random-number generators' states",
    "--finetune": "load the weights only and start at iteration 0 with a fresh optimizer, "
                  "schedule and data position",
    "--no-initialization": "skip the random initialisation of the weights (they must come "
                           "from --load; warned without it)",
    "--use-checkpoint-args": "take the model-shape, layout and tokenizer-type flags not "
                             "given from the checkpoint under --load (a given flag wins, "
                             "with a warning; Megatron-LM overwrites the architecture flags)",
    "--exit-on-missing-checkpoint": "with --load naming no checkpoint: an error (exit status "
                                    "1; Megatron-LM exits with 0) instead of training from "
                                    "scratch",
}

_MIXED_PRECISION = {
    "--fp16": "fp16 parameters and activations with fp32 main weights in the optimizer; "
              "dynamic loss scaling unless --loss-scale",
    "--bf16": "bf16 parameters and activations with fp32 main weights; gradients "
              "accumulated and all-reduced in fp32; no loss scaling unless --loss-scale",
    "--loss-scale": "a constant loss scale (with --fp16 or --bf16); unset or 0: dynamic "
                    "scaling with --fp16",
    "--initial-loss-scale": "the dynamic loss scale at the start (default 2^32)",
    "--min-loss-scale": "the dynamic loss scale never drops below this",
    "--loss-scale-window": "consecutive iterations without overflow after which the dynamic "
                           "loss scale doubles",
    "--hysteresis": "the dynamic loss scale halves at the N-th overflow since it last grew, "
                    "and at every overflow after that",
    "--fp32-residual-connection": "keep the residual stream in fp32 under --fp16/--bf16",
    "--no-query-key-layer-scaling": "Megatron-LM: no extra per-layer scaling of fp16 "
                                    "attention scores",
    "--attention-softmax-in-fp32": "Megatron-LM: compute the attention softmax in fp32",
    "--accumulate-allreduce-grads-in-fp32": "fp32 gradient buffers: gradients accumulated "
                                            "and all-reduced in fp32 (always on with "
                                            "--bf16; needs --DDP-impl local)",
    "--fp16-lm-cross-entropy": "compute the output cross entropy on the fp16 logits (needs "
                               "--fp16)",
}

_DISTRIBUTED = {
    "--tensor-model-parallel-size": "ranks each layer's weight matrices are split over (a "
                                    "size above the world size is clamped to it, with a "
                                    "warning, as Megatron-LM does)",
    "--pipeline-model-parallel-size": "number of pipeline stages, the layers split evenly",
    "--pipeline-model-parallel-split-rank": "the pipeline rank where a T5 decoder starts",
    "--num-layers-per-virtual-pipeline-stage": "layers per virtual stage: the interleaved "
                                               "1F1B schedule, from pipeline size 2 "
                                               "(Megatron-LM: above 2); the micro-batches "
                                               "must be a multiple of the pipeline size",
    "--overlap-p2p-communication": "do not wait for pipeline sends before the next compute "
                                   "(also with the non-interleaved schedule, unlike "
                                   "Megatron-LM)",
    "--distributed-timeout-minutes": "minutes a collective may wait for the other ranks "
                                     "before the run is ended as hung",
    "--DDP-impl": "data-parallel gradient reduction: local (contiguous gradient buffers, "
                  "bucketed) or torch (torch's DistributedDataParallel; not with pipeline "
                  "parallelism, --bf16, --accumulate-allreduce-grads-in-fp32 or "
                  "--use-distributed-optimizer)",
    "--no-contiguous-buffers-in-local-ddp": "Megatron-LM: the local DDP without contiguous "
                                            "gradient buffers; no effect here (warned): the "
                                            "gradients always live in contiguous buffers; "
                                            "refused beside --bf16, "
                                            "--accumulate-allreduce-grads-in-fp32 or "
                                            "--use-distributed-optimizer, as Megatron-LM "
                                            "refuses it",
    "--no-scatter-gather-tensors-in-pipeline": "Megatron-LM: send whole activations between "
                                               "pipeline stages",
    "--use-ring-exchange-p2p": "Megatron-LM: pipeline transfers by ring exchange",
    "--local_rank": "set by torch.distributed.launch; recorded in the arguments only: the "
                    "GPU comes from $LOCAL_RANK",
    "--lazy-mpu-init": "let an external tool set up the model-parallel groups (any value "
                       "turns it on)",
    "--use-cpu-initialization": "draw each full weight in fp32 on the CPU and keep this "
                                "rank's slice: the same initial model for every "
                                "tensor-parallel size that pads the vocabulary alike",
    "--empty-unused-memory-level": "return cached, unused CUDA memory to the driver: 1 "
                                   "after each forward-backward pass, 2 also after the "
                                   "optimizer step (slower; nothing on the CPU)",
    "--standalone-embedding-stage": "the first pipeline stage holds only the embedding, the "
                                    "others split the layers (pipeline size 2 or more)",
    "--use-distributed-optimizer": "shard the optimizer state (and the fp32 main weights of "
                                   "--fp16/--bf16) over the data-parallel ranks: gradients "
                                   "reduce-scattered, parameters all-gathered after the step",
}

_VALIDATION = {
    "--eval-iters": "global batches per evaluation (of the validation set every "
                    "--eval-interval and at the end, of the test set at the end); 0: no "
                    "evaluation",
    "--eval-interval": "iterations between evaluations on the validation set; 0: no "
                       "evaluation, during or after training (Megatron-LM divides by it)",
    "--skip-train": "do not train: evaluate the --load checkpoint on the validation and test "
                    "sets, saving nothing",
}

_DATA = {
    "--data-path": "the training data: one dataset prefix (PREFIX.bin + PREFIX.idx), or "
                   "WEIGHT PREFIX pairs blended by weight; each split into train, "
                   "validation and test documents by --split",
    "--split": "relative shares of each --data-path dataset's documents for training, "
               "validation and test, e.g. 98,2,0 ('/' also separates; default '969, 30, 1')",
    "--train-data-path": "training dataset prefix(es) used whole, with optional weights; "
                         "ignored beside --data-path (warned)",
    "--valid-data-path": "validation dataset prefix(es) used whole; ignored beside "
                         "--data-path (warned)",
    "--test-data-path": "test dataset prefix(es) used whole; ignored beside --data-path "
                        "(warned)",
    "--data-cache-path": "directory for the datasets' index caches (default: index-cache/ "
                         "beside the data, which is also searched first)",
    "--vocab-size": "NullTokenizer's token ids: 0 to N-1 are tokens, N is the end of "
                    "document (other tokenizers: ignored, warned)",
    "--vocab-file": "GPT-2 vocabulary JSON (GPT2BPETokenizer); HuggingFaceTokenizer's "
                    "tokenizer.json when --tokenizer-model is not given",
    "--merge-file": "GPT-2 BPE merges file (GPT2BPETokenizer)",
    "--vocab-extra-ids": "extra <extra_id_N> tokens appended to SentencePieceTokenizer's "
                         "vocabulary; no effect with the other tokenizers (warned)",
    "--seq-length": "tokens per training sample (required; at most "
                    "--max-position-embeddings)",
    "--encoder-seq-length": "the same as --seq-length (pass one of them)",
    "--decoder-seq-length": "sequence length of a T5 decoder",
    "--retriever-seq-length": "sequence length of a biencoder retriever",
    "--sample-rate": "share of the samples a BERT/T5/ICT dataset draws",
    "--mask-prob": "share of the tokens BERT masks",
    "--short-seq-prob": "probability of a shortened BERT sample",
    "--mmap-warmup": "Megatron-LM: read the data files once at start-up",
    "--num-workers": "data-loader worker processes per rank; 0: a background thread of the "
                     "trainer loads the batches",
    "--tokenizer-type": "GPT2BPETokenizer (default, as Megatron-LM's pretrain_gpt.py: "
                        "--vocab-file, --merge-file), SentencePieceTokenizer or "
                        "GPTSentencePieceTokenizer (--tokenizer-model), NullTokenizer "
                        "(--vocab-size), HuggingFaceTokenizer (a local tokenizer.json as "
                        "--tokenizer-model; an extension); the BertWordPiece types are "
                        "refused (no end-of-document token)",
    "--tokenizer-model": "SentencePiece model file, or for HuggingFaceTokenizer a "
                         "tokenizer.json (or the directory holding it)",
    "--data-impl": "Megatron-LM: the format of the .bin/.idx files",
    "--reset-position-ids": "position ids restart at 0 after each end-of-document token "
                            "(a tokenizer without one is refused)",
    "--reset-attention-mask": "tokens attend only to earlier tokens of their own document, "
                              "cut at the end-of-document tokens (an explicit mask: slower "
                              "attention)",
    "--eod-mask-loss": "no loss on the prediction made at an end-of-document token (a "
                       "tokenizer without one is refused)",
}

_AUTORESUME = {
    "--adlr-autoresume": "ADLR autoresume: ask the cluster service whether to save and exit",
    "--adlr-autoresume-interval": "iterations between ADLR autoresume checks",
}

_BIENCODER = {
    "--ict-head-size": "projection size of the ICT head",
    "--biencoder-projection-dim": "output projection size of the biencoder towers",
    "--biencoder-shared-query-context-model": "one tower for queries and contexts",
    "--ict-load": "directory of an ICT checkpoint",
    "--bert-load": "BERT checkpoint the biencoder starts from",
    "--titles-data-path": "titles dataset of the ICT corpus",
    "--query-in-block-prob": "probability that an ICT query stays in its block",
    "--use-one-sent-docs": "keep one-sentence documents in the ICT data",
    "--evidence-data-path": "evidence file for retrieval evaluation",
    "--retriever-report-topk-accuracies": "the k of the reported top-k retrieval accuracies",
    "--retriever-score-scaling": "scale retrieval scores by 1/sqrt(hidden size)",
    "--block-data-path": "block data file of the embedding indexer",
    "--embedding-path": "where the indexer stores the evidence embeddings",
    "--indexer-batch-size": "batch size of the embedding indexer",
    "--indexer-log-interval": "batches between the embedding indexer's log lines",
}

_VISION = {
    "--num-classes": "classes of the image classifier",
    "--img-h": "image height, in pixels",
    "--img-w": "image width, in pixels",
    "--num-channels": "channels per image",
    "--patch-dim": "side of a ViT patch, in pixels",
    "--classes-fraction": "share of the classes trained on",
    "--data-per-class-fraction": "share of each class's images trained on",
    "--no-data-sharding": "with --dataloader-type cyclic: each epoch one permutation of the "
                          "whole dataset dealt to the data-parallel ranks in turn (default: "
                          "each rank shuffles its own contiguous bucket)",
    "--head-lr-mult": "learning-rate multiplier of the classification head",
    "--vision-pretraining": "vision pretraining instead of classification",
    "--vision-pretraining-type": "kind of vision pretraining",
    "--vision-backbone-type": "vision backbone",
    "--swin-backbone-type": "size of the Swin backbone",
    "--mask-type": "inpainting mask kind",
    "--mask-factor": "inpainting mask size factor",
    "--iter-per-epoch": "iterations per vision epoch",
    "--dino-local-img-size": "DINO local crop size, in pixels",
    "--dino-local-crops-number": "DINO local crops per image",
    "--dino-head-hidden-size": "hidden size of the DINO head",
    "--dino-bottleneck-size": "bottleneck size of the DINO head",
    "--dino-freeze-last-layer": "epochs the DINO head's last layer stays frozen",
    "--dino-norm-last-layer": "weight-normalise the DINO head's last layer",
    "--dino-warmup-teacher-temp": "DINO teacher temperature at the start of its warmup",
    "--dino-teacher-temp": "DINO teacher temperature after its warmup",
    "--dino-warmup-teacher-temp-epochs": "epochs of the DINO teacher temperature warmup",
}

_LOGGING = {
    "--log-params-norm": "the parameters' L2 norm on the iteration line and in TensorBoard "
                         "(a pass over all parameters at each report)",
    "--log-num-zeros-in-grad": "the number of zero gradient entries on the iteration line "
                               "and in TensorBoard",
    "--timing-log-level": "timer detail: 0 the set-up and checkpoint timers only; 1 also "
                          "the step's phases at each log line (forward-backward, gradient "
                          "reductions, optimizer); 2 also the compute, batch and pipeline "
                          "transfer timers (more synchronisation)",
    "--no-barrier-with-level-1-timing": "start the level-1 timers without a barrier over "
                                        "all ranks",
    "--timing-log-option": "how the timers of the ranks are reported: max, min and max "
                           "(minmax), or every rank's (all)",
    "--tensorboard-log-interval": "iterations between TensorBoard training scalars",
    "--tensorboard-queue-size": "events the TensorBoard writer queues before it writes to "
                                "disk",
    "--log-timers-to-tensorboard": "write the timers ('<name>-time', with "
                                   "--timing-log-level 1 or 2) and 'iteration-time' to "
                                   "TensorBoard",
    "--log-batch-size-to-tensorboard": "write the global batch size ('batch-size') to "
                                       "TensorBoard",
    "--no-log-learnig-rate-to-tensorboard": "leave the 'learning-rate' scalar out of "
                                            "TensorBoard (Megatron-LM's spelling)",
    "--no-log-loss-scale-to-tensorboard": "leave the 'loss-scale' scalar out of TensorBoard",
    "--log-validation-ppl-to-tensorboard": "also write the validation perplexity "
                                           "('<loss> validation ppl')",
    "--log-memory-to-tensorboard": "write the CUDA allocator's reserved and allocated "
                                   "memory ('mem-*'; CUDA only)",
    "--log-world-size-to-tensorboard": "write the world size ('world-size') to TensorBoard",
}

_INFERENCE = {
    "--inference-batch-times-seqlen-threshold": "Megatron-LM: batch x sequence length above "
                                                "which generation splits a batch into "
                                                "pipeline micro-batches",
    "--max-tokens-to-oom": "largest batch x (prompt + generated) token count the text "
                           "generation server accepts",
    "--output-bert-embeddings": "write BERT embeddings instead of training",
    "--bert-embedder-type": "which BERT model computes the embeddings",
}

_TRANSFORMER_ENGINE = {
    "--fp8-e4m3": "fp8 (e4m3) matrix products through Transformer Engine",
    "--fp8-hybrid": "fp8 with e4m3 in forward and e5m2 in backward",
    "--no-fp8-wgrad": "weight gradients in higher precision than fp8",
    "--fp8-margin": "margin of the fp8 scaling factor",
    "--fp8-interval": "steps between fp8 scaling-factor updates",
    "--transformer-impl": "transformer layers of this framework (local) or of Transformer "
                          "Engine",
    "--fp8-amax-history-len": "length of the fp8 amax history",
    "--fp8-amax-compute-algo": "how the fp8 amax is taken from its history",
}

_RETRO = {
    "--retro-workdir": "RETRO's preprocessing directory",
    "--retro-add-retriever": "add the RETRO retriever to the model",
    "--retro-cyclic-train-iters": "RETRO's training iterations for its cyclic loader",
    "--retro-encoder-layers": "layers of the RETRO encoder",
    "--retro-encoder-hidden-dropout": "hidden dropout of the RETRO encoder",
    "--retro-encoder-attention-dropout": "attention dropout of the RETRO encoder",
    "--retro-num-neighbors": "neighbours retrieved per chunk",
    "--retro-num-retrieved-chunks": "chunks retrieved per neighbour",
    "--retro-return-doc-ids": "return the retrieved documents' ids",
}

# Megatron-LM 23.05's flags, except the deprecated spellings (DEPRECATED_HELP).
MEGATRON_HELP: Dict[str, str] = {
    **_NETWORK, **_REGULARIZATION, **_TRAINING, **_INITIALIZATION, **_LEARNING_RATE,
    **_CHECKPOINTING, **_MIXED_PRECISION, **_DISTRIBUTED, **_VALIDATION, **_DATA,
    **_AUTORESUME, **_BIENCODER, **_VISION, **_LOGGING, **_INFERENCE, **_TRANSFORMER_ENGINE,
    **_RETRO,
}

# The value's name in --help where the flag's kind does not say enough (else N for an int,
# X for a float, the choices for a choice, argparse's upper-case dest for the rest).
METAVARS = {
    "--tensorboard-dir": "DIR", "--save": "DIR", "--load": "DIR", "--data-cache-path": "DIR",
    "--data-path": "PATH", "--train-data-path": "PATH", "--valid-data-path": "PATH",
    "--test-data-path": "PATH", "--split": "SHARES", "--vocab-file": "FILE",
    "--merge-file": "FILE", "--tokenizer-model": "PATH", "--tokenizer-type": "TYPE",
    "--rampup-batch-size": "N", "--ict-load": "DIR", "--bert-load": "DIR",
    "--titles-data-path": "PATH", "--evidence-data-path": "PATH", "--block-data-path": "PATH",
    "--embedding-path": "PATH", "--retro-workdir": "DIR", "--onnx-safe": "BOOL",
    "--lazy-mpu-init": "BOOL", "--config": "FILE", "--gemm-algorithms": "auto|none|FILE",
    "--memory-snapshot-path": "FILE",
}
_KIND_METAVARS = {"int": "N", "+int": "N", "float": "X", "num": "X"}


def metavar(spec) -> Optional[str]:
    """The value's name shown by --help for `spec` (a FlagSpec); None: argparse's own."""
    if spec.flag in METAVARS:
        return METAVARS[spec.flag]
    if spec.choices is None:
        return _KIND_METAVARS.get(spec.kind)
    return None


def _refused_by_group(spec) -> bool:
    return spec.group in NOT_SUPPORTED_GROUPS and spec.flag not in ALLOWED_IN_REJECTED_GROUPS


def _shown_default(spec) -> Optional[str]:
    """The default as --help shows it; None where showing it says nothing (a switch, an
    unset value)."""
    if spec.kind in ("true", "false") or spec.default in (None, []):
        return None
    if isinstance(spec.default, list):
        return " ".join(map(str, spec.default))
    return str(spec.default)


def flag_help(spec) -> str:
    """The --help text of `spec` (a FlagSpec): its description, then why it is refused or
    changes nothing here, then its default (unless the description names it)."""
    if spec.flag in DEPRECATED_HELP:
        return DEPRECATED_HELP[spec.flag]
    text = EXTRA_HELP.get(spec.flag) or MEGATRON_HELP[spec.flag]
    default = None if "default" in text else _shown_default(spec)
    if spec.flag in NOT_SUPPORTED:
        text += f"; refused unless left at its default: {NOT_SUPPORTED[spec.flag]}"
    elif _refused_by_group(spec):
        text += "; refused unless left at its default"
    elif spec.flag in NO_EFFECT:
        text += f"; accepted, no effect here: {NO_EFFECT[spec.flag]}"
    return text if default is None else f"{text} (default: {default})"


def group_description(title: str) -> Optional[str]:
    """The line under a group's title in --help: why a refused group's flags are refused."""
    reason = NOT_SUPPORTED_GROUPS.get(title)
    if reason is None:
        return None
    allowed = [f for f in ALLOWED_IN_REJECTED_GROUPS if FLAG_SPECS[f].group == title]
    but = f" (except {', '.join(allowed)})" if allowed else ""
    return (f"{reason[0].upper()}{reason[1:]}: each flag of this group{but} is refused "
            "unless left at its default.")
