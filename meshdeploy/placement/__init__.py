"""The placement: which device holds which layers of a model, decided for the whole cluster.

One room for the decision and what it weighs (README.md): each device's free memory (memory),
the KV cache a context needs (kvcache), the model's tensors read from its GGUF header (tensors),
the layer assignment llama.cpp makes from a --tensor-split (layers), the speed model fitted by
`bench --sweep` (speed), the placements a plan chooses per server (layout), and the fallbacks
for workers away (failover). Roles read it (rpc_cache seeds what a placement holds, services
renders --tensor-split), the engine's sweep measures for it; it imports no role.
"""
