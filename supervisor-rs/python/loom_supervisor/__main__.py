"""``python -m loom_supervisor ...`` is the ``loom-supervisor`` command."""

from ._cli import main

if __name__ == "__main__":
    main()
