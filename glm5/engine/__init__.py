"""The serving engine: a cache manager (page size, pages, paged latent + indexer pools, RadixCache
prefix reuse, the slot and key rules), scheduler (continuous batching, chunked prefill, admission
tiers), sampling, MTP drafts, glm5.LLM."""
