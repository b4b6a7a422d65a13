"""The reference decoder LM: a Llama-style dense decoder with Engram layers where the config says.

* `ModelConfig`: geometry (and the optional `EngramConfig`);
* `DecoderLM`: the model (training forward, loss, gate capture, incremental decoding);
* `ForwardContext`: what differs between ways of running its blocks (`condmem.models.context`);
* `generate`: sampling with a KV cache;
* `forward_flops_per_token`, `train_flops_per_token`, `iso_flop_baseline`: FLOPs accounting.
"""

from condmem.models.attention import Attention, KVCache
from condmem.models.config import ModelConfig
from condmem.models.context import ForwardContext
from condmem.models.flops import (
    engram_flops_per_token,
    forward_flops_per_token,
    iso_flop_baseline,
    train_flops_per_token,
)
from condmem.models.generate import generate
from condmem.models.transformer import DecoderLM, GateCapture, InferenceCache

__all__ = [
    "Attention",
    "DecoderLM",
    "ForwardContext",
    "GateCapture",
    "InferenceCache",
    "KVCache",
    "ModelConfig",
    "engram_flops_per_token",
    "forward_flops_per_token",
    "generate",
    "iso_flop_baseline",
    "train_flops_per_token",
]
