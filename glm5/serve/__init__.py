"""The HTTP front of the serving engine: an OpenAI-compatible FastAPI app (`glm5.serve.app`:
completions, chat completions with streaming, tool calls and reasoning, /health, /metrics),
its request protocol, admission limits and Prometheus metrics. Text handling (tokenizer, chat
template, parser) is `glm5.text`; the engine is `glm5.engine`. Needs the ``glm5[serve]``
extra; nothing here is imported by ``import glm5``."""
