#: gemmgen's version (the wheel's, and part of every cache key and bundle).
__version__ = "0.1.0"
