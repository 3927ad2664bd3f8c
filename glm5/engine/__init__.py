"""The serving engine: paged latent + indexer cache, RadixCache prefix reuse, scheduler
(continuous batching, chunked prefill, admission tiers), sampling, MTP drafts, glm5.LLM."""
