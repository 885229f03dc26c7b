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


def fresh_at(tree: dict, path) -> dict:
    """The dict at `path` in `tree` (itself a fresh top-level copy), with every dict along the path copied first,
    so it can be changed while the tree it was copied from stays as it was (the rest is shared)."""
    node = tree
    for step in path:
        node[step] = node = dict(node[step])
    return node


def at(tree: dict, path):
    for name in path:
        tree = tree[name]
    return tree
