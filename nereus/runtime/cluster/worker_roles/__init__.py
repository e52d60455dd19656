"""The ``Worker`` actor's roles, one mixin each over ``core.WorkerCore`` (the state they share, initialised
in one place): ``training`` (placing a key's shard, training it, its state read and written),
``inference`` (log-probs and values), ``generation`` (one rollout engine per key, its sessions),
``transitions`` (live moves between layouts), ``recovery`` (state images, a re-formed world, restoring
from images). ``worker.Worker`` composes them; Ray calls each method by its name on the one actor.
"""
