"""Worker of multiprocess_test.py: process 1 fails, process 0 would hang.

Process 1 fails only once process 0 is waiting (it writes the file named by
its first argument), so that the launcher has process 0's output to show
however slowly the processes start.
"""

import os
import pathlib
import sys
import time

ready = pathlib.Path(sys.argv[1])
if os.environ['FDT_MP_PROCESS_ID'] == '1':
  deadline = time.monotonic() + 100
  while not ready.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
  print('worker 1 gives up', flush=True)
  sys.exit(3)
print('waiting', flush=True)
ready.touch()
time.sleep(600)
