"""The code blocks of the README and the docs, run as a reader runs them.

A reader copies one block into a fresh file and runs it on a laptop: one
CPU device, none of our environment variables. So each block runs in a
fresh process without ``XLA_FLAGS``: a block that needs 8 devices sets them
itself (``jax.config.update('jax_num_cpu_devices', 8)``, see
docs/getting_started.md). That process is a fork of a `warm.Pool`, which
imported JAX, Flax and TensorFlow once and started neither: its devices,
its DTensor set-up, Flax's configuration and its globals are its own. The
markers a page may use:

- ``<!-- block: NAME -->`` on the line before a fence names the block.
- ``# Continues: NAME[, NAME]`` as a block's first line: it runs after the
  named blocks of the same page (and theirs), in that order.
- ``# Run in each of the N processes ...`` as a block's first line: it runs
  in N processes at once, process i with i as its argument (and no
  ``DTENSOR_*`` variable: docs/export_multi_process.md).
- ``# Fresh process: WHY`` on a line of its own: the block runs in a new
  ``python``, not a fork of the pool (its subject is what happens at
  import, or it needs modules the pool has not imported).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import textwrap
import time
from collections.abc import Sequence

from support import multiprocess_util, processes, warm

_FENCE = re.compile(
  r'^(?P<indent>[ ]*)```(?P<language>[\w-]*)[^\n]*\n(?P<code>.*?)^(?P=indent)```',
  re.S | re.M,
)
_LABEL = re.compile(r'<!-- block: ([\w-]+) -->\s*$')
_CONTINUES = re.compile(r'# Continues: ([\w-]+(?:, [\w-]+)*)$')
_PROCESSES = re.compile(r'# Run in each of the (\d+) processes')
_FRESH = re.compile(r'^[ ]*# Fresh process: (.+)$', re.M)


@dataclasses.dataclass(frozen=True)
class Block:
  """One fenced code block of a page."""

  page: str
  line: int  # Of the opening fence, 1-based.
  language: str
  code: str
  label: str | None
  continues: tuple[str, ...]
  processes: int
  fresh: str | None  # Why it needs a new `python`, if it says so.

  @property
  def name(self) -> str:
    return f'{self.page}:{self.label or self.line}'


def code_blocks(path: pathlib.Path) -> list[Block]:
  """Every fenced block of the Markdown file at `path`, in page order."""
  text = path.read_text()
  blocks = []
  for m in _FENCE.finditer(text):
    before = text[: m.start()].rstrip('\n').rsplit('\n', 1)[-1]
    label = _LABEL.search(before)
    code = textwrap.dedent(m['code'])
    first = code.split('\n', 1)[0]
    continues = _CONTINUES.match(first)
    processes = _PROCESSES.match(first)
    fresh = _FRESH.search(code)
    blocks.append(
      Block(
        page=path.name,
        line=text.count('\n', 0, m.start()) + 1,
        language=m['language'],
        code=code,
        label=label[1] if label else None,
        continues=tuple(continues[1].split(', ')) if continues else (),
        processes=int(processes[1]) if processes else 1,
        fresh=fresh[1] if fresh else None,
      )
    )
  return blocks


def chains(blocks: Sequence[Block]) -> list[list[Block]]:
  """The Python blocks as scripts: each with the blocks it continues first.

  A block that another continues runs at the start of that one's script,
  in a fresh process: as it would run alone.
  """
  python = [b for b in blocks if b.language == 'python']
  by_label = {b.label: b for b in python if b.label}
  continued = {name for b in python for name in b.continues}

  def chain(block: Block) -> list[Block]:
    out: list[Block] = []
    for name in block.continues:
      assert name in by_label, f'{block.name} continues unknown {name!r}'
      out += [b for b in chain(by_label[name]) if b not in out]
    return [*out, block]

  return [chain(b) for b in python if b.label not in continued]


def run_script(
  script: pathlib.Path,
  cwd: pathlib.Path,
  timeout: float,
  pool: warm.Pool,
  *,
  fresh: bool = False,
  args: Sequence[str] = (),
  env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
  """Runs `script` in `cwd` as a reader would (bounded by `timeout`).

  In a fork of `pool`, or in a new `python` if `fresh`; in `env`, or a
  reader's environment (`processes.reader_env`).
  """
  env = processes.reader_env() if env is None else env
  if fresh:
    return processes.run_python(
      script, *args, cwd=cwd, timeout=timeout, env=env
    )
  return pool.run(script, *args, cwd=cwd, timeout=timeout, env=env)


def run_processes(
  script: pathlib.Path,
  num_processes: int,
  cwd: pathlib.Path,
  timeout: float,
  pool: warm.Pool,
) -> subprocess.CompletedProcess:
  """Runs `script` in `num_processes` forks of `pool` at once, in `cwd`.

  Process i gets i as its argument; the environment is a reader's, with
  `FDT_MP_COORDINATOR` holding a free local address for JAX's coordinator.
  If one fails or the time is up, the others are killed. The result's
  stdout holds each process's output (stdout and stderr), in order.
  """
  (port,) = multiprocess_util.free_ports(1)
  env = processes.reader_env(FDT_MP_COORDINATOR=f'127.0.0.1:{port}')
  logs = [cwd / f'process{i}.log' for i in range(num_processes)]
  cases = []
  outputs_note = ''
  try:
    for i, log in enumerate(logs):
      with open(log, 'wb') as out:
        cases.append(
          pool.start(
            script,
            str(i),
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
          )
        )
    deadline = time.monotonic() + timeout
    while any(c.poll() is None for c in cases):
      if any(c.poll() not in (None, 0) for c in cases):
        break
      if time.monotonic() > deadline:
        outputs_note = f'timed out after {timeout} s; '
        break
      time.sleep(0.05)
  finally:
    for case in cases:
      case.kill()
    codes = [case.wait(60) for case in cases]
  outputs = [log.read_text(errors='replace') for log in logs]
  report = '\n'.join(
    f'--- process {i} (exit {code}) ---\n{out}'
    for i, (code, out) in enumerate(zip(codes, outputs, strict=True))
  )
  status = next((code for code in codes if code), 0)
  return subprocess.CompletedProcess(
    [str(script)],
    status,
    '\n'.join(outputs),
    outputs_note + report if status else '',
  )
