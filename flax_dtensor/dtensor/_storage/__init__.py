"""Storage: bytes to disk and back, atomically.

Atomic directories that know nothing of the format (`_atomic`): the
temporaries beside an export, named by their writer, with their markers
(`_temporaries`), what killed writers left finished or undone
(`_recovery`), and where an export may be written or replaced
(`_writable`). A training run's folder names by step (`_steps`, read
without JAX or TensorFlow by ``inspect``), slices read and written on the
host (`_host_read`, `_host_write`) and saves that run behind training
(`_background`).

May import: `dtensor._layout`, `dtensor._conversion`, `dtensor._format`,
the bridge's top-level helpers and the package's core; never
`_checkpoints` nor `_serving`. `_atomic`, `_temporaries`, `_recovery` and
`_writable` import nothing of the format, nor any other module of this
room.
"""
