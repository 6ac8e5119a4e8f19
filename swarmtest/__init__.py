"""The one test harness: what the tests and the benchmark scripts share, imported as ``swarmtest.<module>``.

configs (tiny swarm configs, the test corpus, the study presets), clock (a fake clock, a virtual-time event loop),
records (a peer's JSONL events), processes (swarms of ``swarmloco`` processes), node (a ``Node`` on a thread), faults
(kills keyed by peer and step, the injector, random schedules), fakes (in-memory networks, stage calls, holders),
replicas (``ReplicaSync``s on the in-memory hub), loopback (outer-step replicas on real DHTs), attacks, bench (local
swarms for benchmarks), wanlab (the WAN lab).
Layering: swarmtest imports peer, swarm, optim and compress; none of them imports swarmtest.

    from swarmtest.configs import tiny_config
"""
