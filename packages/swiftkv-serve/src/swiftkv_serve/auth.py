"""The API key on every route of the server but its health probes: what ``swiftkv-serve`` adds whenever a key is set.

vLLM 0.32's own key check (``--api-key`` / ``VLLM_API_KEY``) guards the paths under /v1, /v2, /inference and /cohere
only: SageMaker's /invocations (completions and chats on the same engine), /tokenize, /detokenize, /metrics, /load,
/version and the scaling routes answer anyone (its ``--api-key`` help says so). ``ApiKeyOnEveryRoute``, an ASGI
middleware vLLM loads through its ``--middleware`` option, answers 401 on every route but ``OPEN`` to a request
without ``Authorization: Bearer KEY`` for one of the keys in the environment variable ``KEYS_VARIABLE`` (one per
line). With plain ``vllm serve``: ``SWIFTKV_SERVE_API_KEYS=KEY vllm serve CKPT --middleware
swiftkv_serve.auth.ApiKeyOnEveryRoute``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

KEYS_VARIABLE = "SWIFTKV_SERVE_API_KEYS"
# every variable a server started by swiftkv-serve takes a key from (cli.server_environment reads them)
KEY_VARIABLES = ("SWIFTKV_API_KEY", "SWIFTKV_API_KEY_FILE", "VLLM_API_KEY", KEYS_VARIABLE)
OPEN = ("/health", "/ping")  # liveness and readiness probes: Docker's HEALTHCHECK, SageMaker's /ping
MIDDLEWARE = f"{__name__}.ApiKeyOnEveryRoute"
_UNAUTHORISED = b'{"error": "Unauthorized: give Authorization: Bearer <API key>"}'


def check_keys(keys: list[str]) -> None:
    """Refuse a key an HTTP client could not send as it is: clients encode a header's non-ASCII characters
    differently (UTF-8 or latin-1), so such a key would match for some clients and lock the others out."""
    if any(not key.isascii() or not key.isprintable() for key in keys):
        raise ValueError(
            "an API key holds a line break or a character outside printable ASCII, which HTTP clients do not send "
            "alike: give each key on one line, in ASCII letters, digits and punctuation (`openssl rand -hex 32`)."
        )


def shown_by_parent(keys: list[str], pid: int | None = None) -> str | None:
    """A warning where the process that started this one (``pid``, default the parent) holds one of ``keys`` (those
    of this process's ``--api-key``) in its own command line, which ``ps`` shows to anyone on the machine: an
    image's init (tini, PID 1, whose arguments are the container's command), a wrapper such as ``uv run``, or a
    ``bash -c``. Taking the option out of this process's command line (``cli.server_environment``) leaves theirs as
    it was. None where no key is shown there."""
    pid = pid or os.getppid()
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            arguments = cmdline.read().decode(errors="replace").split("\0")
    except OSError:  # no /proc (not Linux), or the parent is gone
        return None
    if not any(key and key in argument for key in keys for argument in arguments):
        return None
    try:  # its name as the kernel keeps it: a process title (setproctitle) may hold the whole command line
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        name = "?"
    return (
        f"WARNING: --api-key's key is in the command line of process {pid} ({name}), which "
        "started this one, and `ps` shows it to anyone on this machine: give the key by SWIFTKV_API_KEY_FILE (a "
        "file readable by the server alone) instead."
    )


def readable_by_all(key_file: str | None) -> str | None:
    """A warning where the key file (``SWIFTKV_API_KEY_FILE``) lets every user read it (its mode's o+r; a folder
    above it, or a container's own secret volume, may keep others out all the same)."""
    if not key_file or not os.path.isfile(key_file) or not os.stat(key_file).st_mode & 0o004:
        return None
    return (
        f"WARNING: SWIFTKV_API_KEY_FILE={key_file} lets every user read it (mode o+r): `chmod o-r` it where other "
        "users share this machine (the server's user, or its group, reading it is enough)."
    )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _cors_preflight(method: str | None, headers: list[tuple[bytes, bytes]]) -> bool:
    """A browser's CORS preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``), which vLLM's
    CORS layer answers itself; any other ``OPTIONS`` request reaches the routes (``/metrics`` answers it)."""
    names = {name for name, _ in headers}
    return method == "OPTIONS" and b"origin" in names and b"access-control-request-method" in names


class ApiKeyOnEveryRoute:
    """ASGI middleware: a request to any path but ``OPEN`` needs one of the keys (CORS preflights pass: no route
    answers them). Refuses to start without a key, so a server meant to be closed never runs open."""

    def __init__(self, app) -> None:
        keys = [key.strip() for key in os.environ.get(KEYS_VARIABLE, "").splitlines() if key.strip()]
        if not keys:
            raise ValueError(
                f"{MIDDLEWARE} needs the API keys in {KEYS_VARIABLE} (one per line); it is unset or empty."
            )
        check_keys(keys)
        self.app = app
        self._digests = [_digest(key) for key in keys]

    def authorised(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether ``headers`` (an ASGI scope's) hold ``Authorization: Bearer KEY`` for one of the keys, compared
        in constant time."""
        value = dict(headers).get(b"authorization", b"").decode("latin-1")
        scheme, _, given = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest, matched = _digest(given.strip()), False
        for known in self._digests:  # every key compared, whichever matches
            matched |= secrets.compare_digest(digest, known)
        return matched

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        headers = scope.get("headers", [])
        passes = (
            scope["type"] not in ("http", "websocket")  # lifespan events
            or _cors_preflight(scope.get("method"), headers)  # answered by the CORS layer, never by a route
            or path in OPEN
            or self.authorised(headers)
        )
        if passes:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
        else:
            headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": _UNAUTHORISED})
