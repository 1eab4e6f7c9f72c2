"""Drafter training (dflash-reference.md section 6): target-regenerated data, random anchors, anchor-position
visibility, position-decayed loss, the target's embedding and lm_head frozen."""
