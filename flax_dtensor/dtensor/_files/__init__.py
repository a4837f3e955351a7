"""The checkpoint format and its writing: what lands on disk, and back.

Paths confined to an export (`_paths`), the manifest that describes and
checks an export (`_manifest`, its shards a grid: `_grid`), atomic
directories that know nothing of the format (`_atomic`), saves that run
behind training (`_background`), slices read and written on the host
(`_host_read`, `_host_write`), and the two public steps, `save_checkpoint`
(`_checkpoint`) and `restore_checkpoint` (`_restore`); and a run's output
folder, its parts written aside and swapped in whole (`_run_folder`: the
command line's ``demo`` and ``export``); and a training run's checkpoints
by step (`_manager`: `CheckpointManager`, its folder's names in `_steps`,
read without JAX or TensorFlow by ``inspect``); and one part of a step that
holds the model beside other state, restored into the model
(`_part_restore`: ``export --part``).

May import: `dtensor._layout`, the bridge's top-level helpers and the
package's core; never `_serving`. `_atomic` imports nothing of the format.
"""
