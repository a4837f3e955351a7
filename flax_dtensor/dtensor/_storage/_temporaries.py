"""The temporaries beside an export, named by their writer, and their markers.

An export is written into a hidden sibling whose name says who writes it
(`Writer`: host, pid and process start time), and an old export is
renamed aside under a name that says the same (`sibling`, `siblings`), so
a temporary is owned from the instant it exists (`owner`). A marker file
says a temporary is complete (`write_marker`, `read_marker`). This module
also keeps the temporaries this process writes (`active`) or removed
(`removed`), removes one, its marker last (`remove`), and flushes files and
directories to disk (`flush_files`, `fsync_tree`, `fsync_dir`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import secrets
import shutil
import socket
import zlib
from collections.abc import Callable

IsExport = Callable[[str], bool]
"""Whether a directory holds an export of this package, written for it.

Given by the format's layer (`_decode.is_export`): true for a directory
whose own manifest is valid and describes it, false for anything else.
"""

# Marks a temporary complete (all files written and flushed): its writer's
# identity and `COMPLETE`. Not part of the export.
MARKER = '.flax_dtensor-writer.json'
TMP = '.tmp-'
OLD = '.old-'
STAGING = '.flax_dtensor-staging-'
# States a marker can hold. Only COMPLETE is written now; temporaries
# written by flax_dtensor before names carried the writer hold the others.
WRITING, COMPLETE, REPLACED = 'writing', 'complete', 'replaced'

# Temporaries this process is writing now (a pid alone cannot tell them
# apart from ones a failed save of this same process left).
active: set[str] = set()
# Temporaries this process removed after a failure or an interrupt: a
# library's thread still writing there (Orbax's) may create them again;
# `_recovery.abandon` removes them once more before the process ends.
removed: set[str] = set()


# Writers and liveness
# ------------------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
  """A process's start time (Linux), to tell a reused pid apart."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _host_label(host: str) -> str:
  """`host` as it appears in a name: itself, or a prefix and its CRC.

  Names keep `[A-Za-z0-9.-]` and at most 40 characters as they are; any
  other host name gets a `~` and a CRC-32 of the whole name, so two hosts
  never share a label by truncation.
  """
  safe = re.sub(r'[^A-Za-z0-9.-]', '_', host)
  if safe == host and 0 < len(host) <= 40:
    return host
  return f'{safe[:31]}~{zlib.crc32(host.encode()):08x}'


# token-pid-start-host: all of a name after `.NAME.tmp-` (`.old-`, staging).
_TAG = re.compile(
  r'(?P<token>[0-9a-f]{8})-(?P<pid>[0-9]+)-(?P<started>[0-9]+)-'
  r'(?P<host>[A-Za-z0-9._~-]+)'
)


@dataclasses.dataclass(frozen=True)
class Writer:
  """Who writes (or wrote) a temporary directory."""

  pid: int
  host: str  # A host name or its label (`_host_label`).
  started: str | None  # The process start time, if known.

  @classmethod
  def on_this_host(cls, pid: int) -> Writer:
    """The process `pid` of this host, as a name records it."""
    return cls(pid, _host_label(socket.gethostname()), _start_time(pid))

  @classmethod
  def me(cls) -> Writer:
    return cls.on_this_host(os.getpid())

  @classmethod
  def from_name(cls, path: str, prefix: str) -> Writer | None:
    """The writer the name of `path` records after `prefix`, or None.

    None for a name of an older version (`.NAME.tmp-` and 8 hex digits).
    """
    name = os.path.basename(path)
    if not name.startswith(prefix):
      return None
    match = _TAG.fullmatch(name[len(prefix) :])
    if match is None:
      return None
    started = match['started']
    return cls(
      int(match['pid']), match['host'], None if started == '0' else started
    )

  def tag(self) -> str:
    """A fresh name suffix saying who writes: token-pid-start-host."""
    return f'{secrets.token_hex(4)}-{self.pid}-{self.started or 0}-{self.host}'

  def alive(self, path: str | None = None) -> bool | None:
    """True or False on this host; None (unknown) for another host.

    `path`, a temporary of this process, is alive while this process
    writes it.
    """
    if _host_label(self.host) != _host_label(socket.gethostname()):
      return None
    if self.pid == os.getpid() and self.started in (
      None,
      _start_time(self.pid),
    ):
      return path is None or path in active
    try:
      os.kill(self.pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      pass
    started = _start_time(self.pid)
    return started is None or self.started is None or started == self.started

  def describe(self) -> str:
    return f'pid {self.pid} on host {self.host}'


@dataclasses.dataclass(frozen=True)
class Marker:
  """A temporary's marker file: its writer, and how far it got."""

  writer: Writer
  state: str


def write_marker(directory: str, state: str) -> None:
  path = os.path.join(directory, MARKER)
  me = Writer.me()
  with open(path + '.new', 'w') as f:
    json.dump(
      {'pid': me.pid, 'host': me.host, 'started': me.started, 'state': state},
      f,
    )
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + '.new', path)


def read_marker(directory: str) -> Marker | None:
  """The marker of `directory`, else its half-written `.new`, else None."""
  for name in (MARKER, MARKER + '.new'):
    try:
      with open(os.path.join(directory, name)) as f:
        raw = json.load(f)
      started = raw.get('started')
      writer = Writer(
        int(raw['pid']),
        str(raw['host']),
        None if started is None else str(started),
      )
      return Marker(writer, str(raw['state']))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
      continue
  return None


def owner(path: str, prefix: str) -> Writer | None:
  """Who writes the temporary `path`: its name says, else its marker."""
  writer = Writer.from_name(path, prefix)
  if writer is None:
    marker = read_marker(path)
    writer = marker.writer if marker is not None else None
  return writer


def fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def flush_files(path: str) -> None:
  """Flushes every file under `path` to disk (not the directories).

  A file removed after the listing (another process's part of a manifest,
  merged and deleted by process 0) has nothing left to flush.
  """
  for root, _, files in os.walk(path):
    for name in files:
      try:
        fd = os.open(os.path.join(root, name), os.O_RDONLY)
      except FileNotFoundError:
        continue
      try:
        os.fsync(fd)
      finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
  """Flushes every file under `path`, then the directories, to disk."""
  flush_files(path)
  for root, _, _ in os.walk(path):
    fsync_dir(root)


def sibling(directory: str, infix: str) -> str:
  """A fresh hidden sibling of `directory` (`TMP`, `OLD`), named by me."""
  parent, name = os.path.split(directory)
  return os.path.join(parent, f'.{name}{infix}{Writer.me().tag()}')


def siblings(directory: str) -> list[str]:
  """The hidden temporaries of `directory`: new ones, then old ones."""
  parent, name = os.path.split(directory)
  found = []
  for infix in (TMP, OLD):
    pattern = os.path.join(glob.escape(parent), f'.{glob.escape(name)}{infix}*')
    found += sorted(p for p in glob.glob(pattern) if os.path.isdir(p))
  return found


def remove(path: str) -> None:
  """Deletes a temporary, its marker last: a kill midway leaves it marked."""
  if os.path.islink(path) or not os.path.isdir(path):
    os.remove(path)
    return
  for name in os.listdir(path):
    if name != MARKER:
      child = os.path.join(path, name)
      if os.path.isdir(child) and not os.path.islink(child):
        shutil.rmtree(child)
      else:
        os.remove(child)
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(path, MARKER))
  os.rmdir(path)
