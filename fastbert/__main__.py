"""``python -m fastbert serve MODEL ...`` (the ``fastbert`` command), and ``python -m fastbert info``."""

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": "serve an embeddings, rerank or classify model over HTTP (fastbert serve --help)",
                "info": "what fastbert runs here, and why (fastbert info --json)"}
    if not argv or argv[0] not in commands:
        print("usage: fastbert {serve,info} ...\n" + "\n".join(f"  {name:6} {text}" for name, text in commands.items()),
              file=sys.stderr)
        sys.exit(2)
    if argv[0] == "serve":
        from .serve import main as serve
        serve(argv[1:])
    else:
        from .info import main as info
        info(argv[1:])


if __name__ == "__main__":
    main()
