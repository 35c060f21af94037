"""models: GGUF files from Hugging Face (or a mirror), an Ollama store, or a path.

The role's declaration is role.py (ROLE); this package imports nothing, so that loading a
cluster file reads the role's settings and checks without its operations."""
