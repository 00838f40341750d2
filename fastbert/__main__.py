"""``python -m fastbert serve MODEL ...`` (the ``fastbert`` command), ``python -m fastbert info``, ``--version``."""

import sys

from . import __version__

COMMANDS = {"serve": "serve an embeddings, rerank or classify model over HTTP (fastbert serve --help)",
            "info": "what fastbert runs here, and why (fastbert info --json)"}


def main(argv: list[str] | None = None) -> None:
    """``argv``: default, this process's arguments."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:
        print(f"fastbert {__version__}")
        return
    if not argv or argv[0] not in COMMANDS:
        asked = argv[:1] in (["-h"], ["--help"])
        print("usage: fastbert {serve,info} ... | fastbert --version\n"
              + "\n".join(f"  {name:6} {text}" for name, text in COMMANDS.items()),
              file=sys.stdout if asked else sys.stderr)
        sys.exit(0 if asked else 2)
    if argv[0] == "serve":
        from .serve import main as serve
        serve(argv[1:])
    else:
        from .info import main as info
        info(argv[1:])


if __name__ == "__main__":
    main()
