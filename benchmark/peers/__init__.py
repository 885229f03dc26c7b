"""benchmark/peers/: see benchmark/README.md, "Scripts"."""
