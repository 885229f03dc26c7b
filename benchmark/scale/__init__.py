"""benchmark/scale/: see benchmark/README.md, "Scripts"."""
