"""``swarmloco dashboard``: a live web page of a swarm, from every peer's metrics record in its DHT.

It joins the swarm's DHT as a client and polls the records; the page shows loss against tokens, steps or time
with the validation points (per trainer, labelled by the peers' ``--name``), tokens/s, outer rounds, the
pipeline map, a sortable table of peers, bandwidth by kind, an event log (joins, leaves, moves, recoveries,
bans) and a health verdict. ``/api/state`` serves it as JSON, ``/metrics`` as Prometheus text. Its history
lives in SQLite (``--history``), so a restarted dashboard keeps its curves.

Parts: ``history`` (snapshots in, series, events and verdict out; pure), ``store`` (SQLite), ``exposition``
(Prometheus text), ``server`` (HTTP and the poller); the command is in ``peer/commands/dashboard.py``.
"""


class DashboardError(ValueError):
    """Something the user can fix: a history file that cannot be used, a port that cannot be bound."""
