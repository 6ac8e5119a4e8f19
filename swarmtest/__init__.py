"""The one test harness: what the tests and the benchmark scripts share, imported as ``swarmtest.<module>``.

configs (tiny swarm configs, the test corpus), clock (a fake clock, virtual-time event loops), records (a peer's
JSONL records), processes (swarms of ``swarmloco`` processes), node (a ``Node`` on a thread), faults (kills keyed by
peer and step), fakes (in-memory networks and holders), loopback (outer-step replicas on real DHTs), attacks.

    from swarmtest.configs import tiny_config
"""
