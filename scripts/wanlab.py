"""The WAN lab's command line: peers in network namespaces on a private bridge, each behind its own bandwidth cap and
round-trip delay (the lab itself, ``WanLab``: swarmtest/wanlab.py). Needs root and iproute2 (``ip``, ``tc``).

    sudo python scripts/wanlab.py check
    sudo python scripts/wanlab.py selftest --caps 20,100     # measured TCP throughput against each cap
    sudo python scripts/wanlab.py selftest --caps 20 --rtt-ms 100  # ... with the delay on, and ping against it
    sudo python scripts/wanlab.py up --peers 3 --caps 20 --rtt-ms 100  # prints the hosts, holds the lab until Ctrl+C
    sudo python scripts/wanlab.py run --caps 20,100 -- python my_peer.py --host {addr} --index {i} --all {addrs}
    sudo python scripts/wanlab.py cleanup
"""

from __future__ import annotations

import sys

from swarmtest.wanlab import main

if __name__ == "__main__":
    sys.exit(main())
