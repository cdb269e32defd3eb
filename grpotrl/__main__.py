"""``python -m grpotrl``: the ``grpotrl`` command (``grpotrl.cli``)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
