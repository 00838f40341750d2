"""Importing fastbert from inside its source checkout.

The checkout and the installed package differ in two ways (setup.py):
- ``_C``, the compiled extension, exists only where fastbert was built: in site-packages after ``pip install .``, or
  in the source folder itself after an editable install (``pip install -e .``) or ``setup.py build_ext --inplace``;
- the Triton kernels live in the checkout's top-level ``kernels/`` and are installed as ``fastbert.kernels``. That
  folder has no ``__init__.py`` on purpose: transformers >= 5.25 imports the PyPI package ``kernels``, and from the
  repository root (first on ``sys.path`` for ``python -c``, ``python -m``, pytest, a REPL or a notebook) a regular
  package ``kernels/`` there would shadow it. A folder without ``__init__.py`` is only a namespace candidate, so the
  installed regular package wins, and where none is installed the import system still reports no ``kernels``
  distribution (transformers checks the metadata too).

So after ``pip install .`` a user standing in the repository root who runs ``import fastbert`` finds the source folder
``fastbert/`` first, which lacks ``_C``: ``fastbert/__init__.py`` asks ``shadowed()`` and loads the installed package
in its place (``load_installed``). A source folder with its own ``_C`` is the package (editable): there
``bind_kernels`` makes ``fastbert.kernels`` the checkout's ``kernels/`` when the import system does not (setuptools'
editable finder maps a ``package_dir`` folder only when it has an ``__init__.py``).
"""

import importlib.machinery
import importlib.util
import os
import sys


def _built_here(package_dir: str) -> bool:
    """Whether ``package_dir`` holds the compiled extension ``_C`` (for any Python ABI suffix)."""
    return any(os.path.isfile(os.path.join(package_dir, "_C" + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def shadowed(source_init: str) -> bool:
    """Whether the package of ``source_init`` is a source folder without its compiled ``_C``: never built, so a
    checkout standing in for the installed package."""
    return not _built_here(os.path.dirname(os.path.abspath(source_init)))


def load_installed(name: str, source_init: str) -> None:
    """Import the package ``name`` installed elsewhere on ``sys.path`` into ``sys.modules``, in place of the source
    folder of ``source_init``; an ImportError saying what to do where there is none."""
    source = os.path.dirname(os.path.abspath(source_init))
    root = os.path.dirname(source)
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.origin is None or not _built_here(os.path.dirname(spec.origin)):
        raise ImportError(f"{name} is imported from its source folder {source}, which lacks the compiled extension "
                          "and the kernels (installed as fastbert.kernels): install it (`pip install .` in the "
                          "repository), or run Python from another directory")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (the import statement returns what sys.modules holds once this file has run)
    spec.loader.exec_module(module)


def bind_kernels(name: str, source_init: str) -> None:
    """Where the built package ``name`` is a checkout's source folder (an editable install) and the import system
    finds no ``name.kernels``: make it the checkout's ``kernels/`` folder, as an installed package has it."""
    if importlib.util.find_spec(f"{name}.kernels") is not None:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(source_init)))
    spec = importlib.machinery.PathFinder.find_spec("kernels", [root])  # (a namespace spec: no __init__.py there)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name}.kernels is missing: reinstall fastbert (`pip install .` in the repository)")
    spec.name = f"{name}.kernels"
    sys.modules[spec.name] = kernels = importlib.util.module_from_spec(spec)
    setattr(sys.modules[name], "kernels", kernels)  # (as the import system binds a submodule on its parent)
