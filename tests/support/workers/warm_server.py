"""A warm Python that forks one fresh process per script (tests/support/warm.py).

Started with `CONTROL_FD MODULE...`: it imports the modules (in this order,
without starting JAX's backend or TensorFlow's runtime; `-NAME` blocks
module NAME instead, as `sys.modules[NAME] = None` does), checks that it is
still one thread with neither started, says so on the control socket, then
serves. Each request (a JSON message with three descriptors: the script's
stdin, stdout and stderr) forks a child that runs the script as `python
SCRIPT ARGS` would: in its own process group, in the request's directory and
environment, as `__main__`, exiting as Python exits (non-daemon threads
joined, atexit handlers run, output flushed) but for tearing its modules
down. The server reports each child's pid, then its exit status. When the
control socket closes, it kills the children still running and exits.
"""

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import traceback


def _send(sock, **message):
  sock.send(json.dumps(message).encode())


def _preload(names):
  """Imports `names`; why forking would now be unsafe, or ''."""
  for name in names:
    if name.startswith('-'):
      sys.modules[name[1:]] = None  # Blocked: importing it raises.
    else:
      importlib.import_module(name)
  problems = []
  threads = len(os.listdir('/proc/self/task'))
  if threads != 1:
    problems.append(
      f'{threads} threads (an import started them; OpenBLAS does unless '
      'OPENBLAS_NUM_THREADS=1)'
    )
  if sys.modules.get('jax') is not None:
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
      problems.append("JAX's backend started")
  if 'tensorflow' in sys.modules:
    from tensorflow.python.eager import context

    if context.context()._initialized:
      problems.append("TensorFlow's runtime started")
  return '; '.join(problems)


def _serve(sock):
  """Serves requests; returns (in a child only) the request to run."""
  children = {}  # pid -> request id
  try:
    while True:
      readable, _, _ = select.select([sock], [], [], 0.02)
      while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if not pid:
          break
        code = os.waitstatus_to_exitcode(status)
        _send(sock, id=children.pop(pid), exit=code)
      if not readable:
        continue
      data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
      if not data:  # The test session ended.
        break
      request = json.loads(data)
      sys.stdout.flush()
      sys.stderr.flush()
      # A signal sent to the child while Python's at-fork hooks run in it
      # would raise in a hook, where Python prints the exception and goes
      # on: the signal lost. Blocked across the fork, it waits, and comes
      # as the script starts, as to a fresh `python`.
      mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
      pid = os.fork()
      # Its own process group (set on both sides, so that it exists before
      # either goes on): a timeout kills the script and all it started.
      if pid == 0:
        os.setpgid(0, 0)
        sock.close()
        for target, fd in enumerate(fds):
          os.dup2(fd, target)
          os.close(fd)
        request['mask'] = mask
        return request
      signal.pthread_sigmask(signal.SIG_SETMASK, mask)
      try:
        os.setpgid(pid, pid)
      except OSError:  # The child did it first (and may have ended).
        pass
      for fd in fds:
        os.close(fd)
      children[pid] = request['id']
      _send(sock, id=request['id'], pid=pid)
  except OSError:  # The test session is gone.
    pass
  for pid in children:  # So are the scripts it started.
    try:
      os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  for pid in children:
    os.waitpid(pid, 0)
  return None


def _run(request):
  """Runs the request's script as `python SCRIPT ARGS` would (in a child)."""
  os.chdir(request['cwd'])
  os.environ.clear()
  os.environ.update(request['env'])
  if os.environ.get('PYTHONUNBUFFERED'):  # As `python -u` would write.
    for stream in (sys.stdout, sys.stderr):
      stream.reconfigure(line_buffering=True, write_through=True)
  if 'numpy' in sys.modules:  # Seeded from the OS in a fresh process.
    sys.modules['numpy'].random.seed()
  script = request['script']
  sys.argv = [script, *request['args']]
  # The script's directory, then its PYTHONPATH, for the server's.
  ours = _python_path(os.environ)
  theirs = _python_path(_SERVER_ENV)
  sys.path[:] = [
    os.path.dirname(os.path.abspath(script)),
    *ours,
    *(p for p in sys.path[1:] if p not in theirs and p not in ours),
  ]
  interrupted = False
  try:
    signal.pthread_sigmask(signal.SIG_SETMASK, request['mask'])
    runpy.run_path(script, run_name='__main__')
    status = 0
  except SystemExit as e:
    status = _exit_status(e.code)
  except BaseException as e:  # As Python reports it: the script's frames.
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
      tb = tb.tb_next
    traceback.print_exception(type(e), e, tb or e.__traceback__)
    status = 1
    # Python ends by SIGINT after an uncaught KeyboardInterrupt.
    interrupted = isinstance(e, KeyboardInterrupt)
  # Python's exit, but for tearing the modules down: that touches every
  # page the fork shares with the server (seconds), and shows nothing.
  threading._shutdown()
  atexit._run_exitfuncs()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      status = status or 120
  if interrupted:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
  os._exit(status)


def _python_path(env):
  return [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p]


def _exit_status(code):
  """The exit status of `sys.exit(code)`, as Python gives it."""
  if code is None:
    return 0
  if isinstance(code, int):
    return code & 0xFF
  print(code, file=sys.stderr)
  return 1


_SERVER_ENV = dict(os.environ)
# Held from the fork until the script runs (see `_serve`).
_HELD = {signal.SIGINT, signal.SIGTERM}


def main():
  sock = socket.socket(fileno=int(sys.argv[1]))
  problem = _preload(sys.argv[2:])
  _send(sock, ready=not problem, problem=problem)
  if problem:
    return
  gc.freeze()  # So that the forks' collections leave the shared pages.
  request = _serve(sock)
  if request is not None:
    del sys.argv[1:]
    _run(request)


if __name__ == '__main__':
  main()
