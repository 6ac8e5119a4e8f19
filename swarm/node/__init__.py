"""A peer: the ``Node`` (join → open services → build the role), its context, the roles (trainer, stage server,
full peer) in ``roles/``, and the one replica lifecycle they share (``lifecycle.py``).

    >>> from swarm.node.node import Node
"""
