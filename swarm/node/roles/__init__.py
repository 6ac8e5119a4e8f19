"""The roles a peer plays: trainer (stage 0 and the data), stage server (one middle stage), full peer (every stage).

>>> from swarm.node.roles.trainer import TrainerRole
"""
