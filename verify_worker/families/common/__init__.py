"""Pieces more than one family uses: MLA, the sparse indexer, MoE, row-by-row projections."""
