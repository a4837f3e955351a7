"""Worker of multiprocess_test.py: process 1 fails, process 0 would hang."""

import os
import sys
import time

if os.environ['FDT_MP_PROCESS_ID'] == '1':
  print('worker 1 gives up', flush=True)
  sys.exit(3)
print('waiting', flush=True)
time.sleep(600)
