"""Walking a Flax param tree (nested dicts): where its dense layers are. Shared by the backend's packing and the
model's quantization, which both rewrite every dense layer's weight."""
from __future__ import annotations


def dense_paths(tree: dict, key: str, prefix=()):
    """Paths of the dicts holding `key` (a dense layer's weight), depth first."""
    for name, sub in tree.items():
        if isinstance(sub, dict):
            if key in sub:
                yield prefix + (name,)
            else:
                yield from dense_paths(sub, key, prefix + (name,))


def at(tree: dict, path):
    for name in path:
        tree = tree[name]
    return tree
