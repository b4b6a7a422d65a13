"""`ModelConfig`: the geometry of the reference decoder LM, with or without Engram layers.

A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention), dense or with
routed experts (`MoEConfig`) in some or all blocks. The optional `engram` field is the
model's `EngramConfig`; its ``hidden_size`` must be the model's ``dim`` and its
``layer_ids`` must be layers of this model. Validation errors are `ConfigError` naming the
field, as for `EngramConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from condmem.config import ConfigError, EngramConfig, require_int


@dataclass
class MoEConfig:
    """Routed experts of the blocks that have them (`condmem.models.moe.MoE`).

    In such a block the dense SwiGLU of ``ModelConfig.ffn_hidden`` becomes the shared
    expert, which every token passes through (width 0: none), and each token also goes
    through its ``top_k`` routed experts, weighted by their router scores renormalised over
    the chosen experts (DeepSeek-V3). Balancing by default: the auxiliary-loss-free
    selection bias (``bias_rate``); ``aux_loss_coef`` adds the Switch-style loss instead or
    as well. A config saved before these knobs existed (exactly the keys of
    ``LEGACY_MOE_KEYS``) loads with the routing it was trained with: raw probabilities, no
    bias (`ModelConfig.from_dict`)."""

    n_experts: int
    """Routed experts per block."""
    top_k: int = 2
    """Routed experts each token goes through."""
    expert_hidden: int = 128
    """SwiGLU hidden width of one routed expert."""
    layer_ids: list[int] | None = None
    """Blocks with routed experts (None: every block)."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss ``E * sum_i f_i P_i`` added to the training loss (0: none;
    the loss is still computed and recorded in the router statistics)."""
    score: Literal["softmax", "sigmoid"] = "softmax"
    """Router score of each expert: softmax over the experts, or a sigmoid per expert (DeepSeek-V3)."""
    renormalize: bool = True
    """Divide the chosen experts' scores by their sum (weights sum to ``routed_scale``); False:
    the raw scores (with softmax and many experts, a small routed path)."""
    routed_scale: float = 1.0
    """Factor on the routed experts' weights (DeepSeek-V3's routed scaling factor)."""
    bias_rate: float = 1e-3
    """Auxiliary-loss-free balancing: after each training forward, each expert's selection bias
    moves by this much toward balance (``sign(mean load - load)``); 0: no bias."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        require_int("MoEConfig", "n_experts", self.n_experts, 1)
        require_int("MoEConfig", "top_k", self.top_k, 1)
        require_int("MoEConfig", "expert_hidden", self.expert_hidden, 1)
        if self.top_k > self.n_experts:
            raise ConfigError(f"MoEConfig.top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        if self.layer_ids is not None:
            self.layer_ids = list(self.layer_ids)
            for lid in self.layer_ids:
                require_int("MoEConfig", "layer_ids[]", lid, 0)
            if len(set(self.layer_ids)) != len(self.layer_ids):
                raise ConfigError(f"MoEConfig.layer_ids has duplicates: {self.layer_ids}")
        for name in ("aux_loss_coef", "bias_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"MoEConfig.{name} must be a finite number >= 0, got {value!r}")
        scale = self.routed_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ConfigError(f"MoEConfig.routed_scale must be a finite number > 0, got {scale!r}")
        if self.score not in ("softmax", "sigmoid"):
            raise ConfigError(f"MoEConfig.score must be 'softmax' or 'sigmoid', got {self.score!r}")
        if not isinstance(self.renormalize, bool):
            raise ConfigError(f"MoEConfig.renormalize must be true or false, got {self.renormalize!r}")


LEGACY_MOE_KEYS = {"n_experts", "top_k", "expert_hidden", "layer_ids", "aux_loss_coef"}
"""Every key a saved MoE config had before the routing knobs existed."""
LEGACY_MOE_ROUTING = {"score": "softmax", "renormalize": False, "routed_scale": 1.0, "bias_rate": 0.0}
"""The routing such a config was trained with."""


@dataclass
class ModelConfig:
    """Geometry of the reference decoder LM."""

    vocab_size: int
    """Token ids 0..vocab_size-1 (the tokenizer's full size, special tokens included)."""
    dim: int = 256
    """Width D of the residual stream."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads; the head width is dim / n_heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide n_heads."""
    ffn_hidden: int | list[int] = 688
    """SwiGLU hidden width: one int for every block, or one per block (a baseline can
    spend an Engram's FLOPs on a wider MLP in the same block). In a block with routed
    experts this is the shared expert's width, and 0 means none."""
    max_seq_len: int = 256
    """Longest sequence (RoPE table and KV cache length)."""
    rope_theta: float = 10_000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon of the backbone."""
    tie_embeddings: bool = False
    """Share the token embedding with the output projection."""
    init_std: float = 0.02
    """Standard deviation of the backbone's normal initialization."""
    engram: EngramConfig | None = None
    """Engram layers (None: a plain baseline). ``engram.hidden_size`` must equal ``dim``."""
    engram_table_init_std: float = 1.0
    """Initial standard deviation of the Engram table rows."""
    moe: MoEConfig | None = None
    """Routed experts (None: a dense decoder)."""
    engram_addresses: Literal["hash", "random"] = "hash"
    """Where the Engram layers read: ``hash``, the n-gram hash's rows; ``random``, rows drawn
    uniformly at random over each (order, head) range, afresh at every training step and
    evaluation batch (`condmem.models.addresses`): a control in which no row follows content,
    with the same tables and FLOPs."""

    def __post_init__(self) -> None:
        if isinstance(self.engram, dict):
            self.engram = EngramConfig.from_dict(self.engram)
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` naming the field when a value is out of its domain."""

        def need_int(name: str, value: Any, minimum: int) -> None:
            require_int("ModelConfig", name, value, minimum)

        need_int("vocab_size", self.vocab_size, 2)
        need_int("dim", self.dim, 2)
        need_int("n_layers", self.n_layers, 1)
        need_int("n_heads", self.n_heads, 1)
        need_int("n_kv_heads", self.n_kv_heads, 1)
        need_int("max_seq_len", self.max_seq_len, 1)
        if self.dim % self.n_heads:
            raise ConfigError(f"ModelConfig.dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(f"ModelConfig: head width dim/n_heads = {self.dim // self.n_heads} must be even (RoPE)")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"ModelConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.moe is not None:
            if not isinstance(self.moe, MoEConfig):
                raise ConfigError(f"ModelConfig.moe must be a MoEConfig or None, got {type(self.moe).__name__}")
            self.moe.validate()
            bad = [lid for lid in self.moe.layer_ids or [] if lid >= self.n_layers]
            if bad:
                raise ConfigError(f"ModelConfig.moe.layer_ids {bad} are not layers of a {self.n_layers}-layer model")
        if isinstance(self.ffn_hidden, (list, tuple)):
            self.ffn_hidden = list(self.ffn_hidden)
            if len(self.ffn_hidden) != self.n_layers:
                raise ConfigError(
                    f"ModelConfig.ffn_hidden has {len(self.ffn_hidden)} entries for n_layers={self.n_layers}"
                )
        widths = self.ffn_hidden if isinstance(self.ffn_hidden, list) else [self.ffn_hidden] * self.n_layers
        for layer, width in enumerate(widths):
            # A block with routed experts may have no shared expert; a dense block needs its MLP.
            need_int(
                "ffn_hidden" + ("[]" if isinstance(self.ffn_hidden, list) else ""),
                width,
                0 if self.has_experts(layer) else 1,
            )
        for name in ("rope_theta", "norm_eps", "init_std", "engram_table_init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"ModelConfig.{name} must be a finite positive number, got {value!r}")
        if self.engram_addresses not in ("hash", "random"):
            raise ConfigError(f"ModelConfig.engram_addresses must be 'hash' or 'random', got {self.engram_addresses!r}")
        if self.engram_addresses == "random" and self.engram is None:
            raise ConfigError("ModelConfig.engram_addresses is 'random' but the model has no Engram (engram is None)")
        if self.engram is not None:
            if not isinstance(self.engram, EngramConfig):
                raise ConfigError(
                    f"ModelConfig.engram must be an EngramConfig or None, got {type(self.engram).__name__}"
                )
            self.engram.validate()
            if self.engram.hidden_size != self.dim:
                raise ConfigError(
                    f"ModelConfig.engram.hidden_size ({self.engram.hidden_size}) must equal "
                    f"ModelConfig.dim ({self.dim})"
                )
            if self.engram.hc_mult != 1:
                raise ConfigError(
                    f"ModelConfig.engram.hc_mult is {self.engram.hc_mult}: the reference decoder has one residual "
                    "stream (hc_mult 1)"
                )
            bad = [lid for lid in self.engram.layer_ids if lid >= self.n_layers]
            if bad:
                raise ConfigError(f"ModelConfig.engram.layer_ids {bad} are not layers of a {self.n_layers}-layer model")

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def ffn_width(self, layer: int) -> int:
        """SwiGLU hidden width of block `layer`."""
        return self.ffn_hidden[layer] if isinstance(self.ffn_hidden, list) else self.ffn_hidden

    def has_experts(self, layer: int) -> bool:
        """Whether block `layer` has routed experts."""
        return self.moe is not None and (self.moe.layer_ids is None or layer in self.moe.layer_ids)

    @property
    def moe_layer_ids(self) -> list[int]:
        """Blocks with routed experts."""
        return [i for i in range(self.n_layers) if self.has_experts(i)]

    @property
    def engram_layer_ids(self) -> list[int]:
        return [] if self.engram is None else list(self.engram.layer_ids)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["engram"] = None if self.engram is None else self.engram.to_dict("native")
        if self.moe is None:
            out.pop("moe")  # dense configs keep the keys they always had
        if self.engram_addresses == "hash":
            out.pop("engram_addresses")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"a model config must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s) {unknown}; known: {sorted(names)}")
        data = dict(data)
        if data.get("engram") is not None:
            data["engram"] = EngramConfig.from_dict(data["engram"])
        if isinstance(data.get("moe"), dict) and set(data["moe"]) == LEGACY_MOE_KEYS:
            # Written by `to_dict` before the routing knobs existed: trained with raw probabilities, no bias.
            data["moe"] = {**data["moe"], **LEGACY_MOE_ROUTING}
        return cls(**data)
