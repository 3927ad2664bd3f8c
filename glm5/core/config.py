"""GLM-5 model configuration: presets and the transformers `config.json` (`glm_moe_dsa`) format.

Field names follow transformers' `GlmMoeDsaConfig`, so a config.json maps onto it key by key.
Fields prefixed `dsa_` are glm5 extensions beyond the published model (documented in
docs/model.md) and are written to config.json under the same names; transformers ignores them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing or inconsistent."""


@dataclass
class GLM5Config:
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0}
    )
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    first_k_dense_replace: int = 3
    mlp_layer_types: list[str] | None = None
    indexer_types: list[str] | None = None
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    # glm5 extension: coarse-to-fine block selection in DSA ("token" = the published model).
    dsa_selection: str = "token"
    dsa_block_size: int = 256
    dsa_block_topk: int = 8
    # glm5 extension: "fp8" scores the indexer on e4m3 q and k (`indexer_topk_fp8`, DeepSeek-
    # V3.2's deployed indexer); "bf16" (the published transformers model) in q's dtype.
    dsa_indexer_dtype: str = "bf16"
    # glm5 extension: with the fp8 indexer, rotate q and k by the orthonormal Hadamard matrix
    # before quantizing them (DeepSeek-V3.2's official code and SGLang; vLLM skips it)
    dsa_indexer_hadamard: bool = False

    def __post_init__(self) -> None:
        if self.mlp_layer_types is None:
            n = min(self.first_k_dense_replace, self.num_hidden_layers)
            self.mlp_layer_types = ["dense"] * n + ["sparse"] * (self.num_hidden_layers - n)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * self.num_hidden_layers
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale^2 for YaRN with `mscale_all_dim` (as transformers)."""
        s = self.qk_head_dim ** -0.5
        rp = self.rope_parameters
        if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
            f = float(rp.get("factor", 1.0))
            m = 1.0 if f <= 1 else 0.1 * rp["mscale_all_dim"] * math.log(f) + 1.0
            s *= m * m
        return s

    @property
    def kv_cache_dim(self) -> int:
        """Latent cache row: kv_lora_rank + qk_rope_head_dim (576 for GLM-5)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def validate(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ConfigError(f"glm5 config: {what}")

        for name in _POSITIVE:
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"{name} expected a positive integer, got {v!r}")
        for name in _NON_NEGATIVE:
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                 f"{name} expected a non-negative integer, got {v!r}")
        need(self.hidden_act == "silu", f"hidden_act expected 'silu', got {self.hidden_act!r}")
        ir = self.initializer_range
        need(isinstance(ir, (int, float)) and not isinstance(ir, bool) and math.isfinite(ir)
             and ir > 0, f"initializer_range expected a positive number (the std of the "
             f"initial weights), got {ir!r}")
        need(len(self.mlp_layer_types) == self.num_hidden_layers,
             f"mlp_layer_types expected {self.num_hidden_layers} entries, got "
             f"{len(self.mlp_layer_types)}")
        need(set(self.mlp_layer_types) <= {"dense", "sparse"},
             f"mlp_layer_types entries expected 'dense' or 'sparse', got {self.mlp_layer_types}")
        need(len(self.indexer_types) == self.num_hidden_layers,
             f"indexer_types expected {self.num_hidden_layers} entries, got "
             f"{len(self.indexer_types)}")
        need(set(self.indexer_types) <= {"full", "shared"},
             f"indexer_types entries expected 'full' or 'shared', got {self.indexer_types}")
        need(not self.indexer_types or self.indexer_types[0] == "full",
             "indexer_types[0] expected 'full' (a shared layer reuses an earlier full layer)")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads expected a multiple of num_key_value_heads")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim expected even")
        need(self.index_head_dim >= self.qk_rope_head_dim,
             "index_head_dim expected >= qk_rope_head_dim (the indexer ropes its first dims)")
        need(self.n_routed_experts % self.n_group == 0, "n_routed_experts expected a multiple "
             "of n_group")
        need(self.topk_group <= self.n_group, "topk_group expected <= n_group")
        need(1 <= self.num_experts_per_tok <= self.n_routed_experts,
             "num_experts_per_tok expected in [1, n_routed_experts]")
        need(self.dsa_selection in ("token", "block"),
             f"dsa_selection expected 'token' or 'block', got {self.dsa_selection!r}")
        need(self.dsa_indexer_dtype in ("bf16", "fp8"),
             f"dsa_indexer_dtype expected 'bf16' or 'fp8', got {self.dsa_indexer_dtype!r}")
        need(self.dsa_indexer_dtype == "bf16" or self.dsa_selection == "token",
             "dsa_indexer_dtype 'fp8' expected dsa_selection 'token' (block selection scores "
             "pooled keys in q's dtype)")
        need(isinstance(self.dsa_indexer_hadamard, bool),
             f"dsa_indexer_hadamard expected a bool, got {self.dsa_indexer_hadamard!r}")
        need(not self.dsa_indexer_hadamard or self.dsa_indexer_dtype == "fp8",
             "dsa_indexer_hadamard expected dsa_indexer_dtype 'fp8' (the rotation keeps every "
             "q.k; it only changes the fp8 quantization error)")
        need(not self.dsa_indexer_hadamard or self.index_head_dim & (self.index_head_dim - 1)
             == 0, f"dsa_indexer_hadamard expected a power-of-two index_head_dim, got "
             f"{self.index_head_dim}")
        need("rope_theta" in self.rope_parameters, "rope_parameters expected a 'rope_theta'")
        need(not self.attention_bias, "attention_bias expected False (GLM-5 has no attention "
             "biases; glm5's MLA path does not implement them)")

    # ------------------------------------------------------------------ transformers format
    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"],
                 qk_head_dim=self.qk_head_dim, head_dim=self.qk_rope_head_dim)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "GLM5Config":
        mt = d.get("model_type", "glm_moe_dsa")
        if mt != "glm_moe_dsa":
            raise ConfigError(f"glm5 config: model_type expected 'glm_moe_dsa', got {mt!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        rp = d.get("rope_parameters") or d.get("rope_scaling")
        if rp is None:
            rp = {"rope_type": "default", "rope_theta": float(d.get("rope_theta", 10_000.0))}
        else:
            rp = dict(rp)
            rp.setdefault("rope_type", rp.pop("type", "default"))
            rp.setdefault("rope_theta", float(d.get("rope_theta", 10_000.0)))
        kw["rope_parameters"] = rp
        if kw.get("indexer_types") is None and "num_hidden_layers" in d:
            kw["indexer_types"] = _indexer_types_from_schedule(d, int(d["num_hidden_layers"]))
        if "num_experts" in d and "n_routed_experts" not in d:
            kw["n_routed_experts"] = d["num_experts"]
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "GLM5Config":
        p = Path(path)
        f = p / "config.json" if p.is_dir() else p
        try:
            text = f.read_text()
        except (FileNotFoundError, NotADirectoryError):
            raise ConfigError(f"glm5 config: no config.json at {f}") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"glm5 config: {f} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"glm5 config: {f} expected a JSON object")
        return cls.from_hf_dict(d)

    def save_pretrained(self, path: str | Path) -> None:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        (p / "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> "GLM5Config":
        """A copy with ``changes``; per-layer lists are re-derived when the layer count changes."""
        d = dataclasses.asdict(self)
        if "num_hidden_layers" in changes:
            d["mlp_layer_types"] = d["indexer_types"] = None
        d.update(changes)
        return GLM5Config(**d)


_POSITIVE = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_routed_experts",
    "num_experts_per_tok", "n_group", "topk_group", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "max_position_embeddings",
    "index_topk", "index_head_dim", "index_n_heads", "dsa_block_size", "dsa_block_topk",
)
_NON_NEGATIVE = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")


def attends_densely(max_range: int, index_topk: int) -> bool:
    """The dense/sparse rule, decided here only: a step whose longest causal range (keys a query
    may see) fits in ``index_topk`` attends to every key, since DSA's selection would keep them
    all; a longer one takes the indexer's top-k. The model's attention, the engine's decode
    graphs (one per side) and the planner's costs all ask this."""
    return max_range <= index_topk


def _indexer_types_from_schedule(d: dict[str, Any], n_layers: int) -> list[str]:
    """`indexer_types` for a config.json that has none, derived as transformers does.

    `index_topk_pattern` ("FSSF..." or a list) wins; otherwise layer i is full when
    max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0 (defaults 2 and 1: all full).
    """
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            try:
                return [{"F": "full", "S": "shared"}[c] for c in pattern]
            except KeyError:
                raise ConfigError(f"glm5 config: index_topk_pattern expected only 'F'/'S', "
                                  f"got {pattern!r}") from None
        return list(pattern)
    freq = max(int(d.get("index_topk_freq", 1) or 1), 1)
    offset = int(d.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]


def _glm5() -> GLM5Config:
    return GLM5Config()


def _tiny() -> GLM5Config:
    """For tests: every feature on, tiny shapes (context > index_topk is cheap)."""
    return GLM5Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5, kv_lora_rank=32,
        q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=4096, rope_parameters={"rope_type": "default",
                                                       "rope_theta": 10_000.0},
        index_topk=8, index_head_dim=16, index_n_heads=2, first_k_dense_replace=1,
        indexer_types=["full", "shared", "full"], num_nextn_predict_layers=1,
    )


def _small() -> GLM5Config:
    """For benchmarks: GLM-5's shape ratios at a size a CPU runs at 32K context."""
    return GLM5Config(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
        n_routed_experts=16, num_experts_per_tok=4, kv_lora_rank=128, q_lora_rank=256,
        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
        max_position_embeddings=65536, index_topk=256, index_head_dim=64, index_n_heads=4,
        first_k_dense_replace=1, num_nextn_predict_layers=1,
    )


PRESETS = {"glm-5": _glm5, "tiny": _tiny, "small": _small}


def preset(name: str) -> GLM5Config:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(
            f"glm5 config: unknown preset {name!r}; presets: {', '.join(PRESETS)}"
        ) from None


def missing_config(path: str | Path) -> str | None:
    """Why ``path`` (a checkpoint directory or a config file) has no config.json to read, in the
    words an error message names it with after the argument; None when there is one."""
    p = Path(path)
    if not p.exists():
        return "no config.json there (no such file or directory); expected a checkpoint directory"
    if p.is_dir() and not (p / "config.json").is_file():
        return ("no config.json in this directory; expected a checkpoint directory "
                "(config.json + safetensors)")
    return None
