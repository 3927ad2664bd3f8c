"""The limits `glm5 serve` puts on clients (one `ServeLimits`, built from the command line or
passed to `build_app`), and their defaults next to vLLM's.

=======================  ========  =================================================  ==========================
limit                    default   what happens past it                               vLLM 0.14 (uvicorn)
=======================  ========  =================================================  ==========================
max_body_bytes           8 MiB     413 from the Content-Length header, before the     none
                                   body is read (or once a chunked body passes it)
header_timeout           10 s      a connection whose request line and headers have   none
                                   not all arrived (from connect, or from the end of
                                   the previous response) is closed (408 if it sent
                                   part of a request)
body_timeout             30 s      408 when the body has not all arrived              none
timeout_keep_alive       5 s       an idle keep-alive connection is closed            5 s
max_header_bytes         64 KiB    request line + headers larger: 400, closed         4 MiB, 256 headers
max_connections          auto      a connection over it gets a 503 and is closed at   none (EMFILE)
                                   once; auto: the descriptor limit (raised to its
                                   hard limit) less 256 for the engine's own files
stream_backlog           256       a stream whose client has this many outputs per    none
                                   choice waiting unread is aborted and its pages
                                   freed: generation never runs further ahead
stall_timeout            30 s      a connection whose socket stays unwritable (the    none
                                   client stopped reading) this long is dropped
graceful_timeout         30 s      after SIGTERM, streams still open get a final      none (waits for them)
                                   error event and the server exits
send_buffer_bytes        kernel    caps a connection's kernel send buffer (SO_SNDBUF;  kernel
                                   by default the kernel autotunes it, up to
                                   net.ipv4.tcp_wmem's max, often 4 MiB): what a
                                   client that stops reading holds in the kernel
                                   before stream_backlog starts counting
=======================  ========  =================================================  ==========================

Text prompts are also checked on bytes before they are tokenized: a prompt of B UTF-8 bytes
has at least B / (4 * L) tokens, L being the tokenizer's longest token in bytes (4: a
normalizer maps a character to at least one byte, so it shrinks text at most 4x); one that
cannot fit the context is refused without tokenizing it. Tokenizing runs on a small thread
pool of its own, never on the event loop.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass, fields

MiB = 1 << 20
# Descriptors kept for the engine's own files (checkpoint shards, logs, the tokenizer pool)
# when max_connections is derived from the descriptor limit.
RESERVED_FDS = 256


@dataclass(frozen=True)
class ServeLimits:
    """See the module docstring; times in seconds, sizes in bytes. ``max_connections`` None:
    `connection_cap` derives it from the descriptor limit."""

    max_body_bytes: int = 8 * MiB
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    timeout_keep_alive: float = 5.0
    max_header_bytes: int = 64 * 1024
    max_connections: int | None = None
    stream_backlog: int = 256
    stall_timeout: float = 30.0
    graceful_timeout: float = 30.0
    send_buffer_bytes: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("max_connections", "send_buffer_bytes") and v is None:
                continue
            if f.type in ("int", "int | None"):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"glm5 ServeLimits: argument '{f.name}' expected an int "
                                     f">= 1, got {v!r}")
            elif (isinstance(v, bool) or not isinstance(v, (int, float))
                  or not math.isfinite(v) or v <= 0):
                raise ValueError(f"glm5 ServeLimits: argument '{f.name}' expected a finite "
                                 f"number of seconds > 0, got {v!r}")

    def connection_cap(self) -> int:
        """``max_connections``, or the soft descriptor limit less `RESERVED_FDS` (at least 16)."""
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return 65536
        return max(16, soft - RESERVED_FDS)


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as servers do at start); returns
    (soft before, soft after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# A normalizer maps each character to at least one byte, so text shrinks at most this much.
UTF8_MAX_CHAR_BYTES = 4


def min_tokens(text_bytes: int, longest_token_bytes: int) -> int:
    """A lower bound on the tokens of a text of ``text_bytes`` UTF-8 bytes, when no token is
    longer than ``longest_token_bytes`` bytes."""
    return -(-text_bytes // (UTF8_MAX_CHAR_BYTES * max(1, longest_token_bytes)))
