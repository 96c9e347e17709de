"""Version-pinned SGLang 0.5.23 adapters, one module per integration named in the adapter table.

Each module exposes ``install(row, module) -> bool``: it patches the row's target in the loaded
module, refuses to patch twice (a marker on the patched object), and returns True once in place.
"""
