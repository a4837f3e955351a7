"""The checkpoint format: what an export holds on disk, without JAX or TF.

The manifest, ``flax_dtensor.json``, that describes and checks an export:
its model, the records and constants of the format (`_model`); the one
hash of values and files (`_checksums`); writing it (`_encode`); reading
it, an untrusted document, strictly (`_decode`); checking an export's
files, TF's index and the bytes read against it (`_verify`). Its shards
are a grid of global slices (`_grid`), and the paths an export may name
are confined to it (`_paths`).

May import: `dtensor._layout`, `dtensor._conversion`, the bridge's
top-level helpers and the package's core; never `_storage`, `_checkpoints`
nor `_serving`.
"""
