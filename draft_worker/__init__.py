"""The drafter side: DFlash drafter model, checkpoints, proposal sampling and (later) training."""
