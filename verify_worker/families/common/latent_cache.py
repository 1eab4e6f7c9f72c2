"""Per-slot positional caches of MLA targets (GLM-5.2, GLM-5.3-Flash): per attention layer the normalised
latent and the roped key part of every token, per indexing layer the indexer's key. All written by absolute
position."""

import torch


class LatentCache:
    """attention_layers: the layers that attend (all of them for GLM-5.2); indexed_layers: those that run an
    indexer (index_dim floats per token: its key, or for a pooled indexer its key and gate side by side)."""

    def __init__(self, attention_layers, indexed_layers, num_slots: int, capacity: int, latent_dim: int,
                 rope_dim: int, index_dim: int, dtype: torch.dtype, device):
        self.num_slots, self.capacity = num_slots, capacity
        new = lambda dim: torch.zeros(num_slots, capacity, dim, dtype=dtype, device=device)  # noqa: E731
        self.latents = {layer: new(latent_dim) for layer in attention_layers}
        self.key_ropes = {layer: new(rope_dim) for layer in attention_layers}
        self.index_keys = {layer: new(index_dim) for layer in indexed_layers}

    def nbytes(self) -> int:
        tensors = [*self.latents.values(), *self.key_ropes.values(), *self.index_keys.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, latent: torch.Tensor,
              key_rope: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """latent [b, s, latent_dim], key_rope [b, s, rope_dim], index_keys [b, s, index_dim] at slots [b],
        positions [b, s]."""
        where = (slots[:, None], positions)
        self.latents[layer][where] = latent
        self.key_ropes[layer][where] = key_rope
        if index_keys is not None:
            self.index_keys[layer][where] = index_keys

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Positions 0..length-1 of slot source into slot target, every cache (a kept prefix given to a request
        that starts in another slot)."""
        for cache in (*self.latents.values(), *self.key_ropes.values(), *self.index_keys.values()):
            cache[target, :length] = cache[source, :length]

    def read(self, layer: int, slots: torch.Tensor, length: int):
        """[b, length, dim] each, positions 0..length-1 (the index keys None on a shared layer)."""
        index = self.index_keys.get(layer)
        return (self.latents[layer][slots, :length], self.key_ropes[layer][slots, :length],
                None if index is None else index[slots, :length])
