"""`glm5.LLM`: offline batched generation over prompts of different lengths (as vLLM's LLM)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from glm5 import progress  # progress.progress_bar at call time: tests and callers may replace it
from glm5.core import checkpoint  # checkpoint.load_model at call time, likewise
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.engine import EngineConfig, LLMEngine
from glm5.engine.outputs import RequestOutput
from glm5.engine.sampling import SamplingParams
from glm5.text.tokenizer import Tokenizer


def load_tokenizer(model_dir: Path) -> Any:
    """The directory's tokenizer (tokenizer.json), or None when it has none."""
    if not (model_dir / "tokenizer.json").exists():
        return None
    return Tokenizer.from_dir(model_dir)


class LLM:
    """``LLM(model_dir, backend="cpu").generate(prompts, SamplingParams(...))``.

    ``model``: a checkpoint directory (config.json + safetensors, tokenizer.json for text) or a
    built `GLM5ForCausalLM`. ``backend``: the ops' backend (None: the usual selection).
    ``indexer_dtype`` ("bf16" / "fp8", a checkpoint directory only): overrides the config's
    ``dsa_indexer_dtype`` ("fp8": the fp8 indexer and an fp8 indexer key cache);
    ``indexer_hadamard`` (a bool, likewise) its ``dsa_indexer_hadamard`` (the fp8 indexer's q and
    k Hadamard-rotated before quantization, as DeepSeek-V3.2's official code and SGLang do).
    Other keyword arguments are `EngineConfig` fields (max_num_seqs, page_size, ...).
    """

    def __init__(self, model: str | Path | GLM5ForCausalLM, backend: str | None = None,
                 dtype: torch.dtype | None = None, tokenizer: Any = "auto",
                 indexer_dtype: str | None = None, indexer_hadamard: bool | None = None,
                 **engine_args: Any) -> None:
        unknown = sorted(set(engine_args) - set(EngineConfig.names()))
        if unknown:
            raise TypeError(f"glm5.LLM: unknown argument(s) {', '.join(unknown)}; engine settings "
                            f"are {', '.join(EngineConfig.names())}")
        if isinstance(model, GLM5ForCausalLM):
            for arg, v in (("indexer_dtype", indexer_dtype),
                           ("indexer_hadamard", indexer_hadamard)):
                if v is not None:
                    raise TypeError(f"glm5.LLM: argument '{arg}' expected only with a "
                                    f"checkpoint directory (a built model takes it from its "
                                    f"config: GLM5Config.dsa_{arg})")
            m, model_dir = (model.to(dtype) if dtype else model), None
        else:
            model_dir = Path(model)
            m = checkpoint.load_model(model_dir, dtype, indexer_dtype=indexer_dtype,
                           indexer_hadamard=indexer_hadamard)
        if tokenizer == "auto":
            tokenizer = load_tokenizer(model_dir) if model_dir is not None else None
        self.model_dir = model_dir
        self.engine = LLMEngine(m, EngineConfig(**engine_args), tokenizer, backend)
        self._next = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One finished `RequestOutput` per prompt, in prompt order. A prompt is text (needs the
        tokenizer) or a list of token ids; ``sampling_params`` one for all or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"glm5.LLM.generate: {len(prompts)} prompts but "
                                 f"{len(params)} sampling_params")
        ids = []
        try:
            for p, sp in zip(prompts, params):
                rid = f"llm-{self._next}"
                self._next += 1
                self.engine.add_request(rid, p, sp)
                ids.append(rid)
        except Exception:
            # The call fails as a whole: the prompts already queued would otherwise run, unseen,
            # in the next call. Aborts are applied at the start of a step, before scheduling.
            for rid in ids:
                self.engine.abort(rid)
            self.engine.step()
            raise
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            bar = progress.progress_bar(total=len(ids), desc="generate", unit="req").__enter__()
        while len(done) < len(ids):
            for o in self.engine.step():
                if o.finished:
                    done[o.request_id] = o
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.__exit__(None, None, None)
        return [done[r] for r in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             tools: list[dict] | None = None, enable_thinking: bool = True
             ) -> list[RequestOutput]:
        """`generate` over conversations rendered by the model's chat template."""
        if self.tokenizer is None:
            raise ValueError("glm5.LLM.chat: this model has no tokenizer (tokenizer.json)")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(c, tools=tools,
                                                    enable_thinking=enable_thinking)
                 for c in convs]
        return self.generate(texts, sampling_params)
