"""Text in, text out for the serving engine: the model directory's tokenizer and chat template
(glm5.serve.tokenizer), the GLM-5 chat format and its streaming parser (glm5.serve.chat), and
the OpenAI-compatible HTTP front end. Needs the ``glm5[serve]`` extra; nothing here is imported
by ``import glm5``."""
