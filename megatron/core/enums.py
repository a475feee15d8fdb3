"""Megatron-LM's `megatron.core.enums`, for ported code and for reading its checkpoints.

A 23.05 pretrain script passes `ModelType.encoder_or_decoder` to its `pretrain`, and a
23.05 checkpoint pickles `args.model_type` as a member of this enum; the values are 23.05's.
"""
import enum


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4
