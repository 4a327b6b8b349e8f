"""``python -m kernel_variants`` is the ``kv`` command (and what ``torchrun -m`` launches)."""

from kernel_variants._cli import entry

if __name__ == "__main__":
    entry()
