"""Wait until a server started in the background answers GET /v1/models with 200; fail at
once if its process exits first. Used by scripts/bench.sh and scripts/ab_peer.sh.

    python scripts/wait_ready.py PORT PID [TIMEOUT_S]"""

import os
import sys
import time

import httpx


def main() -> None:
    port, pid = sys.argv[1], int(sys.argv[2])
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 600.0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit("the server exited before it was ready")
        time.sleep(0.5)
    sys.exit(f"the server did not become ready in {timeout:.0f} s")


if __name__ == "__main__":
    main()
