"""A worker's generation engine that lives across calls, so the driver can look at it between chunks of
iterations and move unfinished sequences between its DP replicas mid-step (``run.midstep``).

``Worker.gen_open`` (``NativeEngine.session_open``) builds one ``DecodeEngine`` per DP replica on that
replica's rows of the step's prompts (``decode_engine.replica_engine``: sequence id = global row index, so
each sequence samples from the stream ``generate_continuous`` gives it); ``gen_run`` runs a chunk of
iterations and answers the replica's status; ``gen_migrate`` executes a ``MigrationPlan``
(``kv_migrate.migrate``: every worker of the world takes part, because the commit vote is a collective over
the whole world);
``gen_close`` runs the replica to the end and answers every sequence it finished (one call instead of a
last chunk and a close). Every rank of a replica makes the same calls, so its engines stay in lockstep.
"""

from __future__ import annotations

import time

from nereus.elastic.kvplan import MigrationPlan
from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.comm.transfer import TransferComm
from nereus.runtime.engines.answers import ClosedReplica, MigrationOutcome
from nereus.runtime.engines.native.decode_engine import DecodeEngine, Sequence
from nereus.runtime.engines.native.kv_migrate import MigrationAborted, migrate
from nereus.spec.generation import ReplicaStatus, SequenceRecord


def _record(s: Sequence, replica: int, rng_bytes: int) -> SequenceRecord:
    """A sequence's numbers, as a migration plan needs them (``elastic.kvplan.SeqMove``)."""
    return SequenceRecord(s.seq_id, replica, len(s.prompt), len(s.tokens), s.cached, rng_bytes)


def run_chunk(engine: DecodeEngine, iterations: int, replica: int) -> ReplicaStatus:
    """Up to ``iterations`` engine iterations (fewer when it runs dry); DP replica ``replica``'s status after
    them: its active and queued sequences, the lengths of those that finished in this chunk, the seconds the
    iterations took and their rows (live sequences summed over iterations: an iteration runs each live
    sequence as its own one-row micro-batch, so its cost grows with them)."""
    t0, rows, ran, finished = time.perf_counter(), 0, 0, []
    while ran < iterations and not engine.idle:
        rows += min(engine.slots, len(engine.active) + len(engine.queue))
        finished += [(s.seq_id, len(s.tokens)) for s in engine.step()]
        ran += 1
    rng = engine.rng_bytes
    return ReplicaStatus(replica, tuple(_record(s, replica, rng) for s in engine.active),
                         tuple(_record(s, replica, rng) for s in engine.queue), tuple(finished), ran, rows,
                         time.perf_counter() - t0)


def migrate_sequences(engine: DecodeEngine | None, plan: MigrationPlan, comm: TransferComm,
                      faults: FaultHook) -> MigrationOutcome:
    """This worker's part of a migration between the replicas of one engine layout (the source and the
    destination engine are this worker's own engine, or None where it holds none). A migration that does
    not commit leaves every sequence where it was and answers ``ok=False`` with the cause."""
    t0 = time.perf_counter()
    try:
        res = migrate(plan, engine, engine, comm, faults)
    except MigrationAborted as err:
        return MigrationOutcome(False, str(err), time.perf_counter() - t0)
    return MigrationOutcome(True, "", time.perf_counter() - t0, tuple(res.installed), tuple(res.released),
                            res.bytes_sent, res.bytes_received)


def close_engine(engine: DecodeEngine, replica: int) -> ClosedReplica:
    """Runs the replica to the end (``run_chunk`` without a limit) and answers every sequence it finished."""
    last = run_chunk(engine, 2**62, replica)
    engine.sm.record_memory("generate", kv_cache=engine.peak_kv_bytes)
    return ClosedReplica(replica, {i: (s.tokens, s.logprobs) for i, s in engine.finished.items()},
                         last.iterations, last.rows, last.busy_s)
