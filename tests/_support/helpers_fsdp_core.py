"""Precision plans on an FSDP2-sharded policy, 2 gloo processes: ``python -m torch.distributed.run
--nproc_per_node 2 tests/_support/helpers_fsdp_core.py OUT`` (for ``tests/core/test_fsdp_core.py``).

tiny-random-llama fp32 with embedding row ``OVERFLOW_TOKEN`` set to 1e5 (beyond fp16's 65504: an fp16 copy holds
inf there, an fp32 one normalises it), sharded by ``fully_shard`` (decoder layers, then the root). Process 0's
first row contains that token, process 1's rows do not. Every process scores its 4 rows (2 chunks of 2) with
the fp16 plan (guard on), the fp32 plan and the fp16 plan without guard; process r writes ``OUT.rank<r>``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

OVERFLOW_TOKEN = 7


def _sync_from_a_gathered_root(model, rank: int) -> dict:
    """Plans made while the policy's root unit still holds its gathered (plain, full) tensors and its ``reshard``
    leaves them there, as the root did after TRL's old-logprob forward on the H200 (torch 2.11, accelerate FSDP2):
    every shard of a sharded fp32 shadow must hold this rank's rows of the full weights, and arm E's fp32 head must
    own a copy of the head weight, not alias the gathered tensor that FSDP2 frees at the next reshard."""
    from bloggap_plugin.core.plans import make_plan
    from bloggap_plugin.core.sharding import is_dtensor

    model.unshard()  # the root's parameters: plain full tensors on the modules
    root_class, reshard = type(model), type(model).reshard
    root_class.reshard = lambda self: None
    try:
        full = {name: p.detach().clone() for name, p in model.named_parameters() if not is_dtensor(p)}
        head = make_plan(model, "fp32_head")  # arm E: its fp32 head must not alias the gathered weight
        try:
            shadow = make_plan(model, "fp32").shadow
        except RuntimeError as err:
            return {"plain": sorted(full), "error": str(err)[:300]}
    finally:
        root_class.reshard = reshard
        model.reshard()  # FSDP2 frees the gathered tensors here (their storage shrinks to nothing)
    params = dict(shadow.named_parameters())
    rows = {}
    for name, value in full.items():
        local = params[name].to_local()
        start = sum(c.shape[0] for c in value.chunk(2)[:rank])
        rows[name] = bool(torch.equal(local, value[start:start + local.shape[0]]))
    weight32 = head._head.weight32
    return {"plain": sorted(full), "rows_match": rows, "head_owns_weight": head._head.owns_weight,
            "head_storage_bytes": weight32.untyped_storage().nbytes(),
            "head_equal": weight32.untyped_storage().nbytes() > 0 and bool(torch.equal(weight32, full["lm_head.weight"]))}


def main() -> None:
    torch.set_num_threads(1)
    from events import (
        HANG_S,  # this script's folder is tests/_support: a rank late on a loaded machine is no hang
    )

    dist.init_process_group("gloo", timeout=timedelta(seconds=HANG_S))
    rank = dist.get_rank()
    from torch.distributed.fsdp import fully_shard

    from bloggap_plugin.core.plans import make_plan
    from bloggap_plugin.core.sharding import is_dtensor
    from bloggap_plugin.models import load_model

    model, _ = load_model("tiny-random-llama", dtype="fp32")
    with torch.no_grad():
        model.model.embed_tokens.weight[OVERFLOW_TOKEN] = 1e5
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(10, 60, (4, 12), generator=generator)
    if rank == 0:
        ids[0, 9] = OVERFLOW_TOKEN  # a completion position: its logits (and the rest of the row) overflow in fp16
    mask = torch.ones_like(ids)
    guarded = make_plan(model, "fp16")
    with_guard = guarded.token_logprobs(ids, mask, 4, batch_size=2)
    full = make_plan(model, "fp32").token_logprobs(ids, mask, 4, batch_size=2)
    raw = make_plan(model, "fp16", fp16_guard=False).token_logprobs(ids, mask, 4, batch_size=2)
    record = {"fallbacks": guarded.fp16_fallbacks, "with_guard": with_guard.tolist(), "fp32": full.tolist(),
              "raw": [[None if not torch.isfinite(v) else float(v) for v in row] for row in raw],
              "shadow_sharded": all(is_dtensor(p) for p in guarded.shadow.parameters()),
              "gathered_root": _sync_from_a_gathered_root(model, rank)}
    with open(f"{sys.argv[1]}.rank{rank}", "w") as handle:
        json.dump(record, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
