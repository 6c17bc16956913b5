"""A faithful, fast implementation of the Transformer of "Attention Is All You Need"."""

from transformer import cpuinfo as _cpuinfo

__version__ = "0.1.0"

# Others' CPU use is read from here on where a command starts (`cpuinfo.START`): its imports
# are ~0.7 s of one core before the first model op.
_cpuinfo.mark_start()
