"""benchmark/served/: see benchmark/README.md, "Scripts"."""
