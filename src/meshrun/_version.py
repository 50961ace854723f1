"""meshrun's version, in a leaf that imports nothing: the package face re-exports it, and the
layers below the face (the node handshake, doctor, the CLI) read it here without importing
``meshrun/__init__``."""

__version__ = "0.1.0"
