"""``parallelize``: one rank's shard of a plain ``CausalLM``, made by separate steps in a fixed order.

1. **PP** (``pp.split_stage``): keep this stage's layer range, the embedding on the first stage, the
   final norm and head on the last (plus the last stage's copy of a tied embedding).
2. **TP** (``tp.apply_tp``): slice what the stage kept to this TP rank's boxes of the sharding contract
   and swap the communication modules into the model's slots (``CopyToTP`` before column-parallel
   projections, ``RowParallelLinear``, ``VocabParallelEmbedding``).

3. **Recompute** (``recompute.apply_recompute``): the layout's activation recomputation, checkpointing each
   layer (``full``) or each attention core (``selective``) of the stage.

2a. **EP** (``ep.apply_ep``), between the two: keep this rank's routed experts of each sparse layer and swap the
   all-to-all dispatcher into their ``dispatch`` slot (the experts it keeps are then TP-sliced like an MLP).

PP goes first so that TP slices only what the stage keeps, including the tied-head copy the split adds.
DP changes nothing in the model: gradients are averaged after backward and the optimizer state is
sharded over DP (``dp.average_gradients``, ``dp.ShardedAdam``), both driven by ``engine.ShardedModel``.
"""

from __future__ import annotations

from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.model.decoder import CausalLM
from nereus.runtime.parallel.ep import apply_ep
from nereus.runtime.parallel.pp import split_stage
from nereus.runtime.parallel.recompute import apply_recompute
from nereus.runtime.parallel.tp import apply_tp


def parallelize(model: CausalLM, groups: ParallelGroups) -> CausalLM:
    """``model`` (whole, plain; on the meta device its weights can be loaded after) cut in place into the
    shard of this rank of ``groups``: PP split at its stage of ``groups.dims.pp``, then TP at its TP rank
    (over ``groups.tp_group``), then the layout's activation recomputation."""
    dims, at = groups.dims, groups.coords
    split_stage(model, dims.pp, at.pp_rank)
    apply_ep(model, groups.ep_group, dims.ep, dims.ep_rank(at.dp_rank))
    apply_tp(model, groups.tp_group, dims.tp, at.tp_rank)
    return apply_recompute(model, groups.layout.recompute)
