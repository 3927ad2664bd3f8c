"""Text in and out of the model, for every layer that needs it (engine, serve, rl, testing):
the model directory's tokenizer and the incremental detokenizer that turns streamed token ids
into text without splitting a character (`glm5.text.tokenizer`), GLM-5's chat template and the
streaming parser of its think / tool-call tags (`glm5.text.chat`), and the small byte-level
BPE builder that makes a GLM-style tokenizer without a hub (`glm5.text.bpe`).

Imports no other glm5 layer; ``tokenizers`` and ``jinja2`` are imported lazily, where used."""
