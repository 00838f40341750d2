"""Importing fastbert from inside its source checkout.

After ``pip install .`` a user is still standing in the repository root, and ``python -c``/``python -m`` put the
working directory first on ``sys.path``: ``import fastbert`` then finds the source folder ``fastbert/``, which has
neither ``fastbert.kernels`` (installed from ``kernels/``) nor the compiled ``_C``. ``fastbert/__init__.py`` asks
``shadowed()`` first and, when the source folder stands in for an installed package, loads that one instead: the
package the user installed is what ``import fastbert`` gets, wherever they stand. An editable install maps
``fastbert.kernels`` itself, so there the source folder is the installed package and nothing changes.
"""

import importlib.machinery
import importlib.util
import os
import sys


def shadowed(name: str) -> bool:
    """Whether the package ``name`` being imported is a source folder without its ``kernels`` subpackage."""
    return importlib.util.find_spec(f"{name}.kernels") is None


def load_installed(name: str, source_init: str) -> None:
    """Import the package ``name`` installed elsewhere on ``sys.path`` into ``sys.modules``, in place of the source
    folder of ``source_init``; an ImportError saying what to do where there is none."""
    source = os.path.dirname(os.path.abspath(source_init))
    root = os.path.dirname(source)
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.origin is None or not os.path.isdir(os.path.join(os.path.dirname(spec.origin), "kernels")):
        raise ImportError(f"{name} is imported from its source folder {source}, which lacks {name}.kernels and the "
                          "compiled extension: install it (`pip install .` in the repository), or run Python from "
                          "another directory")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (the import statement returns what sys.modules holds once this file has run)
    spec.loader.exec_module(module)
