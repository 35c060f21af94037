"""meshdeploy: a YAML cluster file in, a running llama.cpp RPC cluster out."""

__version__ = "0.1.0"
