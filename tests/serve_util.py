"""A live `glm5 serve` app for tests: `glm5.serve.http.make_server` (the limits included) on a
free port of 127.0.0.1, in a background thread."""

from __future__ import annotations

import threading
import time

import httpx
import torch

from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from glm5.serve.http import make_server
from glm5.text.bpe import build_tokenizer


def tiny_model_and_tokenizer(tok_dir, vocab: int):
    """The ``tiny`` preset (float32, random weights, seed 0) with ``vocab`` entries, and a
    tokenizer of that size trained on the spot in ``tok_dir``."""
    tok = build_tokenizer(tok_dir, vocab)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(preset("tiny").replace(vocab_size=vocab)).float().eval()
    return model, tok


class LiveServer:
    """``app`` served as `glm5 serve` serves it, on a free port of 127.0.0.1."""

    def __init__(self, app) -> None:
        self.app = app
        self.server = make_server(app, host="127.0.0.1", port=0, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        assert httpx.get(self.url + "/health").status_code == 200

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive()
