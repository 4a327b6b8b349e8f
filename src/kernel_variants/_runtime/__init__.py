"""The runtime: the op call, ``make_op``, ``explain``, ``bind``, the write guards, the
dispatcher, the torch.library custom ops, the compiled call core and device errors."""
