"""benchmark/offline/: see benchmark/README.md, "Scripts"."""
