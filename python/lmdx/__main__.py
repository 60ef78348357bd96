"""``python -m lmdx``: the ``lmdx`` command."""

from .cli import main

if __name__ == "__main__":  # importing the module (pydoc, pkgutil.walk_packages) runs nothing
    raise SystemExit(main())
