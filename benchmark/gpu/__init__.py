"""benchmark/gpu/: see benchmark/README.md, "Scripts"."""
