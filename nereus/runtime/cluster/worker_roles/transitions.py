"""The ``Worker``'s transition role: the keys' groups created ahead of a move, the move itself (weights and
Adam state, as the driver's transition graph plans), and every key rebuilt on a re-formed world's groups."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nereus.runtime.cluster.worker_roles.core import WorkerCore

if TYPE_CHECKING:
    from nereus.elastic.plan import TransitionPlan
    from nereus.runtime.transitions.live import KeySpec, TransitionAnswer


class TransitionRole(WorkerCore):
    """Moves keys between layouts live (``transitions.live``): ``prepare_groups`` fills ``pending``,
    ``transition`` replaces ``models`` and ``groups`` of the moved keys from it (or keeps the old ones on
    failure) over ``comm``, with the fault points ``transition.*`` of ``faults``; ``regroup`` rebuilds
    ``groups`` and ``models`` after ``reinit``."""

    def prepare_groups(self, specs: list[KeySpec]) -> bool:
        """The process groups of every key of a coming transition, created ahead (collective: every
        worker, same order); a key whose layout and workers do not change keeps its groups."""
        from nereus.runtime.comm.groups import ParallelGroups
        from nereus.runtime.parallel.sharded import tied_head

        self.pending = {}
        for s in specs:
            cur = self.groups.get(s.key)
            if cur is not None and (cur.layout, tuple(cur.ranks)) == (s.layout, tuple(s.ranks)):
                self.pending[s.key] = cur
            else:
                self.pending[s.key] = ParallelGroups(s.layout, list(s.ranks), tied_embeddings=tied_head(s.cfg))
        return True

    def regroup(self, specs: list[KeySpec]) -> bool:
        """Every key's groups in the new world (collective, same order everywhere), and its shard rebuilt
        around the same tensors: parameters adopted, Adam's segments and moments handed over."""
        from nereus.runtime.comm.groups import ParallelGroups
        from nereus.runtime.parallel.sharded import tied_head
        from nereus.runtime.transitions.live import rebuild

        for s in specs:
            g = ParallelGroups(s.layout, list(s.ranks), tied_embeddings=tied_head(s.cfg))
            self.groups[s.key] = g
            if s.key in self.models:
                self.models[s.key] = rebuild(self.models[s.key], g)
        return True

    def follows(self, source: str, keys: list[str]) -> bool:
        """Whether every shard this worker holds of ``keys`` is ``source``'s shard's memory here
        (``transitions.live.follows``): true also when it holds none of them."""
        from nereus.runtime.transitions.live import follows

        return all(follows(self.models[k], self.models.get(source)) for k in keys if k in self.models)

    def transition(self, graph: TransitionPlan, old_specs: list[KeySpec], new_specs: list[KeySpec],
                   sources: list[KeySpec] | None = None) -> TransitionAnswer:
        """Replace the keys of ``old_specs`` by ``new_specs``, state moved as ``graph`` plans (groups from
        ``prepare_groups``) from the keys of ``sources`` (default ``old_specs``; a weight sync reads the
        training key only). On failure every worker keeps its old shards and reports the error."""
        return self._guarded(self._transition, graph, old_specs, new_specs, sources)

    def _transition(self, graph: TransitionPlan, old_specs: list[KeySpec], new_specs: list[KeySpec],
                    sources: list[KeySpec] | None) -> TransitionAnswer:
        import time

        from nereus.runtime.transitions.live import TransitionAnswer, transition_keys

        t0 = time.perf_counter()
        sources = old_specs if sources is None else sources
        old = {s.key: self.models[s.key] for s in sources if s.key in self.models}
        pending, self.pending = self.pending, {}
        try:
            scope = "sync" if old_specs == new_specs else "transition"  # a weight sync re-places keys as they are
            models, measured = transition_keys(graph, old, sources, new_specs, pending, self.comm, self.faults,
                                               fault_scope=scope)
        except Exception as exc:  # noqa: BLE001 - reported to the driver; the old layout stays
            for key, g in pending.items():
                if g is not self.groups.get(key):
                    g.destroy()
            self.comm.renew()
            return TransitionAnswer(False, str(exc), time.perf_counter() - t0)
        keep = {id(g) for g in pending.values()}
        for s in old_specs:
            self.models.pop(s.key, None)
            g = self.groups.pop(s.key, None)
            if g is not None and id(g) not in keep:
                g.destroy()
        self.models.update(models)
        self.groups.update(pending)
        return TransitionAnswer(True, "", time.perf_counter() - t0, measured)
