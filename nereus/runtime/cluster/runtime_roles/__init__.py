"""The driver-side ``Runtime``'s roles, one mixin each over ``core.RuntimeCore`` (the workers, the key
records and the calls to them, initialised in one place): ``training`` (placing keys, the optimizer step,
weights and optimizer state read and written), ``inference`` (log-probs and values), ``generation`` (fixed-batch
generation, the rollout engines' lifecycle), ``transitions`` (live moves, weight syncs, resizing),
``recovery`` (snapshots, faults, recovery). ``workers.Runtime`` composes them.
"""
