"""The ``serve`` extra: the modules the server needs beyond fastbert's own dependencies (an ASGI framework and server,
Prometheus metrics, fast JSON), and the error that says how to install them."""

import importlib.util

MODULES = ("starlette", "uvicorn", "prometheus_client", "orjson")
INSTALL = 'pip install "fastbert[serve]"'


def require() -> None:
    """Raise ``ModuleNotFoundError`` naming the missing modules and the install command, where any is missing."""
    missing = [name for name in MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"fastbert serve needs {', '.join(missing)}, which the serve extra installs: "
                                  f"{INSTALL}")
