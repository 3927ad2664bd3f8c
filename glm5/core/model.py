"""The GLM-5 model on the op IR: decoder layers (MLA + DSA attention, dense MLP or MoE), MTP,
KV-cached generation. Parameter names mirror transformers' GlmMoeDsaForCausalLM."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from glm5 import ops
from glm5.ir.opdef import value_checks
from glm5.core.attention import Attention, Pages, Step
from glm5.core.cache import KVCache
from glm5.core.checkpoint_files import save_pretrained
from glm5.core.config import GLM5Config
from glm5.core.index_cache import IndexKeys
from glm5.core.layers import MLP, MoE, RMSNorm, apply_linear, init_weights, linear
from glm5.core.rope import inv_freq, rope_tables


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GLM5Config, layer_idx: int, mlp_type: str | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        kind = mlp_type or cfg.mlp_layer_types[layer_idx]
        self.mlp = MoE(cfg) if kind == "sparse" else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, st, latent, index_keys, prev_idx, rows):
        a, idx = self.self_attn(self.input_layernorm(h), st, latent, index_keys, prev_idx, rows)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), idx


class SharedHead(nn.Module):
    def __init__(self, cfg: GLM5Config) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(nn.Module):
    """Multi-token prediction (DeepSeek-V3 / GLM-5 checkpoints, `model.layers.{L}.*`):
    h' = block(eh_proj([enorm(emb(t+1)); hnorm(h)])); logits = lm_head(shared_head.norm(h'))."""

    def __init__(self, cfg: GLM5Config) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = linear(2 * D, D)
        mtp_cfg = cfg.replace(num_hidden_layers=1, indexer_types=["full"],
                              mlp_layer_types=["sparse"])
        self.block = DecoderLayer(mtp_cfg, 0)
        self.shared_head = SharedHead(cfg)


class GLM5Model(nn.Module):
    def __init__(self, cfg: GLM5Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class NonFiniteLogitsError(FloatingPointError):
    """`generate` met logits that are NaN or infinite; the message names the first module whose
    output was not finite (and the non-finite weights it holds, if any)."""


class GLM5ForCausalLM(nn.Module):
    """GLM-5. ``model(input_ids)`` -> logits [B, T, V]; ``generate(...)`` decodes with a KV cache.

    Built from a config, every weight is initialised as transformers initialises GlmMoeDsa
    (`glm5.core.layers.init_weights`: normal(0, ``initializer_range``), norms one, biases and
    the router's correction bias zero). ``with_mtp``: None (default) builds the config's
    ``num_nextn_predict_layers`` MTP layers; False builds none (``self.mtp`` is None: a model
    for a checkpoint saved without them); True is the same as None.
    """

    def __init__(self, cfg: GLM5Config, with_mtp: bool | None = None) -> None:
        super().__init__()
        if with_mtp not in (None, True, False):
            raise TypeError(f"GLM5ForCausalLM: with_mtp expected None, True or False, got "
                            f"{with_mtp!r}")
        self.config = cfg
        self.model = GLM5Model(cfg)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        n_mtp = cfg.num_nextn_predict_layers if with_mtp is not False else 0
        self.mtp = nn.ModuleList(MTPLayer(cfg) for _ in range(n_mtp)) if n_mtp else None
        freqs, scale = inv_freq(cfg)
        self.register_buffer("inv_freq", freqs, persistent=False)
        self.rope_scaling = scale
        init_weights(self, cfg.initializer_range, cfg.pad_token_id)

    # ------------------------------------------------------------------ helpers
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.config, batch, max_len, self.dtype, self.device)

    def _step(self, cache: KVCache, T: int) -> tuple[Step, torch.Tensor]:
        pos, slots, ks, ke = cache.layout(T)
        cos, sin = rope_tables(self.inv_freq, self.rope_scaling, pos, self.dtype)
        used = cache.length + T
        dev = pos.device
        rows = ((torch.arange(cache.batch, device=dev) * cache.max_len)[:, None]
                + torch.arange(used, device=dev)[None, :]).reshape(-1)
        return Step(cos, sin, slots, ks, ke, used, cache.max_len), rows

    # ------------------------------------------------------------------ forward
    # A run (ops.model_run): the reference fallbacks of one call are logged in one line.
    @ops.model_run
    def hidden_states(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final hidden states before the last norm: [B, T, D]. Appends to ``cache``."""
        if input_ids.dim() != 2:
            raise ValueError(f"glm5 model: input_ids expected [B, T], got {list(input_ids.shape)}")
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("glm5 model: input_ids expected at least one token")
        V = self.config.vocab_size
        if value_checks(input_ids) and bool(((input_ids < 0) | (input_ids >= V)).any()):
            raise ValueError(f"glm5 model: input_ids expected ids in [0, {V})")
        if cache is None:
            cache = self.new_cache(B, T)
        elif cache.batch != B:
            raise ValueError(f"glm5 model: cache holds {cache.batch} sequences, input has {B}")
        st, rows = self._step(cache, T)
        h = self.model.embed_tokens(input_ids).reshape(B * T, -1)
        idx = None  # a "shared" layer returns the selection it was given
        for i, layer in enumerate(self.model.layers):
            h, idx = layer(h, st, cache.latent[i], cache.index_keys[i], idx, rows)
        cache.advance(T)
        return h.reshape(B, T, -1)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return self.forward_with_hidden(input_ids, cache)[0]

    def forward_with_hidden(self, input_ids: torch.Tensor, cache: KVCache | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, T, V], final normed hidden states [B, T, D] — what MTP consumes)."""
        h = self.model.norm(self.hidden_states(input_ids, cache))
        return F.linear(h, self.lm_head.weight), h

    # ------------------------------------------------------------------ paged (serving)
    def paged_step(self, positions: torch.Tensor, slots: torch.Tensor,
                   block_table: torch.Tensor, seq: torch.Tensor, page_size: int,
                   max_range: int | None = None) -> Step:
        """The layout of one forward over a paged cache (the serving engine's): N tokens of any
        number of sequences, token n at logical ``positions[n]`` of sequence ``seq[n]`` (a row of
        ``block_table`` [B, P] int32), written to physical row ``slots[n]``; it attends to its
        sequence's positions 0 .. positions[n] (causal).

        ``max_range``: ``max(positions) + 1`` as the caller knows it on the host (the engine
        does); None reads it from ``positions``, a host synchronisation on a device. A larger
        bound, on the same side of ``index_topk`` and at most ``P * page_size``, gives the same
        result (the dense path then lists that many keys per query, the ones past a query's
        range as -1): a captured decode graph passes one so its shapes do not change with the
        lengths."""
        cos, sin = rope_tables(self.inv_freq, self.rope_scaling, positions, self.dtype)
        k_len = (positions + 1).to(torch.int32)
        if max_range is None:
            max_range = int(k_len.max())
        return Step(cos, sin, slots.to(torch.int32), None, None, max_range, 0,
                    Pages(block_table.to(torch.int32), seq.to(torch.int32), k_len, page_size))

    @ops.model_run
    def hidden_states_paged(self, input_ids: torch.Tensor, st: Step,
                            latent: list[torch.Tensor], index_keys: list[IndexKeys | None]
                            ) -> torch.Tensor:
        """Final hidden states before the last norm, [N, D], of the N tokens ``input_ids`` [N]
        laid out by ``st`` (`paged_step`); ``latent`` / ``index_keys`` are the per-layer page
        pools [num_pages * page_size, *] (written in place at ``st.slots``; an indexer key pool
        may be `FP8Keys`: the model's ``dsa_indexer_dtype = "fp8"``)."""
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"glm5 model: paged input_ids expected [N] with N >= 1, got "
                             f"{list(input_ids.shape)}")
        h = self.model.embed_tokens(input_ids)
        idx = None
        for i, layer in enumerate(self.model.layers):
            h, idx = layer(h, st, latent[i], index_keys[i], idx, None)
        return h

    def logits_and_hidden(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [..., V], normed hidden [..., D]) of pre-norm hidden states [..., D]."""
        hn = self.model.norm(h)
        return F.linear(hn, self.lm_head.weight), hn

    @ops.model_run
    def mtp_paged(self, hidden: torch.Tensor, next_ids: torch.Tensor, st: Step,
                  latent: torch.Tensor, index_keys: IndexKeys, depth: int = 0
                  ) -> torch.Tensor:
        """`mtp_logits` over a paged cache: ``hidden`` [N, D] at positions i (the main model's
        normed final hidden states, or this layer's own output when drafting recursively),
        ``next_ids`` [N] the tokens at i + 1. Returns the layer's output [N, D] (before
        shared_head.norm); `mtp_head` turns rows of it into logits for the tokens at i + 2."""
        if self.mtp is None:
            raise ValueError("glm5 model: this checkpoint has no MTP layer")
        m = self.mtp[depth]
        e = m.enorm(self.model.embed_tokens(next_ids))
        x = apply_linear(m.eh_proj, torch.cat((e, m.hnorm(hidden)), -1))
        return m.block(x, st, latent, index_keys, None, None)[0]

    def mtp_head(self, h: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Logits [..., V] of MTP layer ``depth``'s output rows [..., D]."""
        return F.linear(self.mtp[depth].shared_head.norm(h), self.lm_head.weight)

    def save_pretrained(self, path, max_shard_bytes: int = 5 * 2**30,
                        overwrite: bool = False) -> None:
        """Write config.json + safetensors in the transformers format, atomically; a ``path``
        holding a checkpoint is replaced only with ``overwrite=True`` (see
        `glm5.core.checkpoint_files.save_pretrained`)."""
        save_pretrained(self, path, max_shard_bytes, overwrite=overwrite)

    # ------------------------------------------------------------------ MTP
    @ops.model_run
    def mtp_logits(self, hidden: torch.Tensor, next_ids: torch.Tensor,
                   cache: KVCache | None = None, depth: int = 0) -> torch.Tensor:
        """Logits of the MTP layer ``depth``: ``hidden`` [B, T, D] are the main model's final
        (normed, as vLLM and SGLang feed them) hidden states at positions i, ``next_ids`` [B, T] the tokens at i + 1; the result
        predicts the tokens at i + 2. ``cache`` is the MTP layer's own one-layer cache."""
        if self.mtp is None:
            raise ValueError("glm5 model: this checkpoint has no MTP layer")
        m = self.mtp[depth]
        B, T = next_ids.shape
        if cache is None:
            cache = KVCache(self.config, B, T, self.dtype, self.device, n_layers=1,
                            indexer_layers=[True])
        st, rows = self._step(cache, T)
        e = m.enorm(self.model.embed_tokens(next_ids).reshape(B * T, -1))
        x = apply_linear(m.eh_proj, torch.cat((e, m.hnorm(hidden.reshape(B * T, -1))), -1))
        h, _ = m.block(x, st, cache.latent[0], cache.index_keys[0], None, rows)
        cache.advance(T)
        return F.linear(m.shared_head.norm(h), self.lm_head.weight).reshape(B, T, -1)

    # ------------------------------------------------------------------ training helpers
    def indexer_parameters(self) -> Iterator[nn.Parameter]:
        for name, p in self.named_parameters():
            if ".indexer." in name:
                yield p

    def freeze_indexer(self) -> "GLM5ForCausalLM":
        """Indexer parameters get no gradient and are left out of `param_groups()`."""
        for p in self.indexer_parameters():
            p.requires_grad_(False)
        return self

    def param_groups(self, weight_decay: float = 0.0) -> list[dict]:
        """Optimiser groups of the trainable parameters (norms and biases without decay)."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.dim() < 2 else decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    # ------------------------------------------------------------------ generation
    def _generate_mtp(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        B, T = input_ids.shape
        if max_new_tokens <= 0:
            return input_ids.clone()
        total = T + max_new_tokens + 1
        cache = self.new_cache(B, total)
        mcache = KVCache(self.config, B, total, self.dtype, self.device, n_layers=1,
                         indexer_layers=[True])
        logits, h = self.forward_with_hidden(input_ids, cache)
        self._check_finite(logits[:, -1], input_ids, 0)
        tok = _argmax(logits[:, -1])
        out = [tok]
        ml = self.mtp_logits(h, torch.cat((input_ids[:, 1:], tok[:, None]), 1), mcache)
        self._check_finite(ml[:, -1], _tokens(input_ids, out), 0, mtp=True)
        draft = _argmax(ml[:, -1])
        stats = {"drafted": 0, "accepted": 0}
        while len(out) < max_new_tokens:
            logits, h = self.forward_with_hidden(torch.stack((tok, draft), 1), cache)
            self._check_finite(logits, _tokens(input_ids, out), len(out))
            first = _argmax(logits[:, 0])
            stats["drafted"] += 1
            if bool((first == draft).all()):  # every sequence accepts the draft
                stats["accepted"] += 1
                tok = _argmax(logits[:, 1])
                out += [draft, tok]
                ml = self.mtp_logits(h, torch.stack((draft, tok), 1), mcache)
            else:
                cache.rollback(1)
                tok = first
                out.append(tok)
                ml = self.mtp_logits(h[:, :1], tok[:, None], mcache)
            self._check_finite(ml[:, -1], _tokens(input_ids, out), len(out), mtp=True)
            draft = _argmax(ml[:, -1])
        self.last_mtp_stats = stats
        return torch.cat((input_ids, torch.stack(out[:max_new_tokens], 1)), 1)

    @torch.no_grad()
    @ops.model_run
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, use_mtp: bool = False) -> torch.Tensor:
        """Greedy or sampled decoding with the KV cache: returns [B, T + max_new_tokens].

        Logits that are NaN or infinite raise `NonFiniteLogitsError` naming the first module
        whose output was not finite (found by re-running the tokens so far with a check on
        every module's output; in the normal case each step costs one ``isfinite`` reduction
        over its [B, V] logits).

        ``use_mtp``: greedy self-speculative decoding, the MTP layer drafting one token per
        step that the main model verifies (same tokens as plain greedy decoding); acceptance
        counts are left in ``self.last_mtp_stats``.
        """
        if use_mtp:
            if do_sample:
                raise ValueError("glm5 generate: use_mtp supports greedy decoding only "
                                 "(do_sample=False)")
            if self.mtp is None:
                raise ValueError("glm5 generate: use_mtp needs a checkpoint with an MTP layer")
            return self._generate_mtp(input_ids, max_new_tokens)
        if max_new_tokens < 0:
            raise ValueError(f"glm5 generate: max_new_tokens expected >= 0, got {max_new_tokens}")
        if do_sample and not temperature > 0:
            raise ValueError(f"glm5 generate: temperature expected > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"glm5 generate: top_p expected in (0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"glm5 generate: top_k expected >= 0, got {top_k}")
        B, T = input_ids.shape
        if max_new_tokens == 0:
            return input_ids.clone()
        gen = torch.Generator(device=self.device)
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
        cache = self.new_cache(B, T + max_new_tokens)
        out = [input_ids]
        logits = self.forward(input_ids, cache)[:, -1]
        self._check_finite(logits, input_ids, 0)
        for step in range(max_new_tokens):
            nxt = sample_next(logits.float(), do_sample, temperature, top_p, top_k, gen)
            out.append(nxt[:, None])
            if step + 1 < max_new_tokens:
                logits = self.forward(nxt[:, None], cache)[:, -1]
                self._check_finite(logits, out, step + 1)
        return torch.cat(out, dim=1)

    # ------------------------------------------------------------------ non-finite logits
    def _check_finite(self, logits: torch.Tensor, tokens: torch.Tensor | list[torch.Tensor],
                      step: int, mtp: bool = False) -> None:
        """Raise `NonFiniteLogitsError` when ``logits`` hold a NaN or an infinity. ``tokens``
        ([B, N], or a list of [B, n] pieces) are the tokens the model has consumed so far: only
        on failure are they run again to find the module at fault."""
        if bool(torch.isfinite(logits).all()):
            return
        ids = torch.cat(tokens, 1) if isinstance(tokens, list) else tokens
        where = "MTP logits" if mtp else "logits"
        why = self.first_nonfinite(ids, mtp, decode_last=step > 0)
        raise NonFiniteLogitsError(f"glm5 generate: the {where} at step {step} are not finite "
                                   f"(NaN or inf); {why}")

    @torch.no_grad()
    def first_nonfinite(self, input_ids: torch.Tensor, mtp: bool = False,
                        decode_last: bool = False) -> str:
        """Which module first produces a non-finite output on ``input_ids`` [B, N], and which
        weights are not finite, as a sentence (a diagnostic: it costs a forward and one
        reduction per module output).

        Every module's output is checked in the order the modules finish, so the innermost
        one is named. The tokens run as one prefill, or with ``decode_last`` as a prefill of
        all but the last followed by a one-token step (the path a decode step takes: MLA's
        absorbed mode). ``mtp``: the MTP layers run too, on the main model's hidden states."""
        names = {m: n for n, m in self.named_modules() if n}
        found: list[str] = []

        def hook(mod: nn.Module, args: object, out: object) -> None:
            t = out[0] if isinstance(out, tuple) else out
            if (not found and isinstance(t, torch.Tensor) and t.is_floating_point()
                    and not bool(torch.isfinite(t).all())):
                found.append(names[mod])

        def check(t: torch.Tensor, name: str) -> None:
            if not found and not bool(torch.isfinite(t).all()):
                found.append(name)

        B, N = input_ids.shape
        handles = [m.register_forward_hook(hook) for m in names]
        try:
            cache = self.new_cache(B, N)
            if decode_last and N > 1:
                check(self.forward_with_hidden(input_ids[:, :-1], cache)[0], "lm_head")
            logits, h = self.forward_with_hidden(input_ids[:, cache.length:], cache)
            check(logits, "lm_head")
            if mtp and self.mtp is not None and N > 1:
                if cache.length != N - h.shape[1]:  # the hidden states of every position
                    logits, h = self.forward_with_hidden(input_ids)
                for d in range(len(self.mtp)):
                    check(self.mtp_logits(h[:, :-1], input_ids[:, 1:], depth=d),
                          f"mtp.{d}.shared_head")
        finally:
            for hd in handles:
                hd.remove()
        if not found:
            return ("a fresh run of the same tokens is finite in every module (the non-finite "
                    "values came from state this run does not rebuild)")

        def nonfinite(mod: nn.Module, prefix: str) -> list[str]:
            return [f"{prefix}{n}" for n, t in (*mod.named_parameters(), *mod.named_buffers())
                    if t.is_floating_point() and not bool(torch.isfinite(t).all())]

        def listed(bad: list[str]) -> str:
            return ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")

        name = found[0]
        bad = nonfinite(self.get_submodule(name), f"{name}.")
        if bad:
            weights = f"its weights hold non-finite values: {listed(bad)}"
        else:
            elsewhere = nonfinite(self, "")
            weights = (f"its weights are finite; non-finite weights elsewhere: "
                       f"{listed(elsewhere)}" if elsewhere else
                       f"no weight is non-finite (an overflow in {self.dtype}?)")
        return f"the first module with a non-finite output is {name}; {weights}"


def _tokens(input_ids: torch.Tensor, out: list[torch.Tensor]) -> torch.Tensor:
    """The prompt and the tokens generated so far ([B] each) as [B, T + len(out)]."""
    return torch.cat((input_ids, torch.stack(out, 1)), 1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().argmax(-1)


def sample_next(logits: torch.Tensor, do_sample: bool, temperature: float, top_p: float,
                top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Next token ids [B] from logits [B, V]: argmax, or temperature / top-k / top-p sampling."""
    if not do_sample:
        return logits.argmax(-1)
    z = logits / temperature
    if top_k > 0:
        kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sz, si = torch.sort(z, descending=True, dim=-1)
        p = torch.softmax(sz, -1)
        drop = p.cumsum(-1) - p > top_p  # keep the smallest prefix whose mass reaches top_p
        sz = sz.masked_fill(drop, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, si, sz)
    probs = torch.softmax(z, -1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
