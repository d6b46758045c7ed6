"""MoE routing for `attribute`: every routed call's expert choices, weights and routed-output energy on a pass
(`RoutingRecorder`), and the reference's against the pack's per expert and per layer (`routing_tables`)."""
from __future__ import annotations

import torch

from ..errors import PackError
from .routing import RoutingCounts

class RoutingRecorder:
    """An `OracleTaps.expert_outputs` (the sink `RoutedExperts` tells each call's routing and each expert's weighted
    outputs): records every call's expert choices and weights and each expert's routed-output energy for the layer
    `current_layer`, from the outputs the call computes anyway. Every family whose MoE is
    `fidelity.oracle.moe.RoutedExperts` (Qwen3Moe, Mixtral, DeepSeek) is seen."""

    def __init__(self):
        self.current_layer = -1
        self.layers: dict[int, dict] = {}
        self.counts = RoutingCounts()

    def routed(self, experts, indices, weights):
        self.counts.add(experts, indices)
        entry = self.layers.get(self.current_layer)
        if entry is None:
            entry = self.layers[self.current_layer] = {
                "n_experts": experts.n_experts, "indices": [], "weights": [],
                "energy": torch.zeros(experts.n_experts, dtype=torch.float64, device=indices.device)}
        entry["indices"].append(indices.cpu())
        entry["weights"].append(weights.detach().double().cpu())

    def expert_output(self, e: int, y: torch.Tensor):
        """y: expert e's outputs times the tokens' routing weights, as the call adds them; on the device, no sync."""
        self.layers[self.current_layer]["energy"][e] += y.double().pow(2).sum()

def routing_tables(ref: RoutingRecorder, pack: RoutingRecorder, threshold: float) -> tuple[list[dict], list[dict]]:
    per_expert, per_layer = [], []
    for layer in sorted(ref.layers):
        r, p = ref.layers[layer], pack.layers.get(layer)
        if p is None:
            raise PackError(f"layer {layer} routes experts in the reference but not in the pack")
        n = r["n_experts"]
        sides = {}
        for side, entry in (("ref", r), ("pack", p)):
            idx, w = torch.cat(entry["indices"]), torch.cat(entry["weights"])
            counts = torch.bincount(idx.reshape(-1), minlength=n).numpy()
            mass = torch.zeros(n, dtype=torch.float64).index_add_(0, idx.reshape(-1), w.reshape(-1)).numpy()
            energy = entry["energy"].cpu().numpy()
            sides[side] = {"idx": idx, "counts": counts, "weight_share": mass / mass.sum(),
                           "energy_share": energy / energy.sum() if energy.sum() else energy}
        ri, pi = sides["ref"]["idx"], sides["pack"]["idx"]
        if ri.shape != pi.shape:
            raise PackError(f"layer {layer}: the reference routes {list(ri.shape)} token-expert choices, the pack "
                            f"{list(pi.shape)}")
        ref_sets = torch.zeros(ri.shape[0], n, dtype=torch.bool).scatter_(1, ri, True)
        pack_sets = torch.zeros(pi.shape[0], n, dtype=torch.bool).scatter_(1, pi, True)
        jaccard = (ref_sets & pack_sets).sum(1).double() / (ref_sets | pack_sets).sum(1).double()
        for e in range(n):
            per_expert.append({"layer": layer, "expert": e,
                               **{f"{k}_{side}": (int(s[k][e]) if k == "counts" else float(s[k][e]))
                                  for side, s in sides.items() for k in ("counts", "weight_share", "energy_share")}})
        per_layer.append({"layer": layer, "tokens": int(ri.shape[0]), "top_k": int(ri.shape[1]),
                          "jaccard_mean": float(jaccard.mean()), "jaccard_min": float(jaccard.min()),
                          "same_set": float((jaccard == 1).double().mean()),
                          "super_experts_ref": [e for e in range(n) if sides["ref"]["energy_share"][e] >= threshold],
                          "super_experts_pack": [e for e in range(n) if sides["pack"]["energy_share"][e] >= threshold]})
    return per_expert, per_layer
