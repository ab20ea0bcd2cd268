"""`python -m kvstore.agent`: the node agent as an engine starts it (settings on stdin, see `supervisor`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvstore.agent.main import run_agent
from kvstore.config import load_settings


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.agent", description=__doc__)
    parser.add_argument(
        "--settings-from-stdin", action="store_true", help="read the settings as JSON on stdin"
    )
    parser.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    overrides = json.loads(sys.stdin.read() or "{}") if args.settings_from_stdin else {}
    return run_agent(load_settings(**overrides), exit_when_idle_s=args.exit_when_idle)


if __name__ == "__main__":
    sys.exit(main())
