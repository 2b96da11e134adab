"""The serving image's HEALTHCHECK: GET /health on the port the server was started with (``--port N`` among the
container's arguments, read from PID 1's command line; 8000, vLLM's default, otherwise)."""

import sys
import urllib.request


def port(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--port="):
            return arg.split("=", 1)[1]
    return "8000"


if __name__ == "__main__":
    with open("/proc/1/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port(argv)}/health", timeout=4)
    except OSError as error:
        sys.exit(f"unhealthy: {error}")
