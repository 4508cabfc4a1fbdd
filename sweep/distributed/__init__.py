"""Training under ``torchrun``: the process group, each rank's share, and a rank that fails."""
