"""A worker's generation engine that lives across calls, so the driver can look at it between chunks of
iterations and move unfinished sequences between its DP replicas mid-step (``run.midstep``).

``Worker.gen_open`` builds one ``DecodeEngine`` per DP replica on that replica's rows of the step's
prompts (``decode_engine.replica_engine``: sequence id = global row index, so each sequence samples from
the stream ``generate_continuous`` gives it); ``gen_run`` runs a chunk of iterations and answers the
replica's status; ``gen_migrate`` executes a ``MigrationPlan`` (``runtime.generation.kv_migrate.migrate``: every
worker of the world takes part, because the commit vote is a collective over the whole world);
``gen_close`` runs the replica to the end and answers every sequence it finished (one call instead of a
last chunk and a close). Every rank of a replica makes the same calls, so its engines stay in lockstep.
"""

from __future__ import annotations

import time

from nereus.elastic.kvplan import MigrationPlan
from nereus.runtime.generation.decode_engine import DecodeEngine, Sequence
from nereus.runtime.generation.kv_migrate import MigrationAborted, migrate
from nereus.runtime.recovery.faults import FaultHook
from nereus.runtime.transitions.executor import TransferComm


def _record(s: Sequence, rng_bytes: int) -> list[int]:
    """[seq id, prompt tokens, generated tokens, cached positions, stream-state bytes]: ``SeqMove``'s numbers."""
    return [s.seq_id, len(s.prompt), len(s.tokens), s.cached, rng_bytes]


def run_chunk(engine: DecodeEngine, iterations: int) -> dict:
    """Up to ``iterations`` engine iterations (fewer when it runs dry); the replica's status after them:
    its active and queued sequences (``_record``), the lengths of those that finished in this chunk, the
    seconds the iterations took and their rows (live sequences summed over iterations: an iteration runs
    each live sequence as its own one-row micro-batch, so its cost grows with them)."""
    t0, rows, ran, finished = time.perf_counter(), 0, 0, {}
    while ran < iterations and not engine.idle:
        rows += min(engine.slots, len(engine.active) + len(engine.queue))
        for s in engine.step():
            finished[s.seq_id] = len(s.tokens)
        ran += 1
    rng = engine.rng_bytes
    return {"iterations": ran, "rows": rows, "busy_s": time.perf_counter() - t0, "finished": finished,
            "active": [_record(s, rng) for s in engine.active], "queued": [_record(s, rng) for s in engine.queue]}


def migrate_sequences(engine: DecodeEngine | None, plan: dict, comm: TransferComm, faults: FaultHook) -> dict:
    """This worker's part of a migration between the replicas of one engine layout (the source and the
    destination engine are this worker's own engine, or None where it holds none). A migration that does
    not commit leaves every sequence where it was and answers ``ok: False`` with the cause."""
    t0 = time.perf_counter()
    try:
        res = migrate(MigrationPlan.from_json(plan), engine, engine, comm, faults)
    except MigrationAborted as err:
        return {"ok": False, "error": str(err), "wall_s": time.perf_counter() - t0}
    return {"ok": True, "error": "", "wall_s": time.perf_counter() - t0, "installed": res.installed,
            "released": res.released, "bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received}


def close_engine(engine: DecodeEngine) -> dict:
    """Runs the replica to the end (``run_chunk`` without a limit); ``done``: every sequence it finished
    (its own and those moved in), by id: (tokens, log-probs); with the last iterations' ``rows``,
    ``busy_s`` and ``iterations``."""
    last = run_chunk(engine, 2**62)
    engine.sm.record_memory("generate", kv_cache=engine.peak_kv_bytes)
    return {"done": {i: (s.tokens, s.logprobs) for i, s in engine.finished.items()},
            **{k: last[k] for k in ("rows", "busy_s", "iterations")}}
