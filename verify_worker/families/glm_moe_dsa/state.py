"""The per-slot caches of a glm_moe_dsa target: per layer the normalised latent and the roped key part of
every token, per indexing layer the indexer's key. All positional (written by absolute position)."""

import torch


class LatentCache:
    def __init__(self, num_layers: int, indexed_layers: list[int], num_slots: int, capacity: int, latent_dim: int,
                 rope_dim: int, index_dim: int, dtype: torch.dtype, device):
        self.num_slots, self.capacity = num_slots, capacity
        new = lambda dim: torch.zeros(num_slots, capacity, dim, dtype=dtype, device=device)  # noqa: E731
        self.latents = [new(latent_dim) for _ in range(num_layers)]
        self.key_ropes = [new(rope_dim) for _ in range(num_layers)]
        self.index_keys = {layer: new(index_dim) for layer in indexed_layers}

    def nbytes(self) -> int:
        tensors = self.latents + self.key_ropes + list(self.index_keys.values())
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

    def read(self, layer: int, slots: torch.Tensor, length: int):
        """[b, length, dim] each, positions 0..length-1 (the index keys None on a shared layer)."""
        index = self.index_keys.get(layer)
        return (self.latents[layer][slots, :length], self.key_ropes[layer][slots, :length],
                None if index is None else index[slots, :length])
