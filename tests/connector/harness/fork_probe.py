"""Run by test_forkserver.py as a fork server's child: prints what it sees (its arguments, environment,
working directory, session) as one JSON line, then stays up if asked to, and exits with $PROBE_EXIT."""

import json
import os
import sys
import time

print(
    json.dumps(
        {
            "args": sys.argv[1:],
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "pid": os.getpid(),
            "pgid": os.getpgid(0),
            "sid": os.getsid(0),
        }
    ),
    flush=True,
)
if "--stay" in sys.argv:
    time.sleep(600)
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
